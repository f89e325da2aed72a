"""Token trees vs chains on one target/draft pair: mean_accepted_length, nodes_per_step, paired per-token speedup.

The target is the embedded SmolLM2-135M-Instruct; the draft is a layer-truncated copy of it (4 of its 30 layers,
untrained) unless --draft names a folder (e.g. a distilled draft). For each temperature, target-only decoding,
chains of gamma 1..--max-gamma and the tree shapes all run on the same prompts, one prompt per unit, every mode once
per unit and repeat with the order reversed from one (unit, repeat) to the next (`specdec_runtime.ab.paired_runs`,
the ABBA schedule of `specdistill bench`), after a warm-up of each mode on the longest prompt. Per mode: `speedup` =
median over prompts of target-only decode seconds per token / the mode's (prefill excluded) with its 95 % bootstrap
interval; `speedup_vs_chain` the same against the best chain (the one with the highest median speedup, picked on
these very prompts: a benchmark, not a selection); and the in-run costs of `ab.paired_metrics`: the verify cost v
(one target forward over the nodes, in target-only decode steps), the draft cost c per level, predicted_speedup and
efficiency. v against nodes_per_step is what decides whether a tree can win: on a CPU the target's forward time
grows with the tokens it scores, on a GPU at batch 1 it hardly does.

    python benchmarks/tree_bench.py                                   # CPU, 8 prompts x 48 tokens x 3 repeats, long
    python benchmarks/tree_bench.py --draft runs/quickstart/export/trunc4-fkl --json tree_bench.json
    python benchmarks/tree_bench.py --target random:tiny-llama --draft-layers 2 --num-prompts 2 --max-new-tokens 8 \
        --max-gamma 2 --trees 2,1 dynamic:4 --repeats 1                # smoke, seconds
    python benchmarks/tree_bench.py --device cuda                     # 1 GPU: compact bf16 model + CUDA graphs
"""

from __future__ import annotations

import argparse
import json

import torch

from distill.prompts import load_prompts, render_chat
from distill.students import evenly_spaced_layers, truncate_student
from specdec_runtime.ab import paired_metrics, paired_runs, paired_speedup, pooled
from specdec_runtime.backends import fast_model, full_units, longest_unit
from specdec_runtime.engine import SamplingParams, generate
from specdec_runtime.loading import load_model, stop_token_ids
from specdec_runtime.tree import parse_tree, tree_size

TREES = ["2,1,1,1", "2,2,1", "3,2,1,1", "4,2,2,1", "dynamic:16:5:4", "dynamic:32"]
BASE = "target-only"


def mode_kwargs(max_gamma: int, trees: list[str]) -> dict[str, dict]:
    """Mode name -> its `generate` arguments (target-only first, then the chains, then the trees)."""
    modes: dict[str, dict] = {BASE: {"draft": False}}
    modes |= {f"chain gamma={g}": {"num_draft_tokens": g} for g in range(1, max_gamma + 1)}
    modes |= {f"tree {spec} (depth {tree_size(parse_tree(spec))[0]})": {"tree": spec} for spec in trees}
    return modes


def paired_modes(target, draft, prompts, modes: dict[str, dict], *, temperature, max_new_tokens, stop, repeats):
    """Every mode on every prompt, ABBA-ordered and repeated -> {mode: runs} (`ab.paired_runs`)."""
    units = full_units(prompts, 1)

    def run(unit: int, mode: str, repeat: int):
        kwargs = dict(modes[mode])
        use_draft = kwargs.pop("draft", True)
        gen = torch.Generator(target.device).manual_seed(unit + 7919 * repeat)  # the same seed for every mode
        return generate(
            target,
            draft if use_draft else None,
            units[unit],
            sampling=SamplingParams(temperature),
            max_new_tokens=max_new_tokens,
            stop_token_ids=stop,
            generator=gen,
            **kwargs,
        ).stats

    for mode in [*list(modes)[1:], BASE]:  # speculative modes first: they size the target's static cache
        run(longest_unit(units), mode, 0)  # warm-up: kernels, CUDA graphs, allocator caches
    return paired_runs(run, units=len(units), arms=list(modes), repeats=repeats)


def table_rows(temperature: float, modes: dict[str, dict], runs: dict) -> list[dict]:
    """One row per mode: tokens/s, tau, nodes, in-run costs, paired speedup and speedup_vs_chain with intervals."""
    gammas = {
        m: tree_size(parse_tree(kw["tree"]))[0] if "tree" in kw else kw.get("num_draft_tokens", 0)
        for m, kw in modes.items()
    }
    metrics = {m: paired_metrics(runs[BASE], runs[m], gammas[m]) for m in modes if m != BASE}
    best_chain = max((m for m in metrics if m.startswith("chain")), key=lambda m: metrics[m]["speedup"] or 0)
    rows = []
    for mode in modes:
        row = {
            "temperature": temperature,
            "mode": mode + (" (best chain)" if mode == best_chain else ""),
            "tokens_per_s": pooled(runs[mode]).aggregate()["tokens_per_s"],
        }
        if mode != BASE:
            vs_chain = paired_speedup(runs[best_chain], runs[mode])
            row |= metrics[mode]
            row |= {"speedup_vs_chain": vs_chain["speedup"], "speedup_vs_chain_ci": vs_chain["speedup_ci"]}
        rows.append(row)
    return rows


def _f(x, spec: str = ".2f") -> str:
    return "-" if x is None else format(x, spec)


def _ci(ci) -> str:
    return f"[{ci[0]:.2f}, {ci[1]:.2f}]" if ci else "-"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="embedded:smollm2-135m-instruct")
    parser.add_argument("--draft", default=None, help="draft folder; default: the target truncated to --draft-layers")
    parser.add_argument("--draft-layers", type=int, default=4)
    parser.add_argument("--prompts", default="builtin:test")
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--max-gamma", type=int, default=6)
    parser.add_argument("--trees", nargs="+", default=TREES)
    parser.add_argument("--temperatures", nargs="+", type=float, default=[0.0, 1.0])
    parser.add_argument("--repeats", type=int, default=3, help="timed ABBA repeats of the paired A/B")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    for spec in args.trees:
        parse_tree(spec)  # fail before loading anything

    target, tokenizer = load_model(args.target, device=args.device)
    if args.draft:
        draft, _ = load_model(args.draft, device=args.device)
    else:
        draft = truncate_student(target, evenly_spaced_layers(target.config.num_hidden_layers, args.draft_layers))
    stop = stop_token_ids(target, tokenizer)  # the tokenizer's EOS and the generation config's, as everywhere
    # compact bf16 + CUDA graphs on CUDA; the CPU fast path on the CPU (fp32 target, the draft in cpu.draft_dtype())
    target, draft = fast_model(target), fast_model(draft, draft=True)
    prompts = [render_chat(tokenizer, r.messages) for r in load_prompts(args.prompts, limit=args.num_prompts)]
    print(
        f"device {target.device}, {torch.get_num_threads()} threads, {len(prompts)} prompts x "
        f"{args.max_new_tokens} tokens x {args.repeats} paired repeats, draft "
        f"{args.draft or f'{args.draft_layers} layers of the target, untrained'}",
        flush=True,
    )

    rows = []
    modes = mode_kwargs(args.max_gamma, args.trees)
    for temperature in args.temperatures:
        runs = paired_modes(
            target,
            draft,
            prompts,
            modes,
            temperature=temperature,
            max_new_tokens=args.max_new_tokens,
            stop=stop,
            repeats=args.repeats,
        )
        rows += table_rows(temperature, modes, runs)

    print(
        f"\n{'T':>4}  {'mode':<36}{'tok/s':>7}{'tau':>6}{'nodes':>6}{'c':>6}{'v':>6}{'pred':>6}"
        f"{'speedup [95% CI]':>20}{'eff':>6}{'vs chain [95% CI]':>20}"
    )
    for r in rows:
        speed = f"{_f(r.get('speedup'))} {_ci(r.get('speedup_ci'))}" if "speedup" in r else "1"
        chain = f"{_f(r.get('speedup_vs_chain'))} {_ci(r.get('speedup_vs_chain_ci'))}" if "speedup" in r else "-"
        print(
            f"{r['temperature']:>4g}  {r['mode']:<36}{_f(r['tokens_per_s'], '.1f'):>7}"
            f"{_f(r.get('mean_accepted_length', 1.0)):>6}{_f(r.get('nodes_per_step', 0.0), '.1f'):>6}"
            f"{_f(r.get('cost_ratio')):>6}{_f(r.get('verify_cost_ratio')):>6}{_f(r.get('predicted_speedup')):>6}"
            f"{speed:>20}{_f(r.get('efficiency')):>6}{chain:>20}"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"settings": vars(args), "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
