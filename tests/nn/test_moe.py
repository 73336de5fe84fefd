"""MoE: backends agree (values and gradients), expert parallelism equals the single-device layer, routing
replay keeps the recorded choice while gradients reach the router, rows are laid out by expert as a stable sort
would."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding

from inkling_jax import Backend, preset
from inkling_jax.nn import moe_dispatch
from inkling_jax.nn.moe import MoE
from inkling_jax.parallel.mesh import make_mesh
from inkling_jax.parallel.placement import shard_model
from inkling_jax.parallel.rules import spec_for
from pallas_kernels._common import interpret_default
from pallas_kernels.moe.groups import running_sum


def _moe(seed=0, skew=False, backend="dense"):
    """The tiny preset's MoE layer with the MoE implementation `backend`."""
    moe = MoE(preset("tiny").text, dtype=jnp.float32, rngs=nnx.Rngs(seed), backend=Backend(moe=backend))
    if skew:  # uneven routing: experts 0 and 1 favoured, expert 7 never chosen
        moe.router_bias.set_value(jnp.array([4.0, 4.0, 0, 0, 0, 0, 0, -50.0]))
    return moe


def _run(moe, x):
    def loss(model, x):
        y, ids = model(x)
        return (y * jnp.cos(jnp.arange(y.size).reshape(y.shape))).sum(), (y, ids)

    (_, (y, ids)), grads = nnx.value_and_grad(loss, argnums=(0, 1), has_aux=True)(moe, x)
    return y, ids, grads


@functools.lru_cache(maxsize=None)
def _reference(shape, skew=False):
    """The dense backend on the single-device layer, once per input shape."""
    return nnx.jit(_run)(_moe(skew=skew), _input(shape))


def _input(shape):
    return jax.random.normal(jax.random.key(sum(shape)), shape + (64,))


def _assert_same(got, want, atol=1e-6, tf32=False):
    """Equal routing, values and gradients to fp32 rounding; `tf32`: the compiled GPU kernel multiplies fp32 as
    tf32 (10 mantissa bits), so values and gradients agree to a relative 1e-2 in norm instead."""
    y, ids, g = got
    ref_y, ref_ids, ref_g = want
    np.testing.assert_array_equal(ids, ref_ids)
    leaves, ref_leaves = jax.tree.leaves(g), jax.tree.leaves(ref_g)
    assert len(leaves) == len(ref_leaves) == 10  # x and the 9 parameters
    assert all(np.all(np.isfinite(np.asarray(a))) for a in leaves)
    if tf32:
        for a, b in zip([y, *leaves], [ref_y, *ref_leaves]):
            assert np.linalg.norm(np.asarray(a) - b) <= 1e-2 * np.linalg.norm(b)
        return
    np.testing.assert_allclose(y, ref_y, rtol=1e-5, atol=max(atol, 1e-6))
    for a, b in zip(leaves, ref_leaves):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=atol)


# The tiny preset's expert shapes (hidden 64, width 32, 8 experts, top-2 + 2 shared). 14 tokens give 28 routed
# rows: the Pallas kernel's decode layout, one slab per expert; 80 tokens (160 rows) the same layout, each
# expert in as many slabs as its rows fill; 300 tokens the prefill kernels on every expert's rows padded to whole
# row blocks (`moe_dispatch.lay_out`), forward and backward. A width of 32 once left the Pallas w_down gradient
# unwritten (all NaN).
@pytest.mark.parametrize("backend,tokens", [("ragged", 14), ("ragged", 80), ("pallas", 14), ("pallas", 80),
                                            ("pallas", 300)])
def test_backends_agree_in_value_and_gradient(backend, tokens):
    got = nnx.jit(_run)(_moe(backend=backend), _input((2, tokens // 2)))
    _assert_same(got, _reference((2, tokens // 2)), tf32=backend == "pallas" and not interpret_default())


@pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (simulated) devices")
@pytest.mark.parametrize("spec,tokens,backend", [
    ("expert=8", (2, 5), "ragged"),
    ("data=2,expert=4", (4, 6), "ragged"),
    ("fsdp=2,tensor=2,expert=2", (4, 6), "ragged"),
    ("data=4,expert=2", (4, 5), "pallas"),
])
def test_expert_parallel_equals_single_device(spec, tokens, backend):
    """All-to-all dispatch (the portable transport on CPU) equals the single-device layer: uneven routing,
    expert 7 receives nothing, token counts that do not split evenly over the expert shards."""
    want = _reference(tokens, skew=True)
    ids = np.asarray(want[1])
    assert 7 not in ids and np.bincount(ids.ravel())[0] > ids.shape[0] // 2
    moe = shard_model(_moe(skew=True, backend=backend), make_mesh(spec))
    got = nnx.jit(_run)(moe, _input(tokens))
    _assert_same(got, want, atol=1e-5)


@pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (simulated) devices")
@pytest.mark.parametrize("rows,split", [(8, True), (6, False)])
def test_a_batch_split_over_expert_stays_split(rows, split):
    """A batch that splits over data x expert reaches each expert shard as its own tokens: the layer's output
    stays split, with no all-gather of [tokens, hidden] activations. One that only splits over `data` (6 rows)
    is sliced per expert shard and gathered back."""
    mesh = make_mesh("data=2,expert=4")
    moe = shard_model(_moe(backend="ragged"), mesh)
    x = jax.device_put(_input((rows, 4)), NamedSharding(mesh, spec_for(("batch", None, None), (rows, 4, 64), mesh)))
    forward = nnx.jit(lambda moe, x: moe(x)[0])
    hlo = forward.lower(moe, x).compile().as_text()
    gathers = [line for line in hlo.splitlines() if "all-gather" in line and ",64]" in line.split("=")[1]]
    assert bool(gathers) != split, gathers
    # Each expert shard's share is ceil(rows * 4 / 8) tokens, 2 copies each: no all-to-all slot holds more rows,
    # in the combine too (sent back from a receive buffer 4 times that).
    slots = [int(rows) for line in hlo.splitlines() if "all-to-all" in line and "=" in line
             for rows in re.findall(r"\[1,(\d+),64\]", line.split("=")[1])]
    assert slots and max(slots) <= -(-rows * 4 // 8) * 2, slots
    want = nnx.jit(lambda moe, x: moe(x)[0])(_moe(), _input((rows, 4)))
    np.testing.assert_allclose(forward(moe, x), want, rtol=1e-5, atol=1e-6)


@pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (simulated) devices")
@pytest.mark.parametrize("tokens,decode_bounds", [((5, 8), [40]), ((8, 15), [None])])
def test_expert_parallel_picks_the_decode_layout_by_a_safe_bound(monkeypatch, tokens, decode_bounds):
    """Over 8 expert shards each shard's receive buffer has 8 x ceil(T / 8) x top-2 rows. At T = 40 that is 80
    rows, past the kernel's 64-row decode threshold, yet no expert can receive more than the 40 tokens: the
    decode layout applies with that bound. At T = 120 skewed routing sends more than 64 tokens to expert 0,
    more than a decode slab holds: a bound from one shard's share (15 tokens, 30 rows) would drop rows; the
    layout takes no bound there, each expert in as many slabs as its rows fill."""
    bounds, decode = [], moe_dispatch.moe_ffn_decode

    def recording(*args, max_group_rows, **kwargs):
        bounds.append(max_group_rows)
        return decode(*args, max_group_rows=max_group_rows, **kwargs)

    monkeypatch.setattr(moe_dispatch, "moe_ffn_decode", recording)
    forward = nnx.jit(lambda moe, x: moe(x))  # the bound matters in the forward pass alone: no gradients
    x = _input(tokens)
    want, want_ids = forward(_moe(skew=True), x)
    assert np.bincount(np.asarray(want_ids).ravel())[0] > min(64, x.shape[0] * x.shape[1] // 2)
    got, ids = forward(shard_model(_moe(skew=True, backend="pallas"), make_mesh("expert=8")), x)
    assert sorted(set(bounds)) == decode_bounds
    np.testing.assert_array_equal(ids, want_ids)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_routing_replay_keeps_the_choice_and_gives_reference_gradients():
    moe = _moe(seed=2)
    x = jax.random.normal(jax.random.key(2), (16, 64))
    _, recorded = moe(x)
    # After an update the router would choose differently; replay must keep the recorded experts.
    moe.router.set_value(moe.router[...] + 0.5 * jax.random.normal(jax.random.key(3), moe.router.shape))
    _, fresh = moe(x)
    assert (np.asarray(fresh) != np.asarray(recorded)).any()
    _, replayed = moe(x, expert_ids=recorded)
    np.testing.assert_array_equal(replayed, recorded)
    # Rows without a record (-1) take the router's own choice; the others keep theirs.
    _, mixed = moe(x, expert_ids=jnp.asarray(recorded).at[:8].set(-1))
    np.testing.assert_array_equal(mixed[:8], fresh[:8])
    np.testing.assert_array_equal(mixed[8:], recorded[8:])

    def replay_weights(router):
        logits = x @ router
        routed = jnp.take_along_axis(logits[:, :8], recorded, axis=-1)
        active = jax.nn.sigmoid(jnp.concatenate([routed, logits[:, 8:]], axis=-1))
        return (8.0 * active / active.sum(-1, keepdims=True) * jnp.arange(1, 5)).sum()

    def ours(model):
        w, _, shared = model.route(x, recorded)
        return (jnp.concatenate([w, shared], axis=-1) * jnp.arange(1, 5)).sum()

    got = nnx.grad(ours)(moe)["router"][...]
    np.testing.assert_allclose(got, jax.grad(replay_weights)(moe.router[...]), rtol=1e-4, atol=1e-5)


@pytest.mark.skipif(jax.device_count() < 2, reason="needs 2 (simulated) devices")
def test_padded_transport_follows_the_ragged_all_to_all_contract():
    """The CPU stand-in for `jax.lax.ragged_all_to_all` (which XLA:CPU lacks) on the example of its docs."""
    from jax.sharding import Mesh
    from jax.sharding import PartitionSpec as P

    from inkling_jax.parallel.expert_parallel import ragged_all_to_all_padded

    mesh = Mesh(np.array(jax.devices()[:2]), ("e",))
    per_device = [jnp.array(a) for a in ([[1.0, 2, 2], [3, 4, 0]], [[0.0] * 4] * 2, [[0, 1], [0, 1]],
                                         [[1, 2], [1, 1]], [[0, 0], [1, 2]], [[1, 1], [2, 1]])]

    def f(*args):
        return ragged_all_to_all_padded(*(a[0] for a in args), axis_name="e")[None]

    send = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=P("e"), out_specs=P("e")))
    np.testing.assert_array_equal(send(*per_device), [[1, 3, 0, 0], [2, 2, 4, 0]])
    # An output shorter than the operand (the combine sends back from the larger receive buffer): slots of the
    # output's length. Device 0 sends its rows 0 and 3, device 1 its rows 2 and 1.
    per_device = [jnp.array(a) for a in ([[1.0, 2, 3, 4], [5, 6, 7, 8]], [[0.0] * 2] * 2, [[0, 3], [2, 1]],
                                         [[1, 1], [1, 1]], [[0, 1], [1, 0]], [[1, 1], [1, 1]])]
    np.testing.assert_array_equal(send(*per_device), [[1, 7], [6, 4]])


@pytest.mark.parametrize("sort_free_rows", [0, 1024])  # the sort, then the comparison of all pairs
def test_rows_are_ordered_by_group_as_a_stable_sort_orders_them(monkeypatch, sort_free_rows):
    monkeypatch.setattr(moe_dispatch, "SORT_FREE_ROWS", sort_free_rows)
    rng = np.random.default_rng(1)
    for rows, groups in ((192, 32), (5, 1), (300, 9)):
        group = rng.integers(0, groups + 2, rows)  # groups >= `groups`: rows of no expert, which go last
        order, place = jax.jit(moe_dispatch.order_by_group)(jnp.asarray(group, jnp.int32))
        np.testing.assert_array_equal(order, np.argsort(group, kind="stable"))
        np.testing.assert_array_equal(np.asarray(place)[np.asarray(order)], np.arange(rows))
    sizes = jnp.asarray(rng.integers(0, 50, 37), jnp.int32)
    np.testing.assert_array_equal(jax.jit(running_sum)(sizes), np.cumsum(sizes))


@pytest.mark.parametrize("align", [1, 4])
def test_rows_laid_out_in_blocks_keep_the_stable_order_and_fill_whole_blocks(align):
    """`lay_out`: each group's rows in their stable order, the group starting at a multiple of `align`, the
    places past them in the group empty (source out of range); rows of no group go nowhere (align > 1)."""
    rng = np.random.default_rng(2)
    rows, groups = 45, 6
    group = rng.integers(0, groups + 1, rows)  # group 6: no expert
    group[group == 3] = 2  # an empty group
    place, source, sizes = map(np.asarray, jax.jit(moe_dispatch.lay_out, static_argnums=(1, 2))(
        jnp.asarray(group, jnp.int32), groups, align))
    counts = np.bincount(group, minlength=groups + 1)[:groups]
    np.testing.assert_array_equal(sizes, -(-counts // align) * align)
    start = 0
    for g in range(groups):
        members = np.flatnonzero(group == g)  # in row order: the stable sort's order within the group
        assert start % align == 0
        np.testing.assert_array_equal(place[members], start + np.arange(len(members)))
        np.testing.assert_array_equal(source[start:start + len(members)], members)
        assert np.all(source[start + len(members):start + sizes[g]] >= rows)
        start += sizes[g]
    if align > 1:
        assert np.all(place[group == groups] >= len(source)) and np.all(source[start:] >= rows)
    x = jax.random.normal(jax.random.key(0), (rows, 3))
    taken = moe_dispatch.take_rows(x, jnp.asarray(source), jnp.asarray(place)[:, None])
    np.testing.assert_array_equal(taken[:start], np.where((source[:start] < rows)[:, None], np.asarray(x)[
        np.minimum(source[:start], rows - 1)], 0))
    # The gradient of the gather is the gather back: each row's cotangent from its one place, zeros for none.
    cot = jax.random.normal(jax.random.key(1), taken.shape)
    grad = jax.vjp(lambda x: moe_dispatch.take_rows(x, jnp.asarray(source), jnp.asarray(place)[:, None]), x)[1](
        cot)[0]
    want = jax.vjp(lambda x: jnp.where((source < rows)[:, None], x[np.minimum(source, rows - 1)], 0), x)[1](cot)[0]
    np.testing.assert_allclose(grad, want, rtol=1e-6)
