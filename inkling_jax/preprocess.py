"""Host-side media preprocessing in numpy, matching the reference processor.

Images -> patches [N, 2, P, P, 3]: optional long-edge rescale (LANCZOS, half-up rounding), /255, CLIP
normalisation, raster-order P x P patches over ceil(H/P) rows and floor(W/P) + 1 columns (always one extra
column), pixels outside the image set to the normalised value of -1/255, each patch repeated twice in time.

Audio -> dMel ids [frames, 80]: 16 kHz mono, hop 800, periodic Hann window and FFT of 1600, 800 samples of
left padding, right padding to a multiple of the hop, magnitude STFT, 80 Slaney mel filters (0-8 kHz), log10
(floor 1e-10), clipped to [-7, 2] and quantised to the nearest of 16 evenly spaced levels.
"""

import math

import numpy as np

from inkling_jax.config import AudioConfig, VisionConfig

CLIP_MEAN = np.array([0.48145466, 0.4578275, 0.40821073], np.float32)
CLIP_STD = np.array([0.26862954, 0.2613026, 0.2757771], np.float32)
SAMPLE_RATE = 16000
AUDIO_HOP = 800  # samples per dMel frame


def image_to_patches(image, cfg: VisionConfig = VisionConfig(), rescale: float | None = None,
                     max_long_edge: int = 2048) -> np.ndarray:
    """image: HxWx3 uint8 array (or a PIL image) -> float32 patches [N, temporal, P, P, 3]."""
    if rescale is not None:
        image = _rescale(image, rescale, max_long_edge)
    pixels = np.asarray(image)
    if pixels.ndim != 3 or pixels.shape[-1] != 3:
        raise ValueError(f"expected an RGB image [H, W, 3], got shape {pixels.shape}")
    p = cfg.patch_size
    height, width = pixels.shape[:2]
    rows, cols = _patch_grid(height, width, p)
    canvas = np.full((rows * p, cols * p, 3), -1.0, np.float32)  # raw -1 marks "outside the image"
    canvas[:height, :width] = pixels
    canvas = (canvas / 255.0 - CLIP_MEAN) / CLIP_STD
    patches = canvas.reshape(rows, p, cols, p, 3).transpose(0, 2, 1, 3, 4).reshape(rows * cols, p, p, 3)
    return np.repeat(patches[:, None], cfg.temporal_patch_size, axis=1).astype(np.float32)


def _rescale(image, factor: float, max_long_edge: int):
    from PIL import Image

    image = image if isinstance(image, Image.Image) else Image.fromarray(np.asarray(image, np.uint8))
    size = rescaled_size(*image.size, factor, max_long_edge)
    if size == image.size:
        return image
    return image.convert("RGB").resize(size, Image.LANCZOS)


def rescaled_size(width: int, height: int, factor: float, max_long_edge: int = 2048) -> tuple[int, int]:
    """(width, height) after the long-edge rescale: times `factor`, growth capped at `max_long_edge`."""
    long_edge = max(width, height)
    target = min(long_edge * factor, max(max_long_edge, long_edge))  # the cap only limits growth
    ratio = target / long_edge
    if ratio == 1.0:
        return width, height
    return math.floor(width * ratio + 0.5), math.floor(height * ratio + 0.5)


def image_tokens(width: int, height: int, cfg: VisionConfig = VisionConfig(), rescale: float | None = None,
                 max_long_edge: int = 2048) -> int:
    """The patches (tokens) `image_to_patches` makes of an image of this size: known before any pixel is decoded."""
    if rescale is not None:
        width, height = rescaled_size(width, height, rescale, max_long_edge)
    rows, cols = _patch_grid(height, width, cfg.patch_size)
    return rows * cols


def _patch_grid(height: int, width: int, patch_size: int) -> tuple[int, int]:
    """Rows and columns of patches: the rows cover the image, the columns have one more (always)."""
    return -(-height // patch_size), width // patch_size + 1


def _hz_to_mel(f):
    f = np.asarray(f, np.float64)
    log_region = f >= 1000.0
    mel = 3.0 * f / 200.0
    return np.where(log_region, 15.0 + np.log(np.maximum(f, 1e-10) / 1000.0) * 27.0 / np.log(6.4), mel)


def _mel_to_hz(m):
    m = np.asarray(m, np.float64)
    return np.where(m >= 15.0, 1000.0 * np.exp(np.log(6.4) * (m - 15.0) / 27.0), 200.0 * m / 3.0)


def mel_filters(n_fft: int, n_mels: int, sample_rate: int = SAMPLE_RATE) -> np.ndarray:
    """Slaney-scale, area-normalised triangular filters [n_mels, n_fft // 2 + 1]."""
    freqs = np.linspace(0.0, sample_rate / 2.0, n_fft // 2 + 1)
    edges = _mel_to_hz(np.linspace(_hz_to_mel(0.0), _hz_to_mel(sample_rate / 2.0), n_mels + 2))
    left, center, right = edges[:-2, None], edges[1:-1, None], edges[2:, None]
    rising = (freqs[None] - left) / (center - left)
    falling = (right - freqs[None]) / (right - center)
    tri = np.maximum(0.0, np.minimum(rising, falling))
    return (tri * (2.0 / (right - left))).astype(np.float32)


def audio_tokens(num_samples: int) -> int:
    """The dMel frames (tokens) `dmel_ids` makes of a 16 kHz waveform of this length."""
    return -(-num_samples // AUDIO_HOP)


def log_mel(waveform: np.ndarray, n_mels: int = 80, hop: int = AUDIO_HOP, n_fft: int = 1600) -> np.ndarray:
    """16 kHz mono waveform -> log10 mel energies [ceil(len / hop), n_mels]."""
    wave = np.asarray(waveform, np.float32)
    if wave.ndim == 2:  # multichannel: average to mono
        wave = wave.mean(axis=-1)
    if wave.ndim != 1 or wave.size == 0:
        raise ValueError(f"expected a non-empty mono waveform, got shape {np.shape(waveform)}")
    frames = -(-wave.size // hop)
    padded = np.pad(wave, (n_fft - hop, frames * hop - wave.size))
    window = (0.5 - 0.5 * np.cos(2 * np.pi * np.arange(n_fft) / n_fft)).astype(np.float32)  # periodic Hann
    starts = np.arange(frames) * hop
    segments = padded[starts[:, None] + np.arange(n_fft)[None]] * window
    spectrum = np.fft.rfft(segments.astype(np.float64), axis=-1)
    magnitude = np.sqrt(np.maximum(spectrum.real ** 2 + spectrum.imag ** 2, 1e-10)).astype(np.float32)
    mel = magnitude @ mel_filters(n_fft, n_mels).T
    return np.log10(np.maximum(mel, 1e-10))


def dmel_ids(waveform: np.ndarray, cfg: AudioConfig = AudioConfig()) -> np.ndarray:
    """16 kHz mono waveform -> dMel level ids [frames, n_mel_bins] int32: one audio token per frame."""
    mel = np.clip(log_mel(waveform, cfg.n_mel_bins), cfg.dmel_min_value, cfg.dmel_max_value)
    centers = np.linspace(cfg.dmel_min_value, cfg.dmel_max_value, cfg.mel_vocab_size).astype(np.float32)
    return np.abs(mel[..., None] - centers).argmin(axis=-1).astype(np.int32)
