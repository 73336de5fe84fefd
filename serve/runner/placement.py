"""Where the engine's arrays live: the default device, or a device mesh (`--mesh tensor=..,expert=..`).

On a mesh the parameters are placed by `inkling_jax.parallel.rules`'s logical-axis table (experts over `expert`,
heads and MLP widths over `tensor`), and the cache follows the attention's K/V heads: K/V and their ShortConv
states split over `tensor` when the layer's KV heads divide evenly, else replicated; everything else (rows,
lengths, page tables, the residual-width conv states, sampler state, step inputs) is replicated. Every program
gets explicit output shardings, so a donated cache comes back laid out as it went in and the compiled steps
accept it again.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from inkling_jax.config import TextConfig
from inkling_jax.nn.cache import Cache
from inkling_jax.nn.mtp import keep_first_depths
from inkling_jax.parallel.kernel_sharding import head_shards
from inkling_jax.parallel.mesh import MeshError, check_mesh, make_mesh, parse_mesh_spec
from inkling_jax.parallel.placement import shard_model
from inkling_jax.parallel.rules import override_rules, spec_for
from inkling_jax.quant import serving_view
from serve.engine.config import EngineConfig

# The batch axes of the server's rows: never `expert` (RULES splits a trainer's batch over it). The KV pool is one
# pool of pages, whole on every expert shard; with the rows split over `expert`, every step program would write it
# from rows gathered across the shards (tests/serve/test_mesh.py finds such writes then).
ROWS = ("data", "fsdp")

# LayerCache field -> logical names of its dimensions (see `inkling_jax.nn.cache`)
CACHE_AXES = {"k": (None, None, "kv_heads", None), "v": (None, None, "kv_heads", None),
              "k_conv": (None, None, "kv_heads"), "v_conv": (None, None, "kv_heads"),
              "attn_conv": (None, None, None), "mlp_conv": (None, None, None)}


class Placement:
    def __init__(self, mesh: Mesh | None = None):
        self.mesh = mesh
        self._checked = set()  # the configs `check` passed (the server checks before loading, the runner after)

    @classmethod
    def from_spec(cls, spec: str | None) -> "Placement":
        """"tensor=2,expert=4": a mesh over that many devices (the first ones); None or "": one device."""
        if not spec:
            return cls()
        count = math.prod(parse_mesh_spec(spec).values())
        if count > jax.device_count():
            raise MeshError(f"mesh {spec!r} needs {count} devices; {jax.device_count()} available")
        return cls(make_mesh(spec, jax.devices()[:count]))

    def check(self, text: TextConfig, dense_precision: str = "bf16", lora_experts: bool = False,
              name: str | None = None) -> None:
        """`sharding.check_mesh` (MeshError where the mesh cannot split the model; warnings for what stays whole),
        once per config; NVFP4 dense weights are fused matrices, which a `tensor` axis cannot split. LoRA adapters
        on the experts (`lora_experts`) run the routed experts outside their expert-parallel dispatch
        (`serve.lora.experts`), which an `expert` axis would turn into every device gathering every expert. name:
        what `text` configures where it is not the served model (a draft model), for the error."""
        if dense_precision == "nvfp4" and self.mesh is not None and self.mesh.shape["tensor"] > 1:
            raise MeshError("--dense-precision nvfp4 holds fused q|k|v|r and shared-expert matrices, which a tensor "
                            "axis cannot split: use fp8 or bf16 with this mesh, or a mesh without tensor")
        if lora_experts and self.mesh is not None and self.mesh.shape["expert"] > 1:
            raise MeshError("--lora-experts is not served on a mesh with an expert axis: serve it on a mesh "
                            "without expert (tensor=N), or leave --lora-experts off (adapters on attention and the "
                            "dense MLPs run on any mesh)")
        if self.mesh is not None and text not in self._checked:
            try:
                check_mesh(self.mesh, text)
            except MeshError as err:
                if name is None:
                    raise
                raise MeshError(f"{name}: {err}") from None
            self._checked.add(text)

    @property
    def device_list(self) -> list:
        """The devices the engine's arrays live on."""
        return [jax.devices()[0]] if self.mesh is None else list(self.mesh.devices.flat)

    @property
    def devices(self) -> str:
        return str(jax.devices()[0]) if self.mesh is None else f"mesh {dict(self.mesh.shape)}"

    @property
    def fuses_projections(self) -> bool:
        """Whether the engine's view may fuse each attention's q, k, v and r maps into one matmul, each dense MLP's
        gate and up, and each MoE's shared experts into one MLP: not over a `tensor` axis, which splits them by
        heads or width (the fused columns mix them)."""
        return self.mesh is None or self.mesh.shape["tensor"] == 1

    def model_view(self, model, config: EngineConfig = EngineConfig()):
        """The model an engine of `config` runs, built from `model`, which is left as it was: fused where
        `config.fuse_projections` and the mesh allow (a decode step's small products are latency-bound;
        `serving_view`), with only the MTP depths the engine drafts with (`EngineConfig.mtp_depths`: none unless
        it drafts with the head), and placed on the mesh (`shard_model`)."""
        view = serving_view(model, fuse=config.fuse_projections and self.fuses_projections)
        keep_first_depths(view, config.mtp_depths(model.config))
        return view if self.mesh is None else shard_model(view, self.mesh)

    def replicated(self):
        return None if self.mesh is None else NamedSharding(self.mesh, PartitionSpec())

    def kv_shards(self, text: TextConfig, local: bool = False) -> int:
        """The devices one layer kind's KV heads (and its cache) are split over: where its attention kernels
        split their heads (`kernel_sharding.head_shards`), so each device's cache holds its own heads."""
        shape = text.attention(local)
        return head_shards(self.mesh, (shape.num_heads, shape.num_kv_heads))

    def cache_shardings(self, texts: tuple[TextConfig, ...], cache: Cache):
        """A pytree like `cache` of shardings (None without a mesh). texts: the configs whose layers the cache
        holds, in order (the model's, then a drafter's: `speculative.init_serving_cache`); each layer's K/V split
        as its own attention kernels split its heads (`kv_shards` of its config and kind)."""
        if self.mesh is None:
            return None
        kinds = [(text, text.is_local(i)) for text in texts for i in range(text.num_layers)]
        if len(kinds) != len(cache.layers):
            raise ValueError(f"a cache of {len(cache.layers)} layers for configs of {len(kinds)}")
        layers = []
        for layer, (text, local) in zip(cache.layers, kinds):
            split = self.kv_shards(text, local) > 1
            fields = {}
            for name, axes in CACHE_AXES.items():
                shape = getattr(layer, name).shape
                axes = axes if split else (None,) * len(axes)
                fields[name] = NamedSharding(self.mesh, spec_for(axes, shape, self.mesh))
            layers.append(layer.replace(**fields))
        return cache.replace(lengths=self.replicated(), page_table=self.replicated(), layers=tuple(layers))

    def put(self, tree, shardings=None):
        """Host or device arrays onto the placement (`shardings`: a matching pytree; default replicated)."""
        if self.mesh is None:
            return jax.device_put(tree)
        return jax.device_put(tree, shardings if shardings is not None else self.replicated())

    def create(self, fn, shardings=None):
        """The arrays `fn()` builds, made by each device in its own shards (`shardings`: a matching pytree;
        default replicated): a KV pool sized for every device's memory never exists whole on one of them."""
        return self.jit(fn, out_shardings=shardings)()

    def reserve(self, nbytes: int) -> None:
        """Has the allocator take `nbytes` on every device as one block and hand it back. An allocator that grows
        region by region keeps the block, so the arrays made next (the cache) find room in it; otherwise it may
        grow a region that holds the first of them but not the next (see `serve.engine.memory_plan`)."""
        count = len(self.device_list)
        rows = -(-nbytes // 2**20)  # whole MiB, rows of 1 MiB: no dimension over 2**31
        every_device = None if self.mesh is None else NamedSharding(self.mesh, PartitionSpec(self.mesh.axis_names))
        block = self.create(lambda: jnp.zeros((count * rows, 2**20), jnp.uint8), every_device)
        jax.block_until_ready(block).delete()

    def jit(self, fn, out_shardings=None, **kwargs):
        """jax.jit with explicit output shardings on a mesh (replicated unless given), traced with the server's
        rows whole over `expert` (ROWS)."""
        if self.mesh is None:
            return jax.jit(fn, **kwargs)
        kwargs["out_shardings"] = out_shardings if out_shardings is not None else self.replicated()

        @functools.wraps(fn)
        def with_whole_rows(*args, **kw):
            with override_rules(batch=ROWS):
                return fn(*args, **kw)

        return jax.jit(with_whole_rows, **kwargs)
