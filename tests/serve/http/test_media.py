"""Images and audio in chat messages (OpenAI content parts with base64 data) on a checkpoint with media towers:
the server's first token and logprobs equal the model called directly with the same pixel values and dMel
frames; a text-only model, unknown part types and undecodable data get 400s."""

import base64
import dataclasses
import io
import wave

import jax
import numpy as np
import openai
import pytest
from PIL import Image

from inkling_jax import Backend, preset
from serve.engine.config import EngineConfig
from serve.engine.engine import Engine
from serve.http.chat import ChatError, ChatFormat
from serve.http.media import MediaEncoder
from serve.http.routes import Service
from serve.http.server import ServerThread, serving_app
from serve.http.tokenizer import ByteTokenizer
from serve.random_weights import random_model

REFERENCE = Backend.parse("reference,moe=dense")  # the kernels' jnp references, every expert on every token
CONFIG = preset("tiny").replace(num_layers=2, local_layer_ids=(0,), dense_layer_ids=(0,))
MODEL = "tiny-media"
RNG = np.random.default_rng(5)


def png_url(height, width, fill=None):
    pixels = RNG.integers(0, 256, (height, width, 3), dtype=np.uint8) if fill is None else \
        np.full((height, width, 3), fill, np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return "data:image/png;base64," + base64.b64encode(out.getvalue()).decode()


def wav_base64(seconds, rate=16000):
    out = io.BytesIO()
    with wave.open(out, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes((RNG.standard_normal(int(seconds * rate)) * 3000).astype(np.int16).tobytes())
    return base64.b64encode(out.getvalue()).decode()


@pytest.fixture(scope="module")
def server():
    tokenizer = ByteTokenizer()
    model = random_model(CONFIG, seed=2, backend=REFERENCE)
    # Random weights give a nearly flat next-token distribution that the media barely move; a sharper head
    # makes "the media entered" visible far above the numerical noise.
    model.unembed.set_value(model.unembed[...] * 50)
    engine = Engine(model, EngineConfig(max_num_seqs=2, max_model_len=160, max_num_batched_tokens=96,
                                        page_size=16, chunk_buckets=(1, 32), row_buckets=(3,), decode_steps=4),
                    eos_token_id=CONFIG.eos_token_id)
    chat = ChatFormat(tokenizer, MediaEncoder(model))
    engine.start()
    service = Service(engine, tokenizer, MODEL, "test model", CONFIG.text.unpadded_vocab_size,
                      max_prompt_tokens=150, max_tokens=8, chat=chat)
    with ServerThread(serving_app(service)) as thread:
        yield thread, openai.OpenAI(base_url=thread.url + "/v1", api_key="none", max_retries=0, timeout=120), \
            model, chat


def test_image_and_audio_chat_equals_the_model_on_the_same_inputs(server):
    _, client, model, chat = server
    messages = [{"role": "user", "content": [
        {"type": "text", "text": "What is this?"},
        {"type": "image_url", "image_url": {"url": png_url(23, 31)}},
        {"type": "input_audio", "input_audio": {"data": wav_base64(0.3), "format": "wav"}}]}]
    ids, items = chat.render_with_media(messages)
    assert [item.kind for _, item in items] == ["image", "audio"]
    assert [item.count for _, item in items] == [35, 6]  # 46 x 62 after the 2x upscale: 5 x (6 + 1) patches
    logits = model(np.array([ids]), pixel_values=items[0][1].values, audio_input_ids=items[1][1].values[None])
    expected = np.sort(np.asarray(jax.nn.log_softmax(logits[0, -1])))[::-1][:5]
    out = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, temperature=0, logprobs=True,
                                         top_logprobs=5, extra_body={"skip_special_tokens": False})
    first = out.choices[0].logprobs.content[0]
    np.testing.assert_allclose([t.logprob for t in first.top_logprobs], expected, rtol=1e-4, atol=1e-4)
    assert first.logprob == pytest.approx(expected[0], abs=1e-4)
    # Other pixels (a white image), the same prompt tokens: another distribution (the media really enter, and
    # the prefix cache does not confuse the two prompts).
    messages[0]["content"][1]["image_url"]["url"] = png_url(23, 31, fill=255)
    other = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1, temperature=0,
                                           logprobs=True, top_logprobs=5)
    changed = [t.logprob for t in other.choices[0].logprobs.content[0].top_logprobs]
    assert np.abs(np.array(changed) - expected).max() > 5e-4  # 5x the tolerance above


@pytest.mark.parametrize("part, message", [
    ({"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}, "data URL"),
    ({"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}, "cannot be decoded"),
    ({"type": "input_audio", "input_audio": {"data": "bm90IGEgd2F2", "format": "wav"}}, "not a PCM WAV"),
    ({"type": "input_audio", "input_audio": {"data": "AAAA", "format": "mp3"}}, "format must be wav"),
    ({"type": "video_url", "video_url": {"url": "data:video/mp4;base64,AAAA"}}, "not supported"),
])
def test_bad_media_parts_get_400(server, part, message):
    _, client, _, _ = server
    with pytest.raises(openai.BadRequestError, match=message):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": [part]}], max_tokens=1)


def test_text_only_models_refuse_media():
    image = {"type": "image_url", "image_url": {"url": png_url(8, 8)}}
    with pytest.raises(ChatError, match="takes text only"):
        ChatFormat(ByteTokenizer()).render_with_media([{"role": "user", "content": [image]}])
    audio_only = random_model(dataclasses.replace(CONFIG, vision=None), seed=0)
    with pytest.raises(ChatError, match="no image input"):
        ChatFormat(ByteTokenizer(), MediaEncoder(audio_only)).render_with_media([{"role": "user", "content": [image]}])
