"""One decoder layer: attention + ShortConv, then the dense MLP or the MoE + ShortConv, each residual."""

from flax import nnx

from inkling_jax.backend import Backend
from inkling_jax.config import TextConfig
from inkling_jax.nn.attention import Attention
from inkling_jax.nn.cache import LayerCache
from inkling_jax.nn.layers import RMSNorm, ShortConv
from inkling_jax.nn.mlp import DenseMLP
from inkling_jax.nn.moe import MoE


class DecoderLayer(nnx.Module):
    def __init__(self, cfg: TextConfig, *, local: bool, dense: bool, dtype, rngs: nnx.Rngs,
                 backend: Backend = Backend()):
        hidden, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.attn_norm = RMSNorm(hidden, eps, dtype=dtype, backend=backend)
        self.attn = Attention(cfg, local, dtype=dtype, rngs=rngs, backend=backend)
        self.attn_sconv = ShortConv(hidden, cfg.conv_kernel_size, rngs=rngs, backend=backend)
        self.mlp_norm = RMSNorm(hidden, eps, dtype=dtype, backend=backend)
        if dense:
            self.mlp = DenseMLP(hidden, cfg.dense_intermediate_size, dtype=dtype, rngs=rngs, backend=backend)
        else:
            self.mlp = MoE(cfg, dtype=dtype, rngs=rngs, backend=backend)
        self.mlp_sconv = ShortConv(hidden, cfg.conv_kernel_size, rngs=rngs, backend=backend)

    def __call__(self, x, positions, *, segment_ids=None, cache: LayerCache | None = None, n_new=None,
                 page_table=None, ring_rows=None, expert_ids=None, keep_conv_inputs: bool = False):
        """Returns (x, updated LayerCache or None, the MoE's expert ids or None). `keep_conv_inputs`: the cache's
        ShortConv states come back with every input of the chunk (`ShortConv`, speculative verification)."""
        conv = (lambda name: None) if cache is None else (lambda name: getattr(cache, name))
        a, attn_cache = self.attn(self.attn_norm(x), positions, segment_ids=segment_ids, cache=cache, n_new=n_new,
                                  page_table=page_table, ring_rows=ring_rows, keep_conv_inputs=keep_conv_inputs)
        a, attn_conv = self.attn_sconv(a, conv("attn_conv"), segment_ids, n_new, keep_conv_inputs)
        x = x + a
        m, chosen = self.mlp(self.mlp_norm(x), expert_ids)
        m, mlp_conv = self.mlp_sconv(m, conv("mlp_conv"), segment_ids, n_new, keep_conv_inputs)
        x = x + m
        new_cache = None
        if cache is not None:
            new_cache = LayerCache(**attn_cache, attn_conv=attn_conv, mlp_conv=mlp_conv)
        return x, new_cache, chosen
