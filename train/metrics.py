"""Training metrics: model FLOPs per token (for MFU), device peaks, and the writers (one JSON line per step under
`--out`, and TensorBoard).

MFU counts model FLOPs only (no rematerialisation): 6 x the active matmul parameters per token (forward 2, backward
4), plus attention: scores and values over the keys each query sees (causal rows average (T + 1) / 2 keys, sliding
layers at most the window) and the relative-bias logits, again x 3 for training.
"""

from __future__ import annotations

import json
import logging
import os

import jax
import numpy as np

from inkling_jax.config import TextConfig

log = logging.getLogger(__name__)

# Dense bf16 peak FLOP/s per chip, by device kind (vendor figures; a benchmark should measure its own ceiling).
PEAK_BF16 = {"H100": 989e12, "H200": 989e12, "GH200": 989e12, "A100": 312e12, "B200": 2250e12,
             "TPU v4": 275e12, "TPU v5 lite": 197e12, "TPU v5e": 197e12, "TPU v5p": 459e12, "TPU v6": 918e12}


def active_matmul_params(cfg: TextConfig) -> int:
    """Parameters of the matmuls one token goes through (the embedding lookup is not a matmul)."""
    total = cfg.hidden_size * cfg.unpadded_vocab_size  # the head
    for layer in range(cfg.num_layers):
        s = cfg.attention(cfg.is_local(layer))
        q_width, kv_width = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
        total += cfg.hidden_size * (2 * q_width + 2 * kv_width + s.num_heads * cfg.d_rel)
        if cfg.is_dense(layer):
            total += 3 * cfg.hidden_size * cfg.dense_intermediate_size
        else:
            active_experts = cfg.num_experts_per_tok + cfg.num_shared_experts
            total += cfg.hidden_size * (cfg.num_experts + cfg.num_shared_experts)  # the router
            total += active_experts * 3 * cfg.hidden_size * cfg.moe_intermediate_size
    return total


def attention_flops_per_token(cfg: TextConfig, seq_len: int) -> float:
    """Forward attention FLOPs per token, averaged over the positions of a sequence of `seq_len`."""
    t = np.arange(1, seq_len + 1)
    total = 0.0
    for layer in range(cfg.num_layers):
        s = cfg.attention(cfg.is_local(layer))
        keys = np.minimum(t, s.window).mean() if s.window else t.mean()
        total += 4 * s.num_heads * s.head_dim * keys + 2 * s.num_heads * cfg.d_rel * s.extent
    return float(total)


def train_flops_per_token(cfg: TextConfig, seq_len: int) -> float:
    return 3 * (2 * active_matmul_params(cfg) + attention_flops_per_token(cfg, seq_len))


def peak_flops(device=None) -> float | None:
    """The dense bf16 peak of one device, or None when unknown (CPU)."""
    kind = (device or jax.devices()[0]).device_kind
    return next((v for k, v in PEAK_BF16.items() if k.lower() in kind.lower()), None)


class MetricsWriter:
    """Appends one JSON object per step to `<out>/metrics.jsonl` and mirrors scalars to TensorBoard
    (`<out>/tensorboard`). Only process 0 writes."""

    def __init__(self, out_dir: str, tensorboard: bool = True):
        self.enabled = jax.process_index() == 0
        self.file = self.tb = None
        if not self.enabled:
            return
        os.makedirs(out_dir, exist_ok=True)
        self.file = open(os.path.join(out_dir, "metrics.jsonl"), "a")
        if tensorboard:
            try:
                from tensorboardX import SummaryWriter

                self.tb = SummaryWriter(os.path.join(out_dir, "tensorboard"))
            except ImportError:
                log.warning("tensorboardX is not installed (pip install 'inkling-jax[train]'); no TensorBoard logs")

    def write(self, step: int, metrics: dict) -> None:
        if not self.enabled:
            return
        row = {"step": int(step), **{k: _plain(v) for k, v in metrics.items()}}
        self.file.write(json.dumps(row) + "\n")
        self.file.flush()
        if self.tb is not None:
            for k, v in row.items():
                if k != "step" and isinstance(v, (int, float)):
                    self.tb.add_scalar(f"train/{k}", v, int(step))

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
        if self.tb is not None:
            self.tb.close()


def _plain(v):
    v = np.asarray(v)
    return v.item() if v.ndim == 0 else v.tolist()
