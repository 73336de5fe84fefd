"""The text server that the HTTP tests share (one engine: compiling it is the slow part).

A 2-layer variant of the `tiny` preset with seeded random weights, so it compiles quickly: one sliding and one
full-attention layer, a dense MLP and a MoE. Its KV pool holds 16 pages of 8 tokens for 4 slots of up to 96
tokens, so concurrent traffic preempts and recomputes sequences. Tests that change its limits put them back.
"""

import types

import openai
import pytest

from inkling_jax import preset
from serve.engine.config import EngineConfig
from serve.engine.engine import Engine
from serve.http.chat import ChatFormat
from serve.http.routes import Service
from serve.http.server import ServerThread, serving_app
from serve.http.tokenizer import ByteTokenizer
from serve.random_weights import random_model
from tests.backends import REFERENCE
from tests.serve.http.client import KEY, MODEL

CONFIG = preset("tiny").replace(num_layers=2, local_layer_ids=(0,), dense_layer_ids=(0,))
MAX_BODY_BYTES = 1 << 20


@pytest.fixture(scope="package")
def server():
    tokenizer = ByteTokenizer()
    model = random_model(CONFIG, seed=0, backend=REFERENCE)
    engine = Engine(model, EngineConfig(max_num_seqs=4, max_model_len=96, max_num_batched_tokens=32,
                                        page_size=8, chunk_buckets=(1, 16), row_buckets=(2, 5), num_pages=16,
                                        num_snapshots=8), eos_token_id=CONFIG.eos_token_id)
    engine.start()
    service = Service(engine, tokenizer, MODEL, "test model", CONFIG.text.unpadded_vocab_size,
                      max_prompt_tokens=80, max_tokens=24, max_n=4, api_key=KEY, chat=ChatFormat(tokenizer),
                      max_body_bytes=MAX_BODY_BYTES)
    with ServerThread(serving_app(service), drain_seconds=20) as thread:
        client = openai.OpenAI(base_url=thread.url + "/v1", api_key=KEY, max_retries=0, timeout=120)
        yield types.SimpleNamespace(url=thread.url, client=client, engine=engine, model=model, thread=thread,
                                    tokenizer=tokenizer, chat=service.chat, service=service)
