"""Serving forms of the model: `serving_view(model, QuantConfig(...), fuse=...)` (view.py) returns a new model whose
modules are their serving types, leaving its input as it was. The types, one weight form each: fused attention
(attention.py), dense MLPs (mlp.py), the MoE with its routed experts' forms (moe.py, experts.py), the fp8 LM head
(head.py), and the fp8 and NVFP4 linears they hold (dense_fp8.py, dense_nvfp4.py); `ServingForm` marks them
(form.py), and `QuantConfig` says which to use (config.py)."""

from inkling_jax.quant.config import QuantConfig
from inkling_jax.quant.view import serving_view

__all__ = ["QuantConfig", "serving_view"]
