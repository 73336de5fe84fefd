"""Images and audio in chat messages (OpenAI content parts with base64 data) on a checkpoint with media towers:
the server's first token and logprobs equal the model called directly with the same pixel values and dMel
frames; a text-only model, unknown part types, other media types and undecodable data get 400s; an image or
audio over the limits is refused from its header, before anything is decoded, and decoding runs off the event
loop, so /health answers meanwhile."""

import base64
import dataclasses
import io
import struct
import wave
import zlib

import jax
import numpy as np
import openai
import pytest
from PIL import Image

from inkling_jax import preset
from serve.engine.config import EngineConfig
from serve.engine.engine import Engine
from serve.http import media
from serve.http.chat import ChatError, ChatFormat
from serve.http.media import MediaEncoder
from serve.http.routes import Service
from serve.http.server import ServerThread, serving_app
from serve.http.tokenizer import ByteTokenizer
from serve.random_weights import random_model
from tests.backends import REFERENCE
from tests.serve.http.client import assert_health_answered, health_during, post, slowed

CONFIG = preset("tiny").replace(num_layers=2, local_layer_ids=(0,), dense_layer_ids=(0,))
MODEL = "tiny-media"
RNG = np.random.default_rng(5)
MAX_PIXELS = 100_000


def png_url(height, width, fill=None, truncate=False):
    pixels = RNG.integers(0, 256, (height, width, 3), dtype=np.uint8) if fill is None else \
        np.full((height, width, 3), fill, np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    raw = out.getvalue()
    return "data:image/png;base64," + base64.b64encode(raw[:len(raw) // 2] if truncate else raw).decode()


def wav_base64(seconds, rate=16000, samples=None):
    out = io.BytesIO()
    with wave.open(out, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes((RNG.standard_normal(samples or int(seconds * rate)) * 3000).astype(np.int16).tobytes())
    return base64.b64encode(out.getvalue()).decode()


def png_header_url(width, height):
    """A PNG that says it is width x height, with almost no pixel data: what a decompression bomb looks like."""
    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    raw = (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
           + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b""))
    return "data:image/png;base64," + base64.b64encode(raw).decode()


def claimed_size_url(fmt, width, height):
    """A small JPEG or GIF whose header is rewritten to claim width x height."""
    out = io.BytesIO()
    Image.new("RGB", (8, 8)).save(out, format=fmt)
    raw = out.getvalue()
    if fmt == "JPEG":  # the frame header (SOF0): height, width, big-endian
        at, size = raw.find(b"\xff\xc0") + 5, struct.pack(">HH", height, width)
    else:  # GIF's logical screen: width, height, little-endian
        at, size = 6, struct.pack("<HH", width, height)
    return f"data:image/{fmt.lower()};base64," + base64.b64encode(raw[:at] + size + raw[at + 4:]).decode()


def image_part(url):
    return {"type": "image_url", "image_url": {"url": url}}


def ask(url, *parts):
    return post(url, "/v1/chat/completions", {"model": MODEL, "max_tokens": 1,
                                              "messages": [{"role": "user", "content": list(parts)}]}, key=None)


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
    chat = ChatFormat(tokenizer, MediaEncoder(model, max_image_pixels=MAX_PIXELS))
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
    logits = model(np.array([ids]), pixel_values=items[0][1].load(), audio_input_ids=items[1][1].load()[None])
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
    (image_part("data:text/plain;base64,aGVsbG8="), "'text/plain'"),
    (image_part("data:image/svg+xml;base64,PHN2Zy8+"), "'image/svg.xml'"),
    (image_part("data:;base64,AAAA"), "no media type"),
    (image_part("data:image/png,rawbytes"), "base64-encoded"),
    (image_part(png_url(16, 16, truncate=True)), "cannot be decoded"),  # a valid header, truncated data
    (image_part("data:image/png;base64," + base64.b64encode(b"BM" + bytes(60)).decode()), "cannot be decoded"),
])
def test_bad_media_parts_get_400(server, part, message):
    _, client, _, _ = server
    with pytest.raises(openai.BadRequestError, match=message):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": [part]}], max_tokens=1)


def test_text_only_models_refuse_media():
    image = {"type": "image_url", "image_url": {"url": png_url(8, 8)}}
    with pytest.raises(ChatError, match="takes text only"):
        ChatFormat(ByteTokenizer()).render_with_media([{"role": "user", "content": [image]}])
    audio_only = random_model(dataclasses.replace(CONFIG, vision=None), seed=0, backend=REFERENCE)
    with pytest.raises(ChatError, match="no image input"):
        ChatFormat(ByteTokenizer(), MediaEncoder(audio_only)).render_with_media([{"role": "user", "content": [image]}])


HOSTILE_IMAGES = [
    (png_header_url(10000, 10000), "10000 x 10000 pixels"),
    (png_header_url(1, 200_000), "1 x 200000 pixels"),
    (claimed_size_url("JPEG", 60000, 60000), "too many pixels"),
    (claimed_size_url("GIF", 20000, 20000), "too many pixels"),
    (png_header_url(300, 300), "limit of 150 tokens"),  # within the pixels, not the prompt: 60 x 61 patches
]


@pytest.mark.parametrize("url,message", HOSTILE_IMAGES)
def test_images_over_the_limits_are_refused_from_their_header(server, monkeypatch, url, message):
    thread = server[0]
    decoded = []
    monkeypatch.setattr(media, "image_to_patches", lambda *a, **k: decoded.append(1))
    status, reply = ask(thread.url, image_part(url))
    assert status == 400 and message in reply["error"]["message"], reply
    assert not decoded


@pytest.mark.parametrize("parts", [
    [image_part(png_url(23, 31))] * 5,  # 35 tokens each: the fifth passes the 150
    [{"type": "input_audio", "input_audio": {"data": wav_base64(10), "format": "wav"}}],  # 200 frames
    [{"type": "input_audio", "input_audio": {"data": wav_base64(0, rate=1, samples=100), "format": "wav"}}],
])
def test_media_over_the_prompt_limit_are_refused_before_decoding(server, monkeypatch, parts):
    decoded = []
    monkeypatch.setattr(media, "image_to_patches", lambda *a, **k: decoded.append(1))
    monkeypatch.setattr(media, "dmel_ids", lambda *a, **k: decoded.append(1))
    status, reply = ask(server[0].url, *parts)
    assert status == 400 and reply["error"]["code"] == "context_length_exceeded", reply
    assert not decoded


def test_health_answers_while_hostile_images_are_handled(server):
    url = server[0].url
    requests = [lambda image=image: ask(url, image_part(image)) for image, _ in HOSTILE_IMAGES * 2]
    assert_health_answered(health_during(url, requests))


def test_decoding_runs_off_the_event_loop(server, monkeypatch):
    monkeypatch.setattr(media, "image_to_patches", slowed(media.image_to_patches))
    answers = []
    probes = health_during(server[0].url, [lambda: answers.append(ask(server[0].url, image_part(png_url(23, 31))))])
    assert answers[0][0] == 200, answers
    assert_health_answered(probes)
    assert len(probes) > 5
