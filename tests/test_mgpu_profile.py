"""bench/mgpu_profile.py on a made-up in-kernel trace (the shares, step lengths and gaps it reports), and the
switch that makes the MoE kernels record one."""

import json

import pytest

from bench.mgpu_profile import summarise, warpgroup_ranges


def _events(pid, tid, ranges):
    out = []
    for name, start, end in ranges:
        out += [dict(name=name, ph="B", ts=start, pid=pid, tid=tid), dict(name=name, ph="E", ts=end, pid=pid, tid=tid)]
    return out


def test_a_compute_warpgroup_s_steps_waits_and_tile_gap(tmp_path):
    # one compute warpgroup: Init, two steps (1 us wait between), an epilogue, a 2 us gap, one more step;
    # the TMA warpgroup records only the profiler's Init and does not count
    compute = [("Init", 0, 1), ("step", 1, 4), ("step", 5, 8), ("epilogue", 8, 9), ("step", 11, 14)]
    path = tmp_path / "trace.json"
    events = _events(1, 1, [("Init", 0, 1)]) + _events(1, 2, compute)
    path.write_text(json.dumps({"traceEvents": events[::-1]}))  # any order
    s = summarise(warpgroup_ranges(str(path)))
    assert s["warpgroups"] == 1 and s["span_us"] == 14
    assert s["busy"]["step"] == pytest.approx(9 / 14) and s["busy"]["epilogue"] == pytest.approx(1 / 14)
    assert (s["step_p50_us"], s["wait_p50_us"], s["tile_gap_p50_us"], s["steps_per_warpgroup"]) == (3, 1, 2, 3)


def test_the_profile_switch_turns_on_the_profiler_and_makes_room_in_smem(tmp_path, monkeypatch):
    from pallas_kernels.moe import mgpu

    off_budget = mgpu.smem_budget(3)
    assert mgpu.compiler_params().profile_space == 0
    monkeypatch.setenv(mgpu.PROFILE_DIR_ENV, str(tmp_path / "prof"))
    params = mgpu.compiler_params()
    assert (params.profile_space, params.profile_dir) == (mgpu.PROFILE_RANGES, str(tmp_path / "prof"))
    assert (tmp_path / "prof").is_dir()
    assert mgpu.smem_budget(3) == off_budget - 3 * 16 * mgpu.PROFILE_RANGES
