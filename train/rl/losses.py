"""Group-relative advantages, the policy losses and the train-rollout mismatch metrics.

Per completion token t of sequence i, with logp the trainer's log-probability at the weights being trained,
old the log-probability of the policy that sampled it, A_i the sequence's advantage and eps the clip range:
- advantages over each prompt's G rewards: GRPO and GSPO (r - mean) / (std + 1e-6); Dr. GRPO r - mean;
- `grpo`: ratio = exp(logp - old), loss = sum_t -min(ratio A, clip(ratio, 1 - eps, 1 + eps) A) / (tokens);
- `dr_grpo`: the same per-token terms summed and divided by a constant, sequences x max_new_tokens;
- `gspo`: one ratio per sequence, s_i = exp(mean over its tokens of (logp - old)), loss the mean over
  sequences of -min(s_i A_i, clip(s_i, 1 - eps, 1 + eps) A_i);
- with kl_coef > 0, plus kl_coef x the token mean of k3 = exp(ref - logp) - (ref - logp) - 1 (ref: the initial
  policy), an unbiased, non-negative estimate of KL(policy || initial).
Metrics, over every completion token (mask): |logp_trainer - logp_rollout| mean and max, both of the model's own
distribution (temperature 1, as the engine reports them) at the weights that sampled; `mismatch_kl`, the token
mean of k3 with log r = logp_trainer - logp_rollout, an unbiased estimate of KL(rollout || trainer) from the
rollout's samples; `clip_fraction`, the share of tokens (GSPO: sequences) where the clipped term is taken;
`entropy`, the token mean of the sampling distribution's entropy.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from inkling_jax.nn.invariant import with_gradient_of

LOSSES = ("grpo", "dr_grpo", "gspo")
DEFAULT_CLIP = {"grpo": 0.2, "dr_grpo": 0.2, "gspo": 3e-4}


@dataclasses.dataclass(frozen=True)
class LossConfig:
    kind: str = "grpo"
    clip_eps: float = 0.2
    kl_coef: float = 0.0
    max_new_tokens: int = 64  # Dr. GRPO's constant normaliser is sequences x this


def group_advantages(rewards: np.ndarray, kind: str) -> np.ndarray:
    """rewards [P, G] -> advantages [P, G], each relative to its prompt's group."""
    centred = rewards - rewards.mean(axis=1, keepdims=True)
    if kind == "dr_grpo":
        return centred
    return centred / (rewards.std(axis=1, keepdims=True) + 1e-6)


def token_logprobs(logits_fn, hidden, targets, temperature: float, chunk: int, log_softmax=jax.nn.log_softmax,
                   gradient_of=None):
    """(logp of the targets at `temperature`, logp at temperature 1, entropy at `temperature`), each [B, T] fp32.
    The head runs on `chunk` positions of every row at a time, rematerialised in the backward pass, so whole
    [B, T, vocab] logits never exist at once. log_softmax: over the last axis (a batch-invariant model's is
    `inkling_jax.nn.invariant.log_softmax`, the engine's). gradient_of: another (logits_fn, log_softmax) pair
    computing the same terms, whose derivative is taken instead (a batch-invariant model's values with XLA's
    gradient): each chunk's backward recomputes the terms that way rather than running the batch-invariant
    kernels again, which only the values need."""
    batch, length, _ = hidden.shape
    chunk = length if length % chunk else chunk
    n = length // chunk

    def terms(logits_fn, log_softmax, h, t):
        logits = logits_fn(h).astype(jnp.float32)
        raw = jnp.take_along_axis(log_softmax(logits), t[..., None], axis=-1)[..., 0]
        scaled = log_softmax(logits / temperature)
        logp = jnp.take_along_axis(scaled, t[..., None], axis=-1)[..., 0]
        return logp, raw, -jnp.sum(jnp.exp(scaled) * scaled, -1)

    split = lambda x: jnp.moveaxis(x.reshape(batch, n, chunk, *x.shape[2:]), 1, 0)  # noqa: E731
    join = lambda x: jnp.moveaxis(x, 0, 1).reshape(batch, length)  # noqa: E731
    chunks = (split(hidden), split(targets))
    if gradient_of is None:
        one = jax.checkpoint(lambda args: terms(logits_fn, log_softmax, *args))
    else:
        # A custom derivative sees only its explicit arguments, so the weights both ways close over are hoisted
        # into one list by converting them as one function; each side's unused half is dead code XLA drops.
        both = lambda h, t: (terms(logits_fn, log_softmax, h, t), terms(*gradient_of, h, t))  # noqa: E731
        converted, weights = jax.closure_convert(both, chunks[0][0], chunks[1][0])
        fn = with_gradient_of(lambda *a: converted(*a)[0], lambda *a: converted(*a)[1])
        one = lambda args: fn(*args, *weights)  # noqa: E731
    return tuple(join(x) for x in jax.lax.map(one, chunks))


def k3(log_ratio):
    """exp(x) - x - 1 of a log ratio x = log q/p at samples of p: an unbiased, non-negative estimate of KL(p || q)."""
    return jnp.exp(log_ratio) - log_ratio - 1.0


def policy_loss(cfg: LossConfig, logp, old, advantages, mask, ref=None):
    """(loss, {clip_fraction, kl_to_initial}) over tokens [N, T]; advantages [N] per sequence, mask [N, T] 1.0 on
    completion tokens."""
    tokens = jnp.maximum(mask.sum(), 1.0)
    low, high = 1.0 - cfg.clip_eps, 1.0 + cfg.clip_eps
    if cfg.kind == "gspo":
        lengths = jnp.maximum(mask.sum(-1), 1.0)
        ratio = jnp.exp(jnp.sum((logp - old) * mask, -1) / lengths)
        plain, clipped = ratio * advantages, jnp.clip(ratio, low, high) * advantages
        real = (mask.sum(-1) > 0).astype(jnp.float32)
        loss = -jnp.sum(jnp.minimum(plain, clipped) * real) / jnp.maximum(real.sum(), 1.0)
        clip_fraction = jnp.sum((clipped < plain) * real) / jnp.maximum(real.sum(), 1.0)
    else:
        ratio = jnp.exp(logp - old)
        a = advantages[:, None]
        plain, clipped = ratio * a, jnp.clip(ratio, low, high) * a
        terms = -jnp.minimum(plain, clipped) * mask
        denom = tokens if cfg.kind == "grpo" else float(mask.shape[0] * cfg.max_new_tokens)
        loss = terms.sum() / denom
        clip_fraction = jnp.sum((clipped < plain) * mask) / tokens
    extra = {"clip_fraction": clip_fraction}
    if cfg.kl_coef > 0:
        kl = jnp.sum(k3(ref - logp) * mask) / tokens
        loss = loss + cfg.kl_coef * kl
        extra["kl_to_initial"] = kl
    return loss, extra


def mismatch_metrics(trainer_logp, rollout_logp, mask) -> dict:
    """The train-rollout mismatch at the weights that sampled, over the completion tokens."""
    diff = jnp.abs(trainer_logp - rollout_logp) * mask
    tokens = jnp.maximum(mask.sum(), 1.0)
    return {"logprob_abs_diff_mean": diff.sum() / tokens, "logprob_abs_diff_max": diff.max(),
            "mismatch_kl": jnp.sum(k3(trainer_logp - rollout_logp) * mask) / tokens}
