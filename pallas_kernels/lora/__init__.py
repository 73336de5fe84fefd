"""The multi-LoRA product of a serving step, y += scale[s] * (x @ A[s]) @ B[s] with s each row's adapter slot:
Pallas kernels in a gathered form (decode) and a segmented form (prefill chunks), and the pure-jnp reference."""

from pallas_kernels.lora.kernel import lora_add
from pallas_kernels.lora.tuning import GatheredBlocks, SegmentedBlocks

__all__ = ["lora_add", "GatheredBlocks", "SegmentedBlocks"]
