"""Logits of inkling_jax equal transformers' Inkling on tiny random checkpoints in the hub layout."""

import jax.numpy as jnp
import numpy as np
import pytest

from inkling_jax import Backend, load_pretrained, with_backend
from inkling_jax.generate import StepFunctions
from tests.hf_oracle import AUDIO_TOKEN, IMAGE_TOKEN, logits, relative_error

FP32_TOL = 1e-5
BF16_TOL = 3e-2  # bf16 weights and activations, rounded at different points than PyTorch's bf16 path


def _ids(vocab, shape, seed):
    return np.random.default_rng(seed).integers(0, vocab, shape).astype(np.int32)


@pytest.mark.parametrize("name,seq", [("base", 30), ("long_extent", 40)])
@pytest.mark.parametrize("moe", ["dense", "ragged"])
def test_text_logits_match_reference(checkpoints, name, seq, moe):
    path, ref_model = checkpoints(name)
    model = load_pretrained(path, progress=False)
    vocab = model.config.text.unpadded_vocab_size
    ids = _ids(min(vocab, 150), (2, seq), seed=seq)
    ref = logits(ref_model, ids)
    out = np.asarray(StepFunctions(with_backend(model, Backend.parse(f"reference,moe={moe}"))).forward(ids))
    assert out.shape == ref.shape == (2, seq, vocab)
    assert relative_error(out, ref) < FP32_TOL


def test_image_and_audio_logits_match_reference(checkpoints):
    path, ref_model = checkpoints("base")
    model = load_pretrained(path, progress=False)
    rng = np.random.default_rng(1)
    # 3 image patches and 5 audio frames (of a padded clip of 7) inside ordinary text.
    ids = _ids(150, (1, 20), seed=2)
    ids[0, 3:6] = IMAGE_TOKEN
    ids[0, 10:15] = AUDIO_TOKEN
    pixels = rng.standard_normal((3, 2, 10, 10, 3)).astype(np.float32)
    audio = rng.integers(0, 16, (1, 7, 80)).astype(np.int64)
    mask = np.array([[1, 1, 1, 1, 1, 0, 0]], bool)
    ref = logits(ref_model, ids, pixel_values=pixels, audio_input_ids=audio, audio_input_ids_mask=mask)
    out = np.asarray(model(jnp.asarray(ids), pixel_values=jnp.asarray(pixels), audio_input_ids=jnp.asarray(audio),
                           audio_input_ids_mask=mask))
    assert relative_error(out, ref) < FP32_TOL
    # The media really entered: the same prompt without media differs.
    plain = np.asarray(StepFunctions(model).forward(np.where(ids >= 150, 0, ids)))
    assert relative_error(plain, ref) > 1e-3


def test_placeholder_count_mismatch_is_an_error(checkpoints):
    path, _ = checkpoints("base")
    model = load_pretrained(path, progress=False)
    ids = _ids(150, (1, 12), seed=3)
    ids[0, 2:4] = IMAGE_TOKEN  # two placeholders, three patches
    pixels = np.random.default_rng(0).standard_normal((3, 2, 10, 10, 3)).astype(np.float32)
    with pytest.raises(ValueError, match="2 placeholder tokens .* but 3 image embeddings"):
        model(jnp.asarray(ids), pixel_values=jnp.asarray(pixels))


def test_bfloat16_logits_within_stated_bound(checkpoints):
    path, ref_model = checkpoints("base")
    model = load_pretrained(path, dtype="bfloat16", progress=False)
    ids = _ids(150, (2, 24), seed=4)
    ref = logits(ref_model, ids)  # the fp32 reference
    out = np.asarray(StepFunctions(model).forward(ids)).astype(np.float32)
    assert relative_error(out, ref) < BF16_TOL
