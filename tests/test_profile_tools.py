"""The trace tools in bench/: trace_summary's split of a trace's idle time into short gaps (between a program's
kernels) and long ones (between calls), and hlo_sources naming the Python lines behind a dumped program's
fusions (a real XLA dump, made on CPU in a subprocess: XLA reads its flags only at start-up)."""

import os
import subprocess
import sys
import textwrap

from bench.hlo_sources import instruction_sources
from bench.trace_summary import idle_us


def test_idle_time_splits_short_gaps_from_long_ones():
    # (start us, duration us): two overlapping kernels, a 2 us gap, a 100 us gap (a call boundary), a 5 us gap
    events = [(0, 10, "a"), (5, 10, "b"), (17, 3, "c"), (120, 10, "d"), (135, 1, "e")]
    short, long, count = idle_us(events, gap_us=20)
    assert (short, long, count) == (2 + 5, 100, 1)
    assert idle_us(events, gap_us=1000) == (107, 0, 0)


def test_hlo_sources_name_the_python_lines_behind_each_fusion(tmp_path):
    program = tmp_path / "program.py"
    program.write_text(textwrap.dedent("""\
        import jax, jax.numpy as jnp

        def scaled_row_sums(x):
            return jnp.tanh(x) * 2 + jnp.sum(x, -1, keepdims=True)

        def outer(x):
            return scaled_row_sums(x)

        jax.jit(outer)(jnp.ones((8, 128))).block_until_ready()
        """))
    dump = tmp_path / "dump"
    env = dict(os.environ, XLA_FLAGS=f"--xla_dump_to={dump} --xla_dump_hlo_pass_re=NONE", JAX_PLATFORMS="cpu")
    subprocess.run([sys.executable, str(program)], env=env, check=True, timeout=120)
    (hlo,) = [p for p in dump.iterdir() if p.name.endswith("jit_outer.cpu_after_optimizations.txt")]
    found = instruction_sources(hlo.read_text())
    assert found, "no fusion found in the dump"
    for shape, op_name, stack in found.values():
        assert op_name.startswith("jit(outer)/")
        # innermost first: the expression, its caller, then the module line that ran the jit
        assert [(os.path.basename(f), fn) for f, fn, _ in stack] == [
            ("program.py", "scaled_row_sums"), ("program.py", "outer"), ("program.py", "<module>")]
        assert [line for _, _, line in stack] == [4, 7, 9]
    renamed = {name.replace(".", "_"): value for name, value in found.items()}
    assert instruction_sources(hlo.read_text(), list(renamed)) == renamed  # names as a trace writes them
