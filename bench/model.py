"""Whole-model throughput at the `bench` preset (released per-layer widths, 6 layers, 32 experts), bf16, random
weights, with the kernels the model picks on GPU. Prints prefill tok/s and the decode step's tok/s and achieved
bytes/s against a device copy measured in the same run.

    PYTHONPATH=. python bench/model.py [--backend moe=ragged] [--quick]
"""

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from bench.ceilings import copy_bandwidth, decode_step_bytes, median_seconds
from inkling_jax import InklingModel, preset
from inkling_jax.backend import add_backend_flag
from inkling_jax.generate import StepFunctions


def build(config, backend):
    abstract = nnx.eval_shape(lambda: InklingModel(config, dtype=jnp.bfloat16, rngs=nnx.Rngs(0), backend=backend))
    graphdef, _ = nnx.split(abstract)
    state = jax.jit(lambda: nnx.split(InklingModel(config, dtype=jnp.bfloat16, rngs=nnx.Rngs(0)))[1])()
    return nnx.merge(graphdef, state)


def main():
    parser = argparse.ArgumentParser()
    add_backend_flag(parser)
    parser.add_argument("--quick", action="store_true", help="fewer shapes")
    args = parser.parse_args()
    print(jax.devices()[0].device_kind, "jax", jax.__version__)
    ceiling = copy_bandwidth(1 << 30, data="ones")
    print(f"device copy (read + write): {ceiling / 1e9:.0f} GB/s")
    config = preset("bench")
    t0 = time.time()
    model = build(config, args.backend)
    params = sum(v.get_value().size for _, v in nnx.iter_graph(model) if isinstance(v, nnx.Param))
    print(f"bench preset: {params / 1e9:.2f}B parameters, built in {time.time() - t0:.1f}s, "
          f"{args.backend.resolve()}")
    steps = StepFunctions(model)
    rows = []
    for batch, length in ((1, 2048), (8, 1024)) if not args.quick else ((1, 2048),):
        ids = jnp.asarray(np.random.default_rng(0).integers(0, 200000, (batch, length)), jnp.int32)
        seconds = median_seconds(lambda: steps.forward(ids), trials=5)
        rows.append((f"prefill (forward) bs={batch} L={length}", seconds * 1e3, batch * length / seconds, "", ""))
    max_len = 2048
    for batch in (1, 32) if not args.quick else (1,):
        cache = model.init_cache(batch, max_len)
        # The prompt goes through the general chunk path (dense scores over the cache), so keep it short.
        prompt = jnp.asarray(np.random.default_rng(1).integers(0, 200000, (batch, 256)), jnp.int32)
        logits, cache = steps.extend(prompt, cache)
        token = jnp.argmax(logits[:, -1], axis=-1)[:, None].astype(jnp.int32)
        state = {"cache": cache}

        def step():
            out, state["cache"] = steps.extend(token, state["cache"])
            return out

        # Eight back-to-back steps per trial, as a server chains them: the host's dispatch of one step overlaps
        # the device's work on the one before, so the time is the device's.
        seconds = median_seconds(step, trials=5, calls=8)
        need = decode_step_bytes(model, batch, 256)
        rows.append((f"decode step bs={batch} ctx=256", seconds * 1e3, batch / seconds,
                     f"{need / seconds / 1e9:.0f}", f"{need / seconds / ceiling:.2f}"))
    print(f"\n{'case':<34} {'ms':>9} {'tok/s':>10} {'GB/s':>7} {'of copy':>8}")
    for name, ms, tps, gbs, frac in rows:
        print(f"{name:<34} {ms:9.2f} {tps:10.0f} {gbs:>7} {frac:>8}")
    print("('of copy': bytes the step must read, per second, over the device copy's bytes (read + written) per second)")


if __name__ == "__main__":
    main()
