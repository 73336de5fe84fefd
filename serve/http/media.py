"""Images and audio in chat messages, for checkpoints with media towers (spec section 6).

OpenAI content parts: `{"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}}` and
`{"type": "input_audio", "input_audio": {"data": "<base64 wav>", "format": "wav"}}`. `MediaEncoder.item` turns
a part into the model's inputs (image patches, or dMel frames: `inkling_jax.preprocess`), which fixes its
number of placeholder tokens; after rendering, `encode` runs the towers and returns `Media`: the embeddings
and the prompt positions whose token rows they replace during prefill (the model's placeholder merge).

Both towers work on each patch or frame alone, so their inputs are padded to a power of two and cut back:
one compilation per size class (on its first use, not at warm-up).
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import hashlib
import io
import wave

import jax
import numpy as np
from flax import nnx

from inkling_jax.nn.model import InklingModel
from inkling_jax.preprocess import SAMPLE_RATE, dmel_ids, image_to_patches
from serve.http.chat import ChatError

IMAGE_UPSCALE = 2.0  # the reference processor doubles the long edge (capped at 2048 px)


@dataclasses.dataclass
class MediaItem:
    kind: str  # "image" or "audio"
    values: np.ndarray  # image patches [N, T, P, P, 3] float32, or dMel level ids [N, bins] int32

    @property
    def count(self) -> int:
        """Placeholder tokens it takes in the prompt."""
        return int(self.values.shape[0])


@dataclasses.dataclass
class Media:
    positions: np.ndarray  # [M] prompt positions of the placeholders
    embeddings: np.ndarray  # [M, hidden] their tower outputs
    digest: bytes  # a hash of the media: prompts with different media never share prefix-cache pages


class MediaEncoder:
    def __init__(self, model: InklingModel):
        self.config = model.config
        graphdef, state = nnx.split(model)

        def tower(kind):
            def run(params, values):
                module = getattr(nnx.merge(graphdef, params), kind)
                return module(values)
            return jax.jit(run)

        self._state = state
        self._towers = {kind: tower(name) for kind, name in (("image", "vision"), ("audio", "audio"))
                        if getattr(model, name) is not None}
        self.token_ids = {"image": self.config.image_token_id, "audio": self.config.audio_token_id}

    @property
    def kinds(self) -> tuple[str, ...]:
        return tuple(self._towers)

    def item(self, part: dict) -> MediaItem:
        """The model inputs of one content part (raises ChatError for anything it cannot take)."""
        kind = {"image_url": "image", "input_audio": "audio"}.get(part.get("type"))
        if kind is None:
            raise ChatError(f"content parts of type {part.get('type')!r} are not supported (use text, image_url "
                            "or input_audio)")
        if kind not in self._towers:
            raise ChatError(f"this model takes no {kind} input (its checkpoint has no {kind} tower)")
        if kind == "image":
            url = part.get("image_url")
            url = url.get("url") if isinstance(url, dict) else url
            return MediaItem("image", image_to_patches(_decode_image(url), self.config.vision, IMAGE_UPSCALE))
        audio = part.get("input_audio") or {}
        if audio.get("format", "wav") != "wav":
            raise ChatError("input_audio.format must be wav")
        return MediaItem("audio", dmel_ids(_decode_wav(audio.get("data")), self.config.audio))

    def encode(self, items: list[tuple[int, MediaItem]]) -> Media:
        """Tower outputs of (start position, item) pairs, with the positions they fill."""
        positions, embeddings = [], []
        digest = hashlib.blake2b(digest_size=16)
        for start, item in items:
            positions.append(np.arange(start, start + item.count))
            embeddings.append(self._run(item))
            digest.update(item.kind.encode() + np.ascontiguousarray(item.values).tobytes())
        return Media(np.concatenate(positions), np.concatenate(embeddings), digest.digest())

    def _run(self, item: MediaItem) -> np.ndarray:
        size = 1 << max(item.count - 1, 0).bit_length()
        padded = np.zeros((size,) + item.values.shape[1:], item.values.dtype)
        padded[:item.count] = item.values
        return np.asarray(self._towers[item.kind](self._state, padded))[:item.count]


def _base64(data, what: str) -> bytes:
    if not isinstance(data, str) or not data:
        raise ChatError(f"{what} must be a non-empty base64 string")
    try:
        return base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise ChatError(f"{what} is not valid base64") from None


def _decode_image(url) -> np.ndarray:
    from PIL import Image, UnidentifiedImageError

    if not isinstance(url, str) or not url.startswith("data:") or ";base64," not in url:
        raise ChatError("image_url.url must be a data URL (data:image/...;base64,...); this server fetches "
                        "nothing from the network")
    raw = _base64(url.partition(";base64,")[2], "the image data")
    try:
        with Image.open(io.BytesIO(raw)) as image:
            return np.asarray(image.convert("RGB"))
    except (UnidentifiedImageError, OSError, Image.DecompressionBombError) as exc:
        raise ChatError(f"the image cannot be decoded: {exc}") from None


def _decode_wav(data) -> np.ndarray:
    """16 kHz mono float waveform of a PCM WAV (other rates are resampled linearly)."""
    raw = _base64(data, "input_audio.data")
    try:
        with wave.open(io.BytesIO(raw)) as w:
            width, channels, rate = w.getsampwidth(), w.getnchannels(), w.getframerate()
            frames = w.readframes(w.getnframes())
    except (wave.Error, EOFError) as exc:
        raise ChatError(f"input_audio is not a PCM WAV file: {exc}") from None
    if width not in (1, 2, 4) or not frames:
        raise ChatError("input_audio must be non-empty 8, 16 or 32-bit PCM")
    kind = {1: np.uint8, 2: np.int16, 4: np.int32}[width]
    samples = np.frombuffer(frames, kind).astype(np.float32)
    samples = (samples - 128.0) / 128.0 if width == 1 else samples / float(2 ** (8 * width - 1))
    wave_mono = samples.reshape(-1, channels).mean(axis=1)
    if rate != SAMPLE_RATE:
        times = np.arange(int(len(wave_mono) * SAMPLE_RATE / rate)) * (rate / SAMPLE_RATE)
        wave_mono = np.interp(times, np.arange(len(wave_mono)), wave_mono).astype(np.float32)
    if wave_mono.size == 0:
        raise ChatError("input_audio is too short")
    return wave_mono
