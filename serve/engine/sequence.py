"""One sequence the engine generates: its tokens, its place in the cache, and where it is in its life.

A request with n choices (or several prompts) is several sequences. `num_cached` tokens are in the cache; the
tokens after them are what the next step must feed (the whole prompt, a prefill chunk, or the one token just
sampled). Preemption drops the cache (`num_cached = 0`) and keeps the tokens, so it resumes by recompute.

While a step is in flight whose results the engine applied ahead (`serve.engine.steps_ahead`), `num_cached`
counts the tokens it feeds (`num_unread` of them) and each token it samples stands as PENDING at the end of the
tokens until it is read.
"""

from __future__ import annotations

import enum
import itertools

from serve.engine.outputs import Sample
from serve.engine.sampling_params import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


_ids = itertools.count()

PENDING = -1  # a sampled token not yet read: the device feeds the row's last sample in its place


class Sequence:
    def __init__(self, prompt_ids: list[int], params: SamplingParams, *, request_id: str = "", index: int = 0,
                 media=None, hash_seed: bytes = b"", adapter=None):
        if not prompt_ids:
            raise ValueError("a sequence needs at least one prompt token")
        self.seq_id = next(_ids)
        self.request_id = request_id
        self.index = index  # its choice index in the request
        self.params = params
        self.token_ids = list(prompt_ids)
        self.num_prompt = len(prompt_ids)
        self.num_cached = 0
        self.num_pending = 0  # trailing tokens that are PENDING
        self.num_unread = 0  # of the cached tokens, those fed by steps not yet read
        self.status = Status.WAITING
        self.slot: int | None = None
        self.block_ids: list[int] = []
        self.block_hashes: list[bytes] = []  # chained hashes of its full blocks (a function of the tokens)
        self.num_registered = 0  # leading blocks already published to the prefix cache
        self.num_preemptions = 0
        self.prefix_hit = 0  # prompt tokens taken from the prefix cache at the last admission
        self.media = media  # (prompt positions [M], embeddings [M, hidden]) that replace those tokens, or None
        self.adapter = adapter  # the LoRA adapter it runs with (a `serve.lora.adapters.Adapter`); None: the base
        self.lora_slot = 0  # its adapter's device slot in the step being dispatched (0: the base)
        # starts the block-hash chain: prompts with different media or adapters never share pages
        self.hash_seed = hash_seed if adapter is None else hash_seed + b"\0" + adapter.key
        self.prompt_logprobs: list[Sample] = []  # of prompt tokens 1, 2, ... as far as computed (where asked)
        self.drafts: list[int] = []  # speculative decoding: tokens drafted after the last one, for the next round
        self.accepted: list[tuple[int, int]] = []  # speculative decoding: (drafts verified, accepted) per round
        self.routed_experts = None  # where the engine records routing: read out as it ends (`Output`)

    @property
    def adapter_name(self) -> str | None:
        return None if self.adapter is None else self.adapter.name

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def num_output(self) -> int:
        return len(self.token_ids) - self.num_prompt

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt:]

    @property
    def num_uncached(self) -> int:
        return len(self.token_ids) - self.num_cached

    @property
    def scores_prompt(self) -> bool:
        """Its prefill chunks compute prompt logprobs: asked for and not all computed yet. They are computed from
        the prompt's first token on, so such a sequence takes no prefix-cache hit (the pages hold no logits)."""
        return self.params.prompt_logprobs is not None and len(self.prompt_logprobs) < self.num_prompt - 1

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED

    def end_reason(self, token: int, eos_token_id: int, max_model_len: int) -> str | None:
        """Why the sequence ends with `token`, its last token but the pending ones: "stop" (EOS unless ignored,
        or a stop id), "length" (max_tokens or the context), else None."""
        p = self.params
        if (token == eos_token_id and not p.ignore_eos) or token in p.stop_token_ids:
            return "stop"
        return "length" if self.reached_length(max_model_len, self.num_pending) else None

    def reached_length(self, max_model_len: int, but: int = 0) -> bool:
        """Whether its tokens but the last `but` reach max_tokens or the context."""
        return self.num_output - but >= self.params.max_tokens or len(self) - but >= max_model_len

    def append(self, token: int) -> None:
        self.token_ids.append(token)

    def add_pending(self, count: int) -> None:
        """`count` tokens sampled by a step not yet read."""
        self.token_ids += [PENDING] * count
        self.num_pending += count

    def fill_pending(self, token: int) -> None:
        """The oldest pending token is `token`."""
        self.token_ids[len(self) - self.num_pending] = token
        self.num_pending -= 1

    def __repr__(self) -> str:
        return (f"Sequence({self.seq_id}, {self.status.value}, tokens={len(self)}, cached={self.num_cached}, "
                f"slot={self.slot})")
