"""The GPU programs of the server and the trainer lower for CUDA on a machine without a GPU.

The kernels' CPU tests run them in Pallas' interpret mode, which checks their arithmetic but not what only the GPU
lowering sees: Mosaic GPU's register layouts (a loop carry whose layout differs between iterations, say), the
shapes that wgmma and TMA accept, Triton's block shapes. Here the engine's decode and prefill steps (per expert and
dense precision) and a training gradient are traced with the Pallas kernels in their compiled form
(`Backend(interpret=False)`) and lowered for CUDA, so that Pallas lowers every kernel to Mosaic GPU or Triton.
Not checked: PTX assembly and what happens at run time, which need the GPU (docs/kernels.md, "Testing").

The model is the `bench` preset's per-layer structure cut to two layers, a sliding one with the dense MLP and a
full one with the MoE, at widths the kernels tile; its parameters are abstract (nothing is allocated).
"""

import dataclasses

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from inkling_jax import Backend, InklingModel, preset
from inkling_jax.generate import flat_params
from inkling_jax.quant import QuantConfig, serving_view

COMPILED = dataclasses.replace(Backend.parse("pallas"), interpret=False)  # every kernel in its GPU form, on any host


def _config():
    base = preset("bench")
    text = dataclasses.replace(
        base.text, num_layers=2, local_layer_ids=(0,), dense_layer_ids=(0,), hidden_size=1024, num_heads=16,
        num_kv_heads=2, swa_num_heads=16, swa_num_kv_heads=4, dense_intermediate_size=2048,
        moe_intermediate_size=256, num_experts=8, num_experts_per_tok=2, vocab_size=4096, unpadded_vocab_size=4000,
        rel_extent=256, sliding_window=128)
    return dataclasses.replace(base, text=text)


def _abstract_model(expert_precision: str, dense_precision: str, fp8_twins: bool = False):
    def build():
        model = InklingModel(_config(), dtype=jnp.bfloat16, rngs=nnx.Rngs(0), backend=COMPILED)
        return serving_view(model, QuantConfig(expert_precision, dense_precision, fp8_twins), fuse=False)
    return nnx.eval_shape(build)


def _kernels_in(fn, *args) -> dict[str, int]:
    """Lowers fn(*args) for CUDA; the Mosaic GPU and Triton kernel calls it holds."""
    text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    return {"mosaic": text.count("mosaic_gpu_v2"), "triton": text.count("xla.gpu.triton")}


# Kernel calls in each step's lowered module (a function called from several places counts once). Mosaic GPU:
# the routed experts' gate|up and down in the format's own kernels, and with NVFP4 dense weights a W4A16 product per
# matrix (q|k|v|r and wo of both layers, the widened shared experts' gate|up and down). Triton: in a decode step the
# ring and paged decode attention, the fused prologue and the ShortConv; in a prefill chunk the chunk attention of
# each layer and the ShortConv.
STEP_KERNELS = {"bf16": {"mosaic": 2, "triton": 5}, "fp8": {"mosaic": 2, "triton": 5},
                "nvfp4": {"mosaic": 8, "triton": 5}}


def _step_kernels(model, rows: int, tokens: int) -> dict[str, int]:
    leaves, merged = flat_params(model)
    cache = jax.eval_shape(lambda: model.init_cache(rows, 512))
    ids = jax.ShapeDtypeStruct((rows, tokens), jnp.int32)
    n_new = jax.ShapeDtypeStruct((rows,), jnp.int32)
    return _kernels_in(lambda p, i, c, n: merged(p).extend(i, c, n), leaves, ids, cache, n_new)


@pytest.mark.parametrize("precision", ["bf16", "fp8", "nvfp4"])
@pytest.mark.parametrize("rows, tokens", [(33, 1), (32, 128)])  # a decode step, a prefill chunk per row
def test_serving_steps_lower_for_cuda(precision, rows, tokens):
    assert _step_kernels(_abstract_model(precision, precision), rows, tokens) == STEP_KERNELS[precision]


def test_a_prefill_with_fp8_twins_runs_the_fp8_experts_and_xla_dense_products():
    """NVFP4 weights with fp8 twins (`QuantConfig(fp8_twins=True)`): a 4096-token chunk multiplies the twins, the
    routed experts in the fp8 kernels and the dense matrices as XLA dots, so no W4A16 product is left."""
    assert _step_kernels(_abstract_model("nvfp4", "nvfp4", fp8_twins=True), 32, 128) == STEP_KERNELS["fp8"]


def test_training_gradient_lowers_for_cuda():
    """jax.grad through the model: the relative attention's forward, dK/dV and dQ kernels and the MoE's grouped
    matmuls with their weight gradients."""
    leaves, merged = flat_params(_abstract_model("bf16", "bf16"))
    ids = jax.ShapeDtypeStruct((1, 512), jnp.int32)
    found = _kernels_in(jax.grad(lambda p, i: merged(p)(i).astype(jnp.float32).mean()), leaves, ids)
    assert found == {"mosaic": 11, "triton": 6}


@pytest.mark.parametrize("rows, tokens", [(33, 1), (32, 128)])
def test_batch_invariant_steps_lower_for_cuda(rows, tokens):
    """`Backend(batch_invariant=True)`: every matmul and the routed experts in the grouped-matmul kernels (Mosaic
    GPU), every attention in the chunk kernel and every ShortConv in its kernel (Triton), decode steps included."""
    invariant = dataclasses.replace(COMPILED, batch_invariant=True)

    def build():
        return InklingModel(_config(), dtype=jnp.bfloat16, rngs=nnx.Rngs(0), backend=invariant)
    kernels = _step_kernels(nnx.eval_shape(build), rows, tokens)
    # Kernel calls in the lowered module (a function called from several places counts once), decode and prefill
    # alike: Triton, the chunk attention of each layer kind and the ShortConv at each width; Mosaic GPU, the
    # grouped-matmul kernel at each weight shape (projections, dense MLP, router, shared expert, head) and the
    # routed experts' SwiGLU and down projection.
    assert kernels == {"mosaic": 23, "triton": 5}
