"""The kernels of `inkling_jax.nn.kernels` on a mesh with tensor=2 (8 simulated CPU devices: the rest is data): each
runs once per device on its own heads (and rows, where the call splits them), inside `shard_map`, and gives what the
unsharded call gives. The Pallas kernels run in interpret mode here; on GPUs they are custom calls that XLA cannot
partition, which is why no Pallas call may sit outside a `shard_map` when the model is sharded."""

import jax
import jax.extend.core
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from inkling_jax.backend import Backend
from inkling_jax.nn import kernels
from inkling_jax.parallel.mesh import make_mesh

pytestmark = pytest.mark.skipif(jax.device_count() < 2, reason="needs 2 devices (8 simulated ones on CPU)")

B, T, HQ, HKV, D, D_REL, E = 4, 12, 4, 2, 16, 4, 10
PAGES, PAGE, WINDOW = 9, 4, 8
PALLAS = Backend.parse("pallas")  # interpreted on CPU


def _normal(rng, *shape):
    return jnp.asarray(rng.standard_normal(shape, np.float32))


def _cases(rng):
    """name -> (function of the inputs and a mesh, inputs, the head dimension of each input or None)."""
    q, k, v, r = _normal(rng, B, T, HQ, D), _normal(rng, B, T, HKV, D), _normal(rng, B, T, HKV, D), \
        _normal(rng, B, T, HQ, D_REL)
    rel_proj, tau = _normal(rng, D_REL, E), 1 + jnp.asarray(rng.random((B, T), np.float32))
    positions = jnp.broadcast_to(jnp.arange(T), (B, T))
    k_pages, v_pages = _normal(rng, PAGES, PAGE, HKV, D), _normal(rng, PAGES, PAGE, HKV, D)
    table = jnp.asarray(rng.permutation(PAGES)[:B * 2].reshape(B, 2) % PAGES, jnp.int32)
    cached = jnp.array([0, 3, 5, 2], jnp.int32)
    rings = _normal(rng, B, WINDOW, HKV, D), _normal(rng, B, WINDOW, HKV, D)
    states = _normal(rng, B, 3, HKV * D), _normal(rng, B, 3, HKV * D)
    taps = _normal(rng, HKV * D, 4), _normal(rng, HKV * D, 4)
    norms = 1 + 0.1 * _normal(rng, D), 1 + 0.1 * _normal(rng, D)
    return {
        "self_attention": (
            lambda q, k, v, r, rel_proj, tau, mesh: kernels.self_attention(q, k, v, r, rel_proj, positions, tau=tau,
                                                                           backend=PALLAS, mesh=mesh),
            (q, k, v, r, rel_proj, tau), (2, 2, 2, 2, None, None)),
        "self_attention_sliding": (
            lambda q, k, v, r, mesh: kernels.self_attention(q, k, v, r, rel_proj, positions, window=5,
                                                                 backend=PALLAS, mesh=mesh),
            (q, k, v, r), (2, 2, 2, 2)),
        "chunk_attention": (
            lambda q, kp, vp, r, mesh: kernels.chunk_attention(
                q[:, :3], kp, vp, table, r[:, :3], rel_proj, q_start=cached, key_start=0 * cached,
                key_end=cached + 3, tau=tau[:, :3], backend=PALLAS, mesh=mesh),
            (q, k_pages, v_pages, r), (2, 2, 2, 2)),
        "decode_attention_paged": (
            lambda q, kp, vp, r, mesh: kernels.decode_attention(q[:, 0], kp, vp, r[:, 0], rel_proj, cached + 1,
                                                                page_table=table, tau=tau[:, 0], backend=PALLAS,
                                                                mesh=mesh),
            (q, k_pages, v_pages, r), (2, 2, 2, 2)),
        "decode_attention_ring": (
            lambda q, kr, vr, r, mesh: kernels.decode_attention(q[:, 0], kr, vr, r[:, 0], rel_proj[:, :WINDOW],
                                                                cached + 1, window=WINDOW, backend=PALLAS,
                                                                mesh=mesh),
            (q, *rings, r), (2, 2, 2, 2)),
        "decode_prologue": (
            lambda q, k, v, wk, wv, ks, vs, kr, vr, mesh: kernels.decode_prologue(
                q[:, 0].reshape(B, -1), k[:, 0].reshape(B, -1), v[:, 0].reshape(B, -1), wk, wv, *norms, ks, vs,
                kr, vr, jnp.array([3, -1, 17, 30]), eps=1e-6, backend=PALLAS, mesh=mesh),
            (q, k, v, *taps, *states, *rings), (2, 2, 2, 0, 0, 2, 2, 2, 2)),
        "shortconv_heads": (
            lambda x, w, state, mesh: kernels.shortconv_prefill(x.reshape(B, T, -1), w, state, backend=PALLAS,
                                                                mesh=mesh, split_channels=True),
            (k, taps[0], states[0]), (2, 0, 2)),
        "shortconv_residual": (
            lambda x, w, mesh: kernels.shortconv_prefill(x.reshape(B, T, -1), w, backend=PALLAS, mesh=mesh),
            (k, taps[0]),
            (None, None)),
    }


def _pallas_calls_outside_shard_map(jaxpr, inside=False):
    count = 0
    for eqn in jaxpr.eqns:
        count += eqn.primitive.name == "pallas_call" and not inside
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            count += _pallas_calls_outside_shard_map(sub, inside or eqn.primitive.name == "shard_map")
    return count


def _mesh(name):
    """tensor=2 (8 CPU devices: data=4 besides); the residual stream's ShortConv splits only rows, so data=2."""
    return make_mesh("data=2", jax.devices()[:2]) if name == "shortconv_residual" else make_mesh("tensor=2")


@pytest.mark.parametrize("name", list(_cases(np.random.default_rng(0))))
def test_kernels_run_per_device_on_a_mesh(name):
    mesh = _mesh(name)
    fn, inputs, head_dims = _cases(np.random.default_rng(0))[name]
    placed = [jax.device_put(x, NamedSharding(mesh, P() if d is None or mesh.shape["tensor"] == 1
                                              else P(*(None,) * d, "tensor"))) for x, d in zip(inputs, head_dims)]
    want = jax.jit(lambda *a: fn(*a, mesh=None))(*inputs)
    got = jax.jit(lambda *a: fn(*a, mesh=mesh))(*placed)
    jaxpr = jax.make_jaxpr(lambda *a: fn(*a, mesh=mesh))(*inputs).jaxpr
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-5)
    assert "shard_map" in str(jaxpr) and _pallas_calls_outside_shard_map(jaxpr) == 0


@pytest.mark.parametrize("name", ["self_attention", "shortconv_heads", "shortconv_residual"])
def test_gradients_through_the_per_device_kernels(name):
    """Training splits rows over data and heads over tensor: every input's gradient, those of the replicated
    weights (summed over the devices that share them) included, equals the unsharded one."""
    mesh = _mesh(name)
    fn, inputs, _ = _cases(np.random.default_rng(1))[name]

    def loss(*args, mesh):
        out = jax.tree.leaves(fn(*args, mesh=mesh))[0]
        return jnp.sum(out * jnp.cos(jnp.arange(out.size).reshape(out.shape)))

    argnums = tuple(range(len(inputs)))
    want = jax.jit(jax.grad(lambda *a: loss(*a, mesh=None), argnums))(*inputs)
    got = jax.jit(jax.grad(lambda *a: loss(*a, mesh=mesh), argnums))(*inputs)
    for g, w in zip(got, want):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-4, atol=1e-5)
