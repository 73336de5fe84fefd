"""Media preprocessing in numpy against the reference processor's definitions."""

import numpy as np
import pytest

from inkling_jax.config import AudioConfig, VisionConfig
from inkling_jax.preprocess import CLIP_MEAN, CLIP_STD, dmel_ids, image_to_patches, log_mel


def test_patches_raster_order_with_the_extra_column():
    rng = np.random.default_rng(0)
    image = rng.integers(0, 256, (23, 40, 3)).astype(np.uint8)  # width divisible by the patch: a full pad column
    cfg = VisionConfig(patch_size=10)
    patches = image_to_patches(image, cfg)
    assert patches.shape == (3 * 5, 2, 10, 10, 3)
    pad = (-1.0 / 255.0 - CLIP_MEAN) / CLIP_STD
    for row in range(3):
        for col in range(5):
            patch = patches[row * 5 + col, 0]
            np.testing.assert_array_equal(patch, patches[row * 5 + col, 1])  # duplicated in time
            for y in range(10):
                for x in range(10):
                    iy, ix = row * 10 + y, col * 10 + x
                    want = (image[iy, ix] / 255.0 - CLIP_MEAN) / CLIP_STD if iy < 23 and ix < 40 else pad
                    np.testing.assert_allclose(patch[y, x], want, rtol=1e-6, atol=1e-6)


def test_rescale_doubles_the_long_edge_and_caps_growth():
    image = np.random.default_rng(1).integers(0, 256, (30, 50, 3)).astype(np.uint8)
    cfg = VisionConfig(patch_size=10)
    assert image_to_patches(image, cfg, rescale=2.0).shape[0] == 6 * 11  # 60 x 100
    assert image_to_patches(image, cfg, rescale=2.0, max_long_edge=70).shape[0] == 5 * 8  # 42 x 70


def test_log_mel_and_dmel_match_the_reference_feature_extractor():
    pytest.importorskip("torch")
    from transformers.models.inkling.feature_extraction_inkling import InklingFeatureExtractor

    rng = np.random.default_rng(2)
    t = np.arange(16000 * 3 // 2 + 123) / 16000.0
    wave = (0.3 * np.sin(2 * np.pi * 440 * t) + 0.05 * rng.standard_normal(t.size)).astype(np.float32)
    ref = InklingFeatureExtractor()(wave, sampling_rate=16000, return_tensors="np")["input_features"][0]
    ours = log_mel(wave)
    assert ours.shape == ref.shape == (-(-wave.size // 800), 80)
    np.testing.assert_allclose(ours, ref, atol=2e-4)
    cfg = AudioConfig()
    centers = np.linspace(-7.0, 2.0, 16).astype(np.float32)
    ref_ids = np.abs(np.clip(ref, -7.0, 2.0)[..., None] - centers).argmin(-1)
    assert (dmel_ids(wave, cfg) == ref_ids).mean() > 0.999


def test_bad_media_inputs():
    with pytest.raises(ValueError, match="RGB image"):
        image_to_patches(np.zeros((4, 4)), VisionConfig(patch_size=2))
    with pytest.raises(ValueError, match="mono waveform"):
        log_mel(np.zeros((0,)))
