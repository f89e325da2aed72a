"""A synthetic eval report for the report, recommendation and promotion tests, and a promotable EAGLE-3 run (a local
target, a head for it, a report recommending it) for the engine snippet and conformance tests."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import torch

from specdec_runtime.tree import parse_tree, tree_size

CATEGORIES = {"coding": 2, "math": 1, "writing": 3}


def make_setting(
    gamma: int, temperature: float, rule: str, alpha: float, tree: str | None = None, nodes: int | None = None
) -> dict:
    """One setting as eval/results.py writes it; a tree setting has `tree` set and num_draft_tokens = its depth."""
    c, v = 0.2, 1.3
    tau = (1 - alpha ** (gamma + 1)) / (1 - alpha)
    predicted = tau / (gamma * c + v)
    return {
        "num_draft_tokens": gamma,
        "temperature": temperature,
        "draft_rule": rule,
        "tree": tree,
        "acceptance_rate": alpha,
        "mean_accepted_length": tau,
        "nodes_per_step": float(gamma if nodes is None else nodes),
        "per_position_acceptance": [round(alpha + 0.05 * (gamma - i) / gamma, 4) for i in range(gamma)],
        "expected_acceptance": alpha + 0.01,
        "cost_ratio": c,
        "verify_cost_ratio": v,
        "analytic_speedup": predicted * 1.1,
        "predicted_speedup": predicted,
        "speedup": predicted * 0.9,
        "speedup_ci": [predicted * 0.85, predicted * 0.95],
        "units": 3,
        "efficiency": 0.9,
        "overhead_fraction": 0.1,
        "batch_size": 1,
        "ttft_s": 0.05,
        "tpot_s": 0.01 / (1 + alpha),
        "tokens_per_s": 90.0 * alpha,
        "target_tokens_per_s": 56.0,
        "wall_s": 3.2,
        "new_tokens": 768,
        "target_forwards": 250,
        "draft_forwards": 1000,
        "peak_memory_bytes": 123456789,
        "by_category": {
            cat: {"acceptance_rate": alpha - 0.1 * i, "mean_accepted_length": tau, "count": n}
            for i, (cat, n) in enumerate(CATEGORIES.items())
        },
        "by_length": {
            b: {"acceptance_rate": alpha, "mean_accepted_length": tau, "count": 2} for b in ("short", "medium", "long")
        },
    }


TREE_ALPHA = 0.97  # no chain setting has it, so a tree leaking into a chain plot or table is visible


def make_report(tmp_path, *, enabled: bool = True, trees: tuple[str, ...] = ()) -> dict:
    """A report following the report.json contract: 2 candidates, gamma in {1, 2, 4} x (T=0 greedy, T=1 sample),
    plus one setting per tree spec x (T, draft_rule) when `trees` is given; the first candidate with a run_dir
    holding a small metrics.jsonl (and a torn last line, as a killed run leaves)."""
    run_dir = tmp_path / "candidates" / "trunc2-fkl"
    run_dir.mkdir(parents=True)
    rows = [{"step": s, "train/loss": 3.0 / s, "lr": 1e-3} for s in range(1, 9)]
    rows += [
        {"step": s, "eval/loss": 2.5 / s, "eval/expected_acceptance": 0.4 + 0.05 * s, "eval/greedy_match": 0.3}
        for s in (4, 8)
    ]
    (run_dir / "metrics.jsonl").write_text("\n".join(map(json.dumps, rows)) + '\n{"step": 9, "train/lo')
    candidates = []
    for name, alpha, rd in (("trunc2-fkl", 0.7, str(run_dir)), ("config1-tv", 0.5, None)):
        settings = [
            make_setting(g, t, r, alpha - 0.1 * t) for t, r in ((0.0, "greedy"), (1.0, "sample")) for g in (1, 2, 4)
        ]
        for t, r in ((0.0, "greedy"), (1.0, "sample")):  # interleaved as the sweep writes them: chains, then trees
            for spec in trees:
                depth, nodes = tree_size(parse_tree(spec))
                tree_alpha = TREE_ALPHA - 0.1 * t - 0.01 * nodes / 16 - 0.05 * (0.7 - alpha)
                settings.append(make_setting(depth, t, r, tree_alpha, spec, nodes))
        candidates.append(
            {
                "name": name,
                "draft": str(tmp_path / name / "best"),
                "run_dir": rd,
                "num_parameters": 12345,
                "expected_acceptance": alpha,
                "expected_acceptance_temperature": 1.0,
                "settings": settings,
            }
        )
    best = candidates[0]["settings"][2]
    confirmed = {k: best[k] for k in ("acceptance_rate", "mean_accepted_length", "speedup", "speedup_ci")}
    by_batch = [
        {
            "batch_size": b,
            **confirmed,
            "speedup": best["speedup"] / b**0.5,
            "speedup_ci": [x / b**0.5 for x in best["speedup_ci"]],
            "tokens_per_s": 90.0 * b,
            "target_tokens_per_s": 60.0 * b,
            "ttft_s": 0.05,
            "tpot_s": 0.01 * b**0.5,
            "target_only": {"tokens_per_s": 60.0 * b, "ttft_s": 0.04, "tpot_s": 0.018},
            "units": 3,
        }
        for b in (1, 4)
    ]
    confirmation = {
        "name": "trunc2-fkl",
        "draft": candidates[0]["draft"],
        "num_draft_tokens": 4,
        "draft_rule": "greedy",
        "temperature": 0.0,
        "split": "confirmation",
        "prompts": 3,
        "by_batch_size": by_batch,
    }
    return {
        "schema_version": 1,
        "created_at": "2026-11-29T12:00:00Z",
        "target": "random:tiny-llama",
        "target_fingerprint": "0123456789abcdef",
        "device": "cpu",
        "prompts": {"source": "builtin:test", "count": 6, "categories": CATEGORIES},
        "sweep": {
            "num_draft_tokens": [1, 2, 4],
            "temperatures": [0.0, 1.0],
            "draft_rules": ["greedy", "sample"],
            "trees": list(trees),
            "max_new_tokens": 64,
            "batch_size": 1,
            "batch_sizes": [1, 4],
        },
        "settings": {"backend": "hf-eager", "split": "selection", "repeats": 3, "warmup": 1, "stop_token_ids": [2]},
        "target_only": [
            {
                "temperature": t,
                "tokens_per_s": 56.0,
                "ttft_s": 0.04,
                "tpot_s": 0.018,
                "decode_s": 4.8,
                "calls": 18,
                "peak_memory_bytes": 100000000,
            }
            for t in (0.0, 1.0)
        ],
        "candidates": candidates,
        "confirmation": confirmation,
        "recommendation": {
            "name": "trunc2-fkl",
            "draft": candidates[0]["draft"],
            "num_draft_tokens": 4,
            "draft_rule": "greedy",
            "temperature": 0.0,
            "enabled": enabled,
            "reason": "both gates passed: trunc2-fkl" if enabled else "speedup gate: no candidate beats target-only",
            "gate": "passed" if enabled else "speedup_ci",
            "selection": {**confirmed, "split": "selection"},
            "confirmation": {
                **confirmed,
                "split": "confirmation",
                "batch_size": 1,
                "prompts": 3,
                "max_concurrency": 1,
                "measured_concurrency": [1, 4],
            },
            "max_concurrency": 1,
        },
    }


HEAD_VOCAB = torch.arange(0, 240, 10)  # 24 target ids of the 259-token byte vocabulary; the last + 1 is valid too


def eagle3_run(
    folder: Path,
    *,
    aux_layers: tuple[int, ...] | None = (1, 3, 5),
    draft_rule: str = "sample",
    gamma: int = 3,
    max_concurrency: int = 4,
    measured_concurrency: tuple[int, ...] = (1, 4, 16),
) -> SimpleNamespace:
    """What promotion of an EAGLE-3 head starts from: `folder/target` (an 8-layer tiny Llama with the byte-level
    tokenizer, a local HF folder as a user's target would be), `folder/candidates/eagle3/best` (a head for it with
    every weight random, so each one shows in the outputs; its config.json without aux ids when `aux_layers` is
    None, as heads saved before issue 23 were) and `folder/eval/report.json` recommending it at temperature 1 with
    `draft_rule` and `gamma`, confirmed up to `max_concurrency` of `measured_concurrency`."""
    from eval.results import target_fingerprint
    from helpers.models import tiny_llama
    from specdec_runtime.eagle3 import Eagle3Draft
    from specdec_runtime.tiny import byte_level_tokenizer

    tokenizer = byte_level_tokenizer()
    target = tiny_llama(seed=3, vocab_size=len(tokenizer), layers=8)  # default aux layers [2, 4, 5]
    target.save_pretrained(folder / "target")
    tokenizer.save_pretrained(folder / "target")
    head = Eagle3Draft.from_target(target, HEAD_VOCAB, list(aux_layers) if aux_layers else None, seed=0)
    with torch.no_grad():
        for p in head.parameters():
            p.add_(0.1 * torch.randn_like(p))
    best = folder / "candidates" / "eagle3" / "best"
    head.save_pretrained(best)
    tokenizer.save_pretrained(best)
    if aux_layers is None:
        config = json.loads((best / "config.json").read_text())
        del config["eagle_aux_hidden_state_layer_ids"], config["eagle_config"]
        (best / "config.json").write_text(json.dumps(config))
    confirmed = {"acceptance_rate": 0.62, "mean_accepted_length": 2.4, "speedup": 1.6, "speedup_ci": [1.5, 1.7]}
    rec = {
        "name": "eagle3",
        "draft": str(best),
        "kind": "eagle3",
        "num_draft_tokens": gamma,
        "draft_rule": draft_rule,
        "temperature": 1.0,
        "enabled": True,
        "reason": f"both gates passed: eagle3 at num_draft_tokens={gamma} (T=1, {draft_rule})",
        "confirmation": {
            **confirmed,
            "split": "confirmation",
            "batch_size": 1,
            "prompts": 8,
            "max_concurrency": max_concurrency,
            "measured_concurrency": list(measured_concurrency),
        },
    }
    setting = {"num_draft_tokens": gamma, "temperature": 1.0, "draft_rule": draft_rule, **confirmed}
    report = {
        "schema_version": 1,
        "created_at": "2026-11-29T12:00:00Z",
        "target": str(folder / "target"),
        "target_fingerprint": target_fingerprint(target, tokenizer),
        "device": "cpu",
        "prompts": {"source": "builtin:test", "count": 16},
        "candidates": [{"name": "eagle3", "draft": str(best), "kind": "eagle3", "settings": [setting]}],
        "recommendation": rec,
    }
    (folder / "eval").mkdir(parents=True, exist_ok=True)
    (folder / "eval" / "report.json").write_text(json.dumps(report))
    return SimpleNamespace(
        target=target, tokenizer=tokenizer, head=Eagle3Draft.from_pretrained(best), best=best,
        target_dir=folder / "target", report=folder / "eval" / "report.json",
    )  # fmt: skip
