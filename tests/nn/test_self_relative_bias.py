"""The jnp attention's fast relative bias for self-attention (a skew of r @ P) equals the gathered one wherever
causality lets a key count, packed segments included, and so does its gradient."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.rel_attention import reference


@pytest.mark.parametrize("seq,extent", [(24, 8), (16, 40), (33, 33)])
def test_skewed_bias_equals_the_gathered_one(seq, extent):
    key = jax.random.split(jax.random.PRNGKey(seq), 2)
    r = jax.random.normal(key[0], (2, seq, 3, 4))
    rel_proj = jax.random.normal(key[1], (4, extent))
    pos = jnp.broadcast_to(jnp.arange(seq)[None], (2, seq))
    causal = np.tril(np.ones((seq, seq), bool))
    want = np.asarray(reference.relative_bias(r, rel_proj, pos, pos))
    got = np.asarray(reference.self_relative_bias(r, rel_proj))
    np.testing.assert_allclose(np.where(causal, got, 0), np.where(causal, want, 0), rtol=1e-5, atol=1e-5)


def test_attention_and_gradients_agree_on_packed_rows():
    seq, key = 20, jax.random.split(jax.random.PRNGKey(1), 5)
    q, k, v = (jax.random.normal(key[i], (1, seq, 2, 8)) for i in range(3))
    r, rel_proj = jax.random.normal(key[3], (1, seq, 2, 4)), jax.random.normal(key[4], (4, 12))
    segments = jnp.asarray([[1] * 7 + [2] * 9 + [0] * 4])
    positions = jnp.asarray([list(range(7)) + list(range(9)) + [0] * 4])

    def loss(q, k, v, r, rel_proj, index_distances):
        out = reference.rel_attention(q, k, v, r, rel_proj, positions, positions, window=6, q_segment=segments,
                                      k_segment=segments, index_distances=index_distances)
        return jnp.sum(jnp.sin(out) * (segments > 0)[..., None, None])  # padding rows attend among themselves

    want = jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4))(q, k, v, r, rel_proj, False)
    got = jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4))(q, k, v, r, rel_proj, True)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5)
