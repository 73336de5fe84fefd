"""Built-in verifiable tasks and rewards, so that an RL run needs no dataset and no network.

Rewards (`--reward train.rl.tasks:NAME`), each `f(prompt, completion, **fields) -> float`:
- `exact_match`: 1.0 when the completion, stripped of surrounding whitespace, equals the line's `answer`;
- `final_number`: 1.0 when the last number in the completion equals the line's `answer` (a number);
- `answer_prefix`: the share of the line's `answer` that the completion reproduces from its first character
  (1.0 for an exact answer, partial credit on the way);
- `charset_share`: the share of the completion's characters that are in the line's `charset` (0 when empty): a
  dense signal that a randomly initialised model climbs in a few dozen steps (the `digits` task).

Tasks (`python -m train.rl.tasks --task NAME --count N --out FILE`), one JSONL line per prompt with its `answer`:
- `copy`: "copy: abc=" -> "abc"; `reverse`: "reverse: abc=" -> "cba" (lowercase letters);
- `add`: "12+7=" -> "19" (small operands);
- `digits`: "digits: 4=" with `charset` "0123456789": write digits (for `charset_share`).
"""

from __future__ import annotations

import argparse
import json
import re
import string

import numpy as np

TASKS = ("copy", "reverse", "add", "digits")
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def exact_match(prompt: str, completion: str, answer: str, **fields) -> float:
    return float(completion.strip() == str(answer).strip())


def final_number(prompt: str, completion: str, answer, **fields) -> float:
    numbers = _NUMBER.findall(completion)
    return float(bool(numbers) and float(numbers[-1]) == float(answer))


def answer_prefix(prompt: str, completion: str, answer: str, **fields) -> float:
    answer = str(answer)
    matched = 0
    for got, want in zip(completion, answer):
        if got != want:
            break
        matched += 1
    return matched / max(len(answer), 1)


def charset_share(prompt: str, completion: str, charset: str, **fields) -> float:
    return sum(c in charset for c in completion) / len(completion) if completion else 0.0


def make_task(task: str, rng: np.random.Generator, max_len: int = 4) -> dict:
    """One prompt line of `task` with its answer."""
    if task in ("copy", "reverse"):
        word = "".join(rng.choice(list(string.ascii_lowercase), size=int(rng.integers(1, max_len + 1))))
        return {"prompt": f"{task}: {word}=", "answer": word if task == "copy" else word[::-1]}
    if task == "add":
        a, b = (int(x) for x in rng.integers(0, 10 ** min(max_len, 3) // 2, size=2))
        return {"prompt": f"{a}+{b}=", "answer": str(a + b)}
    if task == "digits":
        return {"prompt": f"digits: {int(rng.integers(0, 10))}=", "charset": string.digits}
    raise ValueError(f"unknown task {task!r}; choose from {TASKS}")


def write_tasks(path: str, task: str, count: int, seed: int = 0, max_len: int = 4) -> None:
    rng = np.random.default_rng(seed)
    with open(path, "w") as fh:
        for _ in range(count):
            fh.write(json.dumps(make_task(task, rng, max_len)) + "\n")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m train.rl.tasks",
                                description="Write a JSONL file of verifiable prompts (each with its `answer`).")
    p.add_argument("--task", required=True, choices=TASKS)
    p.add_argument("--count", type=int, default=256, help="prompts to write")
    p.add_argument("--max-len", type=int, default=4, help="longest word (copy, reverse) or digits (add, up to 3)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True, help="the JSONL file to write")
    args = p.parse_args(argv)
    if args.count < 1 or args.max_len < 1:
        p.error("--count and --max-len must be >= 1")
    write_tasks(args.out, args.task, args.count, args.seed, args.max_len)


if __name__ == "__main__":
    main()
