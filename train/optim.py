"""The optimizer: AdamW with linear warmup and cosine decay, global-norm clipping, decoupled weight decay on
matrices only. The moments are fp32 because the parameters they follow are the fp32 master copies."""

from __future__ import annotations

import dataclasses

import jax
import optax


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    learning_rate: float = 3e-4
    warmup_steps: int = 100
    total_steps: int = 1000
    min_lr_ratio: float = 0.1  # the cosine ends at learning_rate * min_lr_ratio
    weight_decay: float = 0.1
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    clip_norm: float = 1.0  # 0 disables clipping


def schedule(cfg: OptimConfig) -> optax.Schedule:
    warmup = min(cfg.warmup_steps, max(cfg.total_steps - 1, 0))
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=cfg.learning_rate, warmup_steps=warmup,
        decay_steps=max(cfg.total_steps, warmup + 1), end_value=cfg.learning_rate * cfg.min_lr_ratio)


def make_optimizer(cfg: OptimConfig) -> optax.GradientTransformation:
    # Norm weights, scales and other vectors are not decayed: shrinking them toward 0 is not regularisation.
    decay_mask = lambda params: jax.tree.map(lambda p: p.ndim >= 2, params)  # noqa: E731
    adamw = optax.adamw(schedule(cfg), b1=cfg.b1, b2=cfg.b2, eps=cfg.eps, weight_decay=cfg.weight_decay,
                        mask=decay_mask)
    return optax.chain(optax.clip_by_global_norm(cfg.clip_norm), adamw) if cfg.clip_norm > 0 else adamw
