"""The server's memory on each device of a mesh, before it starts: its weights (in the serving form it runs), the
KV pool `serve.engine.memory_plan` would size for that memory, the slots' sliding rings and ShortConv states,
the prefix snapshots, the sampler's state and the step programs' logits and activations.

The pool is sized by the server's own rule (`memory_plan.pages_in`, from what the allocator holds once the
weights are in), so the plan's page count is the one the server logs. The step programs' temporaries are that
rule's estimate (a logits row per step row with its softmax and draws in fp32, the widest step's activations);
at warm-up the server compares it with XLA's figure for each compiled program and shrinks the pool if short.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.sharding import AbstractMesh

from inkling_jax.config import InklingConfig, TextConfig
from inkling_jax.nn.mtp import first_depths
from inkling_jax.parallel.kernel_sharding import head_shards
from plan.weights import Weight, bytes_by_kind, model_weights
from inkling_jax.quant import QuantConfig
from serve.engine.config import EngineConfig
from serve.engine.memory_plan import beside_pool_bytes, cache_layers, page_bytes, pages_in
from serve.runner.speculative import drafter_layers, init_serving_cache

# Cache fields split over `tensor` with their layer's KV heads (`serve.runner.placement.CACHE_AXES`).
KV_FIELDS = ("k", "v", "k_conv", "v_conv")


@dataclasses.dataclass
class ServingPlan:
    weights: dict[str, int]  # kind -> bytes per device
    kv_per_token: int  # bytes per device of one token's K and V in every full-attention layer and MTP depth kept
    kv_needed: int  # every slot at max_model_len
    pages: int  # what the server would allocate for this memory
    page_bytes: int
    state: dict[str, int]  # rings, ShortConv states, snapshots, lengths and page table: per device as placed
    beside_pool: dict[str, int]  # the server's rule: counted whole on every device
    budget: float  # bytes the server sizes the pool from (after the weights, x memory_fraction)
    pages_needed: int

    @property
    def fits(self) -> bool:
        return self.pages >= self.pages_needed


def cache_state_bytes(config: InklingConfig, engine: EngineConfig, dtype, mesh: AbstractMesh,
                      drafter: TextConfig | None = None) -> dict[str, int]:
    """Per device, the cache beside its pages: the sliding layers' K/V rings and the ShortConv states of every
    slot (split over `tensor` with their layer's KV heads, as the server places them), the lengths and page
    table, and the prefix snapshots (a slot's rings and states each); the drafter's layers too (`mtp_drafter`)."""
    shapes = jax.eval_shape(lambda: init_serving_cache(config.text, drafter, engine.num_rows,
                                                       engine.max_model_len + engine.lookahead, dtype,
                                                       page_size=engine.page_size, num_pages=1,
                                                       ring_slack=engine.ring_slack))
    kinds = [(text, text.is_local(i)) for text in cache_layers(config.text, drafter) for i in range(text.num_layers)]
    out = {"sliding rings": 0, "ShortConv states": 0, "lengths and page table": 0}
    for layer, (text, local) in zip(shapes.layers, kinds, strict=True):
        shards = head_shards(mesh, (text.attention(local).num_heads, text.attention(local).num_kv_heads))
        for name in ("k_conv", "v_conv", "attn_conv", "mlp_conv"):
            x = getattr(layer, name)
            out["ShortConv states"] += x.size * x.dtype.itemsize // (shards if name in KV_FIELDS else 1)
        if local:
            out["sliding rings"] += sum(getattr(layer, n).size * getattr(layer, n).dtype.itemsize
                                        for n in ("k", "v")) // shards
    out["lengths and page table"] = sum(x.size * x.dtype.itemsize for x in (shapes.lengths, shapes.page_table))
    out["prefix snapshots"] = engine.snapshots * (out["sliding rings"] + out["ShortConv states"]) // engine.num_rows
    return out


def mtp_drafter(config: InklingConfig, engine: EngineConfig) -> TextConfig | None:
    """The layers an engine drafting with the MTP head keeps beside the model's (`drafter_layers`), or None. A
    draft model's are not planned (the plan has no second checkpoint)."""
    if engine.speculative is not None and engine.speculative.method != "mtp":
        raise ValueError(f"the plan counts the MTP head's drafting, not method {engine.speculative.method!r}")
    return drafter_layers(config, engine.speculative)


def served_config(config: InklingConfig, engine: EngineConfig) -> InklingConfig:
    """The config of the model an engine of `engine` runs (`Placement.model_view`): only the MTP depths it drafts
    with."""
    return first_depths(config, engine.mtp_depths(config))


def serving_plan(config: InklingConfig, mesh: AbstractMesh, engine: EngineConfig, quant: QuantConfig,
                 allocator_bytes: float, dtype=jnp.bfloat16, weights: list[Weight] | None = None) -> ServingPlan:
    """allocator_bytes: what the allocator may hand out on each device (the device's memory times
    XLA_PYTHON_CLIENT_MEM_FRACTION). weights: `model_weights` of the served form, if already made."""
    text = config.text
    if weights is None:
        weights = model_weights(served_config(config, engine), dtype, quant,
                                fuse=engine.fuse_projections and mesh.shape["tensor"] == 1)
    by_kind = bytes_by_kind(weights, mesh)
    shards = head_shards(mesh, (text.attention(False).num_heads, text.attention(False).num_kv_heads))
    drafter = mtp_drafter(config, engine)
    page = page_bytes(text, engine, dtype, shards, drafter)
    budget = (allocator_bytes - sum(by_kind.values())) * engine.memory_fraction
    return ServingPlan(weights=by_kind, kv_per_token=page // engine.page_size,
                       kv_needed=engine.max_num_seqs * engine.pages_per_row * page,
                       pages=pages_in(budget, text, engine, dtype, shards, drafter), page_bytes=page,
                       state=cache_state_bytes(config, engine, dtype, mesh, drafter),
                       beside_pool=beside_pool_bytes(text, engine, dtype, drafter), budget=budget,
                       pages_needed=engine.max_num_seqs * engine.pages_per_row)
