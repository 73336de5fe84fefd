"""The GPU programs of the server and the trainer lower for CUDA on a machine without a GPU.

The kernels' CPU tests run them in Pallas' interpret mode, which checks their arithmetic but not what only the GPU
lowering sees: Mosaic GPU's register layouts (a loop carry whose layout differs between iterations, say), the
shapes that wgmma and TMA accept, Triton's block shapes. Here the engine's decode and prefill steps (per expert and
dense precision) and a training gradient are traced with the Pallas kernels in their compiled form
(`Backend(interpret=False)`) and lowered for CUDA, so that Pallas lowers every kernel to Mosaic GPU or Triton; the
training gradient also with jax's own Mosaic-GPU ragged dot in the MoE (`Backend.moe_forward`, `moe_backward`).
Not checked: PTX assembly and what happens at run time, which need the GPU (docs/kernels.md, "Testing").

The model is the `bench` preset's per-layer structure cut to two layers, a sliding one with the dense MLP and a
full one with the MoE, at widths the kernels tile; its parameters are abstract (nothing is allocated). Its LoRA
serving view (`serve.lora`) adds the adapters' kernels.
"""

import dataclasses
import functools
import types

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from inkling_jax import Backend, InklingModel, preset
from inkling_jax.generate import flat_params
from inkling_jax.quant import QuantConfig, serving_view
from pallas_kernels import mgpu
from pallas_kernels import lowered_once as lowered_once_module
from pallas_kernels.lowered_once import lowered_once
from pallas_kernels.moe import grouped_matmul, jax_mgpu, kernel_w4, moe_ffn
from serve.lora.experts import AdaptedMoE
from serve.lora.view import adapted_modules, lora_view, route

COMPILED = dataclasses.replace(Backend.parse("pallas"), interpret=False)  # every kernel in its GPU form, on any host


def _config():
    base = preset("bench")
    text = dataclasses.replace(
        base.text, num_layers=2, local_layer_ids=(0,), dense_layer_ids=(0,), hidden_size=1024, num_heads=16,
        num_kv_heads=2, swa_num_heads=16, swa_num_kv_heads=4, dense_intermediate_size=2048,
        moe_intermediate_size=256, num_experts=8, num_experts_per_tok=2, vocab_size=4096, unpadded_vocab_size=4000,
        rel_extent=256, sliding_window=128)
    return dataclasses.replace(base, text=text)


def _abstract_model(expert_precision: str, dense_precision: str, fp8_twins: bool = False, lora: bool = False,
                    backend: Backend = COMPILED):
    """lora: the LoRA view, 2 adapter slots of rank 16."""
    def build():
        model = InklingModel(_config(), dtype=jnp.bfloat16, rngs=nnx.Rngs(0), backend=backend)
        view = serving_view(model, QuantConfig(expert_precision, dense_precision, fp8_twins), fuse=False)
        return lora_view(view, slots=3, rank=16, experts=True) if lora else view
    return nnx.eval_shape(build)


def _kernels_in(fn, *args) -> dict[str, int]:
    """Lowers fn(*args) for CUDA; the Mosaic GPU and Triton kernel calls it holds."""
    text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    return {"mosaic": text.count("mosaic_gpu_v2"), "triton": text.count("xla.gpu.triton")}


# Kernels in each step's lowered module: the kernels' entries are jitted, so a kernel at one shape is one function
# however many layers call it. Mosaic GPU: the routed experts' gate|up and down in the format's own kernels, and
# with NVFP4 dense weights a W4A16 product per shape of matrix (q|k|v|r of each layer, wo of both layers at one
# shape, the widened shared experts' gate|up and down). Triton: in a decode step the ring and paged decode
# attention, the fused prologue and the ShortConv; in a prefill chunk the chunk attention of each layer and the
# ShortConv.
STEP_KERNELS = {"bf16": {"mosaic": 2, "triton": 5}, "fp8": {"mosaic": 2, "triton": 5},
                "nvfp4": {"mosaic": 7, "triton": 5}}


def _step_kernels(model, rows: int, tokens: int, ring_slack: int = 0) -> dict[str, int]:
    leaves, merged = flat_params(model)
    cache = jax.eval_shape(lambda: model.init_cache(rows, 512, ring_slack=ring_slack))
    ids = jax.ShapeDtypeStruct((rows, tokens), jnp.int32)
    per_row = jax.ShapeDtypeStruct((rows,), jnp.int32)

    def step(params, ids, cache, n_new, adapter_slots):
        view = merged(params)
        route(view, adapter_slots)  # a view without adapters has none to route
        return view.extend(ids, cache, n_new)
    return _kernels_in(step, leaves, ids, cache, per_row, per_row)


@pytest.mark.parametrize("precision", ["bf16", "fp8", "nvfp4"])
@pytest.mark.parametrize("rows, tokens", [(33, 1), (32, 128)])  # a decode step, a prefill chunk per row
def test_serving_steps_lower_for_cuda(precision, rows, tokens):
    assert _step_kernels(_abstract_model(precision, precision), rows, tokens) == STEP_KERNELS[precision]


@pytest.mark.parametrize("tokens", [1, 4])
def test_steps_over_rings_longer_than_the_window_lower_for_cuda(tokens):
    """Over the rings a speculative engine keeps (K = 3 slots past the window), a draft chain's decode step and a
    verify of K + 1 tokens read the rings in place with the chunk kernel (in the decode step, instead of the ring
    kernel): the same number of kernels."""
    model = _abstract_model("bf16", "bf16")
    assert _step_kernels(model, 33, tokens, ring_slack=3) == STEP_KERNELS["bf16"]


@pytest.mark.parametrize("rows, tokens", [(33, 1), (32, 128)])  # the gathered form, the segmented
def test_lora_serving_steps_lower_for_cuda(rows, tokens):
    """The bf16 model's LoRA view, adapters on the experts included: each shape of adapted projection adds its own
    shrink and expand kernels (Triton) to the step's, the routed experts' in the segmented form whatever the
    step; each adapted MoE its grouped matmuls (Mosaic GPU, for the steps whose rows have adapters on the experts:
    gate and up at one shape, down)."""
    view = _abstract_model("bf16", "bf16", lora=True)
    moes = [node for _, node in nnx.iter_graph(view) if isinstance(node, AdaptedMoE)]
    shapes = {(module.a.shape, module.b.shape) for module in adapted_modules(view)}
    routed = {(p.a.shape, p.b.shape) for moe in moes for p in moe.routed.projections()}
    want = {"mosaic": STEP_KERNELS["bf16"]["mosaic"] + 2 * len(moes),
            "triton": STEP_KERNELS["bf16"]["triton"] + 2 * len(shapes) + 2 * len(routed)}
    assert moes and _step_kernels(view, rows, tokens) == want


def test_a_prefill_with_fp8_twins_runs_the_fp8_experts_and_xla_dense_products():
    """NVFP4 weights with fp8 twins (`QuantConfig(fp8_twins=True)`): a 4096-token chunk multiplies the twins, the
    routed experts in the fp8 kernels and the dense matrices as XLA dots, so no W4A16 product is left."""
    assert _step_kernels(_abstract_model("nvfp4", "nvfp4", fp8_twins=True), 32, 128) == STEP_KERNELS["fp8"]


def _training_gradient_kernels(backend: Backend = COMPILED) -> dict[str, int]:
    leaves, merged = flat_params(_abstract_model("bf16", "bf16", backend=backend))
    ids = jax.ShapeDtypeStruct((1, 512), jnp.int32)
    return _kernels_in(jax.grad(lambda p, i: merged(p)(i).astype(jnp.float32).mean()), leaves, ids)


def test_training_gradient_lowers_for_cuda():
    """jax.grad through the model: the relative attention's forward, dK/dV and dQ kernels and the MoE's grouped
    matmuls with their weight gradients, each distinct MoE kernel once although the forward and the backward both
    call it (`pallas_kernels.lowered_once`)."""
    assert _training_gradient_kernels() == {"mosaic": 10, "triton": 6}


@pytest.mark.parametrize("forward, mosaic", [("pallas", 11), ("jax_mgpu", 12)])
def test_training_gradient_lowers_with_jax_mgpu_matmuls(monkeypatch, forward, mosaic):
    """The MoE's backward (and forward) on jax's Mosaic-GPU ragged dot (`Backend.moe_backward`): its kernels are
    the ones traced, 2 dgrads and 3 weight gradients (and the forward's gate, up and down, traced for the value and
    again for the gradient: the MoE's entry is jitted), and they lower for CUDA beside ours. jax's transposed
    kernel reads the SM count from jax.devices()[0], which a CPU host's device lacks: it is given an H200's here."""
    traced, kernels = [], jax_mgpu.kernels

    def recording(interpret):
        return tuple(functools.partial(_record, traced, name, kernel)
                     for name, kernel in zip(("ragged_dot", "transposed"), kernels(interpret)))
    monkeypatch.setattr(jax_mgpu, "kernels", recording)
    monkeypatch.setattr(jax, "devices", lambda *_: [types.SimpleNamespace(core_count=mgpu.HOPPER_SMS)])
    backend = dataclasses.replace(COMPILED, moe_forward=forward, moe_backward="jax_mgpu")
    assert _training_gradient_kernels(backend) == {"mosaic": mosaic, "triton": 6}
    forward_calls = 3 if forward == "jax_mgpu" else 0
    assert sorted(traced) == ["ragged_dot"] * (2 + 2 * forward_calls) + ["transposed"] * 3


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_narrow_expert_widths_lower_for_cuda(dtype):
    """The tiny preset's expert width, 32, through the MoE FFN's and a grouped matmul's gradients: fp32 keeps the
    width (a 128-byte span) and takes its 32-row weight gradients as transposed products; bf16 pads to 64.
    moe_ffn: its four distinct kernels (gate|up kept for the backward, dh, dx, the weight gradients), each once
    however many times the forward and backward call it; grouped_matmul: its forward (a bf16 K of 32 padded to a
    128-byte span), then dx and dw."""
    shape = functools.partial(jax.ShapeDtypeStruct, dtype=dtype)
    group_sizes = jax.ShapeDtypeStruct((8,), jnp.int32)

    def ffn_loss(x, w_gate, w_up, w_down, group_sizes):
        return moe_ffn(x, w_gate, w_up, w_down, group_sizes, jnp.ones(x.shape[:1]), interpret=False).sum()
    weights = shape((8, 64, 32)), shape((8, 64, 32)), shape((8, 32, 64))
    assert _kernels_in(jax.grad(ffn_loss, (0, 1, 2, 3)), shape((160, 64)), *weights, group_sizes) == \
        {"mosaic": 4, "triton": 0}

    def matmul(x, w, group_sizes):
        return grouped_matmul(x, w, group_sizes, interpret=False)
    assert _kernels_in(matmul, shape((160, 32)), shape((8, 32, 64)), group_sizes) == {"mosaic": 1, "triton": 0}

    def matmul_loss(x, w, group_sizes):
        return matmul(x, w, group_sizes).sum()
    assert _kernels_in(jax.grad(matmul_loss, (0, 1)), shape((160, 32)), shape((8, 32, 64)), group_sizes) == \
        {"mosaic": 2, "triton": 0}


def _record(traced, name, kernel, *args, **kwargs):
    traced.append(name)
    return kernel(*args, **kwargs)


@pytest.mark.parametrize("rows, tokens", [(33, 1), (32, 128)])
def test_batch_invariant_steps_lower_for_cuda(rows, tokens):
    """`Backend(batch_invariant=True)`: every matmul and the routed experts in the grouped-matmul kernels (Mosaic
    GPU), every attention in the chunk kernel and every ShortConv in its kernel (Triton), decode steps included."""
    invariant = dataclasses.replace(COMPILED, batch_invariant=True)

    def build():
        return InklingModel(_config(), dtype=jnp.bfloat16, rngs=nnx.Rngs(0), backend=invariant)
    kernels = _step_kernels(nnx.eval_shape(build), rows, tokens)
    # Kernels in the lowered module (one function per kernel and shapes, however many layers call it), decode and
    # prefill alike: Triton, the chunk attention of each layer kind and the ShortConv at each width; Mosaic GPU,
    # the grouped-matmul kernel at each weight shape (7: the projections, dense MLP, router, shared expert and head
    # at their distinct shapes) and the routed experts' SwiGLU and down projection.
    assert kernels == {"mosaic": 9, "triton": 5}


def test_a_kernel_is_lowered_once_for_all_the_programs_that_hold_it(monkeypatch):
    """Decode steps of 2 and 4 rows run the routed experts and the NVFP4 dense products in the same W4A16 kernels
    (one slab of tokens per expert): the first program exports them, the second calls those exports and holds the
    same kernels without lowering any again; a prefill chunk's wider slabs make kernels of their own."""
    jax.clear_caches()  # jax's traces of the kernels' entries, which would skip their launchers' calls
    monkeypatch.setattr(lowered_once_module, "cache_root", lambda: None)  # a server test may have set one
    monkeypatch.setattr(kernel_w4.w4_gmm, "exports", {})
    model = _abstract_model("nvfp4", "nvfp4")
    assert _step_kernels(model, 2, 1) == STEP_KERNELS["nvfp4"]
    first = set(kernel_w4.w4_gmm.exports)
    assert len(first) == STEP_KERNELS["nvfp4"]["mosaic"]
    assert _step_kernels(model, 4, 1) == STEP_KERNELS["nvfp4"]
    assert set(kernel_w4.w4_gmm.exports) == first
    assert _step_kernels(model, 2, 128) == STEP_KERNELS["nvfp4"]
    assert set(kernel_w4.w4_gmm.exports) > first


def _scaled(x, *, scale, interpret):
    return scale(x) if callable(scale) else x * scale


class Unhashable:
    __hash__ = None

    def __call__(self, x):
        return -x


def test_lowered_once_keys_on_every_static_argument():
    """One export per distinct static leaf (a partial by its function and arguments), shape and dtype; interpreted
    calls and unhashable static leaves take the launcher directly."""
    launcher = lowered_once(_scaled)
    doubled = functools.partial(jnp.multiply, 2.0)

    def program(x, y):
        return [launcher(x, scale=2.0, interpret=False), launcher(x, scale=2.0, interpret=False),
                launcher(x, scale=3.0, interpret=False), launcher(y, scale=2.0, interpret=False),
                launcher(x, scale=doubled, interpret=False), launcher(x, scale=functools.partial(jnp.multiply, 2.0),
                                                                       interpret=False),
                launcher(x, scale=2.0, interpret=True), launcher(x, scale=Unhashable(), interpret=False)]
    x, y = jax.ShapeDtypeStruct((8, 128), jnp.float32), jax.ShapeDtypeStruct((8, 128), jnp.bfloat16)
    text = jax.jit(program).trace(x, y).lower(lowering_platforms=("cuda",)).as_text()
    assert len(launcher.exports) == 4  # 2.0 and 3.0 on x, 2.0 on y, the partial
    assert text.count("call_exported") >= 4


def test_kernel_exports_are_kept_beside_the_compilation_cache(tmp_path, monkeypatch):
    """With a persistent compilation cache, a step's kernels are exported into it; a later process (nothing in
    memory) reads them back instead of lowering them, and a torn file is lowered again and rewritten whole."""
    monkeypatch.setattr(lowered_once_module, "cache_root", lambda: str(tmp_path))
    jax.clear_caches()
    monkeypatch.setattr(kernel_w4.w4_gmm, "exports", {})
    model = _abstract_model("nvfp4", "nvfp4")
    assert _step_kernels(model, 2, 1) == STEP_KERNELS["nvfp4"]
    files = sorted((tmp_path / lowered_once_module.DISK_FOLDER).iterdir())
    assert len(files) == STEP_KERNELS["nvfp4"]["mosaic"]

    def no_lowering(*args, **kwargs):
        raise AssertionError("a kernel kept on disk was lowered again")
    monkeypatch.setattr(kernel_w4.w4_gmm, "exports", {})
    with monkeypatch.context() as patched:
        patched.setattr(lowered_once_module.export, "export", no_lowering)
        assert _step_kernels(model, 4, 1) == STEP_KERNELS["nvfp4"]
    assert len(kernel_w4.w4_gmm.exports) == STEP_KERNELS["nvfp4"]["mosaic"]

    files[0].write_bytes(b"torn")
    monkeypatch.setattr(kernel_w4.w4_gmm, "exports", {})
    assert _step_kernels(model, 3, 1) == STEP_KERNELS["nvfp4"]  # a row count not traced yet: the kernels' calls run
    assert sorted((tmp_path / lowered_once_module.DISK_FOLDER).iterdir()) == files
    assert files[0].read_bytes() != b"torn"
