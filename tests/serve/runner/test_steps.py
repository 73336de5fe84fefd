"""A step's host inputs: each chunk's tokens, pages and sampling parameters in its row, and their packing into a
few arrays, undone exactly inside the programs."""

import numpy as np

from serve.engine.config import EngineConfig
from serve.engine.sampling_params import SamplingParams
from serve.engine.scheduler import Chunk
from serve.engine.sequence import Sequence
from serve.runner.sampler import FLOAT_FIELDS, NO_SEQUENCE
from serve.runner.steps import pack, step_inputs, unpack

CONFIG = EngineConfig(max_num_seqs=3, max_model_len=32, max_num_batched_tokens=32, page_size=8, chunk_buckets=(1, 8),
                      row_buckets=(2, 4))


def test_step_inputs_put_each_chunk_in_its_row_and_pack_exactly():
    params = SamplingParams(temperature=0.7, top_p=0.9, top_k=5, min_p=0.05, presence_penalty=0.5,
                            frequency_penalty=-0.25, repetition_penalty=1.2, seed=2**32 - 1)
    seq = Sequence(list(range(10, 18)), params)
    for token in (18, 19, 20):  # three sampled tokens, the last two not yet in the cache
        seq.append(token)
    seq.slot, seq.block_ids, seq.num_cached = 2, [6, 4], 8
    inputs = step_inputs(CONFIG, [Chunk(seq, 3)], [1], rows=2, chunk=8)
    assert inputs.ids[1, :3].tolist() == [18, 19, 20] and inputs.lengths.tolist() == [0, 8]
    assert inputs.page_rows[1, :2].tolist() == [6, 4] and inputs.steps.tolist() == [0, 1]
    assert inputs.rows.tolist() == [4, 2]  # a gathered step: the padding row gets a row past the cache
    back = unpack(pack(inputs), CONFIG.pages_per_row)
    for name in FLOAT_FIELDS + ("top_k", "seed"):  # every field of SamplingParams the device reads, by its name
        got = np.asarray(getattr(back.params, name))
        np.testing.assert_array_equal(got, np.asarray([getattr(NO_SEQUENCE, name), getattr(params, name)], got.dtype))
    assert np.asarray(back.params.index).tolist() == [0, 3]  # the row's output so far
    for name in ("rows", "ids", "n_new", "lengths", "page_rows", "steps"):
        np.testing.assert_array_equal(np.asarray(getattr(back, name)), getattr(inputs, name))
