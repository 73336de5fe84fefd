"""Tokenizers: the model directory's `tokenizer.json` (HF `tokenizers`), or a byte-level one for the embedded
random-weight default, which has no trained vocabulary.

Both encode plain text without ever turning text like "<|message_model|>" into a control token (control tokens
are only inserted by the chat renderer, by id), and both know Inkling's named special tokens.
"""

from __future__ import annotations

import functools
import json
import os

# Inkling's named special tokens (spec section 7). The byte-level tokenizer numbers them from 256 in this order,
# so the end-of-sampling token is 257, the `tiny` preset's eos_token_id.
SPECIAL_TOKENS = (
    "<|endoftext|>", "<|content_model_end_sampling|>", "<|message_user|>", "<|message_model|>",
    "<|message_system|>", "<|message_tool|>", "<|content_text|>", "<|content_thinking|>", "<|end_message|>",
    "<|content_image|>", "<|content_audio_input|>", "<|content_tool_error|>", "<|content_xml|>", "<|audio_end|>",
    "<|content_invoke_tool_json|>", "<|content_invoke_tool_text|>",
)


class TooLong(ValueError):
    """A prompt longer than the server takes (the API answers 400, context_length_exceeded)."""


class Tokenizer:
    """The interface the server uses."""

    name: str
    special_ids: frozenset[int]
    max_token_chars: int  # the most characters of text that one token covers
    # The model directory's tokenizer_config.json, where it has one: its named tokens and chat template are what
    # `/tokenizer_info` reports.
    config: dict = {}

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """`add_special_tokens`: what the tokenizer's own post-processor adds around the text (a BOS, say;
        Inkling's adds nothing)."""
        raise NotImplementedError

    def encode_at_most(self, text: str, limit: int) -> list[int]:
        """`encode`, raising TooLong for a text over `limit` tokens; one longer than `limit` tokens of the longest
        kind is refused before any encoding, so the work is bounded by the limit, not by the text."""
        ids = None if len(text) > limit * self.max_token_chars else self.encode(text)
        if ids is None or len(ids) > limit:
            raise TooLong(f"the text takes more than {limit} tokens")
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        raise NotImplementedError

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes of one token (for logprobs); specials give their name."""
        raise NotImplementedError

    def token_id(self, name: str) -> int | None:
        raise NotImplementedError

    def token_text(self, token_id: int) -> str:
        """One token as OpenAI shows it in logprobs: its text, or `bytes:\\xNN` when it is not valid UTF-8."""
        raw = self.token_bytes(token_id)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


class ByteTokenizer(Tokenizer):
    """Ids 0..255 are bytes; Inkling's special tokens follow from 256; the other ids are reserved: they decode to
    nothing and show as `<|reserved_N|>` in logprobs."""

    name = "byte-level (no trained vocabulary)"
    max_token_chars = 1

    def __init__(self):
        self.specials = {name: 256 + i for i, name in enumerate(SPECIAL_TOKENS)}
        self.names = {i: name for name, i in self.specials.items()}
        self.special_ids = frozenset(self.names)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return list(text.encode("utf-8"))  # no post-processor

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        out, run = [], bytearray()
        for i in ids:
            if i < 256:
                run.append(i)
            elif i in self.names and not skip_special_tokens:
                out.append(run.decode("utf-8", errors="replace"))
                out.append(self.names[i])
                run = bytearray()
        out.append(run.decode("utf-8", errors="replace"))
        return "".join(out)

    def token_bytes(self, token_id: int) -> bytes:
        if token_id < 256:
            return bytes([token_id])
        return self.names.get(token_id, f"<|reserved_{token_id}|>").encode()

    def token_id(self, name: str) -> int | None:
        return self.specials.get(name)


class HFTokenizer(Tokenizer):
    def __init__(self, path: str, config: dict | None = None):
        from tokenizers import Tokenizer as Backend

        self.name = path
        self.config = config or {}
        self.backend = Backend.from_file(path)
        self.backend.encode_special_tokens = True  # user text never becomes control tokens
        added = self.backend.get_added_tokens_decoder()
        self.special_ids = frozenset(i for i, tok in added.items() if tok.special)
        self.byte_decoder = {c: b for b, c in _bytes_to_unicode().items()}
        # A piece's characters bound the text characters it stands for (byte-level pieces have one per byte).
        self.max_token_chars = max(map(len, self.backend.get_vocab(with_added_tokens=True)))

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_bytes(self, token_id: int) -> bytes:
        piece = self.backend.id_to_token(token_id) or ""
        if token_id not in self.special_ids and piece and all(c in self.byte_decoder for c in piece):
            return bytes(self.byte_decoder[c] for c in piece)  # byte-level BPE: undo the printable mapping
        return self.decode([token_id], skip_special_tokens=False).encode("utf-8")

    def token_id(self, name: str) -> int | None:
        return self.backend.token_to_id(name)


@functools.cache
def _bytes_to_unicode() -> dict[int, str]:
    """Byte-level BPE's reversible map from bytes to printable characters."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    chars = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


def load_tokenizer(model_dir: str | None) -> Tokenizer:
    """`tokenizer.json` (and tokenizer_config.json, if there) of a model directory, or the byte-level tokenizer when
    there is no model directory."""
    if model_dir is None:
        return ByteTokenizer()
    path = os.path.join(model_dir, "tokenizer.json")
    if not os.path.exists(path):
        raise FileNotFoundError(f"{model_dir} has no tokenizer.json (the server reads HF `tokenizers` files)")
    config_path = os.path.join(model_dir, "tokenizer_config.json")
    config = None
    if os.path.exists(config_path):
        with open(config_path, encoding="utf-8") as fh:
            config = json.load(fh)
    return HFTokenizer(path, config)
