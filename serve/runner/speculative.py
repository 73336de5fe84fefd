"""Speculative decoding on the device: the programs of an engine whose decode steps verify drafted tokens.

A round, for every running row at cached length L whose last sampled token t0 is not yet in the cache:

1. verify: the target extends [t0, d1 .. dK] (the row's drafts; `n_new` = 1 + the drafts it may use) in one
   chunk over the paged cache, the ShortConv inputs kept (`keep_conv_inputs`). Its sliding layers' rings hold K
   slots past the window (`SpeculativeConfig.ring_slack`), so what it writes for drafts the row rejects
   overwrites no position the window still needs;
2. accept (`rejection.verify`): position j's logits give the target's distribution after d1 .. dj as the plain
   sampler would draw from it (the row's parameters at output index + j, penalties counting the drafts before
   j). A greedy row keeps the longest prefix of drafts with d_{j+1} == argmax; a sampling row keeps each draft
   with the target's probability of it and draws the token after its last kept draft from the residual, so the
   output is distributed exactly as plain sampling's. a = drafts kept; the row emits them and one more token;
3. commit: the cache keeps t0, d1 .. da (length L + a + 1) and the ShortConv states after them; nothing is
   copied back;
4. draft (method "mtp"): every MTP depth the engine keeps (those the chain reads, the first min(K, depths):
   `drafter_layers`) runs over the kept positions with the trunk's hidden states and the tokens after them
   (g_0 .. g_a), so its cache advances with the trunk's (`MTPHead.extend`); depth 0's output at the last kept
   position drafts d'1, and the chain feeds each step's hidden state and token to the next position (step j
   through depth min(j, depths - 1)) for d'2 .. d'K. The chain's entries past the length stay (never read: the
   drafter's rings too hold K slots past the window), its ShortConv states are not kept.

Method "draft": a smaller Inkling with its own layers in the cache (same lengths and pages) extends over the
kept tokens, then runs K one-token steps from the emitted token for d'1 .. d'K, left behind as the MTP chain is.
A prefill chunk drafts the same way after its sample (`_draft`). A run of rounds (up to the engine's decode steps)
feeds each round the last token and drafts of the one before on the device; the last drafts go back to the host
with the samples and return as the next run's input (`serve.runner.drafters`), unless the engine continues the
run before reading it: the next run then starts from its carry on the device.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from inkling_jax.config import InklingConfig, TextConfig
from inkling_jax.nn.cache import Cache, init_cache
from inkling_jax.nn.mtp import first_depths
from serve.engine.config import SpeculativeConfig
from serve.runner.rollback import keep_conv_prefix
from serve.runner.rejection import verify
from serve.runner.sampler import pack_samples
from serve.runner.steps import PackedInputs, RowState, StepInputs, StepPrograms, unpack


def drafter_layers(config: InklingConfig, speculative: SpeculativeConfig | None,
                   draft: InklingConfig | None = None) -> TextConfig | None:
    """The text config of the layers whose cache the drafter keeps beside the target's: the MTP depths it drafts
    with (`SpeculativeConfig.mtp_depths`; the trunk's attention shapes, local where the depth is), the draft
    model's layers, or None."""
    if speculative is None or speculative.method == "oracle":
        return None
    if speculative.method == "draft":
        return draft.text
    mtp = first_depths(config, speculative.mtp_depths(config.mtp.num_layers)).mtp
    return dataclasses.replace(config.text, num_layers=mtp.num_layers, dense_layer_ids=(),
                               local_layer_ids=mtp.local_layer_ids)


def cache_layout(target: TextConfig, drafter: TextConfig | None) -> TextConfig:
    """A text config whose layers are the cache's, for what reads only which layers are local (`cache_rows`,
    shardings, the memory plan): the target's, then the drafter's."""
    if drafter is None:
        return target
    return dataclasses.replace(target, num_layers=target.num_layers + drafter.num_layers,
                               local_layer_ids=target.local_layer_ids + tuple(
                                   target.num_layers + i for i in drafter.local_layer_ids))


def init_serving_cache(target: TextConfig, drafter: TextConfig | None, *args, **kwargs) -> Cache:
    """`init_cache` of the target with the drafter's layers appended (same rows, lengths and page table)."""
    cache = init_cache(target, *args, **kwargs)
    return cache if drafter is None else cache.replace(layers=cache.layers + init_cache(drafter, *args,
                                                                                         **kwargs).layers)


def check_speculative(config: InklingConfig, speculative: SpeculativeConfig | None,
                      draft: InklingConfig | None = None, oracle: bool = False) -> None:
    """A clear error for drafters that do not go with the method, and for a model (and draft model) the method
    cannot serve."""
    method = None if speculative is None else speculative.method
    if (method == "draft") != (draft is not None) or (method == "oracle" and not oracle) or (method is None and oracle):
        raise ValueError(f"speculative method {method}: a draft model goes with method 'draft' and an oracle "
                         "drafter with 'oracle' or 'mtp'; 'draft' and 'oracle' need theirs")
    if speculative is None:
        return
    k = speculative.num_draft_tokens
    if speculative.method == "mtp" and config.mtp is None:
        raise ValueError("speculative method 'mtp' needs a model with an MTP head (config.mtp is None)")
    for text in (config.text,) if draft is None else (config.text, draft.text):
        if text.local_layer_ids and k + 1 > text.sliding_window:
            raise ValueError(f"{k} draft tokens: a verify of {k + 1} tokens must fit the sliding window "
                             f"({text.sliding_window})")
    if draft is not None and draft.text.unpadded_vocab_size != config.text.unpadded_vocab_size:
        raise ValueError(f"the draft model's vocabulary ({draft.text.unpadded_vocab_size}) is not the model's "
                         f"({config.text.unpadded_vocab_size})")


def after_reads(active, hidden):
    """`active` [R] as a function of `hidden` [R, T, H] too (false only where a row's is NaN), so that a draft
    chain whose writes follow `active` runs after what `hidden` was computed from. A chain step writes the
    drafter's KV pools in place, which the extend before it read; its inputs (a token, the previous step's
    output) do not depend on those reads, and without that order XLA copies each pool whole before writing it."""
    return active & ~jnp.isnan(hidden[:, 0, 0])


def no_previous_round(rows: int, num_drafts: int) -> tuple:
    """The carry a run's first round reads (`SpeculativePrograms.round`): no token, no drafts, nothing emitted."""
    return np.zeros((rows,), np.int32), np.zeros((rows, num_drafts), np.int32), np.zeros((rows,), np.int32)


class SpeculativePrograms(StepPrograms):
    def __init__(self, merge, *args, config: InklingConfig, speculative: SpeculativeConfig, **kwargs):
        """merge: parameter leaves -> the target model, or with method "draft" -> [target, draft model]."""
        self.method = speculative.method
        super().__init__((lambda leaves: merge(leaves)[0]) if self.method == "draft" else merge, *args, **kwargs)
        self.merge_draft = lambda leaves: merge(leaves)[1]  # noqa: E731  (method "draft" only)
        self.num_drafts = speculative.num_draft_tokens
        self.trunk_layers = config.text.num_layers
        self.history = config.text.conv_kernel_size - 1

    def round(self, param_leaves, cache, row_state: RowState, packed: PackedInputs, step, previous, *,
              gather: bool, full: bool):
        """Round `step` (int32 scalar) of a run of rounds over the same inputs (module docstring), ids [R, K + 1]
        and an oracle's plan after them (`drafters.plan_columns`: the later rounds verify its drafts, not the
        drafter's, which still come back as the run's last drafts). Round 0 verifies the host's ids and n_new; a
        later one each row's last token and drafts from `previous`, the run's carry (last token [R], drafts
        [R, K], tokens emitted [R]; zeros at round 0 of a run that continues none). A run that continues one still
        in flight starts at round 1 with that run's carry: its inputs start from the host's applied state, whose
        tokens past the carry's start are `applied` [R]. Row r emits at most `steps[r]` tokens past that state.
        Returns (cache, row_state, (samples [K + 1, R, 2 + 2N] (`sampler.pack_samples` per position), tokens each
        row emitted [R], drafts it verified [R]), carry)."""
        model = self.merge(param_leaves)
        inp = unpack(packed, self.pages_per_row)
        plan = inp.ids[:, self.num_drafts + 1:]  # an oracle's plan (`drafters.plan_columns`; else no columns)
        last, drafted, carried = previous
        emitted = carried - inp.applied  # tokens past the applied state that `inp` starts from
        verified = drafted
        if plan.shape[1]:  # the oracle's drafts: its plan after the tokens the run has emitted
            at = emitted[:, None] + jnp.arange(self.num_drafts)[None, :]
            verified = jnp.where(at < plan.shape[1], jnp.take_along_axis(plan, jnp.minimum(at, plan.shape[1] - 1),
                                                                          axis=1), 0)
        left = inp.steps - emitted
        later = jnp.where(left > 0, 1 + jnp.clip(left - 1, 0, self.num_drafts), 0)
        inp = inp.replace(ids=jnp.where(step == 0, inp.ids[:, :self.num_drafts + 1],
                                        jnp.concatenate([last[:, None], verified], axis=1)),
                          n_new=jnp.where(step == 0, inp.n_new, later), lengths=inp.lengths + emitted,
                          params=inp.params.replace(index=inp.params.index + emitted))
        sub = self._rows_in(cache, inp, gather)
        rows, width = inp.ids.shape
        trunk, drafter = self._split(sub)
        hidden, trunk = model.extend_hidden(inp.ids, trunk, inp.n_new, keep_conv_inputs=True)
        take = lambda x: x.at[inp.rows].get(mode="clip")  # noqa: E731  (padding rows read the scratch row)
        logits = model.logits(hidden)
        out, accepted = verify(self.whole(logits) if full else logits, inp.ids, inp.n_new, inp.params,
                               take(row_state.counts), take(row_state.prompt_mask), self.num_top, full,
                               self.filters)
        active = left > 0
        kept = jnp.where(active, accepted + 1, 0)
        trunk = keep_conv_prefix(trunk, kept, self.history)
        trunk = trunk.replace(lengths=inp.lengths + kept)
        counts = row_state.counts.at[inp.rows[:, None], out.tokens].add(
            ((jnp.arange(width)[None, :] < kept[:, None]) & inp.params.uses_penalties[:, None]).astype(jnp.int32),
            mode="drop")
        drafts = jnp.zeros((rows, self.num_drafts), jnp.int32)
        after = out.tokens[jnp.arange(rows), jnp.maximum(kept - 1, 0)]  # the token the round emits last
        if self.method == "mtp":
            drafter, drafts = self._mtp_drafts(model, drafter.replace(lengths=inp.lengths), hidden, out.tokens, kept,
                                               active)
        elif self.method == "draft":
            drafter, drafts = self._model_drafts(self.merge_draft(param_leaves), drafter.replace(lengths=inp.lengths),
                                                 inp.ids, kept, after, active)
        cache = self._rows_out(cache, inp, self._join(trunk, drafter), gather)
        samples = jnp.moveaxis(pack_samples(jax.tree.map(lambda x: x.reshape(rows * width, *x.shape[2:]), out))
                               .reshape(rows, width, -1), 1, 0)
        carry = (jnp.where(active, after, last), jnp.where(active[:, None], drafts, drafted), carried + kept)
        return cache, row_state.replace(counts=counts), (samples, kept, jnp.maximum(inp.n_new - 1, 0)), carry

    def _draft(self, param_leaves, model, inp: StepInputs, hidden, sub, tokens):
        """After a prefill chunk: the drafter over the chunk (the MTP depths read the token after each position:
        after the last, the row's sample where it ends the known tokens, else the next prompt token), then the
        drafts after the row's sample."""
        rows = inp.ids.shape[0]
        if self.method == "oracle":
            return sub, jnp.zeros((rows, self.num_drafts), jnp.int32)
        trunk, drafter = self._split(sub)
        drafter, sampling = drafter.replace(lengths=inp.lengths), inp.steps > 0
        if self.method == "draft":
            drafter, drafts = self._model_drafts(self.merge_draft(param_leaves), drafter, inp.ids, inp.n_new, tokens,
                                                 sampling)
            return self._join(trunk, drafter), drafts
        last = jnp.maximum(inp.n_new - 1, 0)
        after = jnp.where(sampling, tokens, jnp.maximum(inp.next_token, 0))
        next_ids = jnp.concatenate([inp.ids[:, 1:], jnp.zeros((rows, 1), jnp.int32)], axis=1)
        next_ids = next_ids.at[jnp.arange(rows), last].set(after)
        drafter, drafts = self._mtp_drafts(model, drafter, hidden, next_ids, inp.n_new, sampling)
        return self._join(trunk, drafter), drafts

    def _model_drafts(self, draft, drafter, ids, kept, token, active):
        """The draft model's cache `drafter` (at the trunk's old lengths) advanced over the first `kept [R]` tokens
        of ids [R, T]; and K drafts after `token [R]` (each row's next token), chained on the rows where `active`
        holds (the others write nothing)."""
        hidden, drafter = draft.extend_hidden(ids, drafter, kept)
        active = after_reads(active, hidden)
        chain, drafts, first = drafter, [], jnp.zeros_like(kept)
        for _ in range(self.num_drafts):
            logits, chain = draft.extend(token[:, None], chain, active.astype(jnp.int32), logits_at=first)
            token = jnp.argmax(logits, axis=-1).astype(jnp.int32)
            drafts.append(token)
        return self._after_chain(drafter, chain), jnp.stack(drafts, axis=1)

    def _mtp_drafts(self, model, drafter, hidden, next_ids, kept, active):
        """The MTP depths' cache `drafter` (at the trunk's old lengths) advanced over the `kept` positions of a
        chunk whose trunk hidden states are `hidden [R, T, H]` and next tokens `next_ids [R, T]`; and K drafts
        after the last kept position, chained on the rows where `active` holds (the others write nothing)."""
        rows = hidden.shape[0]
        embed = model.embed_tokens
        depth_hidden, drafter = model.mtp.extend(hidden, next_ids, embed, drafter, kept)
        h = depth_hidden[0][jnp.arange(rows), jnp.maximum(kept - 1, 0)]
        token = jnp.argmax(model.logits(h), axis=-1).astype(jnp.int32)
        drafts, chain = [token], drafter
        active = after_reads(active, depth_hidden[-1])
        depths = len(drafter.layers)
        for j in range(1, self.num_drafts):
            h, chain = model.mtp.step(min(j, depths - 1), h, token, embed, chain, active)
            token = jnp.argmax(model.logits(h), axis=-1).astype(jnp.int32)
            drafts.append(token)
        return self._after_chain(drafter, chain), jnp.stack(drafts, axis=1)

    @staticmethod
    def _after_chain(kept, chain):
        """The drafter's cache `kept` after a draft chain wrote `chain` past its length: the chain's K/V entries
        stay (never read once the length passes them; in the rings they fill the slots past the window); its
        ShortConv states and lengths are not kept."""
        layers = tuple(layer.replace(k=chained.k, v=chained.v) for layer, chained in zip(kept.layers, chain.layers))
        return kept.replace(layers=layers)

    def _split(self, cache):
        """(the trunk's cache, the MTP depths' cache): views of one cache, sharing lengths and pages."""
        layers = cache.layers
        return cache.replace(layers=layers[:self.trunk_layers]), cache.replace(layers=layers[self.trunk_layers:])

    @staticmethod
    def _join(trunk, drafter):
        return trunk.replace(layers=trunk.layers + drafter.layers)
