"""The policy step: the trainer recomputes the completion tokens' logprobs at the weights that sampled them,
measures the train-rollout mismatch, and takes one clipped policy-gradient step (`losses`).

It reuses `train.step.Trainer` for everything but the objective: the state and its shardings, the optimizer,
LoRA and the parameter groups. A batch is one sequence per row, [N, T]: prompt then completion, `segment_ids`
1 on real tokens and 0 on padding, `positions`, `loss_mask` 1 on completion tokens, and per row `advantages`;
`rollout_logprobs` [N, T] holds at position t the engine's logprob of token t + 1. Optional: `expert_ids`
[N, T, MoE layers, top_k], the engine's recorded choice at each position (-1: none), which the forward replays
(routing replay: the choice only; the router's weights are recomputed, so gradients reach it); `pixels`
[P, M, ...] and `media_positions` [P, M], the images of the P prompts whose completions the rows are
(`train.rl.media`).

The importance ratio's old policy is the rollout's own logprob where the engine sampled the distribution it
reports (temperature 1): the clip then also bounds the train-rollout mismatch (decoupled, "bypass" PPO). At
another temperature the engine's logprobs are not those of the sampled distribution, and the old policy is the
trainer's own at the sampling weights (the ratio's value is 1, its gradient the policy gradient).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import optax

from inkling_jax.backend import with_backend
from inkling_jax.nn import invariant
from inkling_jax.parallel.placement import use_mesh
from train.loss import next_token_targets
from train.rl.losses import LossConfig, mismatch_metrics, policy_loss, token_logprobs
from train.rl.media import merge_media
from train.state import Flat, TrainState, put
from train.step import Trainer

BATCH_KEYS = ("input_ids", "segment_ids", "positions", "loss_mask", "advantages", "rollout_logprobs")
_COMPILED: dict = {}  # jitted steps by their setup (train.step's reason: a second run in a process reuses it)


class PolicyTrainer:
    def __init__(self, trainer: Trainer, loss: LossConfig, temperature: float, logits_chunk: int = 1024):
        self.trainer, self.loss, self.temperature, self.chunk = trainer, loss, temperature, logits_chunk

    def reference_params(self, state: TrainState, frozen: Flat) -> Flat | None:
        """The initial policy's complete parameters in the compute dtype, for the KL term (None without one). With
        LoRA it is the base model, which `frozen` holds already (no copy)."""
        if self.loss.kl_coef <= 0:
            return None
        if self.trainer.lora:
            return {**frozen, **state.bias}
        return jax.jit(self.trainer.parts.cast)(self.trainer.model_params(state, frozen))

    def _logprobs(self, params: Flat, batch: dict, temperature: float):
        model = use_mesh(self.trainer.parts.merge(params), self.trainer.mesh)
        embeds = experts = None
        if "pixels" in batch:
            embeds = merge_media(model, batch["input_ids"], batch["pixels"], batch["media_positions"])
        if "expert_ids" in batch:
            experts = [batch["expert_ids"][:, :, layer] for layer in range(batch["expert_ids"].shape[2])]
        hidden, _ = model.hidden_states(batch["input_ids"], segment_ids=batch["segment_ids"],
                                        positions=batch["positions"], expert_ids=experts, embeds=embeds)
        targets, mask = next_token_targets(batch["input_ids"], batch["segment_ids"], batch["loss_mask"])
        backend = self.trainer.cfg.backend
        if not backend.batch_invariant:
            return (*token_logprobs(model.logits, hidden, targets, temperature, self.chunk), mask)
        # The values the engine's (batch-invariant); the gradient XLA's, from a view of the same weights.
        xla = with_backend(model, dataclasses.replace(backend, batch_invariant=False))
        return (*token_logprobs(model.logits, hidden, targets, temperature, self.chunk, invariant.log_softmax,
                                gradient_of=(xla.logits, jax.nn.log_softmax)), mask)

    def _step(self, state: TrainState, frozen: Flat, reference: Flat | None, batch: dict):
        trainer, cfg = self.trainer, self.loss

        def objective(params):
            complete = trainer.model_params(dataclasses.replace(state, params=params), frozen)
            logp, raw, entropy, mask = self._logprobs(complete, batch, self.temperature)
            old = batch["rollout_logprobs"] if self.temperature == 1.0 else jax.lax.stop_gradient(logp)
            ref = None if reference is None else jax.lax.stop_gradient(
                self._logprobs(reference, batch, self.temperature)[0])
            loss, extra = policy_loss(cfg, logp, old, batch["advantages"], mask, ref)
            entropy = jnp.sum(entropy * mask) / jnp.maximum(mask.sum(), 1.0)
            return loss, {**extra, **mismatch_metrics(raw, batch["rollout_logprobs"], mask), "entropy": entropy,
                          "completion_tokens": mask.sum()}

        (loss, metrics), grads = jax.value_and_grad(objective, has_aux=True)(state.params)
        updates, opt_state = trainer.tx.update(grads, state.opt_state, state.params)
        grad_norm = jnp.sqrt(sum(jnp.sum(jnp.square(g)) for g in jax.tree.leaves(grads)))
        metrics.update(loss=loss, grad_norm=grad_norm, lr=trainer.schedule(state.step))
        new = TrainState(step=state.step + 1, params=optax.apply_updates(state.params, updates),
                         opt_state=opt_state, bias=state.bias, rng=jax.random.split(state.rng)[0])
        return new, metrics

    def step(self, state: TrainState, frozen: Flat, reference: Flat | None, batch: dict):
        """One update from a batch of host arrays; the state is not donated (the engine may still hold some of its
        arrays)."""
        t = self.trainer
        args = (state, frozen, reference, batch)
        key = (t.config, t.cfg, t.optim_config, self.loss, self.temperature, self.chunk, t.mesh,
               jax.tree.structure(args), tuple(f"{x.shape}{x.dtype}" for x in jax.tree.leaves(args)))
        if key not in _COMPILED:
            _COMPILED[key] = jax.jit(self._step, out_shardings=(t.shardings.state(t.tx, state), t.shardings.replicated),
                                     compiler_options=t.compiler_options or None)
        batch = put(batch, dict.fromkeys(batch, t.shardings.replicated))  # every process has the whole batch
        return _COMPILED[key](state, frozen, reference, batch)
