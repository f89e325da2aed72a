"""Where a verify's extra time goes on the CPU fast path (issue 28): one target forward of T tokens (T = 1, a decode
step, and the verify widths) after the same prompt, timed and profiled by operator.

    python benchmarks/verify_profile.py --json runs/verify_profile.json                 # eager fast path, ~2 min
    python benchmarks/verify_profile.py --compiled --json runs/verify_profile-compiled.json   # + compiling, ~6 min

The step is the engine's own (`StaticState.extend` on the model `backends.fast_model` builds, the window as wide
as the prompt plus T), run `--reps` times per width with the widths interleaved, each call rolled back so every one
sees the same cache. Wall time: the median per width, no profiler attached. Then one profiled pass per width
(`torch.profiler`, CPU self time per operator, averaged per call) splits the step into: `gemm` (the linears: MKL
`mm` / `addmm` / `bmm`, oneDNN's packed linear; compiled: Inductor's GEMM template and its extern oneDNN calls),
`attention` (SDPA: its score, softmax and value products over the window), `other` (rope, norms, SwiGLU, cache
writes, views, the mask; compiled: Inductor's fused C++ kernels) and each category's growth over T = 1 in ms.
`--layout-table` first prints, per weight shape of the model (every layer's weight of it streamed in sequence, as a
forward reads them) and row count, each fp32 eager layout's median ms and GB/s (`cpu_tune.LAYOUTS`, 9 interleaved
repetitions): how fast the kernels a verify can use stream the weights at 2-8 rows against 1.
`--in-loop GAMMA` then runs the real loop (`engine.generate`, chains of GAMMA greedy drafts from the target's
evenly spaced `--draft-layers`-layer truncation, on the same backend, the first `--num-prompts` builtin:test prompts,
`--max-new-tokens`), timing every target step per width T inside it: median, mean and the calls over twice the
median (a recompile or a stall lifts the mean the loop's phases report, not the median timed here in isolation).
The profiler's own per-op cost inflates `other` on the eager path (~600 ops per step): read the wall time for the
step, the split for where it grows. Compiled kernels are named only with Inductor's kernel profiling on
(`cpp.enable_kernel_profile`, set here before compiling).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from distill.prompts import interleave_categories, load_prompts, render_chat  # noqa: E402
from distill.students import evenly_spaced_layers, truncate_student  # noqa: E402
from specdec_runtime.backends import BackendOptions, fast_model, plan_rows  # noqa: E402
from specdec_runtime.cpu_tune import (  # noqa: E402
    FusedLinear,
    candidates,
    lay_out,
    machine_info,
    probe_bandwidth,
    run_layout,
)
from specdec_runtime.engine import generate  # noqa: E402
from specdec_runtime.llama import StaticState  # noqa: E402
from specdec_runtime.loading import load_model, stop_token_ids  # noqa: E402

GEMM_OPS = ("aten::mm", "aten::addmm", "aten::bmm", "mkldnn::_linear_pointwise", "aten::linear", "aten::matmul")
ATTENTION_OPS = ("scaled_dot_product", "flash_attention", "_softmax")


def category(name: str) -> str:
    """An operator's (or an Inductor kernel's) share of the step: gemm, attention or other."""
    low = name.lower()
    if any(op in low for op in ATTENTION_OPS):
        return "attention"
    if name.startswith(GEMM_OPS) or "gemm" in low or "mkldnn" in low or "linear" in low:
        return "gemm"
    return "other"


def step_fn(model: torch.nn.Module, prompt: list[int], T: int):
    """One forward of T tokens after `prompt`, rolled back afterwards: every call sees the same cache."""
    state = StaticState(model, 1, len(prompt) + 16)
    state.extend(torch.tensor([prompt]), torch.tensor([len(prompt)]), last_only=True)
    tokens, counts = torch.tensor([prompt[-T:]]), torch.tensor([T])

    def run() -> None:
        state.extend(tokens, counts)
        state.rollback(counts)

    return run


def timed(runs: dict, reps: int) -> dict:
    """Median wall ms per width, the widths interleaved so a drift of the machine hits them alike."""
    times = defaultdict(list)
    for _ in range(reps):
        for T, run in runs.items():
            start = time.perf_counter()
            run()
            times[T].append(1e3 * (time.perf_counter() - start))
    return {T: statistics.median(ts) for T, ts in times.items()}


def profiled(run, calls: int) -> tuple[dict, list]:
    """CPU self ms per call by category, and the top operators."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(calls):
            run()
    by_op = {e.key: e.self_cpu_time_total / 1e3 / calls for e in prof.key_averages()}
    cats = defaultdict(float)
    for name, ms in by_op.items():
        cats[category(name)] += ms
    top = sorted(by_op.items(), key=lambda kv: -kv[1])[:12]
    return dict(cats), top


def layout_table(model, rows=(1, 2, 4, 8), reps: int = 9) -> list[dict]:
    """Each eager fp32 layout's median ms per shape and row count, the shape's weights streamed as a forward does."""
    shapes = defaultdict(list)
    for module in model.modules():
        if isinstance(module, FusedLinear):  # random weights of its shape: the values do not change the timing
            N, K = module.out_features, module.in_features
            shapes[(N, K)].append(torch.randn(N, K, generator=torch.Generator().manual_seed(len(shapes))) * 0.02)
    table = []
    for (N, K), weights in shapes.items():
        names = list(candidates(torch.float32))
        laid = {n: [lay_out(w, n) for w in weights] for n in names}
        gb = sum(w.numel() for w in weights) * 4 / 1e9
        for r in rows:
            x = torch.randn(r, K, generator=torch.Generator().manual_seed(0))
            for n in names:  # oneDNN builds its primitive on a first call
                run_layout(n, x, laid[n][0], None, N)
            times = defaultdict(list)
            for _ in range(reps):
                for n in names:
                    start = time.perf_counter()
                    for w in laid[n]:
                        run_layout(n, x, w, None, N)
                    times[n].append(time.perf_counter() - start)
            ms = {n: 1e3 * statistics.median(t) for n, t in times.items()}
            table.append(
                {
                    "shape": f"{N}x{K}x{len(weights)}",
                    "rows": r,
                    "ms": ms,
                    "gb_s": {n: gb / (t / 1e3) for n, t in ms.items()},
                }
            )
    return table


def in_loop(target, draft, prompts, stop, gamma: int, max_new_tokens: int) -> dict:
    """Every target step's wall ms by width T inside real generate calls (target-only and chains, alternating)."""
    times, step = defaultdict(list), target.step

    def timed_step(tokens, *rest):  # the instance attribute shadows Llama.step: StaticState.extend calls this
        start = time.perf_counter()
        out = step(tokens, *rest)
        times[tokens.shape[1]].append(1e3 * (time.perf_counter() - start))
        return out

    for p in prompts[:1]:  # warm-up: every graph either arm needs, outside the timed calls
        generate(target, None, [p], max_new_tokens=max_new_tokens, stop_token_ids=stop)
        generate(target, draft, [p], num_draft_tokens=gamma, max_new_tokens=max_new_tokens, stop_token_ids=stop)
    target.step = timed_step
    try:
        for p in prompts:
            generate(target, None, [p], max_new_tokens=max_new_tokens, stop_token_ids=stop)
            generate(target, draft, [p], num_draft_tokens=gamma, max_new_tokens=max_new_tokens, stop_token_ids=stop)
    finally:
        del target.step
    out = {}
    for T, ts in sorted(times.items()):
        med = statistics.median(ts)
        out[T] = {
            "calls": len(ts),
            "median_ms": med,
            "mean_ms": statistics.fmean(ts),
            "slow": sum(t > 2 * med for t in ts),
        }
        out[T]["slowest_ms"] = sorted(ts)[-3:]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", default="embedded:smollm2-135m-instruct")
    ap.add_argument("--widths", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--prompt-len", type=int, default=128, help="cache length before the step (tokens)")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--profile-calls", type=int, default=10)
    ap.add_argument("--compiled", action="store_true", help="the compiled steps (target.cpu_compile)")
    ap.add_argument("--layout-table", action="store_true", help="each eager layout's GB/s per shape and rows")
    ap.add_argument("--in-loop", type=int, default=None, metavar="GAMMA", help="also time the steps inside generate")
    ap.add_argument("--draft-layers", type=int, default=4)
    ap.add_argument("--num-prompts", type=int, default=6)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--retune", action="store_true", help="time the layouts again (cpu_layouts=tune)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    if args.compiled:
        torch._inductor.config.cpp.enable_kernel_profile = True  # names each generated kernel in the profile
    target, tokenizer = load_model(args.target, device="cpu")
    backend = BackendOptions(cpu_compile=args.compiled, cpu_layouts="tune" if args.retune else "auto")
    options = plan_rows(backend, 1, set(args.widths) | ({1, 2, args.in_loop + 1} if args.in_loop else set()))
    model = fast_model(target, options)
    prompt = [
        int(t)
        for t in torch.randint(
            100, target.config.vocab_size, (args.prompt_len,), generator=torch.Generator().manual_seed(0)
        )
    ]
    machine = machine_info(probe=False)
    print(
        f"{machine['cpu']} ({' '.join(machine['flags'])}), {machine['cores']} cores, {torch.get_num_threads()} threads"
    )
    with torch.no_grad():
        runs = {T: step_fn(model, prompt, T) for T in args.widths}
        start = time.perf_counter()
        for run in runs.values():  # warm-up: oneDNN primitives, compiled graphs
            run(), run()
        print(f"warm-up {time.perf_counter() - start:.0f} s", flush=True)
        probes = [probe_bandwidth()]
        table = layout_table(model) if args.layout_table else None
        wall = timed(runs, args.reps)
        probes.append(probe_bandwidth())
        split = {T: profiled(run, args.profile_calls) for T, run in runs.items()}
        loop = None
        if args.in_loop:
            hf_draft = truncate_student(
                target, evenly_spaced_layers(target.config.num_hidden_layers, args.draft_layers)
            )
            records = load_prompts("builtin:test")
            order = interleave_categories(records)  # as cpu_runtime_bench orders them
            prompts = [render_chat(tokenizer, r.messages) for r in order[: args.num_prompts]]
            draft = fast_model(hf_draft, options, draft=True)
            stop = stop_token_ids(target, tokenizer)
            loop = in_loop(model, draft, prompts, stop, args.in_loop, args.max_new_tokens)
    print(f"read {probes[0]:.1f} / {probes[1]:.1f} GB/s; cache {args.prompt_len} tokens")
    print("| T | wall ms | v(T) | gemm ms | attention ms | other ms | profiled total |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    base = wall[args.widths[0]]
    for T in args.widths:
        cats = split[T][0]
        print(
            f"| {T} | {wall[T]:.1f} | {wall[T] / base:.2f} | {cats.get('gemm', 0):.1f} "
            f"| {cats.get('attention', 0):.1f} | {cats.get('other', 0):.1f} | {sum(cats.values()):.1f} |"
        )
    for T in args.widths:
        print(f"top operators, T = {T} (self ms per call):")
        for name, ms in split[T][1]:
            print(f"  {ms:7.2f}  {name[:100]}")
    if table:
        names = list(table[0]["ms"])
        print("layouts, eager fp32: ms (GB/s) per shape (N x K x layers) and rows")
        print("| shape | rows | " + " | ".join(names) + " |\n| --- | ---: |" + " ---: |" * len(names))
        for t in table:
            cells = " | ".join(f"{t['ms'][n]:.1f} ({t['gb_s'][n]:.1f})" for n in names)
            print(f"| {t['shape']} | {t['rows']} | {cells} |")
    if loop:
        print(f"in the loop (gamma {args.in_loop}, {args.num_prompts} prompts, target-only and chains alternating):")
        print("| T | calls | median ms | mean ms | calls > 2x median | slowest ms |")
        print("| ---: | ---: | ---: | ---: | ---: | --- |")
        for T, r in loop.items():
            slowest = ", ".join(f"{t:.0f}" for t in r["slowest_ms"])
            print(f"| {T} | {r['calls']} | {r['median_ms']:.1f} | {r['mean_ms']:.1f} | {r['slow']} | {slowest} |")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        out = {
            "settings": vars(args),
            "machine": machine | {"bandwidth_probes_gb_s": probes},
            "wall_ms": wall,
            "profile": {T: {"categories": c, "top": t} for T, (c, t) in split.items()},
            "in_loop": loop,
            "layout_table": table,
        }
        Path(args.json).write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
