"""Sequences of random prompt tokens, for the engine's host-side tests."""

import numpy as np

from serve.engine.sampling_params import SamplingParams
from serve.engine.sequence import Sequence

RNG = np.random.default_rng(0)


def seq_of(n, params=SamplingParams()):
    return Sequence(RNG.integers(0, 250, n).tolist(), params)
