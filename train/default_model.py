"""Rebuild the embedded default model, `inkling-tiny` (docs/default-model.md), from its corpus:

    apt-get install bible-kjv          # the King James Bible (public domain) and the `bible` reader, from Debian
    python -m train.default_model      # corpus, tokenizer, data, train, evaluate, samples, ship

Phases, in order (name some to run only those; each reads what the earlier ones left under --work):
- corpus: the KJV text, one chapter per document (verse numbers dropped, one verse per line);
- data: every 20th chapter held out (never seen by the tokenizer or the training); a 4096-entry byte-level
  BPE trained on the rest; the training rows as tokenised JSONL: every chapter as plain text, and chat
  conversations (a user quotes a few verses, the model answers with the next ones, loss on the answer only)
  rendered by the server's own chat format; a small held-out sample for the tests;
- train: `python -m train.run` on the `inkling-tiny` preset, the MTP head included, exported in the hub layout;
- evaluate: `python -m train.evaluate` on the exported bf16 weights in float32: held-out loss, perplexity and
  bits per byte against the unigram and bigram baselines, and against the shipped model's (REBUILD_MARGIN);
- samples: continuations and chat answers to held-out prompts, through the server;
- ship: the exported directory and `training.json` (settings, timings, metrics, samples) into
  inkling_jax/assets/inkling-tiny, the held-out sample into tests/train/data.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import time

import numpy as np

from inkling_jax.assets import DEFAULT_MODEL_DIR

log = logging.getLogger("default_model")

PHASES = ("corpus", "data", "train", "evaluate", "samples", "ship")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SAMPLE_FILE = os.path.join(REPO, "tests", "train", "data", "inkling_tiny_heldout.txt")
CORPUS = {"name": "King James Version of the Bible (1611; Debian's bible-kjv-text 4.38)",
          "license": "public domain (Debian's copyright file: the copyright of the KJV text has expired; in the "
                     "UK the Crown's letters patent still cover printing it)",
          "source": "apt-get install bible-kjv; bible gen1:1-rev22:21"}
HELD_OUT_EVERY = 20  # chapter i is held out when i % 20 == 10
VOCAB_SIZE = 4096  # the `inkling-tiny` preset's vocabulary
CHATS_PER_CHAPTER = 2
# The reference attention and ShortConv and the dense MoE, on every device: the same program on CPU and GPU, and no
# Pallas tiling constraint to meet at these widths.
REFERENCE_PATHS = ["--backend", "attention=reference,decode_attention=reference,shortconv=reference,moe=dense"]
TRAIN_ARGS = ["--preset", "inkling-tiny", "--seq-len", "512", "--batch", "32", "--lr", "2e-3",
              "--weight-decay", "0.1", "--bias-update-rate", "1e-3", "--mtp-weight", "0.5", "--save-every", "1000",
              "--eval-every", "100", "--no-tensorboard", *REFERENCE_PATHS]
SAMPLE_CHAPTERS = 6  # held-out chapters in the committed sample
REBUILD_MARGIN = 0.02  # nats per token: how far a rebuild's held-out loss may land from the shipped model's
# What the server samples with when a request does not say: a little below temperature 1 and the nucleus, so
# that a small model's rare-token tail does not derail it.
SAMPLING = {"temperature": 0.8, "top_p": 0.95}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m train.default_model", description=__doc__.split("\n\n")[0],
                                epilog="Phases: " + ", ".join(PHASES))
    p.add_argument("phases", nargs="*", metavar="PHASE", help="phases to run (default: all)")
    p.add_argument("--work", default="runs/default-model", help="working directory")
    p.add_argument("--kjv", help="the KJV text as `bible` prints it (default: run `bible`)")
    p.add_argument("--steps", type=int, default=500, help="training steps (~6 epochs: held-out loss rose past ~8)")
    p.add_argument("--train-arg", action="append", default=[], help="one more train.run argument (repeatable)")
    p.add_argument("--assets", default=DEFAULT_MODEL_DIR, help="where `ship` puts the model")
    args = p.parse_args(argv)
    unknown = sorted(set(args.phases) - set(PHASES))
    if unknown:
        p.error(f"unknown phase(s) {unknown}; the phases are {', '.join(PHASES)}")
    args.phases = args.phases or list(PHASES)
    return args


# ----------------------------------------------------------------------------------------------------------
# Corpus


def kjv_text(path: str | None) -> str:
    if path:
        with open(path, encoding="utf-8") as fh:
            return fh.read()
    if shutil.which("bible") is None:
        raise SystemExit("the `bible` reader is missing: apt-get install bible-kjv (or give --kjv FILE)")
    return subprocess.run(["bible", "-l", "100000", "gen1:1-rev22:21"], check=True, capture_output=True,
                          text=True).stdout


def chapters(text: str) -> list[dict]:
    """[{"title": "Genesis 1", "verses": [...]}] from `bible` output: a "Book N" line opens a chapter,
    "  N text" opens a verse, and any other line continues the verse (output wrapped at a line width)."""
    out: list[dict] = []
    for line in text.splitlines():
        if not line.strip():
            continue
        verse = re.match(r"\s+\d+ (.*)", line)
        if verse:
            out[-1]["verses"].append(verse.group(1).strip())
        elif line[0].isspace() or not re.search(r" \d+$", line):
            out[-1]["verses"][-1] += " " + line.strip()
        else:
            out.append({"title": line.strip(), "verses": []})
    if len(out) != 1189 or sum(len(c["verses"]) for c in out) != 31102:
        raise ValueError(f"expected the KJV's 1189 chapters and 31102 verses, read {len(out)} chapters")
    return out


def chapter_text(chapter: dict) -> str:
    return chapter["title"] + "\n" + "\n".join(chapter["verses"])


# ----------------------------------------------------------------------------------------------------------
# Data


def split(all_chapters: list[dict]) -> tuple[list[dict], list[dict]]:
    held = [c for i, c in enumerate(all_chapters) if i % HELD_OUT_EVERY == HELD_OUT_EVERY // 2]
    kept = [c for i, c in enumerate(all_chapters) if i % HELD_OUT_EVERY != HELD_OUT_EVERY // 2]
    return kept, held


def chat_rows(chat, tokenizer, chapter: dict, rng: np.random.Generator) -> list[dict]:
    """Conversations from one chapter: the user quotes 1-3 consecutive verses, the model answers with the 1-4
    that follow, as the server renders a prompt and the chat format wants an answer (its own
    `<|message_model|><|content_text|>` ... `<|end_message|>` and the end-of-sampling token)."""
    verses = chapter["verses"]
    rows = []
    for _ in range(CHATS_PER_CHAPTER if len(verses) > 1 else 0):
        quoted = int(rng.integers(1, 4))
        start = int(rng.integers(0, max(len(verses) - quoted, 1)))
        answer = verses[start + quoted:start + quoted + int(rng.integers(1, 5))] or verses[-1:]
        prompt = chat.render([{"role": "user", "content": " ".join(verses[start:start + quoted])}])
        reply = ([chat.ids["<|message_model|>"], chat.ids["<|content_text|>"]] + tokenizer.encode(" ".join(answer))
                 + [chat.ids["<|end_message|>"], chat.ids["<|content_model_end_sampling|>"]])
        rows.append({"input_ids": prompt + reply, "loss_mask": [0] * len(prompt) + [1] * len(reply)})
    return rows


def write_jsonl(path: str, rows: list[dict]) -> None:
    with open(path, "w") as fh:
        for row in rows:
            fh.write(json.dumps(row) + "\n")


def build_data(work: str) -> dict:
    from serve.http.chat import ChatFormat
    from serve.http.tokenizer import load_tokenizer
    from train.tokenizer import train_bpe

    with open(os.path.join(work, "chapters.json")) as fh:
        kept, held = split(json.load(fh))
    bpe = train_bpe((chapter_text(c) for c in kept), VOCAB_SIZE)
    bpe.save(os.path.join(work, "tokenizer.json"))
    tokenizer = load_tokenizer(work)
    chat = ChatFormat(tokenizer)
    eos = chat.ids["<|content_model_end_sampling|>"]
    plain = lambda c: {"input_ids": tokenizer.encode(chapter_text(c)) + [eos]}  # noqa: E731
    rng = np.random.default_rng(0)
    train_rows = [plain(c) for c in kept] + [row for c in kept for row in chat_rows(chat, tokenizer, c, rng)]
    write_jsonl(os.path.join(work, "train.jsonl"), train_rows)
    write_jsonl(os.path.join(work, "heldout.jsonl"), [plain(c) for c in held])
    with open(os.path.join(work, "heldout_sample.txt"), "w") as fh:
        fh.write("\n\n".join(chapter_text(c) for c in held[:SAMPLE_CHAPTERS]) + "\n")
    stats = {"chapters": {"train": len(kept), "held_out": len(held)},
             "characters": {"train": sum(len(chapter_text(c)) for c in kept),
                            "held_out": sum(len(chapter_text(c)) for c in held)},
             "tokens": {"train_plain": sum(len(r["input_ids"]) for r in train_rows[:len(kept)]),
                        "train_chat": sum(len(r["input_ids"]) for r in train_rows[len(kept):]),
                        "held_out": sum(len(tokenizer.encode(chapter_text(c))) + 1 for c in held)},
             "chat_rows": len(train_rows) - len(kept)}
    log.info("data: %s", stats)
    return stats


# ----------------------------------------------------------------------------------------------------------
# Train, evaluate


def train_run(argv: list[str]) -> None:
    """`python -m train.run ARGV`, in a process of its own (as a user would run it)."""
    command = [sys.executable, "-m", "train.run", *argv]
    log.info("running %s", " ".join(command))
    subprocess.run(command, check=True, cwd=REPO)


def metrics_rows(run_dir: str) -> list[dict]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as fh:
        return [json.loads(line) for line in fh]


def evaluate(work: str, held_out: str) -> dict:
    """`python -m train.evaluate` on the exported weights in float32: held-out loss, perplexity, bits per byte
    and the count baselines of the training rows."""
    from inkling_jax.backend import Backend
    from train.evaluate import evaluate_model

    return evaluate_model(os.path.join(work, "export"), os.path.join(work, held_out), seq_len=512, batch=16,
                          dtype="float32", backend=Backend.parse(REFERENCE_PATHS[1]),
                          baseline_data=os.path.join(work, "train.jsonl"))


def against_shipped(eval_loss: float, assets: str) -> dict | None:
    """How a rebuild's held-out loss compares with the shipped model's (None when there is none)."""
    path = os.path.join(assets, "training.json")
    if not os.path.exists(path):
        return None
    with open(path) as fh:
        shipped = json.load(fh)["evaluation"]["eval_loss"]
    difference = eval_loss - shipped
    verdict = "within" if abs(difference) <= REBUILD_MARGIN else "OUTSIDE"
    log.info("held-out loss %.4f, the shipped model's %.4f: %+.4f, %s the %.2f margin", eval_loss, shipped,
             difference, verdict, REBUILD_MARGIN)
    return {"shipped_eval_loss": shipped, "difference": difference, "margin": REBUILD_MARGIN,
            "within_margin": abs(difference) <= REBUILD_MARGIN}


def device_name() -> str:
    """What train.run ran on, asked of a process of its own: this one leaves the devices to train.run."""
    probe = ("import jax, os; d = jax.devices()[0]; print(f'{jax.device_count()} x {d.device_kind}' "
             "if d.platform != 'cpu' else f'CPU ({os.cpu_count()} cores)')")
    return subprocess.run([sys.executable, "-c", probe], check=True, capture_output=True, text=True).stdout.strip()


def write_sampling_defaults(export: str) -> None:
    from inkling_jax.config.generation import FILE, load_generation_config

    stated = dataclasses.replace(load_generation_config(export), **SAMPLING)
    with open(os.path.join(export, FILE), "w") as fh:
        json.dump(stated.to_dict(), fh, indent=1)


def parameter_count(export: str) -> int:
    from inkling_jax.checkpoint.safetensors_io import HubCheckpoint

    checkpoint = HubCheckpoint(export)
    return int(sum(np.prod(checkpoint.shape(name)) for name in checkpoint.names))


# ----------------------------------------------------------------------------------------------------------
# Samples through the server


def samples(export: str, held: list[dict]) -> list[dict]:
    """Completions of held-out chapter openings and chat answers to held-out verses, sampled by the server
    with the model's generation defaults (seeded)."""
    import urllib.request

    from serve.http.server import ServerThread, build_service, serving_app
    from serve.http.server import parse_args as serve_args

    def post(url: str, body: dict) -> dict:
        request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=300) as response:
            return json.load(response)

    service = build_service(serve_args(["--model", export, "--max-num-seqs", "4"]))
    out = []
    with ServerThread(serving_app(service)) as server:
        for i, chapter in enumerate(held[:4]):
            prompt = chapter_text({"title": chapter["title"], "verses": chapter["verses"][:1]}) + "\n"
            done = post(f"{server.url}/v1/completions", {"model": service.model_name, "prompt": prompt,
                                                         "max_tokens": 60, "seed": i})
            out.append({"kind": "completion", "prompt": prompt, "output": done["choices"][0]["text"]})
            message = chapter["verses"][1]
            done = post(f"{server.url}/v1/chat/completions", {
                "model": service.model_name, "messages": [{"role": "user", "content": message}],
                "max_tokens": 80, "seed": i})
            out.append({"kind": "chat", "prompt": message, "output": done["choices"][0]["message"]["content"],
                        "finish_reason": done["choices"][0]["finish_reason"]})
    service.engine.shutdown(drain_seconds=0.0)
    return out


# ----------------------------------------------------------------------------------------------------------


def main(argv=None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    work = os.path.abspath(args.work)
    os.makedirs(work, exist_ok=True)
    record_path = os.path.join(work, "training.json")
    record = {}
    if os.path.exists(record_path):
        with open(record_path) as fh:
            record = json.load(fh)
    record.setdefault("seconds", {})
    export, run_dir = os.path.join(work, "export"), os.path.join(work, "run")

    for phase in [p for p in PHASES if p in args.phases]:
        began = time.time()
        log.info("phase %s", phase)
        if phase == "corpus":
            with open(os.path.join(work, "chapters.json"), "w") as fh:
                json.dump(chapters(kjv_text(args.kjv)), fh)
            record["corpus"] = CORPUS
        elif phase == "data":
            record["data"] = build_data(work)
        elif phase == "train":
            for stale in (export, run_dir):
                shutil.rmtree(stale, ignore_errors=True)
            command = TRAIN_ARGS + ["--steps", str(args.steps), *args.train_arg]
            train_run(command + ["--tokenizer", os.path.join(work, "tokenizer.json"),
                                 "--data", os.path.join(work, "train.jsonl"),
                                 "--eval-data", os.path.join(work, "heldout.jsonl"),
                                 "--out", run_dir, "--export", export])
            write_sampling_defaults(export)
            rows = metrics_rows(run_dir)
            record["train"] = {"command": "python -m train.run " + " ".join(command), "device": device_name(),
                               "steps": len(rows), "tokens_seen": int(sum(r["real_tokens"] for r in rows)),
                               "loss_tokens": int(sum(r["tokens"] for r in rows)),
                               "step_seconds": float(sum(r["step_seconds"] for r in rows)),
                               "curve": [{k: r[k] for k in r if k.startswith(("eval_", "step", "loss", "mtp"))}
                                         for r in rows if "eval_loss" in r]}
        elif phase == "evaluate":
            record["evaluation"] = {"weights": "the exported bf16 weights, computed in float32",
                                    **evaluate(work, "heldout.jsonl")}
            record["evaluation_sample"] = evaluate(work, "heldout_sample.txt")
            record["against_shipped"] = against_shipped(record["evaluation"]["eval_loss"], args.assets)
        elif phase == "samples":
            with open(os.path.join(work, "chapters.json")) as fh:
                record["samples"] = samples(export, split(json.load(fh))[1])
            for s in record["samples"]:
                log.info("%s %r -> %r", s["kind"], s["prompt"], s["output"])
        elif phase == "ship":
            record["parameters"] = parameter_count(export)
            record["size_bytes"] = sum(os.path.getsize(os.path.join(export, f)) for f in os.listdir(export))
            shutil.rmtree(args.assets, ignore_errors=True)
            shutil.copytree(export, args.assets)
            shutil.copyfile(os.path.join(work, "heldout_sample.txt"), SAMPLE_FILE)
        record["seconds"][phase] = round(time.time() - began, 1)
        with open(record_path, "w") as fh:
            json.dump(record, fh, indent=1)
        if phase == "ship":
            shutil.copyfile(record_path, os.path.join(args.assets, "training.json"))


if __name__ == "__main__":
    main()
