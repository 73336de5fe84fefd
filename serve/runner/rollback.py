"""Undoing what speculative decoding wrote past the tokens a row keeps.

K/V entries need nothing: full-attention pages are addressed by absolute position and nothing reads past a row's
length, and the sliding rings (the model's and the drafter's) hold K slots past the window
(`SpeculativeConfig.ring_slack`), so writes past the kept tokens land in slots of positions before the window.
A rejection is just not advancing the length. The ShortConv states come back from a verify with every input
(`keep_conv_inputs`), and `keep_conv_prefix` keeps the state after the kept tokens.
"""

import jax
import jax.numpy as jnp

from inkling_jax.nn.cache import Cache
from serve.runner.cache_rows import conv_state, with_row_state


def keep_conv_prefix(cache: Cache, kept, history: int) -> Cache:
    """`cache` whose ShortConv states are a verify's windows [B, history + T, C] (`keep_conv_inputs`), with each
    row's state after its first `kept [B]` tokens: rows kept .. kept + history - 1 of its window."""
    index = (kept[:, None] + jnp.arange(history)[None, :])[..., None]
    take = lambda x: jnp.take_along_axis(x, index, axis=1)  # noqa: E731
    return with_row_state(cache, jax.tree.map(take, conv_state(cache)))
