"""Token trees vs chains on one target/draft pair: mean_accepted_length, nodes_per_step, measured speedup.

The target is the embedded SmolLM2-135M-Instruct; the draft is a layer-truncated copy of it (4 of its 30 layers,
untrained) unless --draft names a folder (e.g. a distilled draft). For greedy decoding and T=1 it times target-only
decoding, chains of gamma 1..6 (the best one is the baseline a tree must beat) and a few tree shapes, then prints the
verify cost (one target forward over N+1 tokens under the tree mask) and the draft's cost against the token count,
which is what decides whether a tree can win: on a CPU the target's forward time grows with the tokens it scores, on a
GPU at batch 1 it hardly does.

    python benchmarks/tree_bench.py                                   # CPU, ~8 prompts x 48 tokens, a few minutes
    python benchmarks/tree_bench.py --draft runs/quickstart/export/trunc4-fkl --json tree_bench.json
    python benchmarks/tree_bench.py --target random:tiny-llama --draft-layers 2 --num-prompts 2 --max-new-tokens 8
    python benchmarks/tree_bench.py --device cuda                     # compact bf16 model + CUDA graphs
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from distill.prompts import load_prompts, render_chat
from distill.students import evenly_spaced_layers, truncate_student
from specdec_runtime.bench import fast_model
from specdec_runtime.engine import SamplingParams, generate
from specdec_runtime.kv import make_state
from specdec_runtime.loading import load_model
from specdec_runtime.metrics import merge_stats
from specdec_runtime.tree import parse_tree, static_tree, tree_size, verify_layout

TREES = ["2,1,1,1", "2,2,1", "3,2,1,1", "4,2,2,1", "dynamic:16:5:4", "dynamic:32"]
NODE_COUNTS = [1, 2, 4, 8, 16, 32, 48, 64]


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def decode(target, draft, prompts, temperature: float, max_new_tokens: int, stop, **kwargs) -> dict:
    """All prompts one by one (batch 1, the latency setting), after one untimed warm-up prompt -> aggregate stats."""
    run = dict(sampling=SamplingParams(temperature), max_new_tokens=max_new_tokens, stop_token_ids=stop, **kwargs)
    generate(target, draft, prompts[:1], generator=torch.Generator(target.device).manual_seed(0), **run)
    sync(target.device)
    parts = [
        generate(target, draft, [p], generator=torch.Generator(target.device).manual_seed(i), **run).stats
        for i, p in enumerate(prompts)
    ]
    sync(target.device)
    return merge_stats(parts).aggregate()


def fastest_s(step, device: torch.device, iters: int) -> float:
    """Fastest of `iters` timed calls after two warm-ups: other load on the machine only ever adds time."""
    times = []
    for i in range(iters + 2):  # two warm-ups
        sync(device)
        start = time.perf_counter()
        step()
        sync(device)
        if i >= 2:
            times.append(time.perf_counter() - start)
    return min(times)


def forward_costs(model, context_len: int, iters: int) -> dict[int, float]:
    """Seconds of one forward over N+1 tokens under a tree mask (N siblings of the root), as the engine runs it."""
    device = model.device
    state = make_state(model, 1, context_len + max(NODE_COUNTS) + 4)
    gen = torch.Generator().manual_seed(0)
    context = torch.randint(model.config.vocab_size, (1, context_len), generator=gen).to(device)
    nodes = torch.randint(model.config.vocab_size, (1, max(NODE_COUNTS) + 1), generator=gen).to(device)
    costs = {}
    with torch.no_grad():
        state.extend(context, torch.tensor([context_len], device=device), last_only=True)
        one, none = torch.ones(1, dtype=torch.long, device=device), torch.zeros(1, dtype=torch.long, device=device)
        costs[0] = fastest_s(lambda: (state.extend(context[:, :1], one), state.rollback(one)), device, iters)
        for n in NODE_COUNTS:
            tree = static_tree([n]).to(device)
            visible, positions = verify_layout(tree, torch.zeros(1, 0, dtype=torch.bool, device=device), state.lengths)
            tokens = nodes[:, : n + 1]  # [root, n siblings]

            def step(tokens=tokens, positions=positions, seen=visible[:, 0]):
                state.tree_forward(tokens, positions, seen)
                state.tree_commit(none[:, None], none)  # keep nothing: the next call starts from the same cache

            costs[n] = fastest_s(step, device, iters)
    return costs


def table_row(temperature: float, mode: str, agg: dict, base: dict, best_chain: dict) -> dict:
    """One line of the table; speedups are tokens/s ratios: wall-time ratios at T=0 (same tokens), fair at T=1."""
    return {
        "temperature": temperature,
        "mode": mode,
        "tokens_per_s": agg["tokens_per_s"],
        "mean_accepted_length": agg["mean_accepted_length"],
        "nodes_per_step": agg["nodes_per_step"],
        "speedup": agg["tokens_per_s"] / base["tokens_per_s"],
        "speedup_vs_chain": agg["tokens_per_s"] / best_chain["tokens_per_s"],
    }


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
    target, draft = fast_model(target), fast_model(draft)  # compact bf16 + CUDA graphs on CUDA, as given on CPU
    prompts = [render_chat(tokenizer, r.messages) for r in load_prompts(args.prompts, limit=args.num_prompts)]
    stop = (tokenizer.eos_token_id,) if tokenizer.eos_token_id is not None else ()
    print(
        f"device {target.device}, {torch.get_num_threads()} threads, {len(prompts)} prompts x "
        f"{args.max_new_tokens} tokens, draft {args.draft or f'{args.draft_layers} layers of the target, untrained'}",
        flush=True,
    )

    rows = []
    for temperature in args.temperatures:
        kw = dict(temperature=temperature, max_new_tokens=args.max_new_tokens, stop=stop)
        base = decode(target, None, prompts, **kw)
        chains = {g: decode(target, draft, prompts, num_draft_tokens=g, **kw) for g in range(1, args.max_gamma + 1)}
        trees = {spec: decode(target, draft, prompts, tree=spec, **kw) for spec in args.trees}
        best_gamma = max(chains, key=lambda g: chains[g]["tokens_per_s"])
        modes = {"target-only": base}
        modes |= {f"chain gamma={g}" + (" (best)" if g == best_gamma else ""): a for g, a in chains.items()}
        modes |= {f"tree {spec} (depth {tree_size(parse_tree(spec))[0]})": a for spec, a in trees.items()}
        rows += [table_row(temperature, mode, agg, base, chains[best_gamma]) for mode, agg in modes.items()]

    print(f"\n{'T':>4}  {'mode':<30}{'tokens/s':>10}{'tau':>7}{'nodes':>7}{'speedup':>9}{'vs chain':>10}")
    for r in rows:
        print(
            f"{r['temperature']:>4g}  {r['mode']:<30}{r['tokens_per_s']:>10.1f}{r['mean_accepted_length']:>7.2f}"
            f"{r['nodes_per_step']:>7.1f}{r['speedup']:>9.2f}{r['speedup_vs_chain']:>10.2f}"
        )

    context_len = round(statistics.fmean(len(p) for p in prompts)) + args.max_new_tokens // 2
    target_costs, draft_costs = forward_costs(target, context_len, 10), forward_costs(draft, context_len, 10)
    print(f"\nforward cost vs tokens scored (context {context_len}); ratios to one target decode step")
    print(f"{'nodes':>6}{'target ms':>11}{'target v':>10}{'draft ms':>10}{'draft c':>9}")
    decode_s = target_costs[0]
    for n in NODE_COUNTS:
        print(
            f"{n:>6}{1e3 * target_costs[n]:>11.2f}{target_costs[n] / decode_s:>10.2f}"
            f"{1e3 * draft_costs[n]:>10.2f}{draft_costs[n] / decode_s:>9.2f}"
        )
    print(
        f"{'decode':>6}{1e3 * decode_s:>11.2f}{1.0:>10.2f}{1e3 * draft_costs[0]:>10.2f}"
        f"{draft_costs[0] / decode_s:>9.2f}"
    )
    if args.json:
        costs = {"context_len": context_len, "target_s": target_costs, "draft_s": draft_costs}
        with open(args.json, "w") as f:
            json.dump({"settings": vars(args), "rows": rows, "forward_costs": costs}, f, indent=2)


if __name__ == "__main__":
    main()
