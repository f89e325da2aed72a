"""Acceptance-rate evaluation: every candidate draft x num_draft_tokens x temperature x draft_rule, measured with
`specdec_runtime` against target-only decoding on the same prompts in the same process (paired A/B). Token trees
(`eval.trees`) are one more axis: each tree spec adds one setting per temperature x draft_rule, with `tree` set and
num_draft_tokens = the tree's depth (chains have `tree: null`); promotion only considers chains, the drafting that
serving engines run.

    specdistill eval configs/quickstart.yaml                                   # the run's candidates
    specdistill eval --target embedded:smollm2-135m-instruct --drafts runs/quickstart/candidates/trunc4-fkl \\
        --prompts my_prompts.jsonl --out runs/my-eval                          # any drafts, any prompt file
    accelerate launch --config_file configs/accelerate/ddp.yaml -m specdistill eval configs/llama-3.1-8b.yaml

Prompts are split over processes (rank r takes every world-th prompt); per-request counters and wall times are
gathered on rank 0, which writes the report. Timed runs are preceded by warm-up runs that are not counted.
"""

from __future__ import annotations

import hashlib
import json
import resource
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import torch
from tqdm.auto import tqdm

from eval.config import EvalConfig
from specdec_runtime.engine import SamplingParams, generate
from specdec_runtime.loading import check_vocab_compatible, load_model
from specdec_runtime.metrics import (
    GenerationStats,
    analytic_speedup,
    expected_acceptance,
    measure_cost_ratios,
    merge_stats,
    predicted_speedup,
)
from specdec_runtime.tree import parse_tree, tree_size

LENGTH_BUCKETS = ("short", "medium", "long")


@dataclass
class Candidate:
    """One draft to evaluate."""

    name: str
    """Label in the report."""
    path: Path
    """HF folder with the draft's weights (a best/ or checkpoint folder, or an exported draft)."""
    run_dir: Path | None = None
    """Its distillation run directory, when known (for training curves)."""


@dataclass
class EvalPrompt:
    """One eval prompt, already rendered with the chat template."""

    id: str
    category: str
    ids: list[int]


# ----------------------------------------------------------------------------------------------------------------
# Candidates


def resolve_candidates(paths: list[str | Path]) -> list[Candidate]:
    """Draft folders, checkpoint folders, or distillation run directories (their best/ and kept checkpoints)."""
    found: list[Candidate] = []
    for raw in paths:
        path = Path(raw)
        if (path / "best").is_dir() or (path / "checkpoints").is_dir():
            found += _run_dir_candidates(path)
        elif path.is_dir():
            check_draft_folder(path)
            found.append(Candidate(name=path.name, path=path))
        else:
            raise ValueError(f"candidate {path} does not exist; pass a draft folder, a checkpoint folder or a "
                             "distillation run directory (candidates/<name>/)")
    names = [c.name for c in found]
    for i, cand in enumerate(found):  # disambiguate same-named folders from different runs
        if names.count(cand.name) > 1:
            cand.name = f"{cand.name}-{i}"
    return found


def _run_dir_candidates(run_dir: Path) -> list[Candidate]:
    out = []
    if (run_dir / "best").is_dir():
        check_draft_folder(run_dir / "best")
        out.append(Candidate(name=run_dir.name, path=run_dir / "best", run_dir=run_dir))
    for ckpt in sorted((run_dir / "checkpoints").glob("step-*")) if (run_dir / "checkpoints").is_dir() else []:
        if (ckpt / "COMPLETE").is_file():
            out.append(Candidate(name=f"{run_dir.name}@{ckpt.name}", path=ckpt, run_dir=run_dir))
    if not out:
        raise ValueError(f"{run_dir} has no best/ and no complete checkpoint; has its distillation finished?")
    return out


def check_draft_folder(path: Path) -> None:
    has_weights = any(path.glob("*.safetensors")) or (path / "adapter_config.json").is_file()
    if not (path / "config.json").is_file() and not (path / "adapter_config.json").is_file():
        raise ValueError(f"candidate folder {path} has no config.json: expected an HF model folder "
                         "(config.json + *.safetensors), e.g. candidates/<name>/best")
    if not has_weights:
        raise ValueError(f"candidate folder {path} has no weights (*.safetensors); is the checkpoint complete?")


def load_draft(cand: Candidate, device: str, dtype: str):
    """Load a candidate's draft; a LoRA adapter folder is merged into its base for decoding."""
    if (cand.path / "adapter_config.json").is_file():
        from eval.export import load_checkpoint
        from specdec_runtime.loading import resolve_dtype

        # The export loader: it finds the adapters' real base (a truncated student's lora_base/) and refuses a base
        # whose architecture is not the one the adapters were trained on.
        model, tokenizer, _ = load_checkpoint(cand.path)
        return model.to(device=device, dtype=resolve_dtype(dtype, device)).eval(), tokenizer
    return load_model(str(cand.path), dtype=dtype, device=device)


# ----------------------------------------------------------------------------------------------------------------
# Measurement helpers


def target_fingerprint(model, tokenizer) -> str:
    """Identifies the target a report was made for: its vocabulary and its architecture config."""
    digest = hashlib.sha256(json.dumps(sorted(tokenizer.get_vocab().items())).encode())
    arch = {k: v for k, v in model.config.to_dict().items() if k not in ("_name_or_path", "transformers_version",
                                                                        "dtype", "torch_dtype")}
    digest.update(json.dumps(arch, sort_keys=True, default=str).encode())
    return digest.hexdigest()[:16]


def peak_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # Linux reports KiB; process-wide max


def _reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def run_prompts(target, draft, prompts: list[EvalPrompt], *, gamma: int, rule: str, temperature: float,
                max_new_tokens: int, batch_size: int, stop_ids: tuple[int, ...], seed: int, warmup: int,
                tree: str | None = None):
    """Decode every prompt (batched), after `warmup` untimed batches -> (tokens per prompt, stats).

    tree: a token-tree spec drafted instead of a chain of gamma tokens (its depth replaces gamma).
    """
    sampling = SamplingParams(temperature=temperature)
    generator = torch.Generator(device=target.device)
    kwargs = dict(num_draft_tokens=gamma, draft_rule=rule, sampling=sampling, max_new_tokens=max_new_tokens,
                  stop_token_ids=stop_ids, generator=generator, tree=tree)
    batches = [prompts[i:i + batch_size] for i in range(0, len(prompts), batch_size)]
    for batch in batches[:warmup]:
        generate(target, draft, [p.ids for p in batch], **kwargs)
    generator.manual_seed(seed)
    tokens, parts = [], []
    for batch in batches:
        result = generate(target, draft, [p.ids for p in batch], **kwargs)
        tokens += result.tokens
        parts.append(result.stats)
    return tokens, merge_stats(parts)


def offline_acceptance(target, draft, prompts: list[EvalPrompt], outputs: list[list[int]], temperature: float,
                       rule: str) -> float:
    """`expected_acceptance` (sum_v min(p, q), or p(argmax q) for greedy) over the target's own outputs."""
    sampling = SamplingParams(temperature=temperature)
    total, count = 0.0, 0
    with torch.no_grad():
        for prompt, out in zip(prompts, outputs):
            if not out:
                continue
            ids = torch.tensor([prompt.ids + out], device=target.device)
            start = len(prompt.ids) - 1  # logits at position t predict token t + 1: the response's predictors
            t_logits = target(ids).logits[:, start:-1]
            d_logits = draft(ids).logits[:, start:-1]
            mask = torch.ones(t_logits.shape[:2], device=target.device)
            total += float(expected_acceptance(t_logits, d_logits, mask, sampling, rule)) * len(out)
            count += len(out)
    return total / max(count, 1)


def _group(stats: GenerationStats, keys: list[str]) -> dict[str, dict]:
    groups: dict[str, list] = {}
    for key, req in zip(keys, stats.requests):
        groups.setdefault(key, []).append(req)
    out = {}
    for key, reqs in sorted(groups.items()):
        agg = GenerationStats(requests=reqs, wall_s=sum(r.wall_s for r in reqs), target_forwards=0,
                              draft_forwards=0).aggregate()
        out[key] = {"acceptance_rate": agg["acceptance_rate"], "mean_accepted_length": agg["mean_accepted_length"],
                    "count": len(reqs)}
    return out


def length_bucket(n: int, max_new_tokens: int) -> str:
    return LENGTH_BUCKETS[min(2, 3 * n // max(max_new_tokens, 1))]


# ----------------------------------------------------------------------------------------------------------------
# The sweep


def evaluate(target, tokenizer, candidates: list[Candidate], prompts: list[EvalPrompt], cfg: EvalConfig, *,
             target_spec: str, seed: int = 0, device: str = "cpu", dtype: str = "auto", rank: int = 0,
             world_size: int = 1, gather=None, progress: bool = True) -> dict:
    """Run the whole sweep and return the report dict (keys of DESIGN.md; see eval/report.py for rendering).

    `gather(obj) -> list[obj]` collects per-rank results on every rank (accelerate's gather_object); with one
    process it is not needed.
    """
    if not prompts:
        raise ValueError("the eval prompt set is empty; pass a prompt file with at least one prompt")
    if not candidates:
        raise ValueError("no candidate drafts to evaluate; pass draft folders or a run with finished candidates")
    mine = prompts[rank::world_size]
    stop_ids = (tokenizer.eos_token_id,) if tokenizer.eos_token_id is not None else ()
    # At temperature 0 both draft rules propose argmax q, so `sample` would repeat `greedy` exactly.
    settings = [(t, r) for t in cfg.temperatures for r in cfg.draft_rules if not (t == 0 and r == "sample")]
    settings = settings or [(t, "greedy") for t in cfg.temperatures]
    trees = {spec: tree_size(parse_tree(spec)) for spec in cfg.trees}  # spec -> (depth, nodes)
    total = len(cfg.temperatures) + len(candidates) * len(settings) * (len(cfg.num_draft_tokens) + len(trees))
    bar = tqdm(total=total, desc="eval", disable=not progress or rank != 0)
    run = dict(max_new_tokens=cfg.max_new_tokens, batch_size=cfg.batch_size, stop_ids=stop_ids, seed=seed,
               warmup=cfg.warmup)

    baseline, outputs = {}, {}
    for temperature in cfg.temperatures:
        _reset_peak(target.device)
        tokens, stats = run_prompts(target, None, mine, gamma=1, rule="greedy", temperature=temperature, **run)
        baseline[temperature] = (stats, peak_memory_bytes(target.device))
        outputs[temperature] = tokens
        bar.update(1)

    report_candidates = []
    for cand in candidates:
        draft, draft_tokenizer = load_draft(cand, device, dtype)
        check_vocab_compatible(tokenizer, draft_tokenizer, draft.config.vocab_size)
        costs = {g: measure_cost_ratios(target, draft, num_draft_tokens=g) for g in cfg.num_draft_tokens}
        # A tree step's verify forward covers its nodes (+ the pending token), its draft runs one forward per level.
        tree_costs = {spec: measure_cost_ratios(target, draft, num_draft_tokens=nodes)
                      for spec, (_, nodes) in trees.items()}
        offline = {(t, r): offline_acceptance(target, draft, mine, outputs[t], t, r) for t, r in settings}
        offline_t1 = offline_acceptance(target, draft, mine, outputs[cfg.temperatures[-1]], 1.0, "sample")
        rows = []
        for temperature, rule in settings:
            for gamma in cfg.num_draft_tokens:
                _reset_peak(target.device)
                tokens, stats = run_prompts(target, draft, mine, gamma=gamma, rule=rule, temperature=temperature,
                                            **run)
                rows.append(dict(temperature=temperature, draft_rule=rule, num_draft_tokens=gamma, stats=stats,
                                 peak=peak_memory_bytes(target.device), offline=offline[(temperature, rule)],
                                 costs=costs[gamma], tree=None))
                bar.update(1)
            for spec, (depth, _) in trees.items():
                _reset_peak(target.device)
                tokens, stats = run_prompts(target, draft, mine, gamma=depth, rule=rule, temperature=temperature,
                                            tree=spec, **run)
                rows.append(dict(temperature=temperature, draft_rule=rule, num_draft_tokens=depth, stats=stats,
                                 peak=peak_memory_bytes(target.device), offline=offline[(temperature, rule)],
                                 costs=tree_costs[spec], tree=spec))
                bar.update(1)
        report_candidates.append(dict(cand=cand, rows=rows, offline_t1=offline_t1,
                                      num_parameters=sum(p.numel() for p in draft.parameters())))
        del draft
    bar.close()

    local = dict(baseline=baseline, candidates=report_candidates, prompts=mine)
    parts = gather(local) if gather is not None and world_size > 1 else [local]
    return build_report(parts, cfg, target_spec=target_spec, fingerprint=target_fingerprint(target, tokenizer),
                        device=target.device)


def build_report(parts: list[dict], cfg: EvalConfig, *, target_spec: str, fingerprint: str, device) -> dict:
    """Merge per-rank measurements into the report dict: pooled counters, summed wall times."""
    prompts = [p for part in parts for p in part["prompts"]]
    categories: dict[str, int] = {}
    for p in prompts:
        categories[p.category] = categories.get(p.category, 0) + 1

    def merged(get):
        return merge_stats([get(part) for part in parts])

    target_only, base_stats = [], {}
    for temperature in cfg.temperatures:
        stats = merged(lambda part, t=temperature: part["baseline"][t][0])
        base_stats[temperature] = stats
        agg = stats.aggregate()
        target_only.append({"temperature": temperature, **_timing(agg),
                            "peak_memory_bytes": max(part["baseline"][temperature][1] for part in parts)})

    candidates = []
    for c_idx, first in enumerate(parts[0]["candidates"]):
        cand = first["cand"]
        settings = []
        for r_idx, row in enumerate(first["rows"]):
            stats = merged(lambda part, c=c_idx, r=r_idx: part["candidates"][c]["rows"][r]["stats"])
            keys_order = [p for part in parts for p in part["prompts"]]
            settings.append(_setting(row, stats, base_stats[row["temperature"]], keys_order, cfg,
                                     peak=max(part["candidates"][c_idx]["rows"][r_idx]["peak"] for part in parts)))
        candidates.append({"name": cand.name, "draft": str(cand.path),
                           "run_dir": str(cand.run_dir) if cand.run_dir else None,
                           "num_parameters": first["num_parameters"],
                           "expected_acceptance": sum(p["candidates"][c_idx]["offline_t1"] for p in parts) / len(parts),
                           "settings": settings})
    return {
        "schema_version": 1,
        "created_at": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "target": target_spec,
        "target_fingerprint": fingerprint,
        "device": _device_name(device),
        "prompts": {"source": cfg.prompts, "count": len(prompts), "categories": categories},
        "sweep": {"num_draft_tokens": cfg.num_draft_tokens, "temperatures": cfg.temperatures,
                  "draft_rules": cfg.draft_rules, "trees": cfg.trees, "max_new_tokens": cfg.max_new_tokens,
                  "batch_size": cfg.batch_size},
        "target_only": target_only,
        "candidates": candidates,
    }


def _timing(agg: dict) -> dict:
    return {k: agg[k] for k in ("tokens_per_s", "wall_s", "new_tokens", "ttft_s", "tpot_s")}


def _setting(row: dict, stats: GenerationStats, base: GenerationStats, prompts: list[EvalPrompt], cfg: EvalConfig,
             peak: int) -> dict:
    agg = stats.aggregate()
    gamma, (c, v) = row["num_draft_tokens"], row["costs"]
    alpha, tau = agg["acceptance_rate"] or 0.0, agg["mean_accepted_length"] or 1.0
    # Wall time per generated token: equal to the wall-time ratio at T=0 (identical outputs), and fair at T>0 where
    # the two runs sample different lengths.
    base_agg = base.aggregate()
    speedup = (agg["tokens_per_s"] / base_agg["tokens_per_s"]) if agg["tokens_per_s"] and base_agg["tokens_per_s"] \
        else None
    predicted = predicted_speedup(tau, gamma, c, v)
    return {
        "num_draft_tokens": gamma, "temperature": row["temperature"], "draft_rule": row["draft_rule"],
        "tree": row["tree"], "acceptance_rate": alpha, "mean_accepted_length": tau,
        "nodes_per_step": agg["nodes_per_step"],
        "per_position_acceptance": agg["per_position_acceptance"],
        "expected_acceptance": row["offline"], "cost_ratio": c, "verify_cost_ratio": v,
        "analytic_speedup": analytic_speedup(alpha, gamma, c), "predicted_speedup": predicted,
        "speedup": speedup, "efficiency": speedup / predicted if speedup and predicted else None,
        **_timing(agg), "target_tokens_per_s": base_agg["tokens_per_s"],
        "target_forwards": agg["target_forwards"], "draft_forwards": agg["draft_forwards"],
        "peak_memory_bytes": peak,
        "by_category": _group(stats, [p.category for p in prompts]),
        "by_length": _group(stats, [length_bucket(r.new_tokens, cfg.max_new_tokens) for r in stats.requests]),
    }


def _device_name(device) -> str:
    device = torch.device(device)
    if device.type == "cuda":
        return f"{device} ({torch.cuda.get_device_name(device)})"
    return "cpu"


# ----------------------------------------------------------------------------------------------------------------
# Recommendation


def recommend(report: dict, *, temperature: float, draft_rule: str, min_acceptance: float) -> dict:
    """Best candidate and num_draft_tokens by measured speedup at the serving setting; disabled with the reason when
    nothing beats target-only decoding or acceptance is below min_acceptance. Only chains: the serving engines'
    draft-model speculation (vLLM, SGLang, TensorRT-LLM) drafts chains, so tree settings are reported, not promoted."""
    rule = "greedy" if temperature == 0 else draft_rule  # the sweep runs only greedy at T=0 (identical there)
    options = [(s, c) for c in report["candidates"] for s in c["settings"]
               if s["temperature"] == temperature and s["draft_rule"] == rule and s.get("tree") is None]
    if not options:
        raise ValueError(f"the report has no setting at temperature={temperature}, draft_rule={rule}; add them to "
                         "eval.temperatures / eval.draft_rules or change serving.temperature / serving.draft_rule")
    best, cand = max(options, key=lambda sc: sc[0]["speedup"] or 0.0)
    measured = {k: best[k] for k in ("acceptance_rate", "mean_accepted_length", "speedup")}
    rec = {"name": cand["name"], "draft": cand["draft"], "num_draft_tokens": best["num_draft_tokens"],
           "draft_rule": rule, "temperature": temperature, "measured": measured}
    setting = f"{cand['name']} at num_draft_tokens={best['num_draft_tokens']} (T={temperature}, {rule})"
    if (best["speedup"] or 0.0) <= 1.0:
        return {**rec, "enabled": False, "reason": f"no candidate beats target-only decoding: the best, {setting}, "
                f"measured {best['speedup']:.2f}x"}
    if best["acceptance_rate"] < min_acceptance:
        return {**rec, "enabled": False, "reason": f"best speedup {best['speedup']:.2f}x by {setting}, but its "
                f"acceptance_rate {best['acceptance_rate']:.2f} is below min_acceptance {min_acceptance}"}
    return {**rec, "enabled": True, "reason": f"best measured speedup {best['speedup']:.2f}x by {setting}, "
            f"acceptance_rate {best['acceptance_rate']:.2f}"}


def save_report(report: dict, out_dir: Path) -> Path:
    """report.json, written atomically."""
    from eval.report import write_json_atomic

    return write_json_atomic(report, out_dir / "report.json")
