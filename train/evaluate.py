"""Held-out evaluation: the mean next-token loss and perplexity over every counted token of a fixed set of packed
rows (the same tokens every time), the MTP head's loss when the model has one, and on the same tokens the unigram
and bigram baselines of some training rows (`train.ngram`). `train.run --eval-data` runs it during training;
as a command it evaluates a model directory on a file:

    python -m train.evaluate --model inkling_jax/assets/inkling-tiny --data heldout.txt

The file is plain text (documents separated by blank lines, each ending with the EOS token, as `train.run`
reads them) or JSONL (one document a line: `{"text": ...}`, or tokenised `{"input_ids": [...]}` with an
optional `loss_mask`). Documents are packed into rows of --seq-len tokens and every token is predicted once,
from the tokens before it in its row: a document longer than a row continues in the next one without the
earlier context, and the first token of a document or of such a continuation is not predicted. Bits per byte
is the summed loss in bits over the UTF-8 bytes of the counted tokens' text (control tokens have none).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os

import jax
import numpy as np
from tqdm.auto import tqdm

from inkling_jax.backend import Backend, add_backend_flag
from train.data import Packed, file_tokenizer, pack, read_documents
from train.ngram import NgramBaselines

log = logging.getLogger("evaluate")


class Evaluator:
    def __init__(self, packed: Packed, rows_per_batch: int):
        """rows_per_batch: rows per evaluation batch; the last batch is filled with empty rows (segment 0),
        which count nothing."""
        self.packed, self.rows_per_batch = packed, rows_per_batch

    def __len__(self) -> int:
        return -(-len(self.packed) // self.rows_per_batch)

    def batches(self):
        n, size = len(self.packed), self.rows_per_batch
        for start in range(0, n, size):
            rows = self.packed.rows(np.arange(start, min(start + size, n)))
            pad = size - rows["input_ids"].shape[0]
            yield {k: np.pad(v, ((0, pad), (0, 0)))[None] for k, v in rows.items()}

    def evaluate(self, trainer, state, frozen, progress: bool = False) -> dict[str, float]:
        """{"eval_loss", "eval_perplexity", "eval_tokens"} (+ "eval_mtp_loss") of the model in `state`."""
        total: dict[str, float] = {}
        for batch in tqdm(self.batches(), total=len(self), desc="evaluating", unit="batch", disable=not progress):
            sums = jax.device_get(trainer.eval_sums(state, frozen, trainer.place_batch(batch)))
            for k, v in sums.items():
                total[k] = total.get(k, 0.0) + float(v)
        tokens = max(total.pop("tokens"), 1.0)
        out = {"eval_loss": total["loss"] / tokens, "eval_tokens": int(tokens)}
        out["eval_perplexity"] = math.exp(out["eval_loss"])
        if "mtp_loss" in total:
            out["eval_mtp_loss"] = total["mtp_loss"] / tokens
        return out

    def baselines(self, train_rows: Packed, vocab_size: int) -> dict[str, float]:
        """{"eval_unigram_loss", "eval_bigram_loss"} (and their perplexities) of count models of `train_rows`,
        on the evaluated tokens."""
        scores = NgramBaselines.fit(train_rows, vocab_size).losses(self.packed)
        out = {}
        for name in ("unigram", "bigram"):
            out[f"eval_{name}_loss"] = scores[f"{name}_loss"]
            out[f"eval_{name}_perplexity"] = math.exp(scores[f"{name}_loss"])
        return out


# ----------------------------------------------------------------------------------------------------------
# The command


def model_tokenizer(model_dir: str, vocab_size: int):
    """The `tokenizers` object of the directory's tokenizer.json, refused when it has more entries than the
    model's vocabulary (a tokenizer of another model)."""
    path = os.path.join(model_dir, "tokenizer.json")
    if not os.path.exists(path):
        raise FileNotFoundError(f"{model_dir}: no tokenizer.json (a directory `train.run --export` wrote, or a hub "
                                "download, has one)")
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(path)
    if tokenizer.get_vocab_size(with_added_tokens=True) > vocab_size:
        raise ValueError(f"{path} has {tokenizer.get_vocab_size(with_added_tokens=True)} entries, the model's "
                         f"vocabulary {vocab_size}: it is another model's tokenizer")
    return tokenizer


def read_rows(path: str, tokenizer_file: str, config, seq_len: int) -> Packed:
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path}: no such file")
    docs = read_documents(path, file_tokenizer(tokenizer_file), config.eos_token_id, config.text.unpadded_vocab_size)
    return pack(docs, seq_len)


def counted_bytes(rows: Packed, tokenizer) -> int:
    """UTF-8 bytes of the text of the tokens whose loss counts: in each row's piece of a document (a segment),
    the tokens after its first where the loss mask is set."""
    total = 0
    for ids, seg, mask in zip(rows.input_ids, rows.segment_ids, rows.loss_mask):
        for s in np.unique(seg[seg > 0]):
            piece = ids[seg == s][1:][mask[seg == s][1:] > 0]
            total += len(tokenizer.decode(piece.tolist(), skip_special_tokens=True).encode())
    return total


def evaluate_model(model_dir: str, data: str, *, seq_len: int = 512, batch: int = 16, dtype: str = "float32",
                   backend: Backend = Backend(), max_tokens: int | None = None, baseline_data: str | None = None,
                   mesh_spec: str | None = None, devices: int | None = None, progress: bool = True) -> dict:
    """The held-out scores of the model directory `model_dir` on the file `data` (module docstring): the keys of
    `Evaluator.evaluate` and `eval_bits_per_byte`, with `baseline_data` those of `Evaluator.baselines` fitted on
    that file's rows. max_tokens: only the first rows that hold about that many tokens. mesh_spec, devices: as
    train.run's --mesh and --devices."""
    from inkling_jax.config import load_config
    from inkling_jax.parallel.mesh import make_mesh
    from train.state import pretrained_params
    from train.step import StepConfig, Trainer

    config = load_config(model_dir)
    tokenizer = model_tokenizer(model_dir, config.text.unpadded_vocab_size)
    tokenizer_file = os.path.join(model_dir, "tokenizer.json")
    rows = read_rows(data, tokenizer_file, config, seq_len)
    if max_tokens is not None:
        rows = Packed(**rows.rows(slice(0, -(-max_tokens // seq_len))))
    evaluator = Evaluator(rows, batch)
    # Every weight frozen: the trainer holds no optimizer state, only the model in the compute dtype.
    mesh = make_mesh(mesh_spec, jax.devices()[:devices] if devices else None)
    trainer = Trainer(config, mesh, StepConfig(compute_dtype=dtype, freeze=(".",), backend=backend))
    state, frozen = trainer.init(pretrained_params(model_dir, config, trainer.param_shardings(), progress))
    scores = evaluator.evaluate(trainer, state, frozen, progress=progress)
    bits = scores["eval_loss"] * scores["eval_tokens"] / math.log(2)
    scores["eval_bits_per_byte"] = bits / max(counted_bytes(rows, tokenizer), 1)
    if baseline_data:
        scores.update(evaluator.baselines(read_rows(baseline_data, tokenizer_file, config, seq_len),
                                          config.text.unpadded_vocab_size))
    return scores


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m train.evaluate", epilog=__doc__.split("\n\n", 2)[2],
                                description="Held-out loss, perplexity and bits per byte of a model directory on a "
                                "text or JSONL file.", formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="a model directory with its tokenizer.json (the hub layout, or "
                   "what train.run --export writes)")
    p.add_argument("--data", required=True, help="held-out data: plain text (documents split by blank lines) or "
                   "JSONL ({\"text\": ...} or {\"input_ids\": [...]} lines)")
    p.add_argument("--seq-len", type=int, default=512, help="tokens per packed row: the longest context a "
                   "prediction sees (default 512)")
    p.add_argument("--batch", type=int, default=16, help="rows per evaluation step (default 16)")
    p.add_argument("--max-tokens", type=int, help="evaluate only the first rows holding about N tokens (a quick "
                   "estimate)")
    p.add_argument("--baseline-data", metavar="TRAIN_FILE", help="also score unigram and bigram count models of "
                   "this file (the training data, same formats) on the same tokens")
    p.add_argument("--dtype", default="float32", help="compute dtype (default float32)")
    p.add_argument("--mesh", help='e.g. "fsdp=4,tensor=2"; devices left over go to data')
    p.add_argument("--devices", type=int, help="use only the first N devices (default: all)")
    add_backend_flag(p)
    p.add_argument("--json", metavar="OUT", help="also write the scores to this JSON file")
    args = p.parse_args(argv)
    for name in ("seq_len", "batch", "max_tokens", "devices"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    try:
        scores = evaluate_model(args.model, args.data, seq_len=args.seq_len, batch=args.batch, dtype=args.dtype,
                                backend=args.backend, max_tokens=args.max_tokens, baseline_data=args.baseline_data,
                                mesh_spec=args.mesh, devices=args.devices)
    except (FileNotFoundError, ValueError) as exc:
        raise SystemExit(f"error: {exc}") from None
    print(f"tokens           {scores['eval_tokens']}")
    print(f"loss             {scores['eval_loss']:.4f} nats/token")
    print(f"perplexity       {scores['eval_perplexity']:.3f}")
    print(f"bits per byte    {scores['eval_bits_per_byte']:.4f}")
    for name in ("mtp", "unigram", "bigram"):
        if f"eval_{name}_loss" in scores:
            print(f"{name + ' loss':<16} {scores[f'eval_{name}_loss']:.4f} nats/token")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(scores, fh, indent=1)


if __name__ == "__main__":
    main()
