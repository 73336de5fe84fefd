"""The expert-parallel MoE layer over the GPUs of one host: milliseconds per layer by token count and by how the
tokens come, in the same run.

Layer: the `bench` preset's widths (hidden 6144, 32 experts of width 3072 top-6, 2 shared), bf16, random
weights and routing (the router runs outside the timing); `expert_parallel.experts_ep` on a mesh of `expert` =
every GPU, the MoE backend "auto" (`--backend` takes another). The `replicated` rows take the tokens replicated,
as the server gives them (its rows whole: `serve.placement.ROWS`), each shard slicing its share and the output
gathered back; the `split` rows take them split over `expert`, as a trainer's batch comes (`sharding.RULES`),
each shard keeping its output.

    PYTHONPATH=. python bench/moe_ep.py [--tokens 8,256,1024,4096] [--backend SPEC]
"""

import argparse
import os
import sys

# Run as a script, this file's folder comes first on sys.path and bench/serve.py would shadow the `serve` package.
sys.path = [p for p in sys.path if os.path.abspath(p or ".") != os.path.dirname(os.path.abspath(__file__))]

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

from bench.ceilings import median_seconds  # noqa: E402
from inkling_jax import preset  # noqa: E402
from inkling_jax.backend import Backend, add_backend_flag  # noqa: E402
from inkling_jax.nn.moe import MoE  # noqa: E402
from inkling_jax.parallel import expert_parallel  # noqa: E402
from inkling_jax.parallel.mesh import make_mesh  # noqa: E402
from inkling_jax.parallel.placement import shard_model  # noqa: E402
from inkling_jax.parallel.rules import override_rules  # noqa: E402
from serve.placement import ROWS  # noqa: E402


def measure(tokens: list[int], preset_name: str, backend: Backend) -> dict:
    """{(layout, tokens): ms per layer}."""
    text = preset(preset_name).text
    mesh = make_mesh(f"expert={jax.device_count()}")
    moe = shard_model(MoE(text, dtype=jnp.bfloat16, rngs=nnx.Rngs(0)), mesh)
    routed = (moe.w_gate[...], moe.w_up[...], moe.w_down[...])
    shared = (moe.shared_gate[...], moe.shared_up[...], moe.shared_down[...])
    out = {}
    for n in tokens:
        x = jax.random.normal(jax.random.key(n), (n, text.hidden_size), jnp.bfloat16)
        weights, ids, shared_weights = moe.route(x)
        for name, rules in (("replicated", {"batch": ROWS}), ("split", {})):
            def layer(x, r, s, rules=rules):
                with override_rules(**rules):
                    return expert_parallel.experts_ep(x, r, s, ids, weights, shared_weights, mesh, backend.resolve())

            # 10 back-to-back calls a trial: one call's dispatch and wait would hide a small layer's device time.
            out[name, n] = 1e3 * median_seconds(jax.jit(layer), x, routed, shared, trials=5, calls=10)
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", default="8,256,1024,4096")
    p.add_argument("--preset", default="bench", help="tiny: the script's plumbing on CPU")
    add_backend_flag(p)
    args = p.parse_args()
    tokens = [int(t) for t in args.tokens.split(",")]
    rows = {}
    for (name, n), ms in measure(tokens, args.preset, args.backend).items():
        rows.setdefault(name, {})[n] = ms
    print(f"{jax.device_count()} x {jax.devices()[0].device_kind}, jax {jax.__version__}; ms per MoE layer "
          f"({args.preset} preset widths, expert={jax.device_count()})")
    print("| tokens come | " + " | ".join(f"{n} tokens" for n in tokens) + " |")
    print("|---|" + "---:|" * len(tokens))
    for name, by_tokens in rows.items():
        print(f"| {name} | " + " | ".join(f"{by_tokens[n]:.3f}" for n in tokens) + " |")


if __name__ == "__main__":
    main()
