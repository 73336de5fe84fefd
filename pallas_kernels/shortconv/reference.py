"""Pure-jnp ShortConv: the depthwise causal conv (width W, usually 4) with its residual.

    y[t, c] = x[t, c] + sum_k w[c, k] * x[t - (W - 1) + k, c]

Tap W-1 multiplies the current token. Inputs before the sequence start are zero, or come from `state`, the
last W-1 *inputs* (pre-conv) of the preceding chunk. Everything is computed in fp32 and cast once to x.dtype.
"""

import jax.numpy as jnp


def shortconv_prefill(x, w, state=None, segment_ids=None, lengths=None):
    """Causal conv over a chunk.

    Args:
      x: [B, T, C] inputs.
      w: [C, W] taps (fp32).
      state: optional [B, W-1, C] inputs that precede x[:, 0] (oldest first).
      segment_ids: optional [B, T] int; a tap never reaches across a change of segment id
        (packed sequences). The state only feeds the first segment of each row.
      lengths: optional [B] int, valid tokens per row (right padding beyond). The returned state is the
        W-1 inputs ending at lengths[b] - 1 (default T).

    Returns:
      (y [B, T, C] in x.dtype, new_state [B, W-1, C] in x.dtype).
    """
    batch, seq, channels = x.shape
    width = w.shape[-1]
    hist = width - 1
    if state is None:
        state = jnp.zeros((batch, hist, channels), x.dtype)
    xf = x.astype(jnp.float32)
    padded = jnp.concatenate([state.astype(jnp.float32), xf], axis=1)  # [B, hist + T, C]
    if segment_ids is not None:
        # The state belongs to the first segment of the row: give it that segment's id.
        seg = jnp.concatenate([jnp.repeat(segment_ids[:, :1], hist, axis=1), segment_ids], axis=1)
    wf = w.astype(jnp.float32)
    conv = jnp.zeros_like(xf)
    for k in range(width):
        tap = padded[:, k : k + seq]  # x[t - hist + k]
        if segment_ids is not None:
            tap = jnp.where((seg[:, k : k + seq] == segment_ids)[..., None], tap, 0.0)
        conv = conv + tap * wf[:, k]
    y = (conv + xf).astype(x.dtype)  # conv first, then the residual, as the reference sums
    if lengths is None:
        new_state = padded[:, seq:]
    else:
        idx = lengths[:, None] + jnp.arange(hist)[None, :]  # positions in `padded`
        new_state = jnp.take_along_axis(padded, idx[..., None], axis=1)
    return y, new_state.astype(x.dtype)


def shortconv_decode(x, w, state_pool, slots):
    """One new token per row, with states kept in a pool indexed by slot.

    Args:
      x: [N, C] the new inputs; w: [C, W] taps; state_pool: [S, W-1, C]; slots: [N] int rows of the pool.

    Returns:
      (y [N, C], updated state_pool) where the N rows now hold their newest W-1 inputs.
    """
    state = state_pool[slots]  # [N, W-1, C]
    window = jnp.concatenate([state.astype(jnp.float32), x[:, None].astype(jnp.float32)], axis=1)
    y = jnp.einsum("nkc,ck->nc", window, w.astype(jnp.float32)) + x.astype(jnp.float32)
    new_pool = state_pool.at[slots].set(window[:, 1:].astype(state_pool.dtype))
    return y.astype(x.dtype), new_pool
