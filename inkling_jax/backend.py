"""Which implementation runs each kernel of the model: one frozen `Backend`.

It is given at construction (`InklingModel(config, backend=...)`, `load_pretrained(..., backend=...)`) and held
by every module that calls a kernel (attention, ShortConv, MoE, NVFP4 matrices) as a static attribute, so it is
part of what jit compiles for; `with_backend(model, backend)` gives a model that runs another one, sharing the
arrays. `python -m serve.app`, `python -m train.run` and `python -m benchmarks.model` take it as `--backend SPEC`
(`Backend.parse`).

Fields, each "auto" by default:
- attention: self-attention over whole sequences (training, forward) and prefill chunks over the cache;
- decode_attention: a decode step's attention over the cache, with its prologue (ShortConvs, norms and cache
  write) fused into one kernel under "pallas";
- shortconv: the ShortConv of prefill chunks and whole sequences;
  each "reference" (the pure-jnp code in `pallas_kernels/*/reference.py`, the numerical ground truth) or "pallas";
- moe: the routed experts: "dense" (every expert on every token, masked: tiny models only), "ragged"
  (`jax.lax.ragged_dot` on the tokens sorted by expert) or "pallas" (the grouped-matmul kernels). NVFP4 dense
  weights (`quant/dense_nvfp4.py`) follow it rather than having a field of their own: they run as one expert of
  the same W4A16 kernel, so "pallas" means that kernel and anything else its jnp formula;
- moe_forward, moe_backward: under moe "pallas", which grouped matmuls run the routed experts' forward (gate/up
  and down) and backward (dgrads and weight gradients): "pallas" (ours) or "jax_mgpu" (jax's own Mosaic-GPU
  ragged dot, `pallas_kernels/moe/jax_mgpu.py`: compiled only, 16-bit weights), inside our custom VJP, so
  routing, SwiGLU and combine stay ours. "auto" is ours, measured the faster on a GPU (docs/kernels.md).
  Decode-sized steps (`moe_ffn_decode`) and quantised experts always run ours;
- lora: the adapters' products of a LoRA serving view (`serve.lora`), "reference" or "pallas"
  (`pallas_kernels/lora`).
"auto" is "pallas" on GPU; elsewhere "reference", and "ragged" for the MoE (interpreted on CPU the kernels are
far slower than XLA's ops).

batch_invariant (`--batch-invariant`): every token's logits are computed with the same reduction order whatever
the batch, its rows, the concurrency and the chunking, so a decode step, a prefill chunk and a training forward
give the same bits (`inkling_jax/nn/invariant.py`). Matmuls (projections, router, head, dense MLPs, shared
experts) run the grouped-matmul kernel as one group with a fixed K order (tiles by row count, K blocks fixed);
the routed experts its SwiGLU kernels (tiles by row count, never the decode slab layout); attention of every
kind (training, prefill chunks, decode steps) the prefill-chunk kernel with fixed tiles, its key blocks aligned
to absolute positions (the gradient is that of `attention`'s choice); norms, softmaxes and the top-k combine
sum in a fixed order; a decode step runs the model's unfused prologue. It overrides `moe` and, for the forward,
`attention` and `decode_attention`. Self-attention then takes one sequence per row (segment ids may mark only the
padding after it), and the model runs on one device with its own, unfused projections. On CPU the commands
start XLA without fused multiply-adds (`NO_FMA_CPU_FLAG`).

interpret: how a "pallas" kernel runs. True: in Pallas' interpreter, on any platform (slow: CPU tests). False:
compiled for the GPU (on a machine without one such a program can only be lowered, as tests/test_gpu_lowering.py
does). None (default): compiled on GPU, interpreted elsewhere.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from typing import TypeVar

import jax
from flax import nnx

KERNEL_CHOICES = ("auto", "reference", "pallas")
MOE_CHOICES = ("auto", "dense", "ragged", "pallas")
MOE_MATMUL_CHOICES = ("auto", "pallas", "jax_mgpu")
CHOICES = {"attention": KERNEL_CHOICES, "decode_attention": KERNEL_CHOICES, "shortconv": KERNEL_CHOICES,
           "moe": MOE_CHOICES, "moe_forward": MOE_MATMUL_CHOICES, "moe_backward": MOE_MATMUL_CHOICES,
           "lora": KERNEL_CHOICES}
MOE_MATMULS = ("moe_forward", "moe_backward")
# What a SPEC's leading word sets every kernel field to. "reference" puts the MoE on "ragged": "dense" is for
# tiny models only, so it must be named. The MoE's matmul choices are only ever named.
KERNELS = tuple(name for name in CHOICES if name not in MOE_MATMULS)
WORDS = {"auto": {name: "auto" for name in KERNELS},
         "pallas": {name: "pallas" for name in KERNELS},
         "reference": {**{name: "reference" for name in KERNELS}, "moe": "ragged"}}

Module = TypeVar("Module", bound=nnx.Module)

# XLA:CPU's LLVM backend always allows fusing a multiply into the add that uses it (one FMA, one rounding) and
# does so wherever instruction selection happens to match, which depends on how the program around it was fused:
# the same row's arithmetic then rounds differently in a training forward and in a decode step. An instruction
# set without FMA (AVX) rounds every multiply and add on its own. XLA reads it once, when its CPU backend starts.
NO_FMA_CPU_FLAG = "--xla_cpu_max_isa=AVX"


def start_cpu_without_fma() -> None:
    """Put NO_FMA_CPU_FLAG in XLA_FLAGS (unless a maximum ISA is chosen there already) for batch-invariant runs:
    it takes effect if jax has not started its CPU backend yet (a process that did must have set it itself)."""
    flags = os.environ.get("XLA_FLAGS", "")
    if "--xla_cpu_max_isa" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} {NO_FMA_CPU_FLAG}".strip()


@dataclasses.dataclass(frozen=True)
class Backend:
    """The implementation of each kernel (module doc). Hashable: jit treats it as static."""

    attention: str = "auto"
    decode_attention: str = "auto"
    shortconv: str = "auto"
    moe: str = "auto"
    lora: str = "auto"
    moe_forward: str = "auto"
    moe_backward: str = "auto"
    interpret: bool | None = None
    batch_invariant: bool = False

    def __post_init__(self):
        for name, allowed in CHOICES.items():
            if getattr(self, name) not in allowed:
                raise ValueError(f"backend {name} must be one of {allowed}, not {getattr(self, name)!r}")
        if self.interpret not in (None, True, False):
            raise ValueError(f"backend interpret must be True, False or None, not {self.interpret!r}")
        chosen = [name for name in MOE_MATMULS if getattr(self, name) == "jax_mgpu"]
        if chosen and self.moe in ("dense", "ragged"):
            raise ValueError(f"backend {', '.join(chosen)}=jax_mgpu picks the grouped matmuls of moe=pallas, "
                             f"not of moe={self.moe}")
        if self.batch_invariant not in (True, False):
            raise ValueError(f"backend batch_invariant must be True or False, not {self.batch_invariant!r}")

    def resolve(self) -> Backend:
        """The same choices with "auto" and interpret None replaced by what they mean on this platform (and the
        MoE on "pallas" where batch_invariant)."""
        gpu = jax.default_backend() == "gpu"
        auto = {name: "pallas" if gpu else ("ragged" if name == "moe" else "reference") for name in CHOICES}
        auto.update(moe_forward="pallas", moe_backward="pallas")
        chosen = {name: auto[name] if getattr(self, name) == "auto" else getattr(self, name) for name in CHOICES}
        if self.batch_invariant:
            chosen.update(moe="pallas", shortconv="pallas")
        return Backend(**chosen, interpret=(not gpu) if self.interpret is None else self.interpret,
                       batch_invariant=self.batch_invariant)

    @classmethod
    def parse(cls, spec: str) -> Backend:
        """From a command line's SPEC: comma-separated items, an optional leading word that sets every kernel
        field ("auto", "reference" or "pallas", see WORDS), then field=value items. E.g. "auto", "reference",
        "moe=ragged,attention=pallas", "pallas,moe=ragged", "pallas,moe_backward=jax_mgpu"."""
        items = [item.strip() for item in spec.split(",")]
        chosen = {name: "auto" for name in CHOICES}
        if items and items[0] in WORDS:
            chosen.update(WORDS[items.pop(0)])
        given = set()
        for item in items:
            name, sep, value = item.partition("=")
            if not sep or name not in CHOICES:
                raise ValueError(f"backend spec {spec!r}: {item!r} is not FIELD=VALUE with FIELD one of "
                                 f"{tuple(CHOICES)} (a leading {' | '.join(WORDS)} sets every kernel field)")
            if name in given:
                raise ValueError(f"backend spec {spec!r}: {name} is given twice")
            given.add(name)
            chosen[name] = value
        try:
            return cls(**chosen)
        except ValueError as exc:
            raise ValueError(f"backend spec {spec!r}: {exc}") from None


def add_backend_flag(parser: argparse.ArgumentParser) -> None:
    """`--backend SPEC` (`Backend.parse`, default "auto"), the same in every command; the value is a Backend."""

    def spec(text: str) -> Backend:
        try:
            return Backend.parse(text)
        except ValueError as exc:  # argparse prints an ArgumentTypeError's message, not a ValueError's
            raise argparse.ArgumentTypeError(str(exc)) from None

    class KeepBatchInvariant(argparse.Action):  # an earlier --batch-invariant stays set
        def __call__(self, parser, namespace, values, option_string=None):
            kept = getattr(namespace, self.dest, Backend()).batch_invariant
            setattr(namespace, self.dest, dataclasses.replace(values, batch_invariant=kept))

    parser.add_argument("--backend", type=spec, default=Backend(), metavar="SPEC", action=KeepBatchInvariant,
                        help="kernel implementations: auto | reference | pallas, then FIELD=VALUE items, e.g. "
                        "'moe=ragged,attention=pallas' (fields attention, decode_attention, shortconv, lora: "
                        "reference | pallas; moe: dense | ragged | pallas; moe_forward, moe_backward: the "
                        "grouped matmuls of moe=pallas, pallas (ours) | jax_mgpu (jax's Mosaic-GPU ragged dot) | "
                        "auto (ours, jax's in the backward where measured faster: see docs/kernels.md); "
                        "'auto': Pallas on GPU; see "
                        "inkling_jax/backend.py)")


def add_batch_invariant_flag(parser: argparse.ArgumentParser, what: str) -> None:
    """`--batch-invariant`, after `add_backend_flag`: sets the Backend's batch_invariant (whatever the order of the
    two flags), and starts XLA:CPU without fused multiply-adds (`start_cpu_without_fma`). `what`: the sentence
    of the help saying what it gives in this command."""

    class BatchInvariant(argparse.Action):
        def __call__(self, parser, namespace, values, option_string=None):
            namespace.backend = dataclasses.replace(namespace.backend, batch_invariant=True)
            start_cpu_without_fma()

    parser.add_argument("--batch-invariant", action=BatchInvariant, nargs=0, dest="backend", default=argparse.SUPPRESS,
                        help=f"batch-invariant kernels: fixed reduction orders, so that {what} (slower; "
                        "one device, no fused projections, bf16/fp32 weights; on CPU, XLA without fused "
                        "multiply-adds; see inkling_jax/backend.py)")


def with_backend(module: Module, backend: Backend) -> Module:
    """A copy of `module` (a model, or one of its modules) whose kernel-calling modules run `backend`. The copy
    shares the arrays; `module` is left as it is."""
    copy = nnx.merge(*nnx.split(module))
    assign_backend(copy, backend)
    return copy


def assign_backend(module: nnx.Module, backend: Backend) -> None:
    """In place: every module under `module` that calls kernels (has a `backend` attribute) holds `backend`.
    For modules built after the model (quantised weights) and for `with_backend`'s copy."""
    if not isinstance(backend, Backend):
        raise TypeError(f"a backend is a Backend, not {type(backend).__name__} (Backend.parse reads a spec)")
    for _, node in nnx.iter_graph(module):
        if isinstance(node, nnx.Module) and hasattr(node, "backend"):
            node.backend = backend
