"""`benchmarks.multi_lora` end to end on the tiny preset (CPU): a row for every adapter count asked for (the base's
added), with and without the experts' adapters, each row's requests taking its adapters in turn, every ratio to
the base of the same run, the load time of each kind of adapter, and the table printed last."""

import json
import math

from benchmarks import multi_lora

OUTPUT, WARM_UP = 2, 4  # tokens per request of a timed pass and of the warm-up pass


def test_tiny_run_reports_every_row_with_its_adapters(tmp_path, capsys):
    multi_lora.main(["--preset", "tiny", "--adapters", "2,1", "--concurrency", "3", "--prompt-tokens", "16",
                     "--output-tokens", str(OUTPUT), "--passes", "1", "--experts", "--out", str(tmp_path)])
    found = json.loads((tmp_path / "multi_lora.json").read_text())
    assert found["errors"] == {}
    runs = found["runs"]
    assert [(r["adapters"], r["targets"]) for r in runs] == [
        (0, "base"), (1, "dense"), (2, "dense"), (1, "experts"), (2, "experts")]
    assert runs[0]["x_base"] == 1
    for r in runs:
        assert r["tok_s"] > 0 and math.isclose(r["x_base"], r["tok_s"] / runs[0]["tok_s"])
        assert r["tpot_p50_ms"] > 0
    # 3 rows: with 1 adapter all take it; with 2, rows 0 and 2 take the first, row 1 the second
    per_row = OUTPUT + WARM_UP
    assert found["tokens_per_adapter"] == {f"{kind}-{i}": n * per_row for kind in ("dense", "experts")
                                           for i, n in ((1, 3 + 2), (2, 1))}
    assert set(found["load"]) == {"dense", "experts"}
    assert all(load["total_ms"] >= load["read_ms"] > 0 for load in found["load"].values())
    assert found["slots"] == 3 and found["file_bytes"]["experts"] > found["file_bytes"]["dense"] > 0
    assert found["slot_bytes"]["dense"] > 0 and found["slot_bytes"]["experts"] > 0
    table = capsys.readouterr().out.strip().splitlines()[-len(runs) - 2:]
    assert table[0].startswith("| distinct adapters |") and all(line.startswith("|") for line in table)
