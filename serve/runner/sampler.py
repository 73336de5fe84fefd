"""The on-device sampler: one row per sequence, each with its own parameters, in one fixed-shape program; and the
host's side of it: the rows' parameters in (`batch_of`), their samples out (`unpack_samples`, `read_samples`).

Order: penalties -> temperature -> top-k -> top-p -> min-p -> Gumbel-max draw (greedy rows: the same argmax
without noise). Reported logprobs are those of the model's own distribution (before penalties and temperature),
as OpenAI reports them. The random draw of a row depends only on (seed, index of the token in its output), so a
seeded request gives the same tokens alone or batched with others, and after a preemption. With `invariant` (a
batch-invariant model: `inkling_jax.backend.Backend.batch_invariant`) the sums over the vocabulary (logprobs, top-p
mass) are fixed-order trees and the logprobs are `invariant.log_softmax`'s, a trainer's formula, so that they do not
depend on the other rows either.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from inkling_jax.nn import invariant as fixed_order
from serve.engine.outputs import Sample
from serve.engine.sampling_params import SamplingParams

DIGIT_BITS = 4  # the cutoff searches fix 4 bits of a key per pass over the logits: 8 passes each


@struct.dataclass
class SamplingBatch:
    """Per-row parameters [R]: the fields of `SamplingParams` of the same names, and each row's place in its
    output."""

    temperature: jax.Array
    top_p: jax.Array
    top_k: jax.Array  # <= 0: off
    min_p: jax.Array
    presence_penalty: jax.Array
    frequency_penalty: jax.Array
    repetition_penalty: jax.Array
    seed: jax.Array  # uint32
    index: jax.Array  # int32: how many tokens the row has sampled before this one

    @property
    def uses_penalties(self) -> jax.Array:
        """[R] bool: `SamplingParams.uses_penalties` of each row."""
        return (self.presence_penalty != 0) | (self.frequency_penalty != 0) | (self.repetition_penalty != 1)


INT_FIELDS = {"top_k": np.int32, "seed": np.uint32, "index": np.int32}  # SamplingBatch's; the others are float32
FLOAT_FIELDS = tuple(f.name for f in dataclasses.fields(SamplingBatch) if f.name not in INT_FIELDS)
NO_SEQUENCE = SamplingParams(temperature=0.0, seed=0)  # a padding row's: greedy, no filter, no penalty


def batch_of(params: list[SamplingParams], index: list[int]) -> SamplingBatch:
    """Host arrays [R] of the rows' parameters and output indices (`NO_SEQUENCE` for rows that hold none)."""
    columns = {f.name: [getattr(p, f.name) for p in params] for f in dataclasses.fields(SamplingBatch)
               if f.name != "index"}
    columns["seed"] = [0 if seed is None else seed for seed in columns["seed"]]  # Engine.submit seeds every choice
    columns["index"] = index
    return SamplingBatch(**{name: np.asarray(values, INT_FIELDS.get(name, np.float32))
                            for name, values in columns.items()})


@struct.dataclass
class Sampled:
    tokens: jax.Array  # [R] int32
    logprobs: jax.Array  # [R] logprob of the chosen token
    top_ids: jax.Array  # [R, K]
    top_logprobs: jax.Array  # [R, K]


def pack_samples(sampled: Sampled) -> jax.Array:
    """A step's samples as one int32 array [R, 2 + 2K] (the floats bit-cast), so that the host fetches one array
    per step, not four: fewer fetches between decode runs, where the host barely keeps ahead of the device (see
    docs/performance.md)."""
    as_int = lambda x: jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.int32)  # noqa: E731
    return jnp.concatenate([sampled.tokens[:, None], as_int(sampled.logprobs)[:, None], sampled.top_ids,
                            as_int(sampled.top_logprobs)], axis=1)


def unpack_samples(packed) -> Sampled:
    """`pack_samples`' inverse on the host: [..., R, 2 + 2K] int32 -> Sampled of numpy arrays [..., R(, K)]."""
    ints = np.asarray(packed, np.int32)
    floats, k = ints.view(np.float32), (ints.shape[-1] - 2) // 2
    return Sampled(ints[..., 0], floats[..., 1], ints[..., 2:2 + k], floats[..., 2 + k:])


def read_samples(host: Sampled, row: int, count: int, num_top: int) -> list[Sample]:
    """Row `row`'s samples of the first `count` steps of a host read-out [steps, R(, K)], each with its `num_top`
    most likely tokens."""
    top_ids = host.top_ids[:count, row, :num_top].tolist()
    top_logprobs = host.top_logprobs[:count, row, :num_top].tolist()
    return [Sample(int(host.tokens[k, row]), float(host.logprobs[k, row]), tuple(zip(top_ids[k], top_logprobs[k])))
            for k in range(count)]


def sample(logits, params: SamplingBatch, counts, prompt_mask, num_top: int, full: bool = True,
           invariant: bool = False, filters: bool = True) -> Sampled:
    """logits [R, V]; counts [R, V] (output tokens so far) and prompt_mask [R, V] feed the penalties.

    Branch-free: a data-dependent `lax.cond` makes the GPU program wait for its predicate on the host, which
    stops the host from queueing the next decode step ahead. `full` (static) is what the caller decides on the
    host instead: with it, penalties, the top-k / top-p / min-p filters, the chosen token's logprob and the top
    `num_top` ones (~20 passes and a top-k over [R, V]); without it, a temperature draw that reads the logits
    once, so that XLA fuses the LM head's epilogue into it (its logprobs are zeros; counts and prompt_mask are
    not read): the common request's decode step skips the penalties' counts and the passes for logprobs and
    min-p (see docs/performance.md). `filters` (static) False: the full sampler without the top-k / top-p / min-p
    passes, for engines that refuse requests using them (`EngineConfig.sampling_filters`). `invariant`: see the
    module doc."""
    if not full:
        return without_logprobs(_draw(logits.astype(jnp.float32), params, filtered=False), num_top)
    logits = logits.astype(jnp.float32)
    tokens = _draw(apply_penalties(logits, counts, prompt_mask, params), params, filtered=filters,
                   invariant=invariant)
    return with_logprobs(logits, tokens, num_top, invariant)


def with_logprobs(logits, tokens, num_top: int, invariant: bool = False) -> Sampled:
    """tokens [R] with their logprobs and the `num_top` most likely tokens under the model's own distribution,
    logits [R, V] float32. logprob = logit - logsumexp: only the chosen (and top) entries, never the whole [R, V]
    log-softmax; with `invariant`, `invariant.log_softmax` gathered at them. num_top 0 (an engine whose requests
    ask for no top tokens, RL rollouts): no top-k search over the vocabulary."""
    if num_top:
        top_logits, top_ids = jax.lax.top_k(logits, num_top)
    else:
        top_logits, top_ids = logits[:, :0], jnp.zeros((logits.shape[0], 0), jnp.int32)
    if invariant:
        logp = fixed_order.log_softmax(logits)
        pick = lambda ids: jnp.take_along_axis(logp, ids, axis=-1)  # noqa: E731
        return Sampled(tokens, pick(tokens[:, None])[:, 0], top_ids.astype(jnp.int32), pick(top_ids))
    lse = jax.nn.logsumexp(logits, axis=-1)
    chosen = jnp.take_along_axis(logits, tokens[:, None], axis=-1)[:, 0] - lse
    return Sampled(tokens, chosen, top_ids.astype(jnp.int32), top_logits - lse[:, None])


def without_logprobs(tokens, num_top: int) -> Sampled:
    """tokens [R] with zeros for their logprobs (the sampler without `full`)."""
    rows = tokens.shape[0]
    return Sampled(tokens, jnp.zeros((rows,), jnp.float32), jnp.zeros((rows, num_top), jnp.int32),
                   jnp.zeros((rows, num_top), jnp.float32))


def apply_penalties(x, counts, prompt_mask, params: SamplingBatch):
    seen = prompt_mask | (counts > 0)
    rep = params.repetition_penalty[:, None]
    x = jnp.where(seen, jnp.where(x > 0, x / rep, x * rep), x)
    return x - params.frequency_penalty[:, None] * counts - params.presence_penalty[:, None] * (counts > 0)


def _draw(x, params: SamplingBatch, filtered: bool, invariant: bool = False):
    """Each row's token: a Gumbel-max draw from x / temperature after the filters (`filtered`: top-k, top-p,
    min-p), or for greedy rows (temperature 0) the argmax of x. One argmax serves both (an argmax over [R, V]
    fewer than a greedy argmax beside the draw): greedy rows get no noise, and the filters keep every row's
    largest entry."""
    x = target_logits(x, params, filtered, invariant)
    noise = jnp.where((params.temperature > 0)[:, None], gumbel_noise(params.seed, params.index, x.shape[-1]), 0.0)
    return jnp.argmax(x + noise, axis=-1).astype(jnp.int32)


def target_logits(x, params: SamplingBatch, filtered: bool, invariant: bool = False):
    """The logits whose softmax a sampling row draws from: x / temperature, then (`filtered`) top-k, top-p and
    min-p as -inf; greedy rows' x as it is (filtered too: the filters keep the largest entry). `invariant`: the
    top-p mass summed in a fixed order."""
    sampling = params.temperature > 0
    x = x / jnp.where(sampling, params.temperature, 1.0)[:, None]
    if filtered:
        x = top_k_top_p(x, params.top_k, params.top_p, invariant=invariant)
        floor = jnp.log(jnp.maximum(params.min_p, 1e-30))[:, None]
        x = jnp.where((params.min_p[:, None] > 0) & (x - x.max(-1, keepdims=True) < floor), -jnp.inf, x)
    return x


def gumbel_noise(seed, index, vocab: int):
    """Standard Gumbel noise [R, vocab] that depends only on each row's (seed, index) and the position
    (`uniform_noise`)."""
    return -jnp.log(-jnp.log(uniform_noise(seed, index, vocab)))


def uniform_noise(seed, index, vocab: int):
    """Uniform noise in (0, 1) [R, vocab] that depends only on each row's (seed, index) and the position.

    A counter-based hash, not jax.random's threefry (20 rounds per pair of words), which the program computes
    over all of [R, V] for every row, greedy ones included, since it has no branch. A draw needs uniform bits,
    independent across positions, rows and steps; two rounds of a 32-bit avalanche mix of (position, row key)
    give that at a few integer operations per entry (cheaper than threefry at wide batches; see
    docs/performance.md)."""
    row_key = _mix32(_mix32(seed.astype(jnp.uint32) ^ jnp.uint32(0x5BD1E995))
                     ^ index.astype(jnp.uint32) * jnp.uint32(0x9E3779B9))[:, None]
    position = jnp.arange(vocab, dtype=jnp.uint32)[None, :]
    bits = _mix32(_mix32(position ^ row_key) + row_key)
    # 23 bits, so that float32 holds (b + 0.5) exactly: u in (0, 1), both logs finite
    return ((bits >> 9).astype(jnp.float32) + 0.5) * (1.0 / (1 << 23))


def _mix32(h):
    """A bijection of uint32 in which each input bit flips each output bit with probability ~1/2 (two rounds
    of multiply and xor-shift)."""
    h = (h ^ (h >> 16)) * jnp.uint32(0x7FEB352D)
    h = (h ^ (h >> 15)) * jnp.uint32(0x846CA68B)
    return h ^ (h >> 16)


def top_k_top_p(x, top_k, top_p, digit_bits: int = DIGIT_BITS, invariant: bool = False):
    """Keep the top_k largest (<= 0: all), then the smallest head of those whose probability reaches top_p.

    Without a sort (a sort of [R, V] is slow on GPUs): the kept entries of a row are those at or above a cutoff,
    and each cutoff is found digit by digit over the values' order-preserving uint32 keys, one masked count (or
    sum) per digit over [R, V] for all of a digit's values at once. First the k-th largest key; then the largest
    key above which the top-k head still holds top_p of its mass. The definition through a sort keeps the same
    entries except where the mass crosses top_p within float32 rounding, and where values tie at the k-th largest
    (then all of the tied ones count toward the mass). `invariant`: the masses are fixed-order sums."""
    vocab = x.shape[-1]
    key = _order_key(x)
    k = jnp.where(top_k > 0, jnp.minimum(top_k, vocab), vocab)[:, None]
    kth, _ = _largest_true(lambda t: _count_at_least(key, t) >= k, key.shape[0], digit_bits)
    e = jnp.exp(x - x.max(-1, keepdims=True))
    total = fixed_order.tree_sum if invariant else jnp.sum
    head_mass = total(jnp.where(key >= kth, e, 0.0), -1, keepdims=True)
    mass = jnp.where(top_p[:, None] < 1.0, top_p[:, None] * head_mass, jnp.inf)
    # the largest t with at least `mass` strictly above it (t + 1 wraps only at t = 2**32 - 1, probed only if mass
    # lay above 2**32 - 16: a NaN)
    cut, cutting = _largest_true(lambda t: _count_at_least(key, t + 1, e, total) >= mass, key.shape[0], digit_bits)
    keep = (key >= kth) & (~cutting | (key > cut))
    return jnp.where(keep, x, -jnp.inf)


def _order_key(x):
    """uint32 keys in the order of the float32 values x (negative floats: all bits flipped; others: the sign)."""
    bits = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32)
    return jnp.where(bits >> 31 == 1, ~bits, bits | jnp.uint32(1 << 31))


def _count_at_least(key, t, weight=None, total=jnp.sum):
    """key [R, V], thresholds t [R, P] -> [R, P]: how many keys of the row are >= t (or the sum of their weights,
    by `total`). One pass over key for all P thresholds of a row."""
    hit = key[:, :, None] >= t[:, None, :]
    if weight is None:
        return jnp.sum(hit, axis=1)
    return total(jnp.where(hit, weight[:, :, None], 0.0), axis=1)


def _largest_true(holds, rows: int, digit_bits: int):
    """The largest uint32 t of each row where holds(t) is true, for a predicate true up to some point and false
    after it, and whether it holds anywhere ([R, 1] each). holds maps thresholds [R, P] to bools [R, P]. One
    call per digit of digit_bits bits, most significant first, unrolled (32 / digit_bits calls)."""
    if 32 % digit_bits:
        raise ValueError(f"digit_bits must divide 32, not {digit_bits}")
    digits = jnp.arange(1 << digit_bits, dtype=jnp.uint32)[None, :]
    prefix, anywhere = jnp.zeros((rows, 1), jnp.uint32), None
    for shift in range(32 - digit_bits, -1, -digit_bits):
        true = jnp.sum(holds(prefix | (digits << shift)), axis=-1, keepdims=True).astype(jnp.uint32)
        anywhere = true > 0 if anywhere is None else anywhere
        prefix = prefix | (jnp.maximum(true, 1) - 1) << shift  # the digit: the last of the true ones
    return prefix, anywhere
