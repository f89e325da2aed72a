"""Teacher tokens/s of the data stage (issue 25): our runtime against `transformers serve` with continuous batching,
on the embedded SmolLM2 target, the same prompts and sampling, paired and alternated.

Two arms, each on `--units` batches of `--batch-size` training prompts (builtin:train, chat-templated), every unit
`--repeats` times in ABBA order (`specdec_runtime.ab.paired_runs`):

- `runtime`: `data.generator: runtime`, the engine's `generate` on `fast_model(target)` (the CPU fast path), one
  batch per call, sampled with the unit's seed;
- `serve`: `data.generator: endpoint`, the same prompts through the data stage's own client (distill/endpoint.py,
  `max_concurrency` = the batch size, so the server batches them) against `transformers serve --continuous-batching`,
  started here on the same CPU with a KV cache sized for the batch.

Teacher tokens are the runtime's new tokens and the server's own count (usage.completion_tokens). Per unit: serve
tokens/s / runtime tokens/s, each pooled over the unit's repeats; printed: the median over units and its 95 %
bootstrap interval (`specdec_runtime.ab.bootstrap_ci`), and the pooled tokens/s of each arm.

    python benchmarks/endpoint_bench.py                                   # embedded SmolLM2, ~10 min on 2 cores
    python benchmarks/endpoint_bench.py --json runs/endpoint_bench.json
    python benchmarks/endpoint_bench.py --target random:tiny-llama --units 2 --batch-size 2 --max-new-tokens 8 \\
        --repeats 1                                                       # smoke, seconds after the server is up

Either arm may win on a CPU, and neither number says what the endpoint path is for: a serving engine on GPUs (vLLM
or SGLang, data parallel, CUDA graphs) writing the responses while our target only scores them. That comparison
needs a GPU machine. Both processes share this machine's cores (the idle arm waits), so run it on an idle machine.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import torch

from distill.config import EndpointConfig
from distill.endpoint import Request, Sampling, fetch_responses, load_responses
from distill.prompts import load_prompts, render_chat
from specdec_runtime.ab import bootstrap_ci, median, paired_runs
from specdec_runtime.backends import fast_model
from specdec_runtime.engine import SamplingParams, generate
from specdec_runtime.loading import load_model, resolve_model_path, stop_token_ids

ARMS = ("runtime", "serve")
PAGE_TOKENS = 256  # transformers' ContinuousBatchingConfig.page_size: tokens per KV cache block


def start_server(folder: str, port: int, *, blocks: int, batch_tokens: int, log: Path) -> subprocess.Popen:
    """`transformers serve FOLDER --continuous-batching` on the CPU; its KV cache sized by hand (sized from the RAM,
    its first request takes seconds)."""
    cmd = [sys.executable, "-m", "transformers.cli.transformers", "serve", folder, "--host", "127.0.0.1"]
    cmd += ["--port", str(port), "--device", "cpu", "--continuous-batching", "--cb-num-blocks", str(blocks)]
    cmd += ["--cb-max-batch-tokens", str(batch_tokens)]
    env = os.environ | {"HF_HUB_OFFLINE": "1", "HF_HUB_DISABLE_UPDATE_CHECK": "1"}
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc
        except httpx.TransportError:
            time.sleep(0.5)
    proc.kill()
    raise SystemExit(f"transformers serve did not come up (needs `make install`):\n{log.read_text()[-2000:]}")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="embedded:smollm2-135m-instruct")
    p.add_argument("--units", type=int, default=4, help="batches of prompts (the paired units)")
    p.add_argument("--batch-size", type=int, default=16, help="prompts per batch = the client's max_concurrency")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--top-p", type=float, default=0.95)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--cb-max-batch-tokens", type=int, default=1024, help="the server's token budget per step")
    p.add_argument("--json", default=None)
    args = p.parse_args()

    target, tokenizer = load_model(args.target, device="cpu")
    folder, _ = resolve_model_path(args.target)  # the HF folder (a GGUF's converted cache) the server loads
    stop_ids = list(stop_token_ids(target, tokenizer))
    records = load_prompts("builtin:train")[: args.units * args.batch_size]
    prompts = [render_chat(tokenizer, r.messages) for r in records]
    units = [prompts[u * args.batch_size : (u + 1) * args.batch_size] for u in range(args.units)]
    decoder = fast_model(target)
    sampling = SamplingParams(temperature=args.temperature, top_p=args.top_p)
    wire = Sampling(args.max_new_tokens, args.temperature, 0, args.top_p)

    longest = max(map(len, prompts)) + args.max_new_tokens
    blocks = math.ceil(args.batch_size * longest / PAGE_TOKENS) + 8
    port, log = free_port(), Path(tempfile.mkdtemp()) / "serve.log"
    server = start_server(folder, port, blocks=blocks, batch_tokens=args.cb_max_batch_tokens, log=log)
    cfg = EndpointConfig(url=f"http://127.0.0.1:{port}/v1", model=folder, max_concurrency=args.batch_size, retries=0)

    def serve(unit: int, seed: int, plan=None):
        """One batch through the endpoint client -> (server-counted tokens, seconds, the plan)."""
        with tempfile.TemporaryDirectory() as store:
            requests = [Request(i, ids, seed * 1000 + i) for i, ids in enumerate(units[unit])]
            start = time.perf_counter()
            plan = fetch_responses(cfg, requests, Path(store), tokenizer, wire, stop_ids, plan=plan)
            seconds = time.perf_counter() - start
            table, _ = load_responses(Path(store))
        return sum(table["server_tokens"].to_pylist()), seconds, plan

    def run(unit: int, arm: str, repeat: int) -> tuple[int, float]:
        seed = repeat * args.units + unit
        if arm == "serve":
            tokens, seconds, _ = serve(unit, seed, plan)
            return tokens, seconds
        generator = torch.Generator().manual_seed(seed)
        start = time.perf_counter()
        out = generate(
            decoder,
            None,
            units[unit],
            sampling=sampling,
            max_new_tokens=args.max_new_tokens,
            stop_token_ids=stop_ids,
            generator=generator,
        )
        return sum(len(t) for t in out.tokens), time.perf_counter() - start

    try:
        _, _, plan = serve(0, 999_999)  # warm-up: the probe (the plan is reused), the server's first batch
        run(0, "runtime", 999_999)  # warm-up of our side
        runs = paired_runs(run, units=args.units, arms=ARMS, repeats=args.repeats)
    finally:
        os.killpg(server.pid, signal.SIGKILL)
        server.wait()

    def tokens_per_s(calls: list[tuple[int, float]]) -> float:
        return sum(t for t, _ in calls) / sum(s for _, s in calls)

    ratios = [tokens_per_s(s) / tokens_per_s(r) for r, s in zip(runs["runtime"], runs["serve"])]
    result = {
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch threads "
        f"{torch.get_num_threads()}",
        "target": args.target,
        "settings": vars(args) | {"server": "transformers serve --continuous-batching", "plan": plan.notes},
        "runtime_tokens_per_s": tokens_per_s([c for unit in runs["runtime"] for c in unit]),
        "serve_tokens_per_s": tokens_per_s([c for unit in runs["serve"] for c in unit]),
        "serve_over_runtime": median(ratios),
        "serve_over_runtime_ci": bootstrap_ci(ratios),
        "units": len(ratios),
    }
    print(
        f"teacher tokens/s on {result['machine']}: runtime {result['runtime_tokens_per_s']:.1f}, transformers serve "
        f"(CB) {result['serve_tokens_per_s']:.1f}; serve / runtime {result['serve_over_runtime']:.2f}x "
        f"[{result['serve_over_runtime_ci'][0]:.2f}, {result['serve_over_runtime_ci'][1]:.2f}] over {len(ratios)} units"
    )
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
