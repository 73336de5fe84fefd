"""Images and audio in chat messages, for checkpoints with media towers (spec section 6).

OpenAI content parts: `{"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}}` and
`{"type": "input_audio", "input_audio": {"data": "<base64 wav>", "format": "wav"}}`. `MediaEncoder.item` reads a
part's header (an image's size, a WAV's sample count), which fixes its number of placeholder tokens, so the limits
(pixels, prompt tokens) are checked before anything is decoded. After rendering, `encode` decodes the items into
the model's inputs (image patches, or dMel frames: `inkling_jax.preprocess`), runs the towers and returns
`Media`: the embeddings and the prompt positions whose token rows they replace during prefill (the model's
placeholder merge). It is the heavy part: the routes run it off the event loop.

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
from typing import Callable

import jax
import numpy as np
from flax import nnx
from PIL import Image, UnidentifiedImageError

from inkling_jax.nn.model import InklingModel
from inkling_jax.preprocess import SAMPLE_RATE, audio_tokens, dmel_ids, image_to_patches, image_tokens
from serve.http.chat import ChatError

IMAGE_UPSCALE = 2.0  # the reference processor doubles the long edge (capped at 2048 px)
IMAGE_FORMATS = {"image/png": "PNG", "image/jpeg": "JPEG", "image/webp": "WEBP", "image/gif": "GIF"}
MAX_IMAGE_PIXELS = 4096 * 4096  # default of --max-image-pixels


@dataclasses.dataclass
class MediaItem:
    kind: str  # "image" or "audio"
    count: int  # placeholder tokens it takes in the prompt, known from its header
    load: Callable[[], np.ndarray]  # decodes it: image patches [count, T, P, P, 3] float32, or dMel ids [count, bins]


@dataclasses.dataclass
class Media:
    positions: np.ndarray  # [M] prompt positions of the placeholders
    embeddings: np.ndarray  # [M, hidden] their tower outputs
    digest: bytes  # a hash of the media: prompts with different media never share prefix-cache pages


class MediaEncoder:
    def __init__(self, model: InklingModel, max_image_pixels: int = MAX_IMAGE_PIXELS):
        self.config = model.config
        self.max_image_pixels = max_image_pixels
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
        """One content part, from its header only (raises ChatError for anything it cannot take)."""
        kind = {"image_url": "image", "input_audio": "audio"}.get(part.get("type"))
        if kind is None:
            raise ChatError(f"content parts of type {part.get('type')!r} are not supported (use text, image_url "
                            "or input_audio)")
        if kind not in self._towers:
            raise ChatError(f"this model takes no {kind} input (its checkpoint has no {kind} tower)")
        if kind == "image":
            url = part.get("image_url")
            return self._image(url.get("url") if isinstance(url, dict) else url)
        audio = part.get("input_audio") or {}
        if audio.get("format", "wav") != "wav":
            raise ChatError("input_audio.format must be wav")
        return self._audio(audio.get("data"))

    def encode(self, items: list[tuple[int, MediaItem]]) -> Media:
        """Decode (start position, item) pairs and run the towers: their outputs, with the positions they fill."""
        positions, embeddings = [], []
        digest = hashlib.blake2b(digest_size=16)
        for start, item in items:
            values = item.load()
            if values.shape[0] != item.count:  # the header and the decoded data must agree on the prompt's blocks
                raise RuntimeError(f"{item.kind} decoded to {values.shape[0]} tokens, its header said {item.count}")
            positions.append(np.arange(start, start + item.count))
            embeddings.append(self._run(item.kind, values))
            digest.update(item.kind.encode() + np.ascontiguousarray(values).tobytes())
        return Media(np.concatenate(positions), np.concatenate(embeddings), digest.digest())

    def _image(self, url) -> MediaItem:
        raw = _data_url_bytes(url)
        with _open_image(raw) as image:
            width, height = image.size
        if width * height > self.max_image_pixels:
            raise ChatError(f"the image has {width} x {height} pixels; this server takes at most "
                            f"{self.max_image_pixels} per image")
        cfg = self.config.vision

        def load() -> np.ndarray:
            try:
                with _open_image(raw) as image:
                    return image_to_patches(image.convert("RGB"), cfg, IMAGE_UPSCALE)
            except OSError as exc:  # a valid header over broken data
                raise ChatError(f"the image cannot be decoded: {exc}") from None

        return MediaItem("image", image_tokens(width, height, cfg, IMAGE_UPSCALE), load)

    def _audio(self, data) -> MediaItem:
        frames, width, channels, rate = _read_wav(_base64(data, "input_audio.data"))
        num_samples = len(frames) // (width * channels)
        resampled = num_samples if rate == SAMPLE_RATE else int(num_samples * SAMPLE_RATE / rate)
        if resampled == 0:
            raise ChatError("input_audio is too short")
        cfg = self.config.audio
        return MediaItem("audio", audio_tokens(resampled),
                         lambda: dmel_ids(_waveform(frames, width, channels, rate, resampled), cfg))

    def _run(self, kind: str, values: np.ndarray) -> np.ndarray:
        count = values.shape[0]
        padded = np.zeros((1 << max(count - 1, 0).bit_length(),) + values.shape[1:], values.dtype)
        padded[:count] = values
        return np.asarray(self._towers[kind](self._state, padded))[:count]


def _base64(data, what: str) -> bytes:
    if not isinstance(data, str) or not data:
        raise ChatError(f"{what} must be a non-empty base64 string")
    try:
        return base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise ChatError(f"{what} is not valid base64") from None


def _data_url_bytes(url) -> bytes:
    """The bytes of a base64 data URL of an image type this server decodes."""
    if not isinstance(url, str) or not url.startswith("data:"):
        raise ChatError("image_url.url must be a data URL (data:image/...;base64,...); this server fetches "
                        "nothing from the network")
    header, comma, data = url[len("data:"):].partition(",")
    media_type, *params = [p.strip().lower() for p in header.split(";")]
    if media_type not in IMAGE_FORMATS:
        raise ChatError(f"image_url.url is a data URL of {media_type or 'no media type'!r}; this server takes "
                        f"{', '.join(IMAGE_FORMATS)}")
    if not comma or "base64" not in params:
        raise ChatError("image_url.url must be base64-encoded (data:image/png;base64,...)")
    return _base64(data, "the image data")


def _open_image(raw: bytes) -> Image.Image:
    """The image, lazily: its header is read, its pixels only when used."""
    try:
        return Image.open(io.BytesIO(raw), formats=list(IMAGE_FORMATS.values()))
    except Image.DecompressionBombError as exc:  # far more pixels than any limit of this server
        raise ChatError(f"the image has too many pixels: {exc}") from None
    except (UnidentifiedImageError, OSError) as exc:
        raise ChatError(f"the image cannot be decoded: {exc}") from None


def _read_wav(raw: bytes) -> tuple[bytes, int, int, int]:
    """(PCM frames, sample width, channels, rate) of a WAV file; nothing is converted yet."""
    try:
        with wave.open(io.BytesIO(raw)) as w:
            width, channels, rate = w.getsampwidth(), w.getnchannels(), w.getframerate()
            frames = w.readframes(w.getnframes())
    except (wave.Error, EOFError) as exc:
        raise ChatError(f"input_audio is not a PCM WAV file: {exc}") from None
    if width not in (1, 2, 4) or channels < 1 or rate < 1 or not frames:
        raise ChatError("input_audio must be non-empty 8, 16 or 32-bit PCM")
    return frames, width, channels, rate


def _waveform(frames: bytes, width: int, channels: int, rate: int, length: int) -> np.ndarray:
    """The 16 kHz mono float waveform of PCM frames (other rates resampled linearly to `length` samples)."""
    kind = {1: np.uint8, 2: np.int16, 4: np.int32}[width]
    usable = len(frames) // (width * channels) * width * channels
    samples = np.frombuffer(frames[:usable], kind).astype(np.float32)
    samples = (samples - 128.0) / 128.0 if width == 1 else samples / float(2 ** (8 * width - 1))
    mono = samples.reshape(-1, channels).mean(axis=1)
    if rate == SAMPLE_RATE:
        return mono
    times = np.arange(length) * (rate / SAMPLE_RATE)
    return np.interp(times, np.arange(len(mono)), mono).astype(np.float32)
