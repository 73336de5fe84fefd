"""`python -m serve.app`: serve Inkling over an OpenAI-compatible HTTP API.

With --model DIR it serves a hub-layout checkpoint with the directory's tokenizer.json and the sampling defaults
of its generation_config.json. Without it, it serves the embedded default, `inkling-tiny`: a 5M-parameter
Inkling trained by train/ on the King James Bible, a continuation model that writes KJV-like English
(docs/default-model.md). --random-weights serves the `tiny` preset (or --preset NAME) with seeded random weights
and a byte-level tokenizer instead (its output is noise, and /v1/models says so).

    python -m serve.app                                  # http://127.0.0.1:8000/v1, model "inkling-tiny"
    python -m serve.app --model /path/to/Inkling --dtype bfloat16 --api-key SECRET
    python -m serve.app --model /path/to/Inkling --mesh tensor=2,expert=4    # sharded over 8 devices

Chat messages may carry images (`image_url` parts with base64 data URLs) and audio (`input_audio` parts with
base64 WAV) when the checkpoint has the media towers; a text-only checkpoint answers such requests with 400.
"""

from __future__ import annotations

import argparse
import logging
import math
import os

import jax

from inkling_jax.backend import add_backend_flag, add_batch_invariant_flag
from inkling_jax.config.generation import SAMPLING_FIELDS
from serve.engine.config import (MAX_DRAFT_TOKENS, MIN_TOKEN_BUDGET, PREFILL_CHUNKS_PER_STEP, EngineConfig,
                                 SpeculativeConfig, default_token_budget)
from serve.engine.engine import Engine
from serve.engine.sampling_params import SamplingParams
from serve.http.chat import ChatError, ChatFormat
from serve.http.guards import is_loopback, local_host_names
from serve.http.media import MAX_IMAGE_PIXELS, MediaEncoder
from serve.http.routes import MAX_BODY_BYTES, Service
from serve.http.server import Server, serving_app
from serve.http.tokenizer import load_tokenizer
from serve.lora.config import LoRAConfig
from serve.runner.placement import MeshError, Placement
from serve.runner.speculative import check_speculative

log = logging.getLogger("serve")
GPU_MAX_NUM_SEQS = 128  # the concurrency serving benchmarks load a GPU server with; the KV pool takes the rest
CPU_MAX_NUM_SEQS = 8
DEFAULT_DRAFT_TOKENS = 3


def number(kind, low, high=None):
    """An argparse type: a finite `kind` from `low` to `high` (inclusive), else an error that says so."""
    bounds = f"in [{low}, {high}]" if high is not None else f">= {low}"

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if not (math.isfinite(value) and low <= value and (high is None or value <= high)):
            raise argparse.ArgumentTypeError(f"must be {bounds}, got {text}")
        return value
    return parse


def parse_args(argv=None) -> argparse.Namespace:
    from inkling_jax import preset
    from inkling_jax.config.schema import ConfigError
    from inkling_jax.quant.config import DENSE_PRECISIONS, EXPERT_PRECISIONS, QuantConfig

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    a = p.add_argument
    a("--model", help="checkpoint directory in the hub layout (default: the embedded inkling-tiny)")
    a("--random-weights", action="store_true", help="serve the `tiny` preset (or --preset) with seeded random "
      "weights and a byte-level tokenizer (tests, demos and benchmarks of the server; its output is noise)")
    a("--preset", default="tiny", help="with --random-weights: the architecture to build, e.g. bench (the "
      "benchmarks' 6-layer Inkling at the released widths; its weights are made on the device)")
    a("--served-model-name", help="the model id clients send (default: the directory name, inkling-tiny, or "
      "inkling-PRESET-random)")
    a("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    a("--port", type=number(int, 1, 65535), default=8000, help="TCP port (default 8000)")
    key = p.add_mutually_exclusive_group()
    key.add_argument("--api-key", default=os.environ.get("INKLING_API_KEY"),
                     help="require `Authorization: Bearer KEY` on /v1 routes (default: $INKLING_API_KEY, else none; "
                     "without a key, a server on a loopback address answers only Host headers that name it)")
    key.add_argument("--api-key-file", type=argparse.FileType("r"),
                     help="read the API key from this file (its first line), so that it is not on the command line")
    a("--dtype", default=None, choices=["float32", "bfloat16"], help="default: bfloat16 on GPU, float32 on CPU")
    a("--seed", type=int, default=0, help="seed of --random-weights")
    a("--max-num-seqs", type=number(int, 1), help=f"sequences decoded together (cache slots; default "
      f"{GPU_MAX_NUM_SEQS} on GPU, {CPU_MAX_NUM_SEQS} on CPU)")
    a("--max-model-len", type=number(int, 2), default=1024, help="prompt + output tokens per sequence")
    a("--max-num-batched-tokens", type=number(int, 1), help="token budget of one engine step (default: a token "
      f"per sequence plus {PREFILL_CHUNKS_PER_STEP} of the largest prefill chunks, at least {MIN_TOKEN_BUDGET})")
    a("--page-size", type=number(int, 1), default=16, help="tokens per KV page")
    a("--num-pages", type=number(int, 1), help="KV pages (default: from free device memory on GPU; every slot at "
      "full length on CPU)")
    a("--memory-fraction", type=number(float, 0.01, 1.0), default=0.85,
      help="share of free device memory for caches")
    a("--chunk-buckets", help="compiled tokens-per-row sizes; the largest is the longest prefill chunk "
      "(default: 1,16,64,256 on GPU, 1,16 on CPU, where each compilation takes seconds)")
    a("--row-buckets", help="compiled rows-per-step sizes, ending with max-num-seqs + 1 (default: powers of 2 "
      "on GPU, only all rows on CPU)")
    a("--decode-steps", type=number(int, 1), default=8, help="decode steps queued on the device before the host "
      "reads their tokens: fewer host round-trips; stops are applied afterwards and the extra tokens discarded (1: "
      "one token at a time)")
    a("--speculative-algorithm", choices=["mtp", "draft"], help="speculative decoding: mtp drafts with the model's "
      "MTP head, draft with --speculative-draft-model; the model verifies the drafts in one step per round, greedy "
      "requests keeping the longest agreeing prefix, sampled ones accepting by rejection sampling, so outputs are "
      "distributed as plain decoding's (default: off)")
    a("--speculative-draft-model", help="with --speculative-algorithm draft: a smaller Inkling checkpoint "
      "directory with the model's tokenizer")
    a("--speculative-num-draft-tokens", type=number(int, 1, MAX_DRAFT_TOKENS),
      help=f"tokens drafted per round, with --speculative-algorithm (default {DEFAULT_DRAFT_TOKENS}; below the "
      "sliding window)")
    a("--mesh", help="serve sharded over a device mesh, e.g. tensor=2,expert=4 (heads and MLP widths over "
      "`tensor`, routed experts over `expert`; uses that many devices; default: one device). Checked against "
      "the model's config (and a draft model's) before the weights load")
    a("--expert-precision", default="bf16", choices=EXPERT_PRECISIONS,
      help="routed experts' weights: bf16 (in the model's --dtype, as loaded); fp8 e4m3 with one scale per "
      "expert and matrix and the activations quantised per row (half the bytes a decode step reads; a few "
      "percent of error per MoE layer); or nvfp4, 4-bit values with a scale per 16 (0.63 of fp8's memory, "
      "decode a little faster than fp8, prefill slower unless --fp8-twins; an NVFP4 checkpoint's "
      "packed experts load as stored)")
    a("--dense-precision", default="bf16", choices=DENSE_PRECISIONS,
      help="the dense MLP layers' and the LM head's weights: bf16 (in --dtype), or fp8 e4m3 with one scale per "
      "output column and the activations quantised per row (fewer bytes per decode step; the attention "
      "projections, shared experts and embeddings stay in --dtype); nvfp4: as fp8, and the attention "
      "projections and shared experts in NVFP4 (4-bit values, a scale per 16; W4A16; not with a tensor mesh; "
      "faster decode at small batches, slower at large ones: docs/quantisation.md)")
    a("--fp8-twins", action="store_true",
      help="with nvfp4 experts or dense weights: keep an fp8 copy of every NVFP4 weight (one more byte per "
      "weight) for the products of prompt chunks and other wide steps, which then run on fp8 tensor cores at "
      "twice the rate of the 4-bit kernels; decode steps still read the 4-bit weights")
    a("--no-prefix-caching", action="store_true", help="turn the prefix cache off")
    a("--no-mixed-steps", action="store_true",
      help="run a step's decodes and its prompt chunk as two programs (by default a step of decodes and one prompt "
      "chunk runs as one program, which reads the weights once)")
    a("--mixed-prefill-rows", help="row buckets of prompt chunks that the mixed programs take, e.g. 1,2,4,8: a "
      "step of decodes and up to that many chunks runs as one program (default: the smallest row bucket, one "
      "chunk, and the most rows of the largest chunk the token budget holds; each adds a program per decode row "
      "bucket and sampler to start-up)")
    a("--no-fuse-projections", action="store_true",
      help="keep the attention input projections, the dense MLPs' gate and up and the shared experts as separate "
      "matmuls (by default each group is fused into one; not on a tensor-parallel mesh)")
    a("--lora-modules", nargs="+", metavar="NAME=PATH", default=(), help="LoRA adapters served beside the base: "
      "a request's model field NAME runs with the adapter at PATH (an adapters file as `train.run --lora-rank` "
      "writes it, the directory holding it, or a PEFT directory); on attention, dense MLPs, shared experts and "
      "routed experts (those where --expert-precision is bf16)")
    a("--max-loras", type=number(int, 1), default=1, help="LoRA adapters on the device at once (others wait, "
      "least recently used ones making room)")
    a("--max-cpu-loras", type=number(int, 1), help="LoRA adapters whose weights host memory keeps, at least "
      "--max-loras (the default); the least recently used others are read again from their path when needed")
    a("--lora-root", metavar="DIR", help="enable POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's) "
      "for adapters under DIR only")
    a("--max-lora-rank", type=number(int, 1), default=16, help="largest LoRA rank served (every slot holds it)")
    a("--lora-experts", action="store_true", help="LoRA adapters may adapt the MoE's routed and shared experts "
      "(a batch with such an adapter runs the routed experts' projections apart, each plus its adapters' grouped "
      "LoRA product; see docs/serving.md; not on a --mesh with an expert axis)")
    a("--num-snapshots", type=number(int, 0), help="saved window/conv states for prefix hits (default: 2 per slot)")
    a("--max-queued", type=number(int, 1), default=256, help="waiting sequences beyond which requests get 429")
    a("--max-prompt-tokens", type=number(int, 1), help="longest accepted prompt (default: max-model-len - 1)")
    a("--max-tokens", type=number(int, 1), help="largest accepted max_tokens (default: max-model-len - 1)")
    a("--max-n", type=number(int, 1), default=16, help="largest n (choices x prompts) per request")
    a("--max-body-mb", type=number(float, 0.001), default=MAX_BODY_BYTES / 2**20,
      help=f"largest request body in MiB; larger ones get 413 before they are read (default {MAX_BODY_BYTES >> 20})")
    a("--max-image-pixels", type=number(int, 1), default=MAX_IMAGE_PIXELS,
      help=f"largest image (width x height) in a chat message, checked from its header before it is decoded "
      f"(default {MAX_IMAGE_PIXELS})")
    a("--drain-seconds", type=number(float, 0.0), default=10.0,
      help="on shutdown, how long in-flight requests may finish; streams still open then end with an error event")
    add_backend_flag(p)
    add_batch_invariant_flag(p, "a request's tokens and logprobs (greedy or seeded) do not depend on the requests "
                             "running beside it, nor on how its prompt is chunked")
    a("--compilation-cache", default=os.path.expanduser("~/.cache/inkling-jax/xla"),
      help="persistent XLA compilation cache ('' to disable)")
    a("--log-level", default="info", help="debug, info, warning or error (default info)")
    args = p.parse_args(argv)
    if args.model and args.random_weights:
        p.error("--model and --random-weights exclude each other")
    if args.preset != "tiny" and not args.random_weights:
        p.error("--preset needs --random-weights (a checkpoint brings its own architecture)")
    try:
        preset(args.preset)
    except ConfigError as exc:
        p.error(f"--preset: {exc}")
    try:  # before any weights load
        QuantConfig(args.expert_precision, args.dense_precision, args.fp8_twins)
    except ValueError as exc:
        p.error(str(exc))
    if args.speculative_num_draft_tokens and not args.speculative_algorithm:
        p.error("--speculative-num-draft-tokens needs --speculative-algorithm")
    if bool(args.speculative_draft_model) != (args.speculative_algorithm == "draft"):
        p.error("--speculative-algorithm draft and --speculative-draft-model go together")
    if (args.lora_modules or args.lora_root) and args.speculative_algorithm:
        p.error("--lora-modules and --lora-root are not served with --speculative-algorithm yet")
    try:
        args.lora_modules = LoRAConfig.parse_modules(args.lora_modules)
    except ValueError as exc:
        p.error(str(exc))
    if (args.max_cpu_loras or args.max_loras) < args.max_loras:
        p.error(f"--max-cpu-loras must be at least --max-loras ({args.max_loras})")
    for flag in ("max_prompt_tokens", "max_tokens"):
        if (getattr(args, flag) or 0) >= args.max_model_len:
            p.error(f"--{flag.replace('_', '-')} must be below --max-model-len ({args.max_model_len})")
    quantised = {args.expert_precision, args.dense_precision} != {"bf16"}
    if args.backend.batch_invariant and (args.mesh or args.lora_modules or args.lora_root or quantised):
        p.error("--batch-invariant serves bf16 or float32 weights on one device, without LoRA adapters (no --mesh, "
                "--lora-modules, --lora-root, fp8 or nvfp4 precisions)")
    if args.api_key_file:
        with args.api_key_file as file:
            args.api_key = file.readline().strip()
        if not args.api_key:
            p.error(f"--api-key-file {file.name} holds no key")
    return args


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """The engine's shapes from the flags; those not given follow the backend (CPU: few compilations, each takes
    seconds) and, for the token budget and row buckets, `--max-num-seqs`."""
    ints = lambda text: tuple(int(x) for x in text.split(","))  # noqa: E731
    gpu = jax.default_backend() == "gpu"
    seqs = args.max_num_seqs or (GPU_MAX_NUM_SEQS if gpu else CPU_MAX_NUM_SEQS)
    chunks = ints(args.chunk_buckets) if args.chunk_buckets else ((1, 16, 64, 256) if gpu else (1, 16))
    rows = ints(args.row_buckets) if args.row_buckets else (None if gpu else (seqs + 1,))
    return EngineConfig(
        max_num_seqs=seqs, max_model_len=args.max_model_len,
        max_num_batched_tokens=args.max_num_batched_tokens or default_token_budget(seqs, chunks[-1]),
        page_size=args.page_size, num_pages=args.num_pages,
        memory_fraction=args.memory_fraction, chunk_buckets=chunks, row_buckets=rows,
        prefix_caching=not args.no_prefix_caching, mixed_steps=not args.no_mixed_steps,
        mixed_prefill_rows=ints(args.mixed_prefill_rows) if args.mixed_prefill_rows else None,
        fuse_projections=not (args.no_fuse_projections or args.backend.batch_invariant),
        num_snapshots=args.num_snapshots, max_queued=args.max_queued, decode_steps=args.decode_steps,
        speculative=SpeculativeConfig(args.speculative_algorithm,
                                      args.speculative_num_draft_tokens or DEFAULT_DRAFT_TOKENS)
        if args.speculative_algorithm else None,
        lora=LoRAConfig(args.lora_modules, args.max_loras, args.max_lora_rank, args.lora_root, args.max_cpu_loras,
                        args.lora_experts)
        if args.lora_modules or args.lora_root else None)


def build_service(args: argparse.Namespace) -> Service:
    """Load (or build) the model and tokenizer, start the engine (warm-up included) and describe it."""
    from inkling_jax import load_config, load_pretrained, preset
    from inkling_jax.assets import DEFAULT_MODEL_NAME, default_model_description, default_model_dir
    from inkling_jax.config import GenerationConfig, load_generation_config
    from inkling_jax.quant import QuantConfig
    from serve.random_weights import random_weights

    dtype = args.dtype or ("bfloat16" if jax.default_backend() == "gpu" else "float32")
    placement = Placement.from_spec(args.mesh)
    directory = None if args.random_weights else args.model or default_model_dir()
    model_config = preset(args.preset) if directory is None else load_config(directory)
    # A bad mesh, a missing tokenizer or bad engine limits stop the server before the weights load, not after.
    config = engine_config(args)
    placement.check(model_config.text, dense_precision=args.dense_precision,
                    lora_experts=config.lora_experts)
    tokenizer = load_tokenizer(directory)
    draft_dir = args.speculative_draft_model
    draft_config = None if draft_dir is None else load_config(draft_dir)
    if draft_config is not None:
        placement.check(draft_config.text, dense_precision=args.dense_precision, name="the draft model")
    try:
        check_speculative(model_config, config.speculative, draft_config)
        if draft_dir is not None and tokenizer_file(draft_dir) != tokenizer_file(directory):
            raise ValueError(f"{draft_dir}'s tokenizer.json is not the model's")
    except ValueError as exc:
        raise SystemExit(f"--speculative-algorithm {args.speculative_algorithm}: {exc}") from None
    generation = GenerationConfig() if directory is None else load_generation_config(directory)
    quant = QuantConfig(args.expert_precision, args.dense_precision, args.fp8_twins)
    if directory is not None:
        model = load_pretrained(directory, dtype=dtype, config=model_config, mesh=placement.mesh, quant=quant,
                                backend=args.backend)
        if args.model:
            name = args.served_model_name or os.path.basename(os.path.normpath(args.model))
            description = f"checkpoint {args.model}"
        else:
            name, description = args.served_model_name or DEFAULT_MODEL_NAME, default_model_description()
    else:
        model = random_weights(model_config, dtype, args.seed, backend=args.backend, quant=quant)
        name = args.served_model_name or f"inkling-{args.preset}-random"
        description = (f"the `{args.preset}` preset with seeded random weights (seed {args.seed}) and a byte-level "
                       "tokenizer: a demo of the server, its output is noise")
    dense_part = "dense MLPs and LM head" + (" (fp8), attention and shared experts" if args.dense_precision ==
                                             "nvfp4" else "")
    quantised = [f"{part} in {flag}" for part, flag in (("routed experts", args.expert_precision),
                                                         (dense_part, args.dense_precision)) if flag != "bf16"]
    if args.fp8_twins:
        quantised.append("fp8 twins of the NVFP4 weights for wide steps")
    log.info("model %r: %s; tokenizer %s; %s%s on %s", name, description, tokenizer.name, dtype,
             "".join(f", {q}" for q in quantised), placement.devices)
    if name in dict(args.lora_modules):
        raise SystemExit(f"--lora-modules: {name!r} is the served model's name")
    # The engine's view of the model (fused, placed), built here so that the weights it replaces are freed before
    # the engine sizes its KV pool by the free memory; the engine's own view of it then changes nothing.
    model = placement.model_view(model, config)
    draft = None if draft_dir is None else load_pretrained(draft_dir, dtype=dtype, config=draft_config,
                                                           mesh=placement.mesh, quant=quant, backend=args.backend)
    engine = Engine(model, config, eos_token_id=model.config.eos_token_id, placement=placement, draft_model=draft)
    media = (MediaEncoder(model, args.max_image_pixels) if model.vision is not None or model.audio is not None
             else None)
    try:
        chat = ChatFormat(tokenizer, media)
    except ChatError as exc:
        log.warning("chat disabled: %s", exc)
        chat = None
    log.info("chat: %s", "disabled" if chat is None else " + ".join(("text",) + (media.kinds if media else ())))
    engine.start()
    max_len = config.max_model_len
    return Service(engine, tokenizer, name, description, model.config.text.unpadded_vocab_size,
                   max_prompt_tokens=args.max_prompt_tokens or max_len - 1, max_tokens=args.max_tokens or max_len - 1,
                   max_n=args.max_n, api_key=args.api_key, chat=chat, lora=engine.runner.lora,
                   sampling_defaults=sampling_defaults(generation), max_body_bytes=int(args.max_body_mb * 2**20),
                   allowed_hosts=None if args.api_key or not is_loopback(args.host) else local_host_names(args.host))


def tokenizer_file(directory: str | None) -> bytes | None:
    """A model directory's tokenizer.json, as bytes (None: no directory, or none there)."""
    path = None if directory is None else os.path.join(directory, "tokenizer.json")
    if path is None or not os.path.exists(path):
        return None
    with open(path, "rb") as f:
        return f.read()


def sampling_defaults(generation) -> SamplingParams:
    """The request defaults: the checkpoint's generation_config.json where it states them, else the server's."""
    stated = {k: getattr(generation, k) for k in SAMPLING_FIELDS if getattr(generation, k) is not None}
    return SamplingParams(**stated)


def main(argv=None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.compilation_cache:
        jax.config.update("jax_compilation_cache_dir", args.compilation_cache)
    try:
        service = build_service(args)
    except MeshError as e:
        raise SystemExit(f"--mesh {args.mesh}: {e}") from None
    except MemoryError as e:  # the KV pool did not fit: the message says its size and the flags that change it
        raise SystemExit(str(e)) from None
    if not is_loopback(args.host) and not args.api_key:
        log.warning("listening on %s without an API key: anyone who can reach it can use it", args.host)
    log.info("serving %r at http://%s:%d/v1", service.model_name, args.host, args.port)
    Server(serving_app(service), args.host, args.port, args.drain_seconds, args.log_level).run()


if __name__ == "__main__":
    main()
