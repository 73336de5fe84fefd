"""The KV pool leaves room for the compiled step programs: where the largest program's buffers do not fit beside
the first pool (told here by fake memory statistics; CPUs have none), the runner makes a smaller pool, compiles
its programs again for it, and serves the same tokens."""

from inkling_jax import kernels, preset
from serve import memory_plan
from serve.config import EngineConfig
from serve.engine import Engine
from serve.offline import generate
from serve.random_weights import random_model
from serve.sampling import SamplingParams

CONFIG = preset("tiny").replace(num_layers=2, local_layer_ids=(0,), dense_layer_ids=(0,))
ENGINE = dict(max_num_seqs=2, max_model_len=32, max_num_batched_tokens=48, page_size=8, chunk_buckets=(1, 16),
              row_buckets=(3,))
PROMPTS = [[3, 1, 4, 1, 5, 9, 2, 6], [2, 7, 1, 8, 2, 8]]


def _serve(monkeypatch=None, pages_short=0):
    """Greedy tokens of PROMPTS and the engine's pool size, with the programs `pages_short` pages beyond what
    fits beside the first pool (which holds every slot at full length: 8 pages)."""
    with kernels.use("jnp", moe="dense"):
        engine = Engine(random_model(CONFIG, seed=0), EngineConfig(**ENGINE), eos_token_id=CONFIG.eos_token_id)
        runner = engine.runner
        if monkeypatch is not None:
            page = runner.page_bytes_per_device()
            need = 20 * page  # the largest program's bytes, as the fake analysis reports them
            first = runner.num_pages
            monkeypatch.setattr(memory_plan, "program_bytes", lambda compiled: need)
            # free memory falls by a page per page of pool; at the first pool, 21 pages (need + 5%) less the short
            monkeypatch.setattr(memory_plan, "free_bytes", lambda devices: (
                21 - pages_short + first - runner.num_pages) * page)
        engine.start()
    try:
        out = generate(engine, PROMPTS, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    finally:
        engine.shutdown(drain_seconds=0)
    pages = engine.runner.cache.layers[1].k.shape[0]
    return [o.token_ids for o in out], pages


def test_pool_shrinks_to_leave_room_for_the_programs(monkeypatch):
    want, pages = _serve()
    assert pages == 8  # 2 slots x 4 pages of 8 tokens (CPU: no memory statistics)
    got, fewer = _serve(monkeypatch, pages_short=3)
    assert fewer == 5
    assert got == want
