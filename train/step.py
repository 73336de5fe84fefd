"""The jitted training step: explicit in/out shardings, donated state, gradient accumulation, bf16 compute over
fp32 master weights, the optional aux-loss-free balancing update of the MoE selection biases.

    trainer = Trainer(config, mesh, StepConfig(compute_dtype="bfloat16", remat="full"), OptimConfig(...))
    state, frozen = trainer.init(model_params(model), seed=0)
    state, metrics = trainer.step(state, frozen, trainer.place_batch(batch))   # batch: [accum, B, T] arrays

A batch is a dict of `input_ids`, `segment_ids`, `positions`, `loss_mask`, each [accum, micro_batch, T].
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh

from inkling_jax.backend import Backend
from inkling_jax.config import InklingConfig
from inkling_jax.parallel.mesh import check_mesh
from inkling_jax.parallel.placement import use_mesh
from inkling_jax.parallel.rules import activation_sharding, constrain
from train import lora
from train.loss import cross_entropy_sum, distillation_sum, expert_loads, load_balance, next_token_targets
from train.optim import OptimConfig, make_optimizer, schedule
from train.state import Flat, ModelParts, Shardings, TrainState, abstract_like, partition, put, trainable_names

BATCH_KEYS = ("input_ids", "segment_ids", "positions", "loss_mask")
# Jitted steps by everything they depend on, so a second Trainer with the same setup (a resumed run in the same
# process, a test) reuses the compiled step instead of compiling it again.
_COMPILED: dict = {}


@dataclasses.dataclass(frozen=True)
class StepConfig:
    compute_dtype: str = "bfloat16"
    remat: str = "none"  # a REMAT_POLICIES name (inkling_jax/nn/model.py)
    loss_chunk: int = 1024  # positions per row whose logits exist at once
    bias_update_rate: float = 0.0  # aux-loss-free balancing: bias += rate * sign(mean load - load); 0: off
    lora_rank: int = 0  # 0: full fine-tuning
    lora_alpha: float = 32.0
    freeze: tuple[str, ...] = ()  # regexes of weights kept frozen in full fine-tuning
    # > 0: the MTP head trains too, on this weight times its depths' mean cross-entropy (predicting k + 2 ahead)
    mtp_weight: float = 0.0
    # the MTP head alone trains (the model frozen), each depth on the frozen model's own distribution of the token
    # it predicts (self-distillation: a head fitted to the model it drafts for); needs mtp_weight > 0
    mtp_distill: bool = False
    train_towers: bool = False  # the media towers train too (full fine-tuning only; by default they are frozen)
    backend: Backend = Backend()  # the kernels the model runs (`inkling_jax.backend`)


class Trainer:
    """compiler_options: XLA options for the jitted functions (e.g. a lower backend optimisation level for
    quick CPU tests)."""

    def __init__(self, config: InklingConfig, mesh: Mesh, step_config: StepConfig = StepConfig(),
                 optim_config: OptimConfig = OptimConfig(), compiler_options: dict | None = None):
        check_mesh(mesh, config.text)
        if step_config.mtp_weight > 0 and (config.mtp is None or step_config.lora_rank > 0):
            raise ValueError("an MTP loss needs a model with an MTP head, trained in full (not with LoRA)")
        if step_config.mtp_distill and step_config.mtp_weight <= 0:
            raise ValueError("MTP self-distillation trains the head on mtp_weight times its loss: give it > 0")
        if step_config.train_towers and step_config.lora_rank > 0:
            raise ValueError("training the media towers is full fine-tuning: not with LoRA")
        self.config, self.mesh, self.cfg, self.optim_config = config, mesh, step_config, optim_config
        self.tx, self.schedule = make_optimizer(optim_config), schedule(optim_config)
        self.compiler_options = dict(compiler_options or {})
        self.parts = ModelParts(config, step_config.compute_dtype, step_config.backend)
        self.shardings = Shardings(mesh, self._axes)

    @property
    def lora(self) -> bool:
        return self.cfg.lora_rank > 0

    def _axes(self, name: str, ndim: int):
        if name in self.parts.paths:
            return self.parts.axes(name)
        return lora.adapter_axes(name, self.parts.axes(lora.base_name(name)))

    # ------------------------------------------------------------------------------------------------------
    # State

    def init(self, params: Flat, seed: int = 0, adapters: Flat | None = None) -> tuple[TrainState, Flat]:
        """(state, frozen) from a complete flat dict of model parameters (any float dtype, any placement).

        With LoRA, `adapters` continues given ones (e.g. `lora.load_adapters`); by default they start fresh."""
        missing = sorted(set(self.parts.paths) - set(params))
        if missing:
            raise ValueError(f"{missing[0]}: missing from the parameters (`train.state.model_params` of a model of "
                             "this config)")
        key = jax.random.PRNGKey(seed)
        if self.lora:
            _, bias, frozen = partition(self.parts, params, ())
            trained = adapters or lora.init_adapters(self.parts.shapes, self.cfg.lora_rank, jax.random.fold_in(key, 1))
            trained = {n: jnp.asarray(x, jnp.float32) for n, x in trained.items()}
        else:
            trained, bias, frozen = partition(self.parts, params, trainable_names(
                self.parts, self.cfg.freeze, mtp=self.cfg.mtp_weight > 0, text=not self.cfg.mtp_distill,
                towers=self.cfg.train_towers))
        trained = put(trained, self.shardings.flat(trained))
        opt_shardings = self.shardings.opt_state(self.tx, jax.eval_shape(self.tx.init, trained), trained)
        opt_state = jax.jit(self.tx.init, out_shardings=opt_shardings)(trained)
        state = TrainState(step=jnp.zeros((), jnp.int32), params=trained, opt_state=opt_state,
                           bias=put(bias, self.shardings.flat(bias)), rng=jax.random.fold_in(key, 2))
        state = jax.device_put(state, self.shardings.state(self.tx, state))
        return state, put(frozen, self.shardings.flat(frozen))

    def param_shardings(self) -> Flat:
        """Shardings of a complete flat dict of model parameters (what `init` takes), e.g. to create or load
        them in place."""
        return self.shardings.flat({n: jax.ShapeDtypeStruct(s, jnp.float32) for n, s in self.parts.shapes.items()})

    def abstract_state(self, state: TrainState) -> TrainState:
        """Shapes, dtypes and shardings of a state (a restore target)."""
        return abstract_like(state, self.shardings.state(self.tx, state))

    def place_batch(self, batch: dict) -> dict:
        """Host arrays [accum, B, T] -> device arrays sharded over the batch axes (multi-host safe)."""
        batch = {k: batch[k] for k in BATCH_KEYS}
        shardings = {k: activation_sharding(self.mesh, "microbatches", batch[k].shape) for k in BATCH_KEYS}
        return put(batch, shardings)

    def model_params(self, state: TrainState, frozen: Flat) -> Flat:
        """The complete flat parameters of the trained model: LoRA merged (in the base's dtypes), or the fp32
        masters of the trained weights with everything else as it is frozen."""
        return self._forward_params(state.params, state.bias, frozen)

    # ------------------------------------------------------------------------------------------------------
    # Loss and gradients

    def _forward_params(self, params: Flat, bias: Flat, frozen: Flat) -> Flat:
        if self.lora:
            return {**frozen, **bias, **lora.merge(frozen, params, self.cfg.lora_alpha)}
        return {**frozen, **bias, **params}

    def _loss_sum(self, params: Flat, bias: Flat, frozen: Flat, mb: dict, with_mtp: bool = False):
        """(the objective's sum over tokens, (expert loads [moe layers, experts], {"loss": next-token sum,
        "mtp_loss": MTP sum})) of one microbatch. The MTP sum (its depths' mean per token, over the next-token
        count's tokens) is there when the head trains or `with_mtp`; the objective adds it times mtp_weight."""
        model = use_mesh(self.parts.merge(self._forward_params(params, bias, frozen)), self.mesh)
        mb = {k: constrain(v, self.mesh, "tokens") for k, v in mb.items()}
        hidden, chosen = model.hidden_states(mb["input_ids"], segment_ids=mb["segment_ids"],
                                             positions=mb["positions"], remat=self.cfg.remat)
        hidden = constrain(hidden, self.mesh, "hidden")
        targets, weights = next_token_targets(mb["input_ids"], mb["segment_ids"], mb["loss_mask"])
        sums = {"loss": cross_entropy_sum(model.logits, hidden, targets, weights, self.cfg.loss_chunk)}
        objective = sums["loss"]
        if self.cfg.mtp_weight > 0 or (with_mtp and model.mtp is not None):
            depths = model.mtp.hidden_states(hidden, mb["input_ids"], model.embed_tokens,
                                             segment_ids=mb["segment_ids"], positions=mb["positions"])
            mtp = 0.0
            for k, h in enumerate(depths):
                targets, weights = next_token_targets(mb["input_ids"], mb["segment_ids"], mb["loss_mask"], k + 2)
                h = constrain(h, self.mesh, "hidden")
                if self.cfg.mtp_distill:  # the teacher of token t + k + 2: the model's own logits at t + k + 1
                    teacher = jnp.roll(hidden, -(k + 1), axis=1)
                    mtp = mtp + distillation_sum(model.logits, h, teacher, weights, self.cfg.loss_chunk)
                else:
                    mtp = mtp + cross_entropy_sum(model.logits, h, targets, weights, self.cfg.loss_chunk)
            sums["mtp_loss"] = mtp / len(depths)
            objective = objective + self.cfg.mtp_weight * sums["mtp_loss"]
        return objective, (expert_loads(chosen, mb["segment_ids"], self.config.text.num_experts), sums)

    def _grads(self, state: TrainState, frozen: Flat, batch: dict):
        """(mean losses {"loss", and "mtp_loss" when the head trains}, mean gradients in fp32, expert loads,
        counted tokens) over all microbatches of a batch.

        Sums run over microbatches and are divided by the batch's total counted tokens, so accumulation over
        k microbatches equals one step on the whole batch. Gradients are taken with respect to the weights in
        the compute dtype (the same values as through the cast from the fp32 masters, at half the memory) and
        accumulated in fp32."""
        flat = lambda x: x.reshape(-1, x.shape[-1])  # noqa: E731
        counted = jnp.sum(next_token_targets(*(flat(batch[k]) for k in ("input_ids", "segment_ids", "loss_mask")))[1])
        params = state.params if self.lora else self.parts.cast(state.params)
        grad_fn = jax.value_and_grad(self._loss_sum, has_aux=True)
        if batch["input_ids"].shape[0] == 1:  # no accumulation: no fp32 accumulator either
            (_, (loads, sums)), grads = grad_fn(params, state.bias, frozen, jax.tree.map(lambda x: x[0], batch))
        else:
            def micro(carry, mb):
                sum_acc, grad_acc, load_acc = carry
                (_, (loads, sums)), grads = grad_fn(params, state.bias, frozen, mb)
                grads = jax.tree.map(lambda a, g: a + g.astype(jnp.float32), grad_acc, grads)
                return (jax.tree.map(jnp.add, sum_acc, sums), grads, load_acc + loads), None

            zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
            loads = jnp.zeros((len(self.parts.bias_names), self.config.text.num_experts), jnp.float32)
            sums = dict.fromkeys(("loss", "mtp_loss") if self.cfg.mtp_weight > 0 else ("loss",),
                                 jnp.zeros((), jnp.float32))
            (sums, grads, loads), _ = jax.lax.scan(micro, (sums, zeros, loads), batch)
        denom = jnp.maximum(counted, 1.0)
        losses = {k: v / denom for k, v in sums.items()}
        return losses, jax.tree.map(lambda g: g.astype(jnp.float32) / denom, grads), loads, counted

    def _eval_sums(self, state: TrainState, frozen: Flat, batch: dict) -> dict:
        """Sums over a batch [accum, B, T] of the next-token loss, the MTP loss (with an MTP head) and the
        counted tokens, without gradients (held-out evaluation)."""
        params = state.params if self.lora else self.parts.cast(state.params)

        def micro(acc, mb):
            sums = self._loss_sum(params, state.bias, frozen, mb, with_mtp=True)[1][1]
            sums["tokens"] = jnp.sum(next_token_targets(mb["input_ids"], mb["segment_ids"], mb["loss_mask"])[1])
            return jax.tree.map(jnp.add, acc, sums), None

        names = ("loss", "tokens") + (("mtp_loss",) if self.config.mtp is not None else ())
        return jax.lax.scan(micro, dict.fromkeys(names, jnp.zeros((), jnp.float32)), batch)[0]

    # ------------------------------------------------------------------------------------------------------
    # The step

    def _step(self, state: TrainState, frozen: Flat, batch: dict):
        losses, grads, loads, counted = self._grads(state, frozen, batch)
        updates, opt_state = self.tx.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        bias = state.bias
        if self.cfg.bias_update_rate and bias:
            bias = balance_biases(bias, self.parts.bias_names, loads, self.cfg.bias_update_rate)
        grad_norm = jnp.sqrt(sum(jnp.sum(jnp.square(g)) for g in jax.tree.leaves(grads)))
        metrics = {**losses, "grad_norm": grad_norm, "tokens": counted,
                   "real_tokens": jnp.sum(batch["segment_ids"] > 0), **load_balance(loads)}
        metrics["lr"] = self.schedule(state.step)
        new = TrainState(step=state.step + 1, params=params, opt_state=opt_state, bias=bias,
                         rng=jax.random.split(state.rng)[0])
        return new, metrics

    def _compiled(self, kind: str, state: TrainState, frozen: Flat, batch: dict):
        args = (state, frozen, batch)
        key = (kind, self.config, self.cfg, self.optim_config, self.mesh,
               tuple(sorted(self.compiler_options.items())), jax.tree.structure(args),
               tuple(f"{x.shape}{x.dtype}" for x in jax.tree.leaves(args)))
        if key not in _COMPILED:
            state_sh = self.shardings.state(self.tx, state)
            ins = (state_sh, self.shardings.flat(frozen),
                   {k: activation_sharding(self.mesh, "microbatches", v.shape) for k, v in batch.items()})
            rep, opts = self.shardings.replicated, self.compiler_options or None
            if kind == "step":
                _COMPILED[key] = jax.jit(self._step, in_shardings=ins, out_shardings=(state_sh, rep),
                                         donate_argnums=(0,), compiler_options=opts)
            elif kind == "eval":
                _COMPILED[key] = jax.jit(self._eval_sums, in_shardings=ins, out_shardings=rep,
                                         compiler_options=opts)
            else:
                _COMPILED[key] = jax.jit(lambda s, f, b: self._grads(s, f, b)[:2], in_shardings=ins,
                                         out_shardings=(rep, state_sh.params), compiler_options=opts)
        return _COMPILED[key]

    def step(self, state: TrainState, frozen: Flat, batch: dict) -> tuple[TrainState, dict]:
        """One optimizer step over a batch [accum, B, T]; `state` is donated (do not reuse it)."""
        return self._compiled("step", state, frozen, batch)(state, frozen, batch)

    def loss_and_grads(self, state: TrainState, frozen: Flat, batch: dict) -> tuple[jax.Array, Flat]:
        """The mean loss and the gradients the step would apply (before clipping); the state is kept."""
        losses, grads = self._compiled("grads", state, frozen, batch)(state, frozen, batch)
        return losses["loss"], grads

    def eval_sums(self, state: TrainState, frozen: Flat, batch: dict) -> dict:
        """Summed losses and counted tokens of a batch [accum, B, T], no update (`train.evaluate`)."""
        return self._compiled("eval", state, frozen, batch)(state, frozen, batch)


def balance_biases(bias: Flat, names: list[str], loads, rate: float) -> Flat:
    """Aux-loss-free balancing: raise the selection bias of under-loaded experts, lower over-loaded ones."""
    out = dict(bias)
    for layer, name in enumerate(names):
        load = loads[layer]
        out[name] = bias[name] + rate * jnp.sign(load.mean() - load)
    return out
