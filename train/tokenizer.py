"""`tokenizer.json` files (HF `tokenizers`) for models trained here: a byte-level BPE trained on a corpus, and
the byte tokenizer of the presets written as such a file, so that an exported model serves as it is.

Both put Inkling's named special tokens (the chat format's, `serve.http.tokenizer.SPECIAL_TOKENS`) at fixed ids:
first (0..15) in a trained BPE, after the 256 bytes in the presets' byte tokenizer.
"""

from __future__ import annotations

from typing import Iterable

from serve.http.tokenizer import SPECIAL_TOKENS, _bytes_to_unicode


def train_bpe(texts: Iterable[str], vocab_size: int, *, progress: bool = True):
    """A byte-level BPE of exactly `vocab_size` entries (special tokens included) trained on `texts`; raises
    when the corpus is too small to learn that many merges."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=progress)
    tokenizer.train_from_iterator(texts, trainer=trainer)
    if tokenizer.get_vocab_size() != vocab_size:
        raise ValueError(f"the corpus gave a BPE of {tokenizer.get_vocab_size()} entries, not {vocab_size}")
    return tokenizer


def byte_tokenizer():
    """The presets' tokenizer (`serve.http.tokenizer.ByteTokenizer`, `train.data.byte_tokenizer`) as a `tokenizers`
    object: ids 0..255 are the bytes, the special tokens follow from 256."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {char: byte for byte, char in _bytes_to_unicode().items()}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(list(SPECIAL_TOKENS))
    return tokenizer
