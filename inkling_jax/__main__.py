"""`python -m inkling_jax`: load a model and greedily continue a prompt.

With no --model it loads the embedded default, `inkling-tiny` (trained on the King James Bible:
docs/default-model.md), and its tokenizer. --model DIR loads a hub-layout checkpoint, with its tokenizer.json
if it has one (otherwise the prompt is comma-separated token ids). --preset NAME builds that preset with seeded
random weights and byte-level tokens instead (its output is noise, by construction).
"""

import argparse
import os
import time

import jax.numpy as jnp
import numpy as np
from flax import nnx

from inkling_jax import load_pretrained, preset
from inkling_jax.assets import DEFAULT_MODEL_NAME, default_model_dir
from inkling_jax.generate import greedy_generate
from inkling_jax.nn.model import InklingModel, count_params


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--model", help="model directory in the hub layout (default: the embedded inkling-tiny)")
    source.add_argument("--preset", help="build this preset with seeded random weights (e.g. tiny) instead")
    parser.add_argument("--prompt", default="And God said,",
                        help="text, or comma-separated token ids")
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--seed", type=int, default=0, help="seed of the random preset weights")
    args = parser.parse_args(argv)

    t0 = time.time()
    tokenizer = None
    if args.preset:
        model = InklingModel(preset(args.preset), dtype=jnp.dtype(args.dtype), rngs=nnx.Rngs(args.seed))
        source = f"preset '{args.preset}' with seeded random weights (output is noise)"
    else:
        directory = args.model or default_model_dir()
        model = load_pretrained(directory, dtype=args.dtype, progress=False)
        source = args.model or f"the embedded {DEFAULT_MODEL_NAME} ({directory})"
        tokenizer = _tokenizer(directory)
    print(f"model: {source}; {count_params(model) / 1e6:.2f}M parameters; built in {time.time() - t0:.1f}s")

    if all(part.strip().isdigit() for part in args.prompt.split(",")):
        ids = [int(part) for part in args.prompt.split(",")]
    elif tokenizer is not None:
        ids = tokenizer.encode(args.prompt, add_special_tokens=False).ids
    elif args.model:
        parser.error(f"{args.model} has no tokenizer.json: give --prompt as comma-separated token ids")
    else:
        ids = list(args.prompt.encode("utf-8"))  # the presets' byte-level tokens
    t0 = time.time()
    new = greedy_generate(model, np.array([ids], np.int32), args.max_new_tokens)[0].tolist()
    elapsed = time.time() - t0
    print(f"prompt ids: {ids}")
    print(f"generated ids: {new}")
    if tokenizer is not None:
        print("as text:", repr(tokenizer.decode(new)))
    else:
        print("as bytes:", bytes(t for t in new if t < 256))
    print(f"{args.max_new_tokens} tokens in {elapsed:.2f}s (includes compilation)")


def _tokenizer(directory: str):
    """The directory's tokenizer.json (HF `tokenizers`, the serve extra), or None."""
    path = os.path.join(directory, "tokenizer.json")
    if not os.path.exists(path):
        return None
    from tokenizers import Tokenizer

    return Tokenizer.from_file(path)


if __name__ == "__main__":
    main()
