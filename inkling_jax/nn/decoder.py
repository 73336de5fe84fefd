"""One decoder layer: attention + ShortConv, then the dense MLP or the MoE + ShortConv, each residual."""

from flax import nnx

from inkling_jax.backend import Backend
from inkling_jax.config import TextConfig
from inkling_jax.nn.attention import Attention
from inkling_jax.nn.cache import LayerCache
from inkling_jax.nn.layers import RMSNorm, ShortConv
from inkling_jax.nn.mlp import DenseMLP
from inkling_jax.nn.moe import MoE
from inkling_jax.nn.token_sets import LayerSet, TokenLayout


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
        (x,), (new_cache,), chosen = self.over_sets(
            [x], [LayerSet(positions, cache, n_new, page_table, ring_rows, segment_ids)], expert_ids=expert_ids,
            keep_conv_inputs=keep_conv_inputs)
        return x, new_cache, None if chosen is None else chosen[0]

    def over_sets(self, xs: list, sets: list[LayerSet], *, expert_ids=None, keep_conv_inputs: bool = False):
        """The layer over several sets of rows in one pass, xs[i] [B_i, T_i, hidden] with sets[i]: the
        position-wise parts (norms, projections, `wo`, the MLP or MoE) once over all the sets' tokens
        (`TokenLayout`), the attention and the ShortConvs set by set. The K/V page pools and rings go from each
        set's attention to the next: the sets write disjoint pages and rings, but each set starts from the
        pools with the writes before it. Returns (xs, the sets' updated LayerCaches (None without a cache),
        each holding the pools after every set's writes; per set the MoE's expert ids [B_i * T_i, k], or None
        for a dense layer)."""
        layout = TokenLayout([x.shape[:2] for x in xs])
        projected = self.attn.project(self.attn_norm(layout.join(xs)))
        outs, attn_caches, pools = [], [], {}
        for s, q, k, v, r in zip(sets, *(layout.split(p) for p in projected)):
            cache = None if s.cache is None else s.cache.replace(**pools)
            out, updated = self.attn.attend(q, k, v, r, s.positions, segment_ids=s.segment_ids, cache=cache,
                                            n_new=s.n_new, page_table=s.page_table, ring_rows=s.ring_rows,
                                            keep_conv_inputs=keep_conv_inputs)
            pools = {} if updated is None else dict(k=updated["k"], v=updated["v"])
            outs.append(out)
            attn_caches.append(updated)
        a = layout.split(self.attn.wo(layout.join(outs)))
        xs, attn_convs = _add_conv(xs, a, sets, self.attn_sconv, "attn_conv", keep_conv_inputs)
        m, chosen = self.mlp(self.mlp_norm(layout.join(xs)), expert_ids)
        xs, mlp_convs = _add_conv(xs, layout.split(m), sets, self.mlp_sconv, "mlp_conv", keep_conv_inputs)
        caches = [None if fields is None else LayerCache(**(fields | pools), attn_conv=attn_conv, mlp_conv=mlp_conv)
                  for fields, attn_conv, mlp_conv in zip(attn_caches, attn_convs, mlp_convs)]
        return xs, caches, None if chosen is None else layout.split_tokens(chosen)


def _add_conv(xs: list, ys: list, sets: list[LayerSet], conv: ShortConv, state: str, keep_inputs: bool):
    """Per set, x + conv(y) (the residual of a sublayer whose output y goes through its ShortConv) and the conv's
    new state; `state`: the LayerCache field of the conv's state."""
    out, states = [], []
    for x, y, s in zip(xs, ys, sets):
        y, new_state = conv(y, None if s.cache is None else getattr(s.cache, state), s.segment_ids, s.n_new,
                            keep_inputs)
        out.append(x + y)
        states.append(new_state)
    return out, states
