"""MoE with the experts' width split over `tensor`: equals the single-device layer in value and gradient (with and
without expert parallelism, both backends, decode- and prefill-sized steps), and no expert matmul of a shard ever
touches the full width."""

import dataclasses
import re

import jax
import jax.extend.core
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from inkling_jax import Backend, preset
from inkling_jax.nn.moe import MoE
from inkling_jax.parallel.mesh import make_mesh
from inkling_jax.parallel.placement import shard_model
from tests.nn.test_moe import _assert_same, _input, _moe, _reference, _run

needs_8_devices = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (simulated) devices")


# The tiny preset's experts (width 32, 16 per tensor shard; the Pallas kernel pads that to 64). 14 tokens: the
# Pallas decode layout; 80 tokens (160 routed rows): its row-blocked path, unless a batch axis splits them.
@needs_8_devices
@pytest.mark.parametrize("spec,tokens,backend", [
    ("tensor=2", (2, 7), "ragged"),
    ("tensor=2", (8, 10), "pallas"),
    ("fsdp=4,tensor=2", (8, 10), "ragged"),  # 20 tokens per fsdp shard
    ("fsdp=4,tensor=2", (2, 7), "ragged"),  # 14 tokens do not split over 4: every shard takes them all
    ("tensor=2,expert=4", (2, 7), "pallas"),
    ("data=2,tensor=2,expert=2", (8, 10), "ragged"),
])
def test_width_split_equals_single_device(spec, tokens, backend):
    """Skewed routing (expert 7 never chosen); gradients of x and of all nine parameters."""
    want = _reference(tokens, skew=True)
    moe = shard_model(_moe(skew=True, backend=backend), make_mesh(spec))
    got = nnx.jit(_run)(moe, _input(tokens))
    _assert_same(got, want, atol=1e-5)


def _matmul_shapes(jaxpr, found):
    """Shapes of the 3-D operands and results of every grouped matmul, Pallas call and dot in `jaxpr`, nested
    jaxprs (shard_map, custom_vjp, jit) included."""
    for eqn in jaxpr.eqns:
        if eqn.primitive.name in ("ragged_dot", "ragged_dot_general", "pallas_call", "dot_general"):
            found |= {tuple(v.aval.shape) for v in (*eqn.invars, *eqn.outvars) if len(v.aval.shape) == 3}
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            _matmul_shapes(sub, found)
    return found


@needs_8_devices
@pytest.mark.parametrize("backend", ["ragged", "pallas"])
@pytest.mark.parametrize("spec,local_experts", [("tensor=2", 8), ("fsdp=4,tensor=2", 8), ("tensor=2,expert=4", 2)])
@pytest.mark.parametrize("num_tokens", [14, 80])
def test_shards_see_only_their_slice_of_the_width(backend, spec, local_experts, num_tokens):
    """Traced only (forward and gradient): every expert weight, routed and shared, that a matmul or a Pallas
    kernel reads or writes is [experts, hidden 64, width 256 / 2] or its transpose; none has the full width,
    which is what a gather of the tensor-sharded weights (or an unsplit custom call) would show. The width
    is a multiple of the kernel's 64 so that no padding hides it."""
    width, hidden = 256, 64
    cfg = dataclasses.replace(preset("tiny").text, moe_intermediate_size=width)
    moe = MoE(cfg, dtype=jnp.float32, rngs=nnx.Rngs(0), backend=Backend(moe=backend))
    graph, params = nnx.split(shard_model(moe, make_mesh(spec)))

    def loss(params, x):
        return nnx.merge(graph, params)(x)[0].sum()

    x = jax.random.normal(jax.random.key(0), (num_tokens, hidden))
    shapes = _matmul_shapes(jax.make_jaxpr(jax.grad(loss, argnums=(0, 1)))(params, x).jaxpr, set())
    assert not [s for s in shapes if width in s], sorted(shapes)
    assert {(local_experts, hidden, width // 2), (local_experts, width // 2, hidden)} <= shapes, sorted(shapes)
    assert (cfg.num_shared_experts, hidden, width // 2) in shapes, sorted(shapes)  # the shared experts' einsums


@pytest.mark.skipif(jax.default_backend() != "gpu" or jax.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("num_tokens", [16, 256])
def test_compiled_kernels_read_no_gathered_weights(num_tokens):
    """On GPUs, where the Pallas kernel is a custom call XLA cannot partition: bf16 experts split over
    tensor=2 give the single-device output, and the compiled step all-gathers nothing of the full width."""
    width = 1024
    cfg = dataclasses.replace(preset("tiny").text, hidden_size=512, moe_intermediate_size=width)
    x = jax.random.normal(jax.random.key(1), (num_tokens, cfg.hidden_size), jnp.bfloat16)
    forward = nnx.jit(lambda moe, x: moe(x)[0])
    pallas = Backend(moe="pallas")
    want = forward(MoE(cfg, dtype=jnp.bfloat16, rngs=nnx.Rngs(0), backend=pallas), x)
    moe = shard_model(MoE(cfg, dtype=jnp.bfloat16, rngs=nnx.Rngs(0), backend=pallas),
                      make_mesh("tensor=2", jax.devices()[:2]))
    got = forward(moe, x)
    graph, params = nnx.split(moe)
    hlo = jax.jit(lambda p, x: nnx.merge(graph, p)(x)[0]).lower(params, x).compile().as_text()
    scale = float(jnp.abs(want.astype(jnp.float32)).max())
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), atol=2e-2 * scale)
    gathered = [dims for line in hlo.splitlines() if "all-gather" in line
                for dims in re.findall(r"\w+\[([\d,]*)\]", line) if str(width) in dims.split(",")]
    assert not gathered
