"""`python -m inkling_jax`: build or load a model and greedily continue a prompt.

With no --model it uses the embedded `tiny` preset with seeded random weights and byte-level tokens, so it
runs anywhere in seconds (its output is noise, by construction). With --model DIR it loads a hub-layout
checkpoint and takes the prompt as comma-separated token ids (tokenizers arrive with the server).
"""

import argparse
import time

import jax.numpy as jnp
import numpy as np
from flax import nnx

from inkling_jax import load_pretrained, preset
from inkling_jax.generate import greedy_generate
from inkling_jax.nn.model import InklingModel, count_params


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="model directory in the hub layout (default: the tiny preset, random weights)")
    parser.add_argument("--preset", default="tiny", help="preset to build when --model is not given")
    parser.add_argument("--prompt", default="Hello, Inkling!",
                        help="text (byte-level tokens, presets only) or comma-separated token ids")
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--seed", type=int, default=0, help="seed of the random preset weights")
    args = parser.parse_args(argv)

    t0 = time.time()
    if args.model:
        model = load_pretrained(args.model, dtype=args.dtype)
        source = args.model
    else:
        model = InklingModel(preset(args.preset), dtype=jnp.dtype(args.dtype), rngs=nnx.Rngs(args.seed))
        source = f"preset '{args.preset}' with seeded random weights (output is noise)"
    print(f"model: {source}; {count_params(model) / 1e6:.2f}M parameters; built in {time.time() - t0:.1f}s")

    if all(part.strip().isdigit() for part in args.prompt.split(",")):
        ids = [int(part) for part in args.prompt.split(",")]
    elif args.model:
        parser.error("--model needs --prompt as comma-separated token ids")
    else:
        ids = list(args.prompt.encode("utf-8"))  # the presets' byte-level tokens
    t0 = time.time()
    new = greedy_generate(model, np.array([ids], np.int32), args.max_new_tokens)[0].tolist()
    elapsed = time.time() - t0
    print(f"prompt ids: {ids}")
    print(f"generated ids: {new}")
    if not args.model:
        print("as bytes:", bytes(t for t in new if t < 256))
    print(f"{args.max_new_tokens} tokens in {elapsed:.2f}s (includes compilation)")


if __name__ == "__main__":
    main()
