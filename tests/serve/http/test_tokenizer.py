"""The server's `tokenizer.json` path (serve.http.tokenizer.HFTokenizer) on a byte-level BPE like the released one,
trained here offline on a few lines: token bytes rebuild the UTF-8 text (characters split across tokens included),
streamed text equals the decoded text, and user text never turns into control tokens."""

import pytest

from serve.http.text_stream import TextStream
from serve.http.tokenizer import load_tokenizer

SPECIAL = "<|message_user|>"
TEXT = "héllo wörld ✓ 日本語 and naïve café, déjà vu: 🙂!"
UNSEEN = "Ωμέγα 😀 ∑ ∂"  # not in the training lines: byte-level pieces, characters split across tokens


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=[SPECIAL],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    backend.train_from_iterator(["hello world", "café au lait", "naïve", "日本語のテキスト", TEXT] * 20,
                                trainer=trainer)
    directory = tmp_path_factory.mktemp("tokenizer")
    backend.save(str(directory / "tokenizer.json"))
    return load_tokenizer(str(directory))


@pytest.mark.parametrize("text", [TEXT, UNSEEN])
def test_token_bytes_rebuild_the_utf8_text(tokenizer, text):
    ids = tokenizer.encode(text)
    assert tokenizer.decode(ids) == text
    pieces = [tokenizer.token_bytes(i) for i in ids]
    assert b"".join(pieces).decode("utf-8") == text
    if text == UNSEEN:
        assert any(not _is_utf8(p) for p in pieces)  # the case that needs the byte map


@pytest.mark.parametrize("text", [TEXT, UNSEEN])
def test_streamed_text_equals_the_decoded_text(tokenizer, text):
    stream = TextStream(tokenizer)
    parts = [stream.feed(i)[0] for i in tokenizer.encode(text)]
    parts.append(stream.finish()[0])
    assert "".join(parts) == text
    assert all("\ufffd" not in p for p in parts)  # no half character is ever released


def test_user_text_never_becomes_a_control_token(tokenizer):
    special = tokenizer.token_id(SPECIAL)
    assert special is not None
    assert special not in tokenizer.encode(f"say {SPECIAL} now")
    assert tokenizer.token_bytes(special) == SPECIAL.encode()


def _is_utf8(piece: bytes) -> bool:
    try:
        piece.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True
