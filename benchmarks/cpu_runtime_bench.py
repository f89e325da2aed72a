"""CPU runtime bench (issues 14, 28): what a verify, a draft step and a decode step cost on the CPU fast path
(`specdec_runtime.cpu`) against the HF path, and tokens/s against HF `generate`, all measured in one process.

1. In-loop forward costs, batch 1, greedy, one prompt per unit: for each backend (`hf`: the HF model with a
   DynamicCache; `rule`: `cpu.cpu_model` with the fixed layout rule of issue 14; `fast`: `cpu.cpu_model` with the
   layouts timed fastest on this machine (`cpu_tune`; the first run on a machine times them, `--retune` times them
   again), fp32 target, `cpu.draft_dtype()` draft; `compiled`, opt-in: the fast path with its steps compiled by
   Inductor, `cpu.compile_steps`), target-only decoding and speculative decoding with the 4-layer truncated draft
   at each gamma, every arm once per unit and repeat in ABBA order (`ab.paired_runs`), so `rule` and `fast` are a
   paired before / after. From the runs' own phases (`stats.phases`): the decode step (target-only decode
   seconds / steps) and the target's forward within it (`fwd ms`), the forward as a multiple of the
   weight-streaming floor (`x floor`: the target's weight bytes / the probed bandwidth, `cpu_tune.decode_floor_s`),
   one verify forward over gamma + 1 tokens (`verify_cost_ratio`, in decode steps of the same backend), one draft
   forward (`cost_ratio`), tokens/s, and the fast path's step against the HF path's.
2. HF `generate` target-only (greedy) and HF assisted generation (`bench.fair_assistant`: exactly gamma drafts per
   step, gamma 3) on the same prompts: tokens/s against ours.
3. The data stage's teacher generation: `--data-batch` training prompts in one batch, T=0.7, top-p 0.95,
   `--data-new-tokens` tokens, through our engine on each backend and through HF `generate` (left-padded batch).

The `compiled` backend compiles in the warm-up and in `ab.capture_graphs` (every width and power-of-two row count
a timed call can reach), outside the timed calls; that time is reported (`warmup_s`, `<backend>_warmup_s`). The
layouts are planned for the rows this bench runs (1, 2 and each gamma + 1 at batch 1, the data batch); the JSON
records the machine (`cpu_tune.machine_info`), the floor, the layouts chosen and the seconds spent timing them.

    python benchmarks/cpu_runtime_bench.py                     # the embedded SmolLM2 target, minutes idle
    python benchmarks/cpu_runtime_bench.py --json runs/cpu_runtime_bench.json --threads 2
    python benchmarks/cpu_runtime_bench.py --backends hf fast compiled --json runs/cpu_runtime_bench-compiled.json
    python benchmarks/cpu_runtime_bench.py --target random:tiny-llama --draft-layers 2 --num-prompts 2 \
        --max-new-tokens 8 --gammas 3 --data-batch 4 --data-new-tokens 8     # smoke, seconds

Only on a CPU (the CUDA path is measured by benchmarks/gpu_bench.py). Other processes on the machine distort every
number here: run it on an idle machine; the timings are pooled over every call, the ratios come from one run.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace
from pathlib import Path

import torch

from distill.prompts import interleave_categories, load_prompts, render_chat
from distill.students import evenly_spaced_layers, truncate_student
from specdec_runtime.ab import capture_graphs, cost_model, paired_runs, paired_speedup, pooled
from specdec_runtime.backends import BackendOptions, backend_name, fast_model, plan_rows
from specdec_runtime.bench import VerifyWidths, fair_assistant, hf_assisted, hf_generation_config
from specdec_runtime.cpu_tune import decode_floor_s, layout_summary, machine_info, probe_bandwidth
from specdec_runtime.engine import SamplingParams, generate
from specdec_runtime.loading import load_model, stop_token_ids
from specdec_runtime.metrics import GenerationStats

BACKENDS = ("hf", "rule", "fast", "compiled")
DEFAULT_BACKENDS = ["hf", "rule", "fast"]
BEFORE_DATA_TOKENS_PER_S = 48.0
"""The data stage's tokens/s at batch 32 on the idle 2-core CPU before the fast path (issue 14, docs/benchmarks.md)."""


def forward_costs(models: dict, prompts: list[list[int]], gammas: list[int], *, max_new_tokens, stop, repeats) -> dict:
    """Section 1: per backend, target-only and each gamma on every prompt (ABBA) -> {backend: metrics}."""
    arms = [f"{b}:{mode}" for b in models for mode in ["target", *[f"g{g}" for g in gammas]]]

    def run(unit: int, arm: str, repeat: int) -> GenerationStats:
        backend, mode = arm.split(":")
        target, draft = models[backend]
        kwargs = {} if mode == "target" else {"num_draft_tokens": int(mode[1:])}
        return generate(
            target,
            None if mode == "target" else draft,
            [prompts[unit]],
            max_new_tokens=max_new_tokens,
            stop_token_ids=stop,
            **kwargs,
        ).stats

    compile_s = dict.fromkeys(models, 0.0)
    for arm in arms:  # warm-up: allocator caches, oneDNN primitives, the compiled backend's graphs
        start = time.perf_counter()
        run(0, arm, 0)
        backend, mode = arm.split(":")
        target, draft = models[backend]
        capture_graphs(target, draft, batch_size=1, gamma=int(mode[1:]) if mode != "target" else 1)
        compile_s[backend] += time.perf_counter() - start
    runs = paired_runs(run, units=len(prompts), arms=arms, repeats=repeats)
    out = {}
    for backend in models:
        base = pooled(runs[f"{backend}:target"])
        row = {
            "step_ms": 1e3 * base.phases.decode_s / base.phases.verify_forwards,
            "forward_ms": 1e3 * base.phases.verify_s / base.phases.verify_forwards,  # the target's forward alone
            "target_tokens_per_s": base.aggregate()["tokens_per_s"],
            "warmup_s": compile_s[backend],  # the compiled backend's compile time, plus one untimed call per arm
            "gammas": {},
        }
        for g in gammas:
            spec = pooled(runs[f"{backend}:g{g}"])
            agg, costs = spec.aggregate(), cost_model(base, spec)
            row["gammas"][g] = {
                "verify_ms": 1e3 * spec.phases.verify_s / spec.phases.verify_forwards,
                "draft_ms": 1e3 * spec.phases.draft_s / spec.phases.draft_forwards,
                "verify_cost_ratio": costs["verify_cost_ratio"],
                "cost_ratio": costs["cost_ratio"],
                "acceptance_rate": agg["acceptance_rate"],
                "tokens_per_s": agg["tokens_per_s"],
                "speedup": paired_speedup(runs[f"{backend}:target"], runs[f"{backend}:g{g}"])["speedup"],
            }
        out[backend] = row
    return out


def hf_baselines(target, draft, tokenizer, prompts, gamma: int, *, max_new_tokens, stop) -> dict:
    """Section 2: HF generate target-only and HF assisted generation at gamma, prompt by prompt -> tokens/s."""
    config = hf_generation_config(tokenizer, stop, max_new_tokens, 0.0)
    hook = VerifyWidths(target)
    try:
        hf_assisted(target, None, prompts[:1], config, hook)  # warm-up
        plain = hf_assisted(target, None, prompts, config, hook)  # assistant None: plain greedy generate
        with fair_assistant(draft, gamma):
            assisted = hf_assisted(target, draft, prompts, config, hook)
    finally:
        hook.handle.remove()
    return {
        "generate_tokens_per_s": plain.new_tokens / plain.wall_s,
        "assisted_tokens_per_s": assisted.new_tokens / assisted.wall_s,
        "assisted_gamma": gamma,
    }


def hf_generate_batch(model, prompts, sampling: SamplingParams, max_new_tokens: int, stop, seed: int) -> float:
    """HF generate on one left-padded batch -> tokens/s (tokens up to and including each row's first stop)."""
    width, pad = max(len(p) for p in prompts), stop[0]
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = (torch.arange(width) >= torch.tensor([width - len(p) for p in prompts])[:, None]).long()
    torch.manual_seed(seed)
    start = time.perf_counter()
    out = model.generate(
        ids,
        attention_mask=mask,
        do_sample=True,
        temperature=sampling.temperature,
        top_k=0,
        top_p=sampling.top_p,
        max_new_tokens=max_new_tokens,
        eos_token_id=list(stop),
        pad_token_id=pad,
    )
    wall = time.perf_counter() - start
    new = out[:, width:]
    is_stop = torch.isin(new, torch.tensor(stop))
    before_stop = (is_stop.long().cumsum(1) - is_stop.long()) == 0  # up to and including the first stop
    return int(before_stop.sum()) / wall


def data_stage(models: dict, hf_target, prompts, *, max_new_tokens, stop, seed: int = 0) -> dict:
    """Section 3: teacher generation of one batch (T=0.7, top-p 0.95) -> tokens/s per backend and for HF generate."""
    sampling = SamplingParams(temperature=0.7, top_p=0.95)
    out = {}
    for backend, (target, _) in models.items():
        start = time.perf_counter()
        generate(target, None, prompts, sampling=sampling, max_new_tokens=2, stop_token_ids=stop)  # warm-up
        capture_graphs(target, None, batch_size=len(prompts), gamma=0)  # compiled: every row count of the batch
        out[f"{backend}_warmup_s"] = time.perf_counter() - start
        result = generate(
            target,
            None,
            prompts,
            sampling=sampling,
            max_new_tokens=max_new_tokens,
            stop_token_ids=stop,
            generator=torch.Generator().manual_seed(seed),
        )
        out[f"{backend}_tokens_per_s"] = result.stats.aggregate()["tokens_per_s"]
        out[f"{backend}_phases"] = result.stats.phases.to_dict()
    out["hf_generate_tokens_per_s"] = hf_generate_batch(hf_target, prompts, sampling, max_new_tokens, stop, seed)
    return out


def _f(value, fmt: str = ".3f") -> str:
    return "-" if value is None else format(value, fmt)


def report(costs: dict, hf: dict, data: dict, gammas: list[int], floor_ms: float | None = None) -> str:
    columns = f"{'v':>6}{'draft ms':>10}{'c':>6}{'alpha':>7}{'speedup':>8}"
    head = "".join(f"{f'g={g}: verify ms':>18}{columns}" for g in gammas)
    lines = [f"{'backend':<9}{'step ms':>8}{'fwd ms':>8}{'x floor':>8}{'tok/s':>8}{head}"]
    for backend, row in costs.items():
        cells = "".join(
            f"{_f(r['verify_ms'], '.1f'):>18}{_f(r['verify_cost_ratio'], '.2f'):>6}{_f(r['draft_ms'], '.1f'):>10}"
            f"{_f(r['cost_ratio'], '.2f'):>6}{_f(r['acceptance_rate'], '.2f'):>7}{_f(r['speedup'], '.2f'):>8}"
            for r in row["gammas"].values()
        )
        vs_floor = _f(row["forward_ms"] / floor_ms if floor_ms else None, ".2f")
        lines.append(
            f"{backend:<9}{row['step_ms']:>8.1f}{row['forward_ms']:>8.1f}{vs_floor:>8}"
            f"{row['target_tokens_per_s']:>8.1f}{cells}"
        )
    ratios = []
    for name in [b for b in ("rule", "fast", "compiled") if b in costs]:  # the issues' goals, per fast backend
        fast = costs[name]
        g2, g4, g8 = fast["gammas"].get(1), fast["gammas"].get(3), fast["gammas"].get(7)
        ratios += [
            (f"verify_cost_ratio, 2 tokens ({name})", g2 and g2["verify_cost_ratio"], "~1.1, issue 28"),
            (f"verify_cost_ratio, 4 tokens ({name})", g4 and g4["verify_cost_ratio"], "<= 1.3"),
            (f"verify_cost_ratio, 8 tokens ({name})", g8 and g8["verify_cost_ratio"], "<= 1.6"),
            (f"cost_ratio, draft ({name})", g4 and g4["cost_ratio"], "<= 0.2"),
        ]
        if "hf" in costs:
            ratios.append((f"decode step, hf / {name}", costs["hf"]["step_ms"] / fast["step_ms"], "> 1"))
        ratios.append(
            (
                f"target-only tok/s, {name} / HF generate",
                fast["target_tokens_per_s"] / hf["generate_tokens_per_s"],
                ">= 1",
            )
        )
        ga = fast["gammas"].get(hf["assisted_gamma"])
        if ga:
            ratios.append(
                (
                    f"speculative tok/s g={hf['assisted_gamma']}, {name} / HF assisted",
                    ga["tokens_per_s"] / hf["assisted_tokens_per_s"],
                    ">= 1.3",
                )
            )
        if f"{name}_tokens_per_s" in data:
            ratios.append(
                (
                    f"data stage tok/s, {name} / HF generate",
                    data[f"{name}_tokens_per_s"] / data["hf_generate_tokens_per_s"],
                    "> 1",
                )
            )
            ratios.append(
                (
                    f"data stage tok/s, {name} / {BEFORE_DATA_TOKENS_PER_S:g} (before issue 14)",
                    data[f"{name}_tokens_per_s"] / BEFORE_DATA_TOKENS_PER_S,
                    ">= 3",
                )
            )
    if "compiled" in costs and "fast" in costs:
        ratios.append(("decode step, fast / compiled", costs["fast"]["step_ms"] / costs["compiled"]["step_ms"], "> 1"))
    if "rule" in costs and "fast" in costs:  # issue 28, before / after, paired in the same run
        rule, tuned = costs["rule"], costs["fast"]
        ratios.append(("decode step, rule / fast (tuned)", rule["step_ms"] / tuned["step_ms"], ">= 1"))
        for g in gammas:
            before, after = rule["gammas"][g]["verify_ms"], tuned["gammas"][g]["verify_ms"]
            ratios.append((f"verify ms, {g + 1} tokens, rule / fast (tuned)", before / after, ">= 1"))
    lines.append("")
    lines.append(
        f"HF generate {hf['generate_tokens_per_s']:.1f} tok/s, HF assisted (g={hf['assisted_gamma']}) "
        f"{hf['assisted_tokens_per_s']:.1f} tok/s; data stage tok/s: "
        + ", ".join(f"{k.removesuffix('_tokens_per_s')} {v:.1f}" for k, v in data.items() if k.endswith("tokens_per_s"))
    )
    lines.append(
        "warm-up s (the compiled backend compiles here): "
        + ", ".join(f"{b} {row['warmup_s']:.0f}" for b, row in costs.items())
        + "; data stage "
        + ", ".join(f"{k.removesuffix('_warmup_s')} {v:.0f}" for k, v in data.items() if k.endswith("_warmup_s"))
    )
    lines.append("")
    width = max(len(name) for name, _, _ in ratios)
    lines += [f"{name:<{width}}  {_f(value, '.3f'):>7}  (goal {goal})" for name, value, goal in ratios]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="embedded:smollm2-135m-instruct")
    parser.add_argument("--draft-layers", type=int, default=4)
    parser.add_argument("--prompts", default="builtin:test")
    parser.add_argument("--num-prompts", type=int, default=6)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--gammas", nargs="+", type=int, default=[1, 3, 7], help="verify widths gamma + 1 = 2, 4, 8")
    parser.add_argument("--repeats", type=int, default=1, help="timed ABBA repeats of section 1")
    parser.add_argument("--backends", nargs="+", choices=BACKENDS, default=DEFAULT_BACKENDS)
    parser.add_argument("--retune", action="store_true", help="time the fast layouts again (cpu_layouts=tune)")
    parser.add_argument("--data-prompts", default="builtin:train")
    parser.add_argument("--data-batch", type=int, default=32)
    parser.add_argument("--data-new-tokens", type=int, default=48)
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    target, tokenizer = load_model(args.target, device="cpu")
    draft = truncate_student(target, evenly_spaced_layers(target.config.num_hidden_layers, args.draft_layers))
    stop = stop_token_ids(target, tokenizer)
    # the GEMM rows this bench runs: decode and verify steps at batch 1, the data stage's batch
    rows = plan_rows(BackendOptions(), 1, {1, 2, *(g + 1 for g in args.gammas)})
    tuned = plan_rows(rows, args.data_batch, {1})
    options = {
        "rule": replace(tuned, cpu_layouts="rule"),
        "fast": replace(tuned, cpu_layouts="tune" if args.retune else "auto"),
        "compiled": replace(tuned, cpu_compile=True),  # packed weights, GEMM kernels autotuned by Inductor
    }
    models, load_s = {}, {}
    for b in args.backends:
        start = time.perf_counter()
        if b == "hf":
            models[b] = (target, draft)
        else:  # the first fast load on a machine times its layouts (a few seconds), later ones read the plan
            models[b] = (fast_model(target, options[b]), fast_model(draft, options[b], draft=True))
        load_s[b] = time.perf_counter() - start
    records = load_prompts(args.prompts)
    # one prompt per category first (short answers and long passages alike), then the rest
    order = interleave_categories(records)
    prompts = [render_chat(tokenizer, r.messages) for r in order[: args.num_prompts]]
    data_prompts = [render_chat(tokenizer, r.messages) for r in load_prompts(args.data_prompts, limit=args.data_batch)]
    machine = machine_info(probe=False)
    # Probed now, not read from the plan cache: on a shared VM the bandwidth drifts (14-23 GB/s within an hour on
    # the 2-core EPYC), so the floor is taken around section 1, before and after, at the faster probe (the floor
    # no step can beat, the harder goal).
    probes = [probe_bandwidth()]
    print(
        f"{torch.get_num_threads()} threads, {torch.backends.cpu.get_cpu_capability()}, backends "
        + ", ".join(f"{b}={backend_name(t)}" for b, (t, _) in models.items())
        + f"; {len(prompts)} prompts of {min(map(len, prompts))}-{max(map(len, prompts))} tokens\n"
        + f"{machine['cpu']} ({' '.join(machine['flags'])}), {machine['cores']} cores; read {probes[0]:.1f} GB/s",
        flush=True,
    )
    tuning = {b: {"target": t.cpu_tuning, "draft": d.cpu_tuning} for b, (t, d) in models.items() if b != "hf"}
    for b, both in tuning.items():
        seconds = both["target"]["tune_s"] + both["draft"]["tune_s"]
        print(f"{b} layouts: {both['target']['layouts']}, {seconds:.1f} s of timing in {load_s[b]:.1f} s of loading")

    with torch.no_grad():
        start = time.perf_counter()
        costs = forward_costs(
            models, prompts, args.gammas, max_new_tokens=args.max_new_tokens, stop=stop, repeats=args.repeats
        )
        print(f"section 1 (forward costs): {time.perf_counter() - start:.0f} s", flush=True)
        probes.append(probe_bandwidth())
        floor_ms = 1e3 * decode_floor_s(target, max(probes))  # every backend reads the fp32 weights
        print(f"read {probes[0]:.1f} / {probes[1]:.1f} GB/s before / after: decode step floor {floor_ms:.2f} ms")
        start = time.perf_counter()
        hf_gamma = 3 if 3 in args.gammas else args.gammas[0]  # issue 14's goal against HF assisted is at gamma 3
        hf = hf_baselines(target, draft, tokenizer, prompts, hf_gamma, max_new_tokens=args.max_new_tokens, stop=stop)
        print(f"section 2 (HF generate, HF assisted): {time.perf_counter() - start:.0f} s", flush=True)
        start = time.perf_counter()
        data = data_stage(models, target, data_prompts, max_new_tokens=args.data_new_tokens, stop=stop)
        print(f"section 3 (data stage): {time.perf_counter() - start:.0f} s", flush=True)
    print(report(costs, hf, data, args.gammas, floor_ms))
    if args.json:
        layouts = {b: {"target": layout_summary(t), "draft": layout_summary(d)} for b, (t, d) in models.items()}
        out = {
            "settings": vars(args),
            "machine": machine
            | {"bandwidth_gb_s": max(probes), "bandwidth_probes_gb_s": probes, "decode_floor_ms": floor_ms},
            "layouts": layouts,
            "layout_tuning": tuning,
            "load_s": load_s,
            "forward_costs": costs,
            "hf": hf,
            "data_stage": data,
        }
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)  # a fresh clone has no runs/
        Path(args.json).write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
