"""Inkling's chat format (spec section 7): messages -> prompt token ids, and the model's output -> reasoning and
answer text.

Each message is `ROLE [author name] CONTENT_KIND payload <|end_message|>`; a past assistant turn ends with
`<|content_model_end_sampling|>`. A reasoning-effort block `Thinking effort level: X` follows the leading system
messages. The prompt ends after the last `<|end_message|>`: the model writes its own `<|message_model|>`, then
a `<|content_thinking|>` block and a `<|content_text|>` block, and stops with `<|content_model_end_sampling|>`.
Control tokens are inserted by id, so message text can never forge one.
"""

from __future__ import annotations

from serve.engine.outputs import Sample
from serve.http.text_stream import Delta, TextStream, as_deltas
from serve.http.tokenizer import Tokenizer, TooLong

EFFORT_LEVELS = {"none": 0.0, "minimal": 0.1, "low": 0.2, "medium": 0.7, "high": 0.9, "xhigh": 0.99, "max": 0.99}
DEFAULT_EFFORT = 0.9
ROLE_TOKENS = {"system": "<|message_system|>", "developer": "<|message_system|>", "user": "<|message_user|>",
               "assistant": "<|message_model|>", "tool": "<|message_tool|>"}


class ChatError(ValueError):
    """A conversation that cannot be rendered (the API answers 400)."""


def effort_value(effort: str | float | None) -> float:
    if effort is None:
        return DEFAULT_EFFORT
    if isinstance(effort, str):
        if effort not in EFFORT_LEVELS:
            raise ChatError(f"reasoning_effort must be one of {sorted(EFFORT_LEVELS)} or a number in [0, 0.99]")
        return EFFORT_LEVELS[effort]
    if not 0.0 <= effort <= 0.99:
        raise ChatError("a numeric reasoning_effort must be in [0, 0.99]")
    return float(effort)


def format_effort(value: float) -> str:
    """At most two decimals, no trailing zeros, "0" for zero."""
    return f"{value:.2f}".rstrip("0").rstrip(".")


MEDIA_FRAMING = {"image": ("<|content_image|>", ()), "audio": ("<|content_audio_input|>", ("<|audio_end|>",))}


class ChatFormat:
    def __init__(self, tokenizer: Tokenizer, media=None):
        """media: a `serve.http.media.MediaEncoder` for a checkpoint with media towers (None: text only)."""
        self.tokenizer = tokenizer
        self.media = media
        names = set(ROLE_TOKENS.values()) | {"<|content_text|>", "<|content_thinking|>", "<|end_message|>",
                                              "<|content_model_end_sampling|>"}
        self.ids = {name: tokenizer.token_id(name) for name in names}
        missing = [name for name, i in self.ids.items() if i is None]
        if missing:
            raise ChatError(f"the tokenizer lacks Inkling's chat tokens {missing}")
        self.reasoning_start = self.ids["<|content_thinking|>"]

    def render(self, messages: list[dict], reasoning_effort: str | float | None = None) -> list[int]:
        """Prompt ids of a text conversation: dicts with `role`, `content` (text or text parts) and `name`."""
        ids, media = self.render_with_media(messages, reasoning_effort)
        if media:
            raise ChatError("this conversation holds media: use render_with_media")
        return ids

    def render_with_media(self, messages: list[dict], reasoning_effort: str | float | None = None,
                          max_tokens: int | None = None):
        """(prompt ids, [(start position, MediaItem)]): image and audio parts become blocks of placeholder
        tokens (spec 6.1, 6.2) whose rows the media embeddings replace. A prompt that would pass `max_tokens`
        raises TooLong as soon as it does: each text before it is encoded, each media item from its header."""
        if not messages:
            raise ChatError("messages must not be empty")
        leading = 0
        while leading < len(messages) and messages[leading].get("role") in ("system", "developer"):
            leading += 1
        if leading == len(messages):
            raise ChatError("messages need at least one non-system message")
        effort = f"Thinking effort level: {format_effort(effort_value(reasoning_effort))}"
        prompt = _Prompt(max_tokens)
        for i, message in enumerate(messages):
            if i == leading:
                self._block(prompt, "system", None, effort)
            self._message(message, prompt)
        return prompt.ids, prompt.media

    def _message(self, message: dict, prompt: "_Prompt") -> None:
        role, name = message.get("role"), message.get("name")
        if role not in ROLE_TOKENS:
            raise ChatError(f"unknown role {role!r}; use one of {sorted(ROLE_TOKENS)}")
        for kind, value in _blocks(message.get("content")):
            if kind == "text":
                self._block(prompt, role, name, value)
                continue
            if self.media is None:
                raise ChatError("this model takes text only: image and audio content parts need a checkpoint "
                                "with media towers")
            item = self.media.item(value)
            opener, closers = MEDIA_FRAMING[item.kind]
            self._head(prompt, role, name)
            prompt.add([self._special(opener)])
            prompt.room(item.count)
            prompt.media.append((len(prompt.ids), item))
            prompt.add([self.media.token_ids[item.kind]] * item.count)
            prompt.add([self._special(closer) for closer in closers] + [self.ids["<|end_message|>"]])
        if role == "assistant":
            prompt.add([self.ids["<|content_model_end_sampling|>"]])

    def _head(self, prompt: "_Prompt", role: str, name: str | None) -> None:
        prompt.add([self.ids[ROLE_TOKENS[role]]])
        if name:
            prompt.add(self.tokenizer.encode_at_most(name, prompt.room()))

    def _block(self, prompt: "_Prompt", role: str, name: str | None, text: str) -> None:
        self._head(prompt, role, name)
        prompt.add([self.ids["<|content_text|>"]])
        prompt.add(self.tokenizer.encode_at_most(text, prompt.room()))
        prompt.add([self.ids["<|end_message|>"]])

    def _special(self, name: str) -> int:
        token = self.tokenizer.token_id(name)
        if token is None:
            raise ChatError(f"the tokenizer lacks {name}, which media content needs")
        return token


class _Prompt:
    """Prompt ids and media being rendered, never past a limit of tokens."""

    def __init__(self, limit: int | None):
        self.ids: list[int] = []
        self.media: list = []
        self.limit = limit

    def room(self, needed: int = 0) -> int:
        """Tokens still free (a large number without a limit); raises TooLong when fewer than `needed`."""
        free = (1 << 62) if self.limit is None else self.limit - len(self.ids)
        if free < needed:
            raise TooLong(f"the prompt takes more than {self.limit} tokens")
        return free

    def add(self, ids: list[int]) -> None:
        self.room(len(ids))
        self.ids += ids


def _blocks(content) -> list[tuple[str, object]]:
    """A message's content as blocks: ("text", str) for each run of text parts, ("media", part) otherwise."""
    if content is None or isinstance(content, str):
        return [("text", content or "")]
    blocks: list[tuple[str, object]] = []
    for part in content:
        if part.get("type") != "text":
            blocks.append(("media", part))
        elif blocks and blocks[-1][0] == "text":
            blocks[-1] = ("text", blocks[-1][1] + (part.get("text") or ""))
        else:
            blocks.append(("text", part.get("text") or ""))
    return blocks or [("text", "")]


class ChatOutput:
    """Splits generated tokens into reasoning (after `<|content_thinking|>`) and content (everything else).
    Stop strings apply to the content; control tokens carry no text."""

    def __init__(self, chat: ChatFormat, stop: tuple[str, ...] = (), skip_special_tokens: bool = True):
        # A thinking block switches to reasoning; a new message or a text block switches back.
        self.switches = {chat.ids[name]: "content" for name in set(ROLE_TOKENS.values()) | {"<|content_text|>"}}
        self.switches[chat.reasoning_start] = "reasoning"
        self.streams = {"content": TextStream(chat.tokenizer, stop, skip_special_tokens),
                        "reasoning": TextStream(chat.tokenizer, (), skip_special_tokens)}
        self.channel = "content"

    @property
    def stopped(self) -> bool:
        return self.streams["content"].stopped

    def feed(self, token_id: int, sample: Sample | None = None) -> list[Delta]:
        self.channel = self.switches.get(token_id, self.channel)
        return as_deltas(self.channel, *self.streams[self.channel].feed(token_id, sample))

    def finish(self, stop: Sample | None = None) -> list[Delta]:
        """A chat's logprobs list its content's tokens alone: not `stop`."""
        return [d for channel, stream in self.streams.items() for d in as_deltas(channel, *stream.finish())]
