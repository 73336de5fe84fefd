"""How many KV pages the server allocates: what `memory_fraction` of the device's free memory holds after
everything else the engine keeps (the slots' ring and ShortConv states, the prefix snapshots, the sampler's
per-row state, the steps' logits and activations); without memory statistics (CPU) enough pages for every slot
at full length.

Free memory is counted only as far as one block holds it (`largest_allocation`): each full-attention layer's K
and V pool is one array. Where the allocator grows region by region (XLA_PYTHON_CLIENT_PREALLOCATE=false), the
runner also has it take the whole cache as one block and hand it back before making the arrays
(`Placement.reserve`). Without that, it may grow a region that holds the K pool but leaves the V pool room
neither there nor for a region of its own. Once the step programs are compiled, `pages_that_fit` checks the
plan's formula for their buffers against what XLA says each program needs.
"""

import logging
import math

import jax
import jax.numpy as jnp

from inkling_jax.config import TextConfig
from inkling_jax.nn.cache import cache_bytes
from serve.engine.config import EngineConfig

log = logging.getLogger(__name__)


def cache_layers(text: TextConfig, drafter: TextConfig | None) -> tuple[TextConfig, ...]:
    """The configs of the cache's layers: the target's, then the drafter's (if any)."""
    return (text,) if drafter is None else (text, drafter)


def page_bytes(text: TextConfig, config: EngineConfig, dtype, kv_shards: int = 1,
               drafter: TextConfig | None = None) -> int:
    """Bytes of one page: page_size tokens of K and V in every full-attention layer of the target and of the
    drafter's layers (`serve.runner.speculative.drafter_layers`, each with its own shapes); per device where the
    KV heads are split over kv_shards devices (the target's split, taken for the drafter's layers too)."""
    total = 0
    for layers in cache_layers(text, drafter):
        shape = layers.attention(False)
        full = layers.num_layers - len(layers.local_layer_ids)
        total += 2 * full * config.page_size * shape.num_kv_heads * shape.head_dim * jnp.dtype(dtype).itemsize
    return total // kv_shards


def pages_for_memory(text: TextConfig, config: EngineConfig, dtype, kv_shards: int = 1, devices=None,
                     drafter: TextConfig | None = None) -> int:
    """The pages to allocate (see the module docstring); logs the budget where it sized from memory. kv_shards:
    the devices a page's KV heads are split over (tensor parallelism), each holding that share of every page;
    the rest is counted whole, as if every device held all of it. devices: those the cache lives on (default
    the first), sized by the one with the least memory. drafter: the speculative drafter's cache layers, if any."""
    cfg = config
    devices = jax.devices()[:1] if devices is None else devices
    available, block = free_bytes(devices), largest_allocation(devices)
    if available is None:
        return cfg.max_num_seqs * cfg.pages_per_row
    free = min(available, block or available) * cfg.memory_fraction
    fixed = sum(beside_pool_bytes(text, cfg, dtype, drafter).values())
    pages = pages_in(free, text, cfg, dtype, kv_shards, drafter)
    log.info("device memory: %.1f GiB free, %.1f GiB of it in one block, x %.2f; %.1f GiB for slots, snapshots and "
             "step buffers; %d pages", available / 2**30, free / cfg.memory_fraction / 2**30, cfg.memory_fraction,
             fixed / 2**30, pages)
    return pages


def beside_pool_bytes(text: TextConfig, config: EngineConfig, dtype,
                      drafter: TextConfig | None = None) -> dict[str, int]:
    """What the engine keeps beside its KV pool, by kind, counted whole (as if every device held all of it):
    the slots' sliding rings and ShortConv states (with their lengths and page table), the prefix snapshots
    (a slot's rings and states each), the sampler's per-row state, the largest step's logits (a row each, with
    its softmax and draws, fp32; a mixed step samples its decode and prefill rows together) and its widest
    activations (`EngineConfig.max_step_tokens`). The drafter's layers are counted as a cache of their own (its
    lengths and page table too: a few bytes a row more than the engine keeps)."""
    cfg, vocab = config, text.unpadded_vocab_size
    slots = sum(cache_bytes(layers, cfg.num_rows, cfg.max_model_len, dtype, page_size=cfg.page_size, num_pages=1,
                            ring_slack=cfg.ring_slack) for layers in cache_layers(text, drafter))
    slots -= page_bytes(text, cfg, dtype, drafter=drafter)
    return {"slot states": slots, "prefix snapshots": cfg.snapshots * (slots // cfg.num_rows),
            "sampler state": cfg.num_rows * vocab * 5,  # penalty counts (int32) and prompt masks (bool)
            "step logits": 4 * (cfg.rows[-1] + max(cfg.mixed_prefills, default=0)) * vocab * 4,
            "step activations": 2 * cfg.max_step_tokens * text.hidden_size * 4 * 4}


def pages_in(budget: float, text: TextConfig, config: EngineConfig, dtype, kv_shards: int = 1,
             drafter: TextConfig | None = None) -> int:
    """The KV pages that `budget` bytes per device hold beside `beside_pool_bytes` (the server's sizing rule)."""
    fixed = sum(beside_pool_bytes(text, config, dtype, drafter).values())
    return int((budget - fixed) // page_bytes(text, config, dtype, kv_shards, drafter))


def _stats(devices) -> list[dict]:
    """Each device's allocator statistics ({} where it keeps none: CPU)."""
    return [d.memory_stats() or {} for d in devices]


def free_bytes(devices) -> int | None:
    """The least free memory among `devices` (bytes the allocator may still hand out); None without statistics."""
    stats = _stats(devices)
    if any("bytes_limit" not in st for st in stats):
        return None
    return min(st["bytes_limit"] - st["bytes_in_use"] for st in stats)


def largest_allocation(devices) -> int | None:
    """The largest single array the allocator can still hand out on every one of `devices`: its largest free
    block, or a new region up to its limit where it grows on demand; None without statistics."""
    stats = _stats(devices)
    if any("largest_free_block_bytes" not in st or "bytes_limit" not in st for st in stats):
        return None
    return min(max(st["largest_free_block_bytes"], st["bytes_limit"] - st.get("pool_bytes", st["bytes_limit"]))
               for st in stats)


def is_out_of_memory(message: str) -> bool:
    return "RESOURCE_EXHAUSTED" in message or "Out of memory" in message


def grows_on_demand(devices) -> bool:
    """Whether the allocator takes device memory region by region as arrays need it
    (XLA_PYTHON_CLIENT_PREALLOCATE=false) instead of holding its whole limit from the start."""
    stats = _stats(devices)
    return any(st.get("pool_bytes", math.inf) < st.get("bytes_limit", 0) for st in stats)


def bytes_per_device(shapes, shardings=None) -> int:
    """Bytes that arrays of these shapes take on each device (`shardings`: a matching pytree, None: whole)."""
    leaves = jax.tree.leaves(shapes)
    placed = [None] * len(leaves) if shardings is None else jax.tree.leaves(shardings)
    return sum(math.prod(x.shape if s is None else s.shard_shape(x.shape)) * x.dtype.itemsize
               for x, s in zip(leaves, placed, strict=True))


def program_bytes(compiled) -> int:
    """Device bytes a compiled program allocates when it runs: temporaries and outputs that alias no input."""
    m = compiled.memory_analysis()
    return 0 if m is None else m.temp_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes


def pages_that_fit(programs: dict, num_pages: int, page_bytes_per_device: int, free: int | None,
                   fixed_pages: bool, spare: float = 0.05) -> int:
    """The KV pages that leave room for the largest of `programs` (compiled), and `spare` of it more (the allocator
    rounds and fragments), beside everything already allocated (`free`: `free_bytes` now, with the pool of
    num_pages in place; None: no statistics, keep num_pages). Raises ValueError where the pages were given
    (`fixed_pages`, --num-pages) and do not leave that room."""
    if free is None or not programs:
        return num_pages
    need = max(program_bytes(p) for p in programs.values())
    short = need + int(need * spare) - free
    if short <= 0:
        return num_pages
    pages = num_pages - math.ceil(short / page_bytes_per_device)
    if fixed_pages:
        raise ValueError(f"the step programs need {need / 2**30:.1f} GiB beside the KV pool and {free / 2**30:.1f} "
                         f"GiB is free: --num-pages {num_pages} is too many, at most {max(pages, 0)} leave room")
    log.warning("the step programs need %.1f GiB beside the KV pool, %.1f GiB is free: %d pages instead of %d",
                need / 2**30, free / 2**30, pages, num_pages)
    return pages
