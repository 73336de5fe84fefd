"""How many KV pages the server allocates: what `memory_fraction` of the device's free memory holds after
everything else the engine keeps (the slots' ring and ShortConv states, the prefix snapshots, the sampler's
per-row state, the steps' logits and activations); without memory statistics (CPU) enough pages for every slot
at full length."""

import logging

import jax
import jax.numpy as jnp

from inkling_jax.cache import cache_bytes
from inkling_jax.config import TextConfig
from serve.config import EngineConfig

log = logging.getLogger(__name__)


def page_bytes(text: TextConfig, config: EngineConfig, dtype) -> int:
    """Bytes of one page: page_size tokens of K and V in every full-attention layer."""
    full = text.num_layers - len(text.local_layer_ids)
    shape = text.attention(False)
    return 2 * full * config.page_size * shape.num_kv_heads * shape.head_dim * jnp.dtype(dtype).itemsize


def pages_for_memory(text: TextConfig, config: EngineConfig, dtype, kv_shards: int = 1) -> int:
    """The pages to allocate (see the module docstring); logs the budget where it sized from memory. kv_shards:
    the devices a page's KV heads are split over (tensor parallelism), each holding that share of every page;
    the rest is counted whole, as if every device held all of it."""
    cfg, vocab = config, text.unpadded_vocab_size
    stats = jax.devices()[0].memory_stats() or {}
    if "bytes_limit" not in stats:
        return cfg.max_num_seqs * cfg.pages_per_row
    free = (stats["bytes_limit"] - stats["bytes_in_use"]) * cfg.memory_fraction
    page = page_bytes(text, cfg, dtype)
    fixed = cache_bytes(text, cfg.num_rows, cfg.max_model_len, dtype, page_size=cfg.page_size, num_pages=1) - page
    page //= kv_shards
    per_row = fixed // cfg.num_rows
    fixed += cfg.snapshots * per_row + cfg.num_rows * vocab * 5  # snapshots; penalty counts and prompt masks
    fixed += 4 * cfg.rows[-1] * vocab * 4  # one logits row per step row, its softmax and draws, fp32
    fixed += 2 * max(r * t for r, t in cfg.buckets) * text.hidden_size * 4 * 4  # the widest activations
    pages = int((free - fixed) // page)
    log.info("device memory: %.1f GiB free x %.2f; %.1f GiB for slots, snapshots and step buffers; %d pages",
             free / cfg.memory_fraction / 2**30, cfg.memory_fraction, fixed / 2**30, pages)
    return pages
