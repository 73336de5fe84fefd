"""Text streaming: stop strings split across tokens, held text, UTF-8 completion, special tokens."""

from serve.engine.outputs import Sample
from serve.http.text_stream import TextOutput, TextStream
from serve.http.tokenizer import ByteTokenizer


def feed_all(stream, ids):
    text, entries = "", []
    for i in ids:
        t, e = stream.feed(i, Sample(i, -1.0, ()))
        text, entries = text + t, entries + e
    return text, entries


def test_stop_string_split_across_tokens_is_held_back_then_cut():
    tok = ByteTokenizer()
    stream = TextStream(tok, stop=("STOP",))
    pieces = [stream.feed(i)[0] for i in tok.encode("abST")]
    assert "".join(pieces) == "ab"  # "ST" could begin the stop string: held
    assert stream.feed(tok.encode("X")[0])[0] == "STX"  # resolved: not a stop, released
    text, entries = feed_all(stream, tok.encode("yySTOPzz"))
    assert text == "yy" and stream.stopped
    assert [e.token_id for e in entries] == tok.encode("yy")  # tokens of the stop string are not reported
    assert stream.feed(65) == ("", [])


def test_held_text_is_flushed_at_the_end_and_utf8_waits_for_its_last_byte():
    tok = ByteTokenizer()
    stream = TextStream(tok, stop=("\u00e9t\u00e9!",))
    snowman = "\u2603".encode()
    assert feed_all(stream, snowman[:2])[0] == ""  # an incomplete character is not emitted
    assert feed_all(stream, snowman[2:] + "\u00e9t".encode())[0] == "\u2603"
    assert stream.finish()[0] == "\u00e9t"


def test_special_tokens_are_skipped_unless_asked_for():
    tok = ByteTokenizer()
    eos = tok.token_id("<|content_model_end_sampling|>")
    assert feed_all(TextOutput(tok).stream, [72, eos, 105])[0] == "Hi"
    assert feed_all(TextOutput(tok, skip_special_tokens=False).stream, [72, eos])[0] == \
        "H<|content_model_end_sampling|>"
