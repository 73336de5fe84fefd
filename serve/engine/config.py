"""The engine's configuration: slots, token budget, pages, shape buckets, prefix caching, limits.

Every jitted step runs at one of a fixed set of shapes: `row_buckets` (how many cache rows a step touches; the
last one is every row, which needs no gather) times `chunk_buckets` (tokens per row; 1 is a decode step, the
others are prefill chunks). Decode steps may use every row bucket; a prefill step only those whose padded size
rows x tokens stays within the step's token budget. Warm-up compiles each such pair once, so nothing compiles
while serving.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from serve.engine.sampling_params import InvalidParams, SamplingParams
from serve.lora.config import LoRAConfig

if TYPE_CHECKING:
    from inkling_jax.config import InklingConfig

# Where no token budget is given: a decode token for every slot, plus this many prompt chunks of the largest size,
# so that a server with every slot busy still prefills several prompts per step (one per step starves the TTFT of
# a burst); never below MIN_TOKEN_BUDGET.
PREFILL_CHUNKS_PER_STEP = 8
MIN_TOKEN_BUDGET = 256


def default_token_budget(max_num_seqs: int, max_chunk: int) -> int:
    return max(MIN_TOKEN_BUDGET, max_num_seqs + PREFILL_CHUNKS_PER_STEP * max_chunk)


SPECULATIVE_METHODS = ("mtp", "draft", "oracle")
MAX_DRAFT_TOKENS = 8  # Inkling's MTP head has 8 depths


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding: every decode step verifies `num_draft_tokens` drafted tokens per row (`serve.runner.
    speculative`). method "mtp": the model's MTP head drafts them; "draft": a smaller Inkling with the same
    vocabulary (the engine's `draft_model`); "oracle": a host table of the tokens to propose
    (`serve.runner.drafters.OracleDrafter`; tests and benchmarks, it knows the target's output in advance)."""

    method: str
    num_draft_tokens: int

    def __post_init__(self):
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative method must be one of {SPECULATIVE_METHODS}, got {self.method!r}")
        if not 1 <= self.num_draft_tokens <= MAX_DRAFT_TOKENS:
            raise ValueError(f"num_draft_tokens must be in [1, {MAX_DRAFT_TOKENS}], got {self.num_draft_tokens}")

    @property
    def lookahead(self) -> int:
        """Positions past a row's cached tokens that a step may write: the verify's drafts, then the next drafts'
        chain (their entries are never read once the row's length passes them, but need pages)."""
        return 2 * self.num_draft_tokens

    def mtp_depths(self, head_depths: int) -> int:
        """The depths of an MTP head of `head_depths` that this drafting reads: draft j comes from depth
        min(j, depths - 1), so K drafts read the first min(K, depths); none unless the method is "mtp"."""
        return min(self.num_draft_tokens, head_depths) if self.method == "mtp" else 0

    @property
    def ring_slack(self) -> int:
        """Slots the sliding rings (the model's and the drafter's) hold past the window: K. A verify writes K + 1
        positions from a row's length and a draft chain at most K from the new length, and the row keeps at least
        the first, so what they write past the kept tokens lands in slots of positions before the window: a
        rejection copies nothing back."""
        return self.num_draft_tokens


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    max_num_seqs: int = 8  # slots: sequences that hold cache rows at once
    max_model_len: int = 512  # prompt + output tokens of one sequence
    max_num_batched_tokens: int = 256  # token budget of one step (decodes count one each)
    page_size: int = 16
    num_pages: int | None = None  # None: sized from free device memory (GPU) or enough for every slot (CPU)
    memory_fraction: float = 0.85  # of the free device memory that caches may take
    chunk_buckets: tuple[int, ...] = (1, 16, 64, 256)
    row_buckets: tuple[int, ...] | None = None  # None: powers of two below max_num_seqs, then all rows
    prefix_caching: bool = True
    num_snapshots: int | None = None  # saved ring + conv states for prefix hits; None: 2 per slot
    max_queued: int = 256  # waiting requests beyond this get 429
    max_logprobs: int = 20
    decode_steps: int = 8  # decode steps queued before the host reads their tokens (it applies stops afterwards)
    fuse_projections: bool = True  # q|k|v|r, MLP gate|up, shared experts as one MLP (placement.model_view)
    speculative: SpeculativeConfig | None = None  # None: one token per decode step
    lora: LoRAConfig | None = None  # LoRA adapters served beside the base (`serve.lora`)
    # routing replay: every finished sequence's Output carries the experts each MoE layer chose at each position
    # (`serve.runner.routing_record`); off, the step programs and the host do nothing more
    record_experts: bool = False
    # every step samples with the full sampler (filters, penalties, logprobs; `serve.runner.sampler`), and only its
    # programs compile (prefill programs always do; decode and mixed ones then lose their plain twins): for engines
    # whose requests all ask for logprobs (RL rollouts)
    full_sampler_only: bool = False
    # the full sampler's top-k / top-p / min-p filters (16 passes over [rows, vocab] per step, most of the sampler's
    # time); off, for engines whose requests never filter (RL rollouts), requests that do are refused
    sampling_filters: bool = True
    # requests may ask for their prompts' logprobs (a prefill program that runs the head at every position, with
    # its [rows x chunk, vocab] logits); off for engines that never score prompts (RL rollouts): one program and
    # its buffers fewer
    score_prompts: bool = True
    # a step of decodes and one prompt chunk runs as one program (`StepPrograms.mixed`): the projections, MLPs,
    # MoEs and head over both sets' tokens at once, so the step reads the weights once; off, or where no mixed
    # program fits (`mixed_buckets`), such a step runs a decode program and a prefill program
    mixed_steps: bool = True
    # the prompt chunks' row buckets that mixed programs are compiled for beside every decode row bucket (each a
    # row bucket with a prefill program of the largest chunk): a step of decodes and up to the most of them runs
    # as one program; None: the smallest row bucket (one chunk: a busy server's steady state) and the most rows
    # of the largest chunk (a burst of prompts prefilled beside the decodes)
    mixed_prefill_rows: tuple[int, ...] | None = None

    def __post_init__(self):
        if self.max_num_seqs < 1 or self.page_size < 1 or self.max_model_len < 2:
            raise ValueError("max_num_seqs, page_size must be >= 1 and max_model_len >= 2")
        if list(self.chunk_buckets) != sorted(set(self.chunk_buckets)) or self.chunk_buckets[0] != 1:
            raise ValueError(f"chunk_buckets must increase from 1 (decode), got {self.chunk_buckets}")
        if self.max_chunk < self.page_size:
            raise ValueError(f"the largest chunk ({self.max_chunk}) must hold at least one page ({self.page_size})")
        if self.max_num_batched_tokens < max(self.max_num_seqs + self.page_size, self.max_chunk):
            raise ValueError("max_num_batched_tokens must cover the largest chunk, and a decode token per slot "
                             "plus one page of prefill")
        rows = self.rows
        if list(rows) != sorted(set(rows)) or rows[0] < 1 or rows[-1] != self.num_rows:
            raise ValueError(f"row_buckets must increase and end at every row ({self.num_rows}), got {rows}")
        mixed = self.mixed_prefill_rows or ()
        if list(mixed) != sorted(set(mixed)) or not set(mixed) <= set(self._chunk_rows):
            raise ValueError(f"mixed_prefill_rows must increase and be row buckets below every row with a prefill "
                             f"program of the largest chunk ({self.max_chunk} tokens), got {self.mixed_prefill_rows}")
        if rows[0] * self.max_chunk > self.max_num_batched_tokens:
            raise ValueError(f"a prefill step of {rows[0]} row(s) x {self.max_chunk} tokens exceeds the token budget "
                             f"({self.max_num_batched_tokens}): add a smaller row bucket or raise the budget")
        if self.decode_steps < 1:
            raise ValueError("decode_steps must be >= 1")
        if not 0 < self.memory_fraction <= 1:
            raise ValueError("memory_fraction must be in (0, 1]")
        if self.lora is not None and self.speculative is not None:
            raise ValueError("LoRA adapters are not served with speculative decoding yet")
        if self.record_experts and self.speculative is not None:
            raise ValueError("record_experts (routing replay) does not work with speculative decoding yet")

    def check_request(self, params: SamplingParams) -> None:
        """Raises InvalidParams for what this engine does not compile: prompt scoring (`score_prompts`), the
        sampling filters (`sampling_filters`)."""
        if params.prompt_logprobs is not None and not self.score_prompts:
            raise InvalidParams("prompt_logprobs: this engine does not score prompts", "prompt_logprobs")
        used = {"top_k": params.top_k > 0, "top_p": params.top_p < 1.0, "min_p": params.min_p > 0.0}
        filter_used = next((name for name, on in used.items() if on), None)
        if filter_used and not self.sampling_filters:
            raise InvalidParams(f"{filter_used}: this engine samples without filters", filter_used)

    def full_sampler(self, tokens: int, asked: bool) -> bool:
        """Whether a step of `tokens` tokens per row (a mixed step counts as a decode step, 1) runs the full
        sampler's program (`serve.runner.sampler.sample`); `asked`: whether one of its requests needs it
        (`SamplingParams.needs_full_sampler`). Prefill steps always do: it costs them little beside a chunk's
        forward (a decode step much), and start-up compiles one program per prefill bucket, not two."""
        return asked or self.full_sampler_only or tokens > 1

    def samplers(self, tokens: int) -> tuple[bool, ...]:
        """The sampler programs (`full_sampler`'s answers) compiled for a bucket of `tokens` tokens per row."""
        return tuple(sorted({self.full_sampler(tokens, False), True}))

    @property
    def num_rows(self) -> int:
        """Cache rows: one per slot plus a scratch row, the last, that padding rows of a gathered step read."""
        return self.max_num_seqs + 1

    @property
    def lora_experts(self) -> bool:
        """Whether LoRA adapters may adapt the experts (`LoRAConfig.experts`)."""
        return self.lora is not None and self.lora.experts

    @property
    def max_chunk(self) -> int:
        return self.chunk_buckets[-1]

    @property
    def lookahead(self) -> int:
        """Positions past its tokens that a step may write for a row (`SpeculativeConfig.lookahead`; else 0)."""
        return 0 if self.speculative is None else self.speculative.lookahead

    @property
    def ring_slack(self) -> int:
        """Slots the sliding rings hold past the window (`SpeculativeConfig.ring_slack`; else 0)."""
        return 0 if self.speculative is None else self.speculative.ring_slack

    def mtp_depths(self, model: InklingConfig) -> int:
        """How many of `model`'s MTP depths the engine drafts with (`SpeculativeConfig.mtp_depths`; else none):
        the depths its model view and cache keep."""
        if self.speculative is None or model.mtp is None:
            return 0
        return self.speculative.mtp_depths(model.mtp.num_layers)

    @property
    def pages_per_row(self) -> int:
        return -(-(self.max_model_len + self.lookahead) // self.page_size)

    @property
    def rows(self) -> tuple[int, ...]:
        if self.row_buckets is not None:
            return tuple(self.row_buckets)
        powers = []
        size = 1
        while size < self.max_num_seqs:
            powers.append(size)
            size *= 2
        return tuple(powers) + (self.num_rows,)

    @property
    def snapshots(self) -> int:
        if not self.prefix_caching:
            return 0
        return 2 * self.max_num_seqs if self.num_snapshots is None else self.num_snapshots

    @property
    def prompt_logprobs_rows(self) -> int:
        """Rows of the one prefill program that also computes prompt logprobs (`ModelRunner`; it runs the head at
        every position, chunks padded to the largest): the most rows of a bucket whose largest chunks fit the token
        budget. A step's prefill rows run in it when any of them asks."""
        return max(r for r in self.rows if r * self.max_chunk <= self.max_num_batched_tokens)

    @property
    def mixed_buckets(self) -> tuple[int, ...]:
        """The decode row buckets of the mixed programs (`mixed_steps`), each with the prompt chunks of
        `mixed_prefills`. None are compiled with speculative decoding, or where the smallest row bucket is every
        row (the chunks' rows are gathered, apart from the decode rows)."""
        if not self.mixed_steps or self.speculative is not None or self.rows[0] == self.num_rows:
            return ()
        return self.rows

    @property
    def mixed_prefills(self) -> tuple[int, ...]:
        """The rows of prompt chunks (each of the largest chunk size) that the mixed programs take, one program per
        decode row bucket and each of them (`mixed_prefill_rows`); none without mixed programs."""
        if not self.mixed_buckets:
            return ()
        return self.mixed_prefill_rows or tuple(sorted({self.rows[0], max(self._chunk_rows)}))

    @property
    def _chunk_rows(self) -> tuple[int, ...]:
        """The row buckets below every row with a prefill program of the largest chunk."""
        return tuple(r for r in self.rows[:-1] if self.fits(r, self.max_chunk))

    def mixed_prefill_bucket(self, chunks: int) -> int | None:
        """The fewest prompt-chunk rows of a mixed program that hold `chunks` chunks (None: none does)."""
        return next((rows for rows in self.mixed_prefills if rows >= chunks), None)

    @property
    def max_step_tokens(self) -> int:
        """The most tokens (padding included) that one compiled step program runs: a bucket's rows x tokens, or a
        mixed program's decode rows plus its chunk."""
        mixed = [rows + max(self.mixed_prefills) * self.max_chunk for rows in self.mixed_buckets]
        return max([r * t for r, t in self.buckets] + mixed)

    def fits(self, rows: int, tokens: int) -> bool:
        """Whether a step of `rows` rows of up to `tokens` tokens has a compiled bucket."""
        return tokens == 1 or self.row_bucket(rows) * self.chunk_bucket(tokens) <= self.max_num_batched_tokens

    @property
    def buckets(self) -> list[tuple[int, int]]:
        """Every compiled (rows, tokens) shape."""
        return [(r, t) for t in self.chunk_buckets for r in self.rows if t == 1 or r * t <= self.max_num_batched_tokens]

    def row_bucket(self, rows: int) -> int:
        return next(b for b in self.rows if b >= rows)

    def chunk_bucket(self, tokens: int) -> int:
        return next(b for b in self.chunk_buckets if b >= tokens)
