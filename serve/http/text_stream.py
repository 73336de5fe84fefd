"""Token ids -> released text: incremental detokenization, stop strings held back until resolved, and the
`Sample`s (for logprobs) of the tokens whose text has been released.

Text is decoded from a short window of recent tokens, so a character split across tokens (UTF-8 bytes, BPE
merges) is emitted only once it is complete. A stop string can also be split across tokens: the longest tail
of the text that could still begin a stop string is held back until the next tokens decide it. When a stop
string appears, the text before it is final and the sequence stops; tokens that only produced stop-string
text are dropped from the logprobs.
"""

from __future__ import annotations

import dataclasses

from serve.engine.outputs import Sample
from serve.http.tokenizer import Tokenizer


class TextStream:
    def __init__(self, tokenizer: Tokenizer, stop: tuple[str, ...] = (), skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.stop = stop
        self.skip_special = skip_special_tokens
        self.ids: list[int] = []
        self.prefix_offset = 0  # decoding restarts here (the context for the next token's text)
        self.read_offset = 0  # tokens before this are decoded into `text`
        self.text = ""  # decoded so far
        self.released = 0  # characters of `text` handed out
        self.pending: list[tuple[int, Sample | None]] = []  # (text end offset, sample) not yet released
        self.pending_start = 0  # text offset where the first pending token's text begins
        self.stopped = False

    def feed(self, token_id: int, sample: Sample | None = None) -> tuple[str, list[Sample]]:
        """Add one token (`sample`: its Sample, to be released with its text); returns (newly released text, newly
        released samples)."""
        if self.stopped:
            return "", []
        self.ids.append(token_id)
        before = self._decode(self.ids[self.prefix_offset:self.read_offset])
        after = self._decode(self.ids[self.prefix_offset:])
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self.text += after[len(before):]
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        self.pending.append((len(self.text), sample))
        cut = self._find_stop()
        if cut is not None:
            self.stopped = True
            self.text = self.text[:cut]
            return self._release(cut, cut_tokens=True)
        return self._release(len(self.text) - self._held_back())

    def finish(self, stop: Sample | None = None) -> tuple[str, list[Sample]]:
        """Release everything still held (the sequence ended for another reason than a stop string), and `stop`,
        the sample of the stop token that ended it (no text), if given."""
        if self.stopped:
            return "", []
        rest = self._decode(self.ids[self.prefix_offset:])[len(self._decode(self.ids[self.prefix_offset:
                                                                                    self.read_offset])):]
        self.text += rest
        self.read_offset = len(self.ids)
        self.pending = [(len(self.text), s) for _, s in self.pending] + [(len(self.text), stop)]
        return self._release(len(self.text))

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special)

    def _find_stop(self) -> int | None:
        """Start of the earliest stop string in the unreleased text (it may begin in held-back text)."""
        if not self.stop:
            return None
        # Released text never ends inside a possible stop string (see _held_back), so searching from there suffices.
        found = [i for i in (self.text.find(s, self.released) for s in self.stop) if i >= 0]
        return min(found) if found else None

    def _held_back(self) -> int:
        """Length of the longest tail of the text that is a proper prefix of a stop string."""
        longest = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(self.text) - self.released), longest, -1):
                if self.text.endswith(s[:n]):
                    longest = n
                    break
        return longest

    def _release(self, upto: int, cut_tokens: bool = False) -> tuple[str, list[Sample]]:
        """Hand out text up to `upto` and the samples of tokens whose text ends there; on a stop, also the
        tokens that began before the cut."""
        upto = max(upto, self.released)
        text, self.released = self.text[self.released:upto], upto
        samples, still = [], []
        start = self.pending_start
        for end, sample in self.pending:
            if end <= upto or (cut_tokens and start < upto):
                if sample is not None:
                    samples.append(sample)
                self.pending_start = end
            elif not cut_tokens:
                still.append((end, sample))
            start = end
        self.pending = still
        return text, samples


def prompt_text(tokenizer: Tokenizer, ids: list[int]) -> tuple[str, list[int]]:
    """A prompt's text (as its completion echoes it) and where each token's text begins in it; tokens that
    complete a character begun before them begin where it does."""
    stream, offsets = TextStream(tokenizer), []
    for token_id in ids:
        offsets.append(len(stream.text))
        stream.feed(token_id)
    stream.finish()
    return stream.text, offsets


@dataclasses.dataclass
class Delta:
    channel: str  # "text" (completions), "content" or "reasoning" (chat)
    text: str
    samples: list[Sample]  # of the tokens whose text this is (where the request wants logprobs)


class TextOutput:
    """The output of a completion: one text stream. (`serve.http.chat.ChatOutput` splits reasoning from content.)"""

    def __init__(self, tokenizer: Tokenizer, stop: tuple[str, ...] = (), skip_special_tokens: bool = True):
        self.stream = TextStream(tokenizer, stop, skip_special_tokens)

    @property
    def stopped(self) -> bool:
        return self.stream.stopped

    def feed(self, token_id: int, sample: Sample | None = None) -> list[Delta]:
        return as_deltas("text", *self.stream.feed(token_id, sample))

    def finish(self, stop: Sample | None = None) -> list[Delta]:
        """A completion's logprobs list the stop token too, as OpenAI's do."""
        return as_deltas("text", *self.stream.finish(stop))


def as_deltas(channel: str, text: str, samples: list[Sample]) -> list[Delta]:
    return [Delta(channel, text, samples)] if text or samples else []
