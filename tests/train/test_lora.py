"""LoRA through `python -m train.run` on 8 simulated CPU devices: only the adapters train, and the exported merged
model is the base model plus (alpha / r) * A @ B on exactly the adapted weights."""

import json
import os

import jax
import numpy as np
import pytest

from inkling_jax import preset
from inkling_jax.checkpoint.loading import load_pretrained
from inkling_jax.config import load_config
from inkling_jax.parallel.mesh import make_mesh
from train import lora
from train.run import first_layers, initial_params, main, parse_args
from train.state import model_params, seeded_params
from train.step import Trainer

RANK, ALPHA = 4, 8.0


@pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (simulated) devices")
def test_lora_trains_only_adapters_and_exports_base_plus_ba(tmp_path):
    data = tmp_path / "corpus.txt"
    data.write_text("\n\n".join(["LoRA adapts a frozen model.", "Only A and B receive updates."] * 8))
    out, export = tmp_path / "run", tmp_path / "merged"
    main(["--preset", "tiny", "--layers", "3", "--data", str(data), "--out", str(out), "--steps", "4",
          "--mesh", "fsdp=2,tensor=2,expert=2", "--seq-len", "32", "--batch", "4", "--lr", "2e-2", "--warmup", "0",
          "--lora-rank", str(RANK), "--lora-alpha", str(ALPHA), "--dtype", "float32", "--export", str(export),
          "--fast-compile", "--no-tensorboard"])

    adapters, alpha = lora.load_adapters(str(out / "adapters.safetensors"))
    base = jax.device_get(seeded_params(first_layers(preset("tiny"), 3), 0,
                                        compiler_options={"xla_backend_optimization_level": 0}))
    targets = lora.target_names({n: x.shape for n, x in base.items()})
    assert alpha == ALPHA and sorted(adapters) == sorted(n + s for n in targets for s in (lora.A, lora.B))
    # 5 attention projections per layer, the dense MLP's 3, and 3 routed + 3 shared expert weights per MoE layer.
    assert len(targets) == 3 * 5 + 3 + 2 * 6
    assert all(np.abs(adapters[n + lora.B]).max() > 0 for n in targets)  # B started at 0: it trained

    merged = model_params(load_pretrained(str(export), "float32", progress=False))
    assert sorted(merged) == sorted(base)
    for name, weight in merged.items():
        weight = np.asarray(weight)
        if name in targets:
            delta = (ALPHA / RANK) * np.einsum("...ir,...ro->...io", adapters[name + lora.A].astype(np.float64),
                                                adapters[name + lora.B].astype(np.float64))
            np.testing.assert_allclose(weight, base[name] + delta, rtol=1e-5, atol=1e-7, err_msg=name)
            assert not np.array_equal(weight, base[name]), name
        else:
            np.testing.assert_array_equal(weight, base[name], err_msg=name)

    # `--model DIR` reads the exported model back onto a mesh, tensor by tensor.
    args = parse_args(["--model", str(export), "--data", str(data), "--steps", "1", "--out", str(tmp_path / "again")])
    config = load_config(str(export))
    loaded = initial_params(args, config, Trainer(config, make_mesh("fsdp=4,tensor=2")))
    assert loaded["layers.1.mlp.w_gate"].sharding.spec[1] == "fsdp"
    for name, weight in merged.items():
        np.testing.assert_array_equal(np.asarray(loaded[name]), np.asarray(weight), err_msg=name)

    rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    assert [r["step"] for r in rows] == [1, 2, 3, 4] and rows[-1]["loss"] < rows[0]["loss"]
