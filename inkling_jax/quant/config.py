"""How a served model holds its weights: the precisions of the routed experts and of the dense weights, and
whether NVFP4 weights keep an fp8 twin (`inkling_jax.quant.view.serving_view`, `load_pretrained(quant=...)`)."""

from __future__ import annotations

import dataclasses

EXPERT_PRECISIONS = ("bf16", "fp8", "nvfp4")
DENSE_PRECISIONS = ("bf16", "fp8", "nvfp4")


@dataclasses.dataclass(frozen=True)
class QuantConfig:
    """expert_precision: "fp8" or "nvfp4" holds the routed experts in that format (`inkling_jax.quant.experts`).
    dense_precision: "fp8" holds the text layers' dense MLPs and the LM head in fp8 (`dense_fp8`); "nvfp4" also
    holds every attention's q|k|v|r and wo and every MoE's shared experts in NVFP4 (`dense_nvfp4`), fused (so not
    for a tensor-parallel mesh), while the dense MLPs stay fp8: a prefill runs their large products on fp8 tensor
    cores at twice the rate of the W4A16 kernel's f16 ones. "bf16" leaves weights as they are (in the model's
    dtype, or a form they already have). fp8_twins: every NVFP4 weight also keeps an fp8 copy for wide steps."""

    expert_precision: str = "bf16"
    dense_precision: str = "bf16"
    fp8_twins: bool = False

    def __post_init__(self):
        for name, value, allowed in (("expert_precision", self.expert_precision, EXPERT_PRECISIONS),
                                     ("dense_precision", self.dense_precision, DENSE_PRECISIONS)):
            if value not in allowed:
                raise ValueError(f"{name} must be one of {allowed}, not {value!r}")
        if self.fp8_twins and "nvfp4" not in (self.expert_precision, self.dense_precision):
            raise ValueError("fp8 twins are copies of NVFP4 weights: choose nvfp4 experts or dense weights "
                             "(--expert-precision / --dense-precision nvfp4)")
