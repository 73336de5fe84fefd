"""Whole-model throughput at the `bench` preset (the released per-layer widths, 6 layers, 32 experts), bf16, random
weights, with the kernels the model picks: prefill tok/s, and the decode step's tok/s and achieved bytes/s
against a device copy measured in the same run.

    python -m benchmarks.model [--backend moe=ragged] [--batch-invariant] [--quick] [--preset tiny]

The decode step's bytes are `decode_step_bytes`: every text weight but the routed experts no token touches and
the embedding rows not looked up, plus the K/V in use. `--preset tiny` starts the same cases on a CPU.
"""

import argparse
import time

import jax.numpy as jnp
import numpy as np
from flax import nnx

from benchmarks.timing import copy_bandwidth, median_seconds, stamp, stamp_line
from inkling_jax import preset
from inkling_jax.backend import add_backend_flag, add_batch_invariant_flag
from inkling_jax.generate import StepFunctions
from inkling_jax.nn.moe_dispatch import ROUTED_FP8, ROUTED_NVFP4
from serve.random_weights import device_random_model


def decode_step_bytes(model, batch: int, context: int, tokens_per_row: int = 1) -> int:
    """Bytes one decode step of `batch` rows at `context` tokens must read at least: every text weight but
    the untouched experts' (the expected count of distinct experts hit by batch x tokens_per_row x top-k uniform
    picks) and the embedding table (one row per token), plus each row's K/V in use (sliding layers: at most the
    window). tokens_per_row > 1: a speculative verify of that many tokens per row."""
    text = model.config.text
    item = model.dtype.itemsize
    total = 0
    params = {path: var for path, var in nnx.iter_graph(model) if isinstance(var, nnx.Param)}
    for path, var in params.items():
        if path[0] in ("vision", "audio", "mtp") or "twin" in path:  # fp8 twins: read by wide steps only
            continue
        size = var.get_value().nbytes
        if path[-1] == "embed":
            size = batch * tokens_per_row * text.hidden_size * item
        elif path[-1] in ("w_gate", "w_up", "w_down", *ROUTED_FP8, *ROUTED_NVFP4) and (
                var.get_value().ndim >= 3):  # routed experts (the dense MLP's matrices share names, at rank 2)
            picks = batch * tokens_per_row
            touched = text.num_experts * (1 - (1 - text.num_experts_per_tok / text.num_experts) ** picks)
            size = size * touched / text.num_experts
        total += size
    kv = 0
    for i in range(text.num_layers):
        shape = text.attention(text.is_local(i))
        tokens = min(context, shape.window) if shape.window else context
        kv += 2 * tokens * shape.num_kv_heads * shape.head_dim * item
    return int(total + batch * kv)


def build(config, backend):
    """The model with its random weights made on the device."""
    return device_random_model(config, jnp.bfloat16, 0, backend)


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m benchmarks.model", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_backend_flag(parser)
    add_batch_invariant_flag(parser, "its times are the batch-invariant mode's (run once with, once without: the "
                             "slowdown against the fast mode)")
    parser.add_argument("--quick", action="store_true", help="batch-1 cases only")
    parser.add_argument("--preset", default="bench", help="the model's configuration (tiny: a start on CPU)")
    args = parser.parse_args(argv)
    print(stamp_line(stamp()))
    ceiling = copy_bandwidth(1 << 30, data="ones")
    print(f"device copy (read + write): {ceiling / 1e9:.0f} GB/s")
    config = preset(args.preset)
    vocab = config.text.unpadded_vocab_size
    t0 = time.time()
    model = build(config, args.backend)
    params = sum(v.get_value().size for _, v in nnx.iter_graph(model) if isinstance(v, nnx.Param))
    print(f"{args.preset} preset: {params / 1e9:.2f}B parameters, built in {time.time() - t0:.1f}s, "
          f"{args.backend.resolve()}")
    steps = StepFunctions(model)
    rows = []
    for batch, length in ((1, 2048), (8, 1024)) if not args.quick else ((1, 2048),):
        ids = jnp.asarray(np.random.default_rng(0).integers(0, vocab, (batch, length)), jnp.int32)
        seconds = median_seconds(lambda: steps.forward(ids), trials=5)
        rows.append((f"prefill (forward) bs={batch} L={length}", seconds * 1e3, batch * length / seconds, "", ""))
    max_len = 2048
    for batch in (1, 32) if not args.quick else (1,):
        cache = model.init_cache(batch, max_len)
        # The prompt goes through the general chunk path (dense scores over the cache), so keep it short.
        prompt = jnp.asarray(np.random.default_rng(1).integers(0, vocab, (batch, 256)), jnp.int32)
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
