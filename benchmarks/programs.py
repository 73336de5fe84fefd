"""The engine's compiled step programs timed alone, on its own cache after its thread has stopped: no host work
between calls, so the time is the device's (the ceiling a served load is held against).

- `decode_program_call` / `decode_program_seconds`: the decode program (or a speculative engine's round) at a
  row count and context;
- `prefill_program_seconds`: a prefill chunk per row;
- `mixed_program_seconds`: the mixed program (decode rows and prompt chunks, `StepPrograms.mixed`).
"""

import numpy as np

from benchmarks.timing import median_seconds
from serve.engine.engine import Engine
from serve.runner.steps import pack

# Back-to-back calls per timed trial: each call's dispatch overlaps the device's run of the call before, as in the
# engine, and the one wait for the device at a trial's end is shared by them (with one call per trial, a step's
# time would include a dispatch and a wait that the engine does not pay per step).
CALLS = 4


def _program_inputs(engine: Engine, num_rows: int, tokens: int, cached: int = 128, steps: int | None = None,
                    first_row: int = 0):
    """Device inputs of a step of `num_rows` rows (cache rows from `first_row` on) in the smallest row bucket that
    holds them: `tokens` new tokens per row (1: decode after `cached` ones, `steps` device steps per call, default
    the engine's `decode_steps`; a speculative engine's decode step is a round over its K + 1 tokens per row;
    more: a prefill chunk from position 0)."""
    runner = engine.runner
    cfg = runner.config
    rows = cfg.row_bucket(num_rows)
    inputs = runner._inputs([], rows, cfg.chunk_bucket(tokens))
    if rows != cfg.num_rows:
        inputs.rows[:num_rows] = first_row + np.arange(num_rows)
    per_decode_step = 1 if cfg.speculative is None else cfg.speculative.num_draft_tokens + 1
    inputs.lengths[:num_rows] = cached if tokens == 1 else 0
    inputs.n_new[:num_rows] = per_decode_step if tokens == 1 else tokens
    inputs.steps[:num_rows] = (steps or cfg.decode_steps) if tokens == 1 else 1
    pages = (first_row + np.arange(num_rows))[:, None] * cfg.pages_per_row + np.arange(cfg.pages_per_row)
    inputs.page_rows[:num_rows] = pages % runner.num_pages
    # Distinct random tokens per row: identical rows would route to the same few experts, and the step would read
    # fewer expert weights than the engine's requests make it read.
    inputs.ids[:num_rows] = np.random.default_rng(num_rows).integers(0, runner.vocab, inputs.ids[:num_rows].shape)
    return rows, runner.placement.put(pack(inputs))


def decode_program_call(engine: Engine, num_rows: int, cached: int = 128, steps: int | None = None):
    """One call of the compiled decode program alone, as the engine dispatches it: `num_rows` rows at `cached`
    tokens, `steps` steps per call (default the engine's `decode_steps`; a step samples one token, or is a
    speculative round), in the smallest decode bucket that holds them. Use it after the engine thread has
    stopped: it runs on the engine's cache."""
    runner = engine.runner
    steps = steps or runner.config.decode_steps
    rows, inputs = _program_inputs(engine, num_rows, 1, cached, steps)
    program = runner._steps[rows, 1, runner.config.full_sampler(1, False)]  # greedy rows' sampler

    def call():
        samples, _ = runner.run_decode(program, rows, inputs, steps)
        return samples

    return call


def decode_program_seconds(engine: Engine, num_rows: int, cached: int = 128, steps: int | None = None) -> float:
    """Seconds per call of `decode_program_call` (no host work between calls, `CALLS` calls back to back)."""
    return median_seconds(decode_program_call(engine, num_rows, cached, steps), trials=5, calls=CALLS)


def prefill_program_seconds(engine: Engine, num_rows: int, tokens: int) -> float:
    """Seconds per call of the compiled prefill program alone: `num_rows` prompts of `tokens` tokens."""
    runner = engine.runner
    rows, inputs = _program_inputs(engine, num_rows, tokens)
    chunk = runner.config.chunk_bucket(tokens)
    program = runner._steps[rows, chunk, runner.config.full_sampler(chunk, False)]  # greedy rows' sampler

    def call():
        runner.cache, runner.row_state, out = program(runner.params, runner.cache, runner.row_state, inputs)
        return out

    return median_seconds(call, trials=5, calls=CALLS)


def mixed_program_seconds(engine: Engine, num_rows: int, cached: int, chunk_rows: int | None = None) -> float:
    """Seconds per call of the compiled mixed program alone (`StepPrograms.mixed`): `num_rows` decode rows at
    `cached` tokens and `chunk_rows` prompt chunks (a row bucket of `EngineConfig.mixed_prefills`; default the
    fewest, one by default) of the largest size, from position 0, in rows past them."""
    runner = engine.runner
    rows, decode = _program_inputs(engine, num_rows, 1, cached, steps=1)
    chunk_rows = chunk_rows or runner.config.mixed_prefills[0]
    _, prefill = _program_inputs(engine, chunk_rows, runner.config.max_chunk, first_row=num_rows)
    program = runner._mixed[rows, chunk_rows, runner.config.full_sampler(1, False)]  # greedy rows' sampler

    def call():
        runner.cache, runner.row_state, *out = program(runner.params, runner.cache, runner.row_state, decode,
                                                       prefill)
        return out

    return median_seconds(call, trials=5, calls=CALLS)
