"""The scheduler: token budget, prefill chunks beside decodes, compiled buckets, first-come admission bounded by
slots, and preemption by recompute."""

from serve.engine.block_manager import BlockManager
from serve.engine.config import EngineConfig
from serve.engine.scheduler import Scheduler
from serve.engine.sampling_params import SamplingParams
from serve.engine.sequence import PENDING, Sequence, Status
from tests.serve.engine.sequences import seq_of


def make_scheduler(num_blocks=64, **overrides):
    config = EngineConfig(**{**dict(max_num_seqs=3, max_model_len=64, max_num_batched_tokens=20, page_size=4,
                                    chunk_buckets=(1, 8)), **overrides})
    return Scheduler(config, BlockManager(num_blocks, config.page_size, config.snapshots))


def run_step(scheduler, sample=True):
    """Schedule, pretend the model ran, append a token to every sequence that reached its end."""
    chunks = scheduler.schedule()
    for c in chunks:
        c.seq.num_cached += c.num_tokens
        scheduler.blocks.register(c.seq)
        if sample and c.seq.num_cached == len(c.seq):
            c.seq.append(7)
    return chunks


def test_budget_chunks_and_decodes_share_steps():
    scheduler = make_scheduler(prefix_caching=False)
    long, short = seq_of(30), seq_of(3)
    scheduler.add(long)
    scheduler.add(short)
    first = run_step(scheduler)
    assert [(c.seq, c.num_tokens) for c in first] == [(long, 8), (short, 3)]  # chunk cap, then a whole prompt
    second = run_step(scheduler)
    assert [(c.seq, c.num_tokens) for c in second] == [(long, 8), (short, 1)]  # prefill chunk + a decode
    for chunks in (first, second):
        assert sum(c.num_tokens for c in chunks) <= 20
        assert all(c.seq.num_cached % 4 == 0 or c.seq.num_cached == len(c.seq) - 1 for c in chunks)


def test_prefix_caching_takes_no_extra_chunk():
    for prefix_caching in (True, False):
        scheduler = make_scheduler(prefix_caching=prefix_caching)
        seq = seq_of(22)  # pages of 4, chunks of at most 8: 8 + 8 + 6, not 4 + 2 at 20 (its last page boundary)
        scheduler.add(seq)
        assert [[c.num_tokens for c in run_step(scheduler)] for _ in range(3)] == [[8], [8], [6]]


def test_prefill_rows_stay_within_a_compiled_bucket():
    scheduler = make_scheduler(prefix_caching=False)  # rows (1, 2, 4) x 8 tokens: 4 x 8 > the budget of 20
    assert (4, 8) not in scheduler.config.buckets and (4, 1) in scheduler.config.buckets
    for _ in range(3):
        scheduler.add(seq_of(2))
    assert [c.num_tokens for c in run_step(scheduler)] == [2, 2]
    assert [c.num_tokens for c in run_step(scheduler)] == [1, 1, 2]


def test_admission_is_first_come_first_served_and_bounded_by_slots():
    scheduler = make_scheduler(prefix_caching=False, max_num_batched_tokens=32)
    seqs = [seq_of(2) for _ in range(5)]
    for s in seqs:
        scheduler.add(s)
    run_step(scheduler)
    assert scheduler.running == seqs[:3] and list(scheduler.waiting) == seqs[3:]
    scheduler.finish(seqs[1])
    run_step(scheduler)
    assert scheduler.running == [seqs[0], seqs[2], seqs[3]]
    assert seqs[1].status is Status.FINISHED and seqs[1].block_ids == []


def test_preemption_by_recompute_when_pages_run_out():
    scheduler = make_scheduler(num_blocks=4, prefix_caching=False)  # 16 tokens of KV in all
    old, new = seq_of(6), seq_of(6)
    scheduler.add(old)
    scheduler.add(new)
    run_step(scheduler)  # both prefilled (2 pages each), then decode until old needs a third page
    for _ in range(3):
        run_step(scheduler)
    assert scheduler.num_preemptions == 1 and len(old) == 10
    assert new.status is Status.WAITING and new.num_cached == 0 and new.block_ids == [] and new.slot is None
    assert list(scheduler.waiting) == [new] and len(new) == 9  # its sampled tokens are kept for the recompute
    scheduler.finish(old)
    chunks = run_step(scheduler, sample=False)
    assert [(c.seq, c.num_tokens) for c in chunks] == [(new, 8)]  # recomputed: prompt and output alike


def apply_ahead(chunks):
    """As the engine does with a step it queues the next behind: tokens cached, each sample PENDING."""
    for c in chunks:
        c.seq.num_cached += c.fed
        c.seq.add_pending(c.samples)


def test_a_step_scheduled_ahead_preempts_nothing():
    scheduler = make_scheduler(num_blocks=4, prefix_caching=False)  # as in the preemption test above
    old, new = seq_of(6), seq_of(6)
    scheduler.add(old)
    scheduler.add(new)
    run_step(scheduler)
    run_step(scheduler)  # 7 tokens each cached, the 8th known
    apply_ahead(scheduler.schedule(ahead=True))  # the 8th fed (their two pages full), the 9th pending
    assert scheduler.schedule(ahead=True) == [] and scheduler.num_preemptions == 0  # the 9th needs a third page
    assert new.status is Status.RUNNING and new.num_cached == 8 and len(new.block_ids) == 2


def test_a_step_scheduled_ahead_skips_a_sequence_its_pending_token_ends():
    scheduler = make_scheduler(prefix_caching=False)
    ends, goes_on = seq_of(5, SamplingParams(max_tokens=1)), seq_of(5, SamplingParams(max_tokens=2))
    scheduler.add(ends)
    scheduler.add(goes_on)
    first = scheduler.schedule()
    assert [c.ends for c in first] == [True, True]
    apply_ahead(first)
    second = scheduler.schedule(ahead=True)
    assert [(c.seq, c.num_tokens, c.ends) for c in second] == [(goes_on, 1, True)]
    assert goes_on.token_ids[-1] == PENDING and goes_on.num_uncached == 1


def test_a_sequence_asking_prompt_logprobs_takes_no_prefix_hit():
    scheduler = make_scheduler()
    prompt = seq_of(13).token_ids
    first = Sequence(prompt, SamplingParams())
    scheduler.add(first)
    while first.num_cached < len(prompt):  # prefilled as the engine does: pages published, chunk ends saved
        for chunk in scheduler.schedule():
            chunk.seq.num_cached += chunk.num_tokens
            scheduler.blocks.register(chunk.seq)
            scheduler.blocks.snapshot_slot(chunk.seq)
    scheduler.finish(first)
    plain, scored = Sequence(prompt, SamplingParams()), Sequence(prompt, SamplingParams(prompt_logprobs=1))
    scheduler.add(plain)
    scheduler.add(scored)
    chunks = scheduler.schedule()
    assert plain.prefix_hit == 8 and scored.prefix_hit == 0  # its logprobs need the cached prefix computed
    assert [(c.seq, c.num_tokens, c.scores) for c in chunks] == [(plain, 5, False), (scored, 8, True)]


def test_prompt_logprob_chunks_run_in_the_scoring_programs_rows():
    def first_step(params):
        scheduler = make_scheduler(max_num_seqs=4, max_num_batched_tokens=32, chunk_buckets=(1, 4, 8),
                                   prefix_caching=False)
        for _ in range(4):
            scheduler.add(Sequence(seq_of(4).token_ids, params))
        return scheduler.config, scheduler.schedule()

    config, plain = first_step(SamplingParams())
    assert len(plain) == 4 and (5, 4) in config.buckets  # 4 prompts of 4 tokens in one prefill step...
    assert config.prompt_logprobs_rows == 2  # ...but the scoring program is 2 rows x 8 (5 x 8 exceeds 32)
    _, scored = first_step(SamplingParams(prompt_logprobs=0))
    assert [(c.num_tokens, c.scores) for c in scored] == [(4, True), (4, True)]
