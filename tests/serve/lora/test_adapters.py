"""Adapters read strictly: `train.run`'s file or its directory (the experts' factors with them), PEFT's layout (the
hub's interleaved w13 split into gate and up), and a clear error naming the adapter and the tensor for anything
that does not fit."""

import json

import numpy as np
import pytest

from inkling_jax.checkpoint.safetensors_io import write_safetensors
from inkling_jax.quant import QuantConfig, serving_view
from serve.lora.adapters import PEFT_CONFIG, PEFT_FILE, load_adapter
from serve.lora.view import adapted_shapes, lora_view
from tests.serve.lora.adapters import base_model, random_adapters, save, without_experts
from train import lora

HUB = {"wq": "wq_du", "wk": "wk_dv", "wv": "wv_dv", "wr": "wr_du", "wo": "wo_ud"}


@pytest.fixture(scope="module")
def model_and_shapes():
    model = base_model()
    return model, adapted_shapes(lora_view(model, slots=2, rank=8, experts=True))


def peft_dir(path, adapters: dict, alpha: float, rank: int):
    """`adapters` (`train.lora`'s names) written as PEFT would: torch's [r, in] / [out, r], the hub's names, the
    dense gate and up as one w13 whose B rows interleave them."""
    tensors = {}
    for name in {lora.base_name(n) for n in adapters}:
        layer, module = name.split(".")[1], name.split(".", 2)[2]
        if module.startswith("attn."):
            hub = f"attn.{HUB[module.split('.')[1]]}"
            a, b = adapters[name + lora.A], adapters[name + lora.B]
        elif module == "mlp.w_down":
            hub, a, b = "mlp.w2_md", adapters[name + lora.A], adapters[name + lora.B]
        elif module == "mlp.w_gate":
            gate, up = (adapters[f"layers.{layer}.mlp.{m}{lora.B}"] for m in ("w_gate", "w_up"))
            hub, a, b = "mlp.w13_dn", adapters[name + lora.A], np.stack([gate, up], axis=-1).reshape(rank, -1)
        else:
            continue  # w_up travels with w_gate
        prefix = f"base_model.model.model.llm.layers.{layer}.{hub}"
        tensors[f"{prefix}.lora_A.weight"], tensors[f"{prefix}.lora_B.weight"] = a.T.copy(), b.T.copy()
    path.mkdir()
    write_safetensors(str(path / PEFT_FILE), tensors)
    (path / PEFT_CONFIG).write_text(json.dumps({"peft_type": "LORA", "r": rank, "lora_alpha": alpha}))
    return str(path)


def test_train_file_directory_and_peft_read_alike(model_and_shapes, tmp_path):
    model, shapes = model_and_shapes
    adapters = random_adapters(model, 4, seed=1)  # with the routed and shared experts' factors
    # PEFT's w13 shares one A between gate and up
    adapters["layers.0.mlp.w_up" + lora.A] = adapters["layers.0.mlp.w_gate" + lora.A]
    (tmp_path / "run").mkdir()
    file = save(tmp_path / "run" / "adapters.safetensors", adapters, 8.0)
    peft = without_experts(adapters)  # PEFT's layout is read for attention and the dense MLP
    for path, expected in ((file, adapters), (str(tmp_path / "run"), adapters),
                           (peft_dir(tmp_path / "peft", peft, 8.0, 4), peft)):
        adapter = load_adapter("x", path, shapes, max_rank=8)
        assert (adapter.rank, adapter.scale) == (4, 2.0)
        assert sorted(adapter.weights) == sorted({lora.base_name(n) for n in expected})
        for name, (a, b) in adapter.weights.items():
            np.testing.assert_array_equal(a, expected[name + lora.A], err_msg=name)
            np.testing.assert_array_equal(b, expected[name + lora.B], err_msg=name)


def test_strict_errors_name_the_adapter_and_tensor(model_and_shapes, tmp_path):
    model, shapes = model_and_shapes
    adapters = random_adapters(model, 4, seed=2)
    with pytest.raises(ValueError, match=r"'big': rank 4 is above --max-lora-rank 2"):
        load_adapter("big", save(tmp_path / "a.safetensors", adapters, 8.0), shapes, max_rank=2)

    wrong = dict(adapters)
    wrong["layers.1.attn.wk.kernel" + lora.A] = np.ones((7, 4), np.float32)
    with pytest.raises(ValueError, match=r"'bad': layers\.1\.attn\.wk\.kernel has A \(7, 4\).*base weight is"):
        load_adapter("bad", save(tmp_path / "b.safetensors", wrong, 8.0), shapes, max_rank=8)

    experts = dict(adapters)  # the routed experts' factors for 2 experts of 8
    experts["layers.1.mlp.w_gate" + lora.A] = np.ones((2, 64, 4), np.float32)
    with pytest.raises(ValueError, match=r"'moe': layers\.1\.mlp\.w_gate has A \(2, 64, 4\).*"
                                         r"base weight is \[8, 64, 32\], so A must be \[8, 64, r\]"):
        load_adapter("moe", save(tmp_path / "c.safetensors", experts, 8.0), shapes, max_rank=8)

    # routed experts held in fp8 are not adapted (their shared experts are)
    fp8 = adapted_shapes(lora_view(serving_view(model, QuantConfig(expert_precision="fp8")), slots=2, rank=8,
                                   experts=True))
    with pytest.raises(ValueError, match=r"'fp8': layers\.1\.mlp\.w_down is not a weight this server adapts"):
        load_adapter("fp8", save(tmp_path / "d.safetensors", adapters, 8.0), fp8, max_rank=8)
    shared = {n: x for n, x in adapters.items() if ".mlp.w_" not in n or n.startswith("layers.0.")}
    assert load_adapter("fp8", save(tmp_path / "e.safetensors", shared, 8.0), fp8, max_rank=8).rank == 4

    plain = adapted_shapes(lora_view(model, slots=2, rank=8))  # a server without --lora-experts
    with pytest.raises(ValueError, match=r"'moe': layers\.1\.mlp\.\S+ is not a weight this server adapts.*--lora-experts"):
        load_adapter("moe", save(tmp_path / "f.safetensors", adapters, 8.0), plain, max_rank=8)
    assert load_adapter("dense", save(tmp_path / "g.safetensors", without_experts(adapters), 8.0), plain, 8).rank == 4

    peft = peft_dir(tmp_path / "peft", without_experts(adapters), 8.0, 4)
    for module in ("mlp.gate", "mlp.experts"):
        tensors = {f"base_model.model.model.llm.layers.1.{module}.lora_A.weight": np.ones((4, 64), np.float32)}
        write_safetensors(f"{peft}/{PEFT_FILE}", tensors)
        with pytest.raises(ValueError, match=rf"'peft': .*layers\.1\.{module}\.lora_A\.weight is not a LoRA factor.*"
                                             r"experts are read from `train\.run`'s adapters\.safetensors"):
            load_adapter("peft", peft, shapes, max_rank=8)

    with pytest.raises(ValueError, match=r"'none': .* holds neither adapters\.safetensors nor"):
        load_adapter("none", str(tmp_path), shapes, max_rank=8)
