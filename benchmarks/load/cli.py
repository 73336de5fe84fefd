"""`inkling-bench-serving` (`python -m benchmarks.load.cli`): load an OpenAI-compatible server with streamed
requests and report vLLM's serving metrics (throughputs; TTFT, TPOT, ITL, E2EL in ms).

    inkling-bench-serving --base-url http://127.0.0.1:8000 --num-prompts 512 --max-concurrency 128 \\
        --random-input-len 1024 --random-output-len 256 --save-result --result-filename run.json
    inkling-bench-serving --base-url http://gpu-box:30000 --model Qwen/Qwen3-8B --dataset-name sharegpt \\
        --dataset-path ShareGPT_V3_unfiltered_cleaned_split.json --request-rate 8 --endpoint /v1/chat/completions

The flags and the saved JSON's keys are those of vLLM's `benchmark_serving` (the same command pointed at vLLM or
SGLang compares like with like). Random prompts are token-id lists (only /v1/completions takes them; nothing is
downloaded, no tokenizer is needed); ShareGPT prompts are counted with the server's /tokenize. Every request
streams with `stream_options.include_usage` and, unless --no-ignore-eos, `ignore_eos` so that outputs have the
asked length; its token counts are the server's `usage`.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import queue
import threading
import time

import numpy as np
from tqdm import tqdm

from benchmarks.load import report
from benchmarks.load.arrivals import send_offsets
from benchmarks.load.client import CHAT, COMPLETIONS, Server, request_body, server_token_counter, stream
from benchmarks.load.datasets import DEFAULT_TOKEN_RANGE, random_prompts, sharegpt_prompts


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="inkling-bench-serving", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    a = p.add_argument
    a("--base-url", default="http://127.0.0.1:8000", help="the server, without /v1 (default %(default)s)")
    a("--endpoint", default=COMPLETIONS, choices=[COMPLETIONS, CHAT])
    a("--model", help="the model id to send (default: the first of the server's /v1/models)")
    a("--api-key", default=os.environ.get("OPENAI_API_KEY"), help="bearer key (default: $OPENAI_API_KEY)")
    a("--dataset-name", default="random", choices=["random", "sharegpt"])
    a("--dataset-path", help="a ShareGPT-format JSON file (--dataset-name sharegpt)")
    a("--sharegpt-output-len", type=int, help="output tokens of every ShareGPT request (default: its answer's)")
    a("--random-input-len", type=int, default=1024)
    a("--random-output-len", type=int, default=128)
    a("--random-range-ratio", type=float, default=0.0,
      help="lengths uniform in [L (1 - r), L (1 + r)]; 0: exactly L (default)")
    a("--random-token-range", default=",".join(map(str, DEFAULT_TOKEN_RANGE)),
      help="random prompts' token ids are drawn from [LOW, HIGH) (default %(default)s)")
    a("--num-prompts", type=int, default=1000)
    a("--request-rate", type=float, default=math.inf, help="requests per second (default inf: all at once)")
    a("--burstiness", type=float, default=1.0, help="gamma shape of the gaps between requests: 1 Poisson, "
      "< 1 burstier, > 1 more even")
    a("--max-concurrency", type=int, help="requests in flight at most (default: no limit)")
    a("--seed", type=int, default=0)
    a("--temperature", type=float, default=0.0)
    a("--no-ignore-eos", action="store_true", help="do not send ignore_eos (outputs may end early)")
    a("--metric-percentiles", default="99", help="comma-separated percentiles of each latency (default 99)")
    a("--request-timeout", type=float, default=3600.0, help="seconds a request may take")
    a("--save-result", action="store_true", help="write the metrics and per-request details as JSON")
    a("--result-filename", help="where --save-result writes (default: bench-serving-<date>.json)")
    a("--disable-tqdm", action="store_true")
    args = p.parse_args(argv)
    positive = {"--num-prompts": args.num_prompts, "--random-input-len": args.random_input_len,
                "--random-output-len": args.random_output_len, "--max-concurrency": args.max_concurrency or 1,
                "--sharegpt-output-len": args.sharegpt_output_len or 1, "--request-timeout": args.request_timeout}
    for flag, value in positive.items():
        if not value > 0:
            p.error(f"{flag} must be > 0, got {value}")
    if not 0 <= args.random_range_ratio < 1:
        p.error(f"--random-range-ratio must be in [0, 1), got {args.random_range_ratio}")
    if not args.request_rate > 0 or not (0 < args.burstiness < math.inf):
        p.error("--request-rate must be > 0 (inf: all at once) and --burstiness a finite number > 0")
    try:
        args.percentiles = tuple(float(x) for x in args.metric_percentiles.split(","))
        low, high = (int(x) for x in args.random_token_range.split(","))
    except ValueError:
        p.error("--metric-percentiles takes numbers, --random-token-range two integers LOW,HIGH")
    if not all(0 < q <= 100 for q in args.percentiles) or not 0 <= low < high:
        p.error("percentiles must be in (0, 100], and the token range LOW < HIGH with LOW >= 0")
    args.token_range = (low, high)
    if args.dataset_name == "sharegpt" and not args.dataset_path:
        p.error("--dataset-name sharegpt needs --dataset-path (a ShareGPT-format JSON file)")
    if args.dataset_name == "random" and args.endpoint == CHAT:
        p.error("random prompts are token ids, which only /v1/completions takes; use sharegpt for chat")
    return args


def served_model(server: Server) -> str:
    connection = server.connect()
    try:
        connection.request("GET", server.prefix + "/v1/models", headers=server.headers)
        response = connection.getresponse()
        body = response.read()
    finally:
        connection.close()
    if response.status != 200:
        raise SystemExit(f"GET /v1/models: HTTP {response.status}; pass --model")
    return json.loads(body)["data"][0]["id"]


def run(server: Server, bodies: list[dict], prompt_lens: list[int], offsets: np.ndarray,
        max_concurrency: int | None, progress) -> tuple[list, float]:
    """Send request i at offsets[i] seconds from the start (or once one of `max_concurrency` workers is free,
    in order); returns the results and the seconds from the first send to the last answer."""
    results = [None] * len(bodies)
    jobs: queue.SimpleQueue = queue.SimpleQueue()

    def work():
        while (i := jobs.get()) is not None:
            results[i] = stream(server, bodies[i], prompt_lens[i])
            progress.update()

    workers = [threading.Thread(target=work, daemon=True) for _ in range(min(max_concurrency or len(bodies),
                                                                             len(bodies)))]
    for worker in workers:
        worker.start()
    start = time.perf_counter()
    for i, offset in enumerate(offsets):
        time.sleep(max(0.0, start + offset - time.perf_counter()))
        jobs.put(i)
    for _ in workers:
        jobs.put(None)
    for worker in workers:
        worker.join()
    return results, time.perf_counter() - start


def benchmark(args: argparse.Namespace) -> dict:
    """The whole run: prompts, a first request that checks the server answers, the load, the metrics."""
    server = Server(args.base_url, args.endpoint, args.api_key, args.request_timeout)
    model = args.model or served_model(server)
    rng = np.random.default_rng(args.seed)
    if args.dataset_name == "random":
        prompts = random_prompts(args.num_prompts, args.random_input_len, args.random_output_len,
                                 args.random_range_ratio, rng, args.token_range)
    else:
        prompts = sharegpt_prompts(args.dataset_path, args.num_prompts, rng, server_token_counter(server, model),
                                   args.sharegpt_output_len)
    sampling = {"temperature": args.temperature, **({} if args.no_ignore_eos else {"ignore_eos": True})}
    bodies = [request_body(args.endpoint, model, p, sampling) for p in prompts]
    first = stream(server, {**bodies[0], "max_tokens": min(4, prompts[0].output_len)}, prompts[0].prompt_len)
    if not first.success:
        raise SystemExit(f"the first request to {args.base_url}{args.endpoint} failed: {first.error}")
    offsets = send_offsets(len(bodies), args.request_rate, args.burstiness, rng)
    with tqdm(total=len(bodies), disable=args.disable_tqdm) as progress:
        results, duration = run(server, bodies, [p.prompt_len for p in prompts], offsets, args.max_concurrency,
                                progress)
    found = report.metrics(results, duration, args.percentiles)
    return {"date": time.strftime("%Y%m%d-%H%M%S"), "base_url": args.base_url, "endpoint": args.endpoint,
            "model_id": model, "dataset_name": args.dataset_name, "num_prompts": args.num_prompts,
            "request_rate": args.request_rate if math.isfinite(args.request_rate) else "inf",
            "burstiness": args.burstiness, "max_concurrency": args.max_concurrency, **found,
            **report.details(results)}


def main(argv=None) -> None:
    args = parse_args(argv)
    found = benchmark(args)
    print(report.summary(found, args.percentiles))
    if args.save_result:
        path = args.result_filename or f"bench-serving-{found['date']}.json"
        with open(path, "w") as f:
            json.dump(found, f, indent=1)
        print(f"saved {path}")


if __name__ == "__main__":
    main()
