"""The media towers that turn images and audio into rows of the token embedding.

- Vision: the HMLP patch encoder. Each patch [T=2, 40, 40, 3] is folded space/time-to-depth in stages, each
  stage a bias-free linear then RMSNorm + exact GELU (not after the last), then a final RMSNorm: one vector per
  patch, no attention anywhere.
- Audio (dMel): each frame holds one quantised level per mel bin; its embedding is the sum of one learned row
  per (bin, level), then RMSNorm.
"""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from inkling_jax.backend import Backend
from inkling_jax.config import AudioConfig, VisionConfig
from inkling_jax.nn.layers import Linear, RMSNorm, normal

TOWER_NORM_EPS = 1e-6


def _prime_factors(n: int) -> list[int]:
    out, p = [], 2
    while p * p <= n:
        while n % p == 0:
            out.append(p)
            n //= p
        p += 1
    return out + ([n] if n > 1 else [])


def plan_scales(cfg: VisionConfig) -> np.ndarray:
    """The (t, h, w, channels) grid of each stage boundary, [n_layers + 1, 4].

    Candidate scales grow the patch side through its prime factors (largest first), then time; the n_layers + 1
    boundaries are the candidates closest, in log size, to an even log-spaced progression (an optimal
    assignment), with the first and last fixed.
    """
    from scipy.optimize import linear_sum_assignment

    h = np.cumprod(_prime_factors(cfg.patch_size)[::-1])
    t = np.cumprod(_prime_factors(cfg.temporal_patch_size)[::-1]) if cfg.temporal_patch_size > 1 else np.zeros(0, int)
    c = cfg.num_channels
    spatial = [(1, s, s, int(np.ceil(s * s * c / 64)) * 64) for s in h]
    temporal = [(int(tt), int(h[-1]), int(h[-1]), int(h[-1] ** 2 * c * tt) * 64) for tt in t]
    scales = np.array([(1, 1, 1, c)] + spatial + temporal, dtype=np.int64)
    size = np.prod(scales[:, :3], axis=1).astype(np.float64)
    total = cfg.patch_size ** 2 * cfg.temporal_patch_size * c
    ideal = np.linspace(0.0, np.log(float(total)), cfg.n_layers + 1)
    cost = np.abs(ideal[:, None] - np.log(size)[None, :])
    if cfg.n_layers >= len(scales):
        idx = np.argmin(cost, axis=1)
    else:
        idx = linear_sum_assignment(cost)[1]
    idx[0], idx[-1] = 0, len(scales) - 1
    return scales[idx]


def fold_to_depth(x, t_fold: int, hw_fold: int):
    """[B, T, H, W, C] -> [B, T/t, H/s, W/s, t*s*s*C], new channels ordered (t offset, h offset, w offset, C)."""
    b, t, h, w, c = x.shape
    x = x.reshape(b, t // t_fold, t_fold, h // hw_fold, hw_fold, w // hw_fold, hw_fold, c)
    x = x.transpose(0, 1, 3, 5, 2, 4, 6, 7)
    return x.reshape(b, t // t_fold, h // hw_fold, w // hw_fold, t_fold * hw_fold * hw_fold * c)


class VisionTower(nnx.Module):
    def __init__(self, cfg: VisionConfig, hidden: int, *, dtype, rngs: nnx.Rngs, backend: Backend = Backend()):
        scales = plan_scales(cfg)
        self.folds = []
        linears, norms = [], []
        last = len(scales) - 2
        for i, (start, end) in enumerate(zip(scales[:-1], scales[1:])):
            t_fold, hw_fold = int(end[0] // start[0]), int(end[1] // start[1])
            self.folds.append((t_fold, hw_fold))
            in_dim = int(start[3]) * t_fold * hw_fold * hw_fold
            out_dim = hidden if i == last else int(end[3])
            linears.append(Linear(in_dim, out_dim, dtype=dtype, rngs=rngs, backend=backend))
            if i != last:
                norms.append(RMSNorm(out_dim, TOWER_NORM_EPS, dtype=dtype, backend=backend))
        self.linears, self.norms = nnx.List(linears), nnx.List(norms)
        self.final_norm = RMSNorm(hidden, TOWER_NORM_EPS, dtype=dtype, backend=backend)

    def __call__(self, pixel_values):
        """pixel_values [N, T, P, P, C] (one patch each) -> [N, hidden]."""
        x = pixel_values.astype(self.final_norm.weight.dtype)
        for i, (t_fold, hw_fold) in enumerate(self.folds):
            if t_fold > 1 or hw_fold > 1:
                x = fold_to_depth(x, t_fold, hw_fold)
            x = self.linears[i](x)
            if i < len(self.norms):
                x = jax.nn.gelu(self.norms[i](x), approximate=False)
        return self.final_norm(x).reshape(x.shape[0], -1)


class AudioTower(nnx.Module):
    def __init__(self, cfg: AudioConfig, hidden: int, *, dtype, rngs: nnx.Rngs, backend: Backend = Backend()):
        self.levels = cfg.mel_vocab_size
        self.embedding = nnx.Param(normal(rngs, (cfg.n_mel_bins * cfg.mel_vocab_size, hidden), dtype))
        self.final_norm = RMSNorm(hidden, TOWER_NORM_EPS, dtype=dtype, backend=backend)

    def __call__(self, audio_ids):
        """audio_ids [N, n_mel_bins] quantised levels -> [N, hidden]."""
        offsets = jnp.arange(audio_ids.shape[-1]) * self.levels
        rows = jnp.take(self.embedding[...], audio_ids + offsets, axis=0)
        return self.final_norm(rows.sum(axis=-2))
