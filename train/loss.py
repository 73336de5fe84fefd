"""Next-token cross-entropy over packed sequences, and the MoE expert loads of a batch.

A packed row holds several sequences, told apart by `segment_ids` (0 = padding). Token t is trained to predict
token t + 1 when both are in the same segment and `loss_mask[t + 1]` is set (e.g. 0 on prompt tokens).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def next_token_targets(input_ids, segment_ids, loss_mask, offset: int = 1):
    """(targets [B, T], weights [B, T] in fp32): the token `offset` ahead (1: the next one; the MTP head's
    depth k predicts k + 2 ahead) and whether it counts."""
    targets = jnp.roll(input_ids, -offset, axis=1)
    same = (segment_ids == jnp.roll(segment_ids, -offset, axis=1)) & (segment_ids > 0)
    counted = same & (jnp.roll(loss_mask, -offset, axis=1) > 0)
    counted = counted.at[:, -offset:].set(False)  # the last tokens' targets are in another row
    return targets, counted.astype(jnp.float32)


def cross_entropy_sum(logits_fn, hidden, targets, weights, chunk: int):
    """sum over tokens of weights * -log softmax(logits)[target], in fp32.

    The head runs on `chunk` positions of every row at a time, each chunk rematerialised in the backward
    pass, so full [B, T, vocab] logits never exist at once (they dominate memory at Inkling's vocabulary).
    """
    def one(h, t, w):
        logits = logits_fn(h).astype(jnp.float32)
        target_logit = jnp.take_along_axis(logits, t[..., None], axis=-1)[..., 0]
        return jnp.sum((jax.nn.logsumexp(logits, axis=-1) - target_logit) * w)

    return _chunked_sum(one, (hidden, targets, weights), chunk)


def distillation_sum(logits_fn, hidden, teacher_hidden, weights, chunk: int):
    """sum over tokens of weights * the cross-entropy from the teacher's distribution (softmax of its logits,
    held constant) to the student's, in fp32; chunked as `cross_entropy_sum`."""
    def one(h, teacher, w):
        student = jax.nn.log_softmax(logits_fn(h).astype(jnp.float32), axis=-1)
        target = jax.nn.softmax(jax.lax.stop_gradient(logits_fn(teacher)).astype(jnp.float32), axis=-1)
        return -jnp.sum(jnp.sum(target * student, axis=-1) * w)

    return _chunked_sum(one, (hidden, teacher_hidden, weights), chunk)


def _chunked_sum(fn, arrays, chunk: int):
    """sum of fn(*chunk of every array) over chunks of `chunk` positions of every row ([B, T, ...] arrays; the
    whole row when chunk does not divide T), each chunk rematerialised in the backward pass."""
    batch, length = arrays[0].shape[:2]
    chunk = length if length % chunk else chunk
    n = length // chunk
    split = lambda x: jnp.moveaxis(x.reshape(batch, n, chunk, *x.shape[2:]), 1, 0)  # noqa: E731
    return jnp.sum(jax.lax.map(jax.checkpoint(lambda args: fn(*args)), tuple(split(x) for x in arrays)))


def expert_loads(chosen: list, segment_ids, num_experts: int):
    """Tokens routed to each expert, per MoE layer: [layers, experts] fp32 (padding not counted)."""
    if not chosen:
        return jnp.zeros((0, num_experts), jnp.float32)
    real = (segment_ids.reshape(-1) > 0).astype(jnp.float32)
    return jnp.stack([jnp.zeros((num_experts,), jnp.float32).at[ids].add(
        jnp.broadcast_to(real[:, None], ids.shape)) for ids in chosen])


def load_balance(loads):
    """Scalars of the expert loads [layers, experts]: max/mean (1 is perfect) and coefficient of variation,
    each averaged over layers."""
    if loads.shape[0] == 0:
        return {}
    mean = jnp.maximum(loads.mean(axis=-1), 1e-9)
    return {"expert_load_max_over_mean": jnp.mean(loads.max(axis=-1) / mean),
            "expert_load_cv": jnp.mean(loads.std(axis=-1) / mean)}
