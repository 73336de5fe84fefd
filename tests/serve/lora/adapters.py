"""Random LoRA adapters for tests, written as `train.run --lora-rank` writes them, and the merged models they
must serve like (`train.lora.merge`)."""

import jax.numpy as jnp
import numpy as np
from flax import nnx

from inkling_jax import preset
from serve.lora.random_adapters import random_factors
from serve.random_weights import random_model
from tests.backends import REFERENCE
from train import lora
from train.state import ModelParts, model_params

# Layer 0 dense, layer 1 an MoE (8 routed experts, top-2, and 2 shared ones).
CONFIG = preset("tiny").replace(num_layers=2, local_layer_ids=(0,), dense_layer_ids=(0,))
ATTENTION = ("wq", "wk", "wv", "wr", "wo")
EXPERTS = ("w_gate", "w_up", "w_down", "shared_gate", "shared_up", "shared_down")  # layer 1's, [experts, in, out]


def base_model():
    return random_model(CONFIG, seed=0, backend=REFERENCE)


def random_adapters(model, rank: int, seed: int, layers=(0, 1), experts: bool = True) -> dict[str, np.ndarray]:
    """Random factors (`serve.lora.random_adapters`) on every attention projection of `layers`, the dense MLP of
    layer 0 and (with `experts`) the routed and shared experts of layer 1."""
    flat = model_params(model)
    targets = [f"layers.{i}.attn.{n}.kernel" for i in layers for n in ATTENTION]
    targets += [f"layers.0.mlp.{n}" for n in ("w_gate", "w_up", "w_down")] if 0 in layers else []
    targets += [f"layers.1.mlp.{n}" for n in EXPERTS] if experts and 1 in layers else []
    return random_factors({name: flat[name].shape for name in targets}, rank, seed)


def without_experts(adapters: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {n: x for n, x in adapters.items() if not any(f"layers.1.mlp.{e}." in n for e in EXPERTS)}


def merged_model(model, adapters: dict[str, np.ndarray], alpha: float):
    """The base with the adapters merged in (what `train.run --export` writes)."""
    flat = model_params(model)
    merged = lora.merge(flat, {n: jnp.asarray(x) for n, x in adapters.items()}, alpha)
    return ModelParts(CONFIG, jnp.float32, REFERENCE).merge({**flat, **merged})


@nnx.jit
def forward(model, ids):
    return model(ids)


def greedy(model, prompt: list[int], n: int) -> list[int]:
    """n greedy tokens after `prompt` by whole forwards of one padded length (the model is causal: padding after
    a position changes nothing before it), so one compiled program serves every step and model."""
    ids = np.zeros((1, len(prompt) + n), np.int32)
    ids[0, :len(prompt)] = prompt
    for k in range(len(prompt), len(prompt) + n):
        ids[0, k] = int(jnp.argmax(forward(model, ids)[0, k - 1, :CONFIG.text.unpadded_vocab_size]))
    return ids[0, len(prompt):].tolist()


def save(path, adapters: dict[str, np.ndarray], alpha: float) -> str:
    lora.save_adapters(str(path), {n: jnp.asarray(x) for n, x in adapters.items()}, alpha)
    return str(path)
