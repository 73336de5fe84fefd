"""The prompts file and the reward function of an RL run.

`--prompts FILE`: JSONL, one prompt per line, `{"prompt": "text"}` (encoded as it is, no chat format) or
`{"messages": [{"role": ..., "content": ...}, ...]}` (rendered by the server's chat format, which ends with the
assistant's turn opened). Every other field of a line is passed to the reward as a keyword argument. Image parts
(`{"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}}`, as the chat API takes them) become
the image's placeholder tokens, for a model with a vision tower; their pixels are decoded when a step draws the
prompt (`train.rl.media`). Audio parts are not taken.

`--reward MODULE:FUNCTION`: `f(prompt: str, completion: str, **fields) -> float`, imported from the Python path;
`prompt` is the line's text (for messages, the last message's text), `completion` the decoded completion (special
tokens left out); for messages, its answer alone: the content that the chat API returns, without the reasoning.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
from typing import Callable

from serve.http.chat import ChatError, ChatFormat, ChatOutput
from serve.http.media import MediaEncoder
from serve.http.tokenizer import Tokenizer

Reward = Callable[..., float]


@dataclasses.dataclass(frozen=True)
class Prompt:
    ids: tuple[int, ...]  # what the engine is given
    text: str  # what the reward is given
    fields: dict  # the line's other fields, the reward's keyword arguments
    chat: bool  # given as messages (rendered by the chat format)
    images: tuple = ()  # (start position, `serve.http.media.MediaItem`) of each image, in order

    @property
    def image_tokens(self) -> int:
        return sum(item.count for _, item in self.images)


def _message_text(message: dict) -> str:
    content = message.get("content")
    if isinstance(content, str):
        return content
    return "".join(part.get("text", "") for part in content or () if isinstance(part, dict))


def read_prompts(path: str, tokenizer: Tokenizer, vocab_size: int,
                 media: MediaEncoder | None = None) -> list[Prompt]:
    """Every prompt of a JSONL file, tokenised; clear errors name the line. `media`: reads image parts (a model
    with a vision tower; None: text only)."""
    chat = None
    prompts = []
    with open(path, encoding="utf-8") as fh:
        for line_no, line in enumerate(fh, 1):
            if not line.strip():
                continue
            where = f"{path}:{line_no}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{where}: not JSON ({exc})") from None
            if not isinstance(row, dict) or ("prompt" in row) == ("messages" in row):
                raise ValueError(f"{where}: a line needs exactly one of 'prompt' (a string) or 'messages' (a list)")
            fields = {k: v for k, v in row.items() if k not in ("prompt", "messages")}
            if "prompt" in row:
                if not isinstance(row["prompt"], str) or not row["prompt"]:
                    raise ValueError(f"{where}: 'prompt' must be a non-empty string")
                ids, text, images = tokenizer.encode(row["prompt"]), row["prompt"], []
            else:
                messages = row["messages"]
                if not isinstance(messages, list) or not messages:
                    raise ValueError(f"{where}: 'messages' must be a non-empty list")
                chat = chat or ChatFormat(tokenizer, media)
                try:
                    ids, images = chat.render_with_media(messages)
                except ChatError as exc:
                    raise ValueError(f"{where}: {exc}") from None
                if any(item.kind != "image" for _, item in images):
                    raise ValueError(f"{where}: an audio part; RL takes text and image parts only")
                text = _message_text(messages[-1])
            if not ids or max(ids) >= vocab_size:
                raise ValueError(f"{where}: the prompt encodes to no tokens or to ids outside the model's "
                                 f"vocabulary of {vocab_size}")
            prompts.append(Prompt(tuple(ids), text, fields, "messages" in row, tuple(images)))
    if not prompts:
        raise ValueError(f"{path}: no prompts")
    return prompts


def load_reward(spec: str) -> Reward:
    """The function `MODULE:FUNCTION` names."""
    module_name, sep, function_name = spec.partition(":")
    if not sep or not module_name or not function_name:
        raise ValueError(f"--reward {spec!r}: expected MODULE:FUNCTION, e.g. train.rl.tasks:exact_match")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"--reward {spec!r}: cannot import {module_name} ({exc})") from None
    function = getattr(module, function_name, None)
    if not callable(function):
        raise ValueError(f"--reward {spec!r}: {module_name} has no function {function_name}")
    return function


def completion_text(prompt: Prompt, token_ids: list[int], tokenizer: Tokenizer, chat: ChatFormat | None) -> str:
    """What the reward reads of a completion (module doc); `chat`: the chat format, for prompts given as messages."""
    if not prompt.chat:
        return tokenizer.decode(token_ids)
    output = ChatOutput(chat)
    deltas = [delta for token in token_ids for delta in output.feed(token)] + output.finish()
    return "".join(delta.text for delta in deltas if delta.channel == "content")


def score(reward: Reward, prompt: Prompt, completion: str) -> float:
    value = reward(prompt.text, completion, **prompt.fields)
    try:
        value = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"the reward returned {value!r}, not a number") from None
    if value != value or value in (float("inf"), float("-inf")):
        raise ValueError(f"the reward returned {value}, not a finite number")
    return value
