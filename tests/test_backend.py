"""The backend config (`inkling_jax.backend`): specs parse or fail clearly, "auto" resolves by platform, the
commands take `--backend`, and the choice a model holds is the one its kernels run: each field brings in its own
kernels and nothing else, with the same logits."""

import jax
import jax.extend.core
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from inkling_jax import Backend, InklingModel, load_pretrained, preset, with_backend
from inkling_jax import backend as backend_module
from inkling_jax.generate import StepFunctions, flat_params
from inkling_jax.quant import QuantConfig, serving_view
from inkling_jax.quant.dense_nvfp4 import Nvfp4Linear
from serve.random_weights import random_model
from tests.backends import REFERENCE
from tests.hf_oracle import relative_error


@pytest.mark.parametrize("spec,want", [
    ("auto", Backend()),
    ("reference", Backend("reference", "reference", "reference", "ragged", "reference")),
    ("pallas", Backend("pallas", "pallas", "pallas", "pallas", "pallas")),
    ("moe=ragged,attention=pallas", Backend(attention="pallas", moe="ragged")),
    (" pallas , moe=dense ", Backend("pallas", "pallas", "pallas", "dense", "pallas")),
    ("lora=pallas", Backend(lora="pallas")),
    ("reference,decode_attention=pallas,shortconv=auto", Backend("reference", "pallas", "auto", "ragged", "reference")),
    ("pallas,moe_backward=jax_mgpu", Backend("pallas", "pallas", "pallas", "pallas", "pallas", moe_backward="jax_mgpu")),
    ("moe_forward=jax_mgpu,moe_backward=pallas", Backend(moe_forward="jax_mgpu", moe_backward="pallas")),
])
def test_specs_parse(spec, want):
    assert Backend.parse(spec) == want


@pytest.mark.parametrize("spec,message", [
    ("", r"'' is not FIELD=VALUE"),
    ("fast", r"'fast' is not FIELD=VALUE"),
    ("moe=ragged,pallas", r"'pallas' is not FIELD=VALUE"),  # the word that sets every field comes first
    ("speed=fast", r"'speed=fast' is not FIELD=VALUE with FIELD one of"),
    ("moe=fast", r"moe must be one of \('auto', 'dense', 'ragged', 'pallas'\), not 'fast'"),
    ("attention=ragged", r"attention must be one of \('auto', 'reference', 'pallas'\), not 'ragged'"),
    ("attention=jnp", r"attention must be one of"),
    ("moe=dense,moe=ragged", r"moe is given twice"),
    ("moe_backward=ours", r"moe_backward must be one of \('auto', 'pallas', 'jax_mgpu'\), not 'ours'"),
    ("reference,moe_backward=jax_mgpu", r"moe_backward=jax_mgpu picks the grouped matmuls of moe=pallas, not"),
])
def test_bad_specs_say_what_is_wrong(spec, message):
    with pytest.raises(ValueError, match=message):
        Backend.parse(spec)


def test_bad_fields_are_errors():
    with pytest.raises(ValueError, match="shortconv must be one of"):
        Backend(shortconv="triton")
    with pytest.raises(ValueError, match="interpret must be True, False or None"):
        Backend(interpret="mosaic")


@pytest.mark.parametrize("platform,kernels,moe,interpret,backward", [("gpu", "pallas", "pallas", False, "pallas"),
                                                                     ("cpu", "reference", "ragged", True, "pallas")])
def test_auto_resolves_by_platform(monkeypatch, platform, kernels, moe, interpret, backward):
    monkeypatch.setattr(backend_module.jax, "default_backend", lambda: platform)
    # The MoE's matmuls: ours, forward and backward, everywhere (jax's only when named).
    ours = {"moe_forward": "pallas", "moe_backward": backward}
    assert Backend().resolve() == Backend(kernels, kernels, kernels, moe, kernels, **ours, interpret=interpret)
    # Named choices stay; an explicit interpret too (False on CPU: the compiled form, to lower for CUDA).
    assert Backend(attention="reference", moe="dense").resolve() == Backend("reference", kernels, kernels, "dense",
                                                                             kernels, **ours, interpret=interpret)
    if moe == "pallas":
        assert Backend(moe_backward="jax_mgpu").resolve().moe_backward == "jax_mgpu"
    else:  # jax's matmuls are those of the Pallas MoE, which "auto" is not here
        with pytest.raises(ValueError, match="of moe=pallas, not of moe=ragged"):
            Backend(moe_backward="jax_mgpu").resolve()
    assert Backend(interpret=False).resolve().interpret is False
    assert Backend().resolve().resolve() == Backend().resolve()


def test_serve_and_train_take_the_same_flag(capsys):
    from serve.app import parse_args as serve_args
    from train.run import parse_args as train_args

    train = ["--preset", "tiny", "--data", "d.txt", "--steps", "1", "--out", "o"]
    assert serve_args(["--backend", "moe=ragged"]).backend == Backend(moe="ragged")
    assert serve_args([]).backend == Backend()
    assert train_args(train + ["--backend", "reference"]).backend == Backend.parse("reference")
    for parse, argv in ((serve_args, ["--backend", "moe=fast"]), (train_args, train + ["--backend", "moe=fast"])):
        with pytest.raises(SystemExit):
            parse(argv)
    errors = capsys.readouterr().err
    assert errors.count("backend spec 'moe=fast': backend moe must be one of") == 2


# head_dim 16 and a window of 16: the smallest shapes the GPU kernels accept. Two layers: a sliding one with the
# dense MLP, a full one with the MoE.
CONFIG = preset("tiny").replace(sliding_window=16, rel_extent=24, num_layers=2, local_layer_ids=(0,),
                                dense_layer_ids=(0,))


@pytest.fixture(scope="module")
def model():
    return with_backend(random_model(CONFIG, seed=3), REFERENCE)


def test_with_backend_gives_another_model_sharing_the_arrays(model):
    other = with_backend(model, Backend(moe="ragged"))
    held = [(type(m).__name__, m.backend) for _, m in nnx.iter_graph(other) if hasattr(m, "backend")]
    assert {name for name, _ in held} == {"InklingModel", "Attention", "ShortConv", "MoE", "Linear", "RMSNorm",
                                          "DenseMLP"}
    assert {backend for _, backend in held} == {Backend(moe="ragged")}
    assert {m.backend for _, m in nnx.iter_graph(model) if hasattr(m, "backend")} == {REFERENCE}
    assert other.layers[1].mlp.w_gate[...] is model.layers[1].mlp.w_gate[...]
    with pytest.raises(TypeError, match="Backend.parse reads a spec"):
        with_backend(model, "ragged")


def test_quantised_matrices_run_the_models_backend():
    backend = Backend(moe="pallas")

    def build():
        return serving_view(InklingModel(CONFIG, rngs=nnx.Rngs(0), backend=backend), QuantConfig("nvfp4", "nvfp4"))

    matrices = [m for _, m in nnx.iter_graph(nnx.eval_shape(build)) if isinstance(m, Nvfp4Linear)]
    assert matrices and {m.backend for m in matrices} == {backend}


def test_load_pretrained_builds_the_model_with_the_backend(checkpoints):
    path, _ = checkpoints("base")
    backend = Backend.parse("pallas,moe=ragged")
    model = load_pretrained(path, progress=False, backend=backend)
    assert {m.backend for _, m in nnx.iter_graph(model) if hasattr(m, "backend")} == {backend}


def test_the_backend_is_a_static_part_of_the_jitted_program(model):
    traced = []

    @nnx.jit
    def forward(m, ids):
        traced.append(m.backend.moe)
        return m(ids)

    ids = jnp.zeros((1, 4), jnp.int32)
    ragged = with_backend(model, Backend(moe="ragged"))
    for m in (model, ragged, model, ragged):
        forward(m, ids)
    assert traced == ["dense", "ragged"]


def _kernels(jaxpr, found):
    """The pallas_kernels folders of every Pallas call in `jaxpr` (nested ones included), and "ragged_dot"."""
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "pallas_call":
            source = eqn.params["jaxpr"].debug_info.func_src_info
            found.add(source.split("pallas_kernels/")[1].split("/")[0])
        elif eqn.primitive.name.startswith("ragged_dot"):
            found.add("ragged_dot")
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            _kernels(sub, found)
    return found


IDS = np.random.default_rng(0).integers(0, 256, (2, 9)).astype(np.int32)


def _steps(model):
    """(forward, prefill of 8 tokens, one decode step) as functions of the flat parameters, and their inputs."""
    leaves, merged = flat_params(model)
    cache = model.init_cache(2, 32)
    return leaves, {"forward": (lambda p: merged(p)(jnp.asarray(IDS)), ()),
                    "prefill": (lambda p, c: merged(p).extend(jnp.asarray(IDS[:, :8]), c)[0], (cache,)),
                    "decode": (lambda p, c: merged(p).extend(jnp.asarray(IDS[:, 8:]), c)[0], (cache,))}


# Each field switched to its other implementation alone: the kernels that then appear in the forward, a prefill
# chunk and a decode step (none on the reference path with the dense MoE).
FIELDS = {
    "reference,moe=dense": (set(), set(), set()),
    "reference": ({"ragged_dot"}, {"ragged_dot"}, {"ragged_dot"}),
    "reference,moe=pallas": ({"moe"}, {"moe"}, {"moe"}),
    "reference,moe=dense,attention=pallas": ({"rel_attention"}, {"rel_attention"}, set()),
    "reference,moe=dense,shortconv=pallas": ({"shortconv"}, {"shortconv"}, {"shortconv"}),
    "reference,moe=dense,decode_attention=pallas": (set(), set(), {"decode_attention", "attn_prologue"}),
}


@pytest.mark.parametrize("spec", list(FIELDS))
def test_each_field_brings_in_its_kernels_alone(model, spec):
    leaves, steps = _steps(with_backend(model, Backend.parse(spec)))
    for (name, (fn, args)), want in zip(steps.items(), FIELDS[spec], strict=True):
        assert _kernels(jax.make_jaxpr(fn)(leaves, *args).jaxpr, set()) == want, name


@pytest.fixture(scope="module")
def reference_logits(model):
    return np.asarray(StepFunctions(model).forward(IDS))


# The MoE's three implementations and the attention kernel (interpreted) in the model give its logits (the other
# fields' kernels are compared in the model, prefill and decode steps included, by test_kernels_in_model.py).
@pytest.mark.parametrize("spec", ["reference", "reference,moe=pallas", "reference,moe=dense,attention=pallas"])
def test_the_moe_and_attention_choices_give_the_same_logits(model, reference_logits, spec):
    logits = StepFunctions(with_backend(model, Backend.parse(spec))).forward(IDS)
    assert relative_error(np.asarray(logits), reference_logits) < 1e-5
