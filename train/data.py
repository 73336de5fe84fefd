"""Training data: documents read from tokenised JSONL or plain text, packed into fixed-length rows, served as
batches that are a pure function of (seed, step), so a resumed run sees exactly the batches it would have seen.

- JSONL: one document per line, `{"input_ids": [...]}` (or `"tokens"`), optionally `"loss_mask": [...]` of the
  same length (0 on tokens that are not to be predicted, e.g. a prompt). Tokens are used as given. A line
  `{"text": "..."}` is tokenised as a plain-text document is.
- Plain text: documents are separated by blank lines; each is tokenised (UTF-8 bytes for presets, or the
  model's tokenizer) and ends with the EOS token.

Packing fills rows of `seq_len` tokens in document order; a document that does not fit continues in the next
row as a new segment. Each row carries `segment_ids` (1, 2, ... per document piece; 0 = padding), `positions`
restarting at 0 in every segment, and `loss_mask`.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
from typing import Callable, Iterable

import numpy as np


def byte_tokenizer(text: str) -> list[int]:
    """The presets' tokenizer: UTF-8 bytes (ids 0-255)."""
    return list(text.encode("utf-8"))


def file_tokenizer(path: str) -> Callable[[str], list[int]]:
    """A tokenizer.json file (needs the `tokenizers` package), read when first used: tokenised JSONL needs none."""
    @functools.cache
    def backend():
        if not os.path.exists(path):
            raise FileNotFoundError(f"{path}: no tokenizer; give the data as tokenised JSONL instead")
        from tokenizers import Tokenizer

        return Tokenizer.from_file(path)

    return lambda text: backend().encode(text, add_special_tokens=False).ids


def text_document(text: str, tokenize: Callable[[str], list[int]], eos_id: int):
    """(tokens, loss_mask) of a text: its tokens and the EOS token, every one counted."""
    ids = np.asarray(tokenize(text) + [eos_id], np.int32)
    return ids, np.ones(len(ids), np.uint8)


def read_documents(path: str, tokenize: Callable[[str], list[int]], eos_id: int, vocab_size: int):
    """[(tokens int32 [n], loss_mask uint8 [n])] from a .jsonl file or a text file."""
    docs = []
    if path.endswith((".jsonl", ".json")):
        with open(path) as fh:
            for line_no, line in enumerate(fh, 1):
                if not line.strip():
                    continue
                row = json.loads(line)
                if isinstance(row.get("text"), str):
                    docs.append(text_document(row["text"], tokenize, eos_id))
                    continue
                ids = row.get("input_ids", row.get("tokens"))
                if ids is None:
                    raise ValueError(f"{path}:{line_no}: no 'input_ids' (or 'tokens') nor 'text' field")
                mask = row.get("loss_mask", [1] * len(ids))
                if len(mask) != len(ids):
                    raise ValueError(f"{path}:{line_no}: loss_mask has {len(mask)} entries for {len(ids)} tokens")
                docs.append((np.asarray(ids, np.int32), np.asarray(mask, np.uint8)))
    else:
        with open(path, encoding="utf-8") as fh:
            text = fh.read()
        docs += [text_document(part, tokenize, eos_id) for part in (p.strip() for p in text.split("\n\n")) if part]
    if not docs:
        raise ValueError(f"{path}: no documents")
    top = max(int(d[0].max()) for d in docs)
    if top >= vocab_size or min(int(d[0].min()) for d in docs) < 0:
        raise ValueError(f"{path}: token ids must lie in [0, {vocab_size}); found up to {top}")
    return docs


@dataclasses.dataclass
class Packed:
    """Rows [R, T] of packed documents."""

    input_ids: np.ndarray
    segment_ids: np.ndarray
    positions: np.ndarray
    loss_mask: np.ndarray

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def rows(self, index) -> dict[str, np.ndarray]:
        return {f.name: getattr(self, f.name)[index] for f in dataclasses.fields(self)}


def pack(documents: Iterable[tuple[np.ndarray, np.ndarray]], seq_len: int) -> Packed:
    ids, segs, pos, mask = [], [], [], []
    row_ids, row_segs, row_pos, row_mask = [], [], [], []

    def close_row():
        pad = seq_len - len(row_ids)
        ids.append(row_ids + [0] * pad)
        segs.append(row_segs + [0] * pad)
        pos.append(row_pos + [0] * pad)
        mask.append(row_mask + [0] * pad)

    for tokens, loss_mask in documents:
        start = 0
        while start < len(tokens):
            take = min(seq_len - len(row_ids), len(tokens) - start)
            segment = (row_segs[-1] + 1) if row_segs else 1
            row_ids += tokens[start:start + take].tolist()
            row_mask += loss_mask[start:start + take].tolist()
            row_segs += [segment] * take
            row_pos += list(range(take))
            start += take
            if len(row_ids) == seq_len:
                close_row()
                row_ids, row_segs, row_pos, row_mask = [], [], [], []
    if row_ids:
        close_row()
    return Packed(np.asarray(ids, np.int32), np.asarray(segs, np.int32), np.asarray(pos, np.int32),
                  np.asarray(mask, np.int32))


class Batches:
    """Batch `step` of an endless, per-epoch shuffled stream of rows: `[accum, micro_batch, T]` arrays.

    Row k of the stream is row perm_e[k % R] of epoch e = k // R, perm_e drawn from (seed, e); batch i takes
    stream rows [i * G, (i + 1) * G) with G = accum * micro_batch. Nothing but `step` is needed to resume.
    """

    def __init__(self, packed: Packed, micro_batch: int, accum: int = 1, seed: int = 0, shuffle: bool = True):
        self.packed, self.micro_batch, self.accum, self.seed, self.shuffle = packed, micro_batch, accum, seed, shuffle
        self._perms: dict[int, np.ndarray] = {}

    def _perm(self, epoch: int) -> np.ndarray:
        if epoch not in self._perms:
            n = len(self.packed)
            rng = np.random.default_rng([self.seed, epoch])
            self._perms = {epoch: rng.permutation(n) if self.shuffle else np.arange(n)}
        return self._perms[epoch]

    def batch(self, step: int) -> dict[str, np.ndarray]:
        n, size = len(self.packed), self.accum * self.micro_batch
        stream = np.arange(step * size, (step + 1) * size)
        index = np.asarray([self._perm(int(k // n))[k % n] for k in stream])
        rows = self.packed.rows(index)
        return {k: v.reshape(self.accum, self.micro_batch, -1) for k, v in rows.items()}
