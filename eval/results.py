"""Assemble the eval report (report.json) from the sweep's measurements; eval/report.py renders it.

    report = build_report(parts, candidates, cfg, target_spec=..., fingerprint=target_fingerprint(target, tok), ...)
    report["confirmation"] = confirmation_block(parts, name, draft, best, cfg.batch_sizes)
    save_report(report, out_dir)                                     # <out_dir>/report.json, written atomically

`parts` are the per-rank measurements eval/sweep.py gathers: for the sweep, one {"points": [Setting],
"candidates": [{"rows": [measure() per point], "offline", "offline_t1", "params"}]} per rank; for the confirmation,
one [measure() per batch size] per rank. Keys follow DESIGN.md's metric names (docs/metrics.md). The records a
report is made of (`Candidate`, `Setting`) live here too: the sweep imports them, this module never imports the sweep.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import torch

from eval.config import EvalConfig
from specdec_runtime import atomic
from specdec_runtime.ab import paired_metrics, pooled
from specdec_runtime.eagle3 import is_eagle3_folder
from specdec_runtime.metrics import GenerationStats, merge_stats

LENGTH_BUCKETS = ("short", "medium", "long")
PROMPT_LENGTH_EDGES = (64, 256)
"""Inclusive upper edges, in prompt tokens, of the prompt-length buckets <=64, 65-256 and >256 (`by_prompt_length`).
Fixed rather than quantiles, so one report's buckets mean the same as another's: short chat prompts (builtin:test's
~20-60 tokens) land in the first, long-input prompts (builtin:long-input's ~370) in the last."""


@dataclass
class Candidate:
    """One draft to evaluate."""

    name: str
    """Label in the report."""
    path: Path | None
    """HF folder with the draft's weights (a best/ or checkpoint folder, or an exported draft); None for a lookup."""
    run_dir: Path | None = None
    """Its distillation run directory, when known (for training curves)."""
    lookup: str | None = None
    """A zero-training draft's spec, e.g. 'ngram:max=4,min=2' or 'suffix' (`specdec_runtime.lookup.lookup_draft`)."""

    @property
    def kind(self) -> str:
        """`ngram` or `suffix` for a lookup, `eagle3` for an EAGLE-3 head (shared/EAGLE3.md), else `standalone`: the
        report's `kind` column."""
        if self.lookup is not None:
            return self.lookup.partition(":")[0]
        return "eagle3" if is_eagle3_folder(self.path) else "standalone"

    @property
    def draft(self) -> str:
        """The report's `draft`: the folder, or the lookup's spec."""
        return self.lookup if self.lookup is not None else str(self.path)


@dataclass(frozen=True)
class Setting:
    """One measured point: sampling, drafting and concurrency."""

    temperature: float
    draft_rule: str
    num_draft_tokens: int
    """gamma for a chain, the depth for a tree."""
    tree: str | None
    batch_size: int


def target_fingerprint(model, tokenizer) -> str:
    """Identifies the target a report was made for: its vocabulary and its architecture config."""
    digest = hashlib.sha256(json.dumps(sorted(tokenizer.get_vocab().items())).encode())
    arch = {
        k: v
        for k, v in model.config.to_dict().items()
        if k not in ("_name_or_path", "transformers_version", "dtype", "torch_dtype")
    }
    digest.update(json.dumps(arch, sort_keys=True, default=str).encode())
    return digest.hexdigest()[:16]


# ----------------------------------------------------------------------------------------------------------------
# One setting


def _paired(runs: dict, gamma: int) -> dict:
    """`ab.paired_metrics` plus both arms' latency and phases, pooled over every unit and repeat (throughput over
    the batch, TTFT / TPOT per request)."""
    base, spec = pooled(runs["target_only"]), pooled(runs["speculative"])
    agg, base_agg = spec.aggregate(), base.aggregate()
    latency = ("tokens_per_s", "ttft_s", "tpot_s")
    return {
        **paired_metrics(runs["target_only"], runs["speculative"], gamma),
        **{k: agg[k] for k in latency},
        "phases": spec.phases.to_dict(),
        "target_only": {**{k: base_agg[k] for k in latency}, "phases": base.phases.to_dict()},
        "target_tokens_per_s": base_agg["tokens_per_s"],
    }


def _units_by(units: list[list], key: Callable) -> dict[str, list[int]]:
    """Per key(prompt): the indices of the units whose prompts all share it. A unit mixing keys counts in none: its
    timings (one call for the whole batch) cannot be split between its prompts."""
    out: dict[str, list[int]] = {}
    for i, unit in enumerate(units):
        keys = {key(p) for p in unit}
        if len(keys) == 1:
            out.setdefault(keys.pop(), []).append(i)
    return out


def _paired_by_category(runs: dict, units: list[list], gamma: int) -> dict[str, dict]:
    """Per category: the paired speedup (its interval from 2 units on) and the in-run cost ratio over the units whose
    prompts all belong to it (at batch size 1 every unit; a unit mixing categories counts in none)."""
    out = {}
    for category, idx in _units_by(units, lambda p: p.category).items():
        m = paired_metrics([runs["target_only"][i] for i in idx], [runs["speculative"][i] for i in idx], gamma)
        out[category] = {k: m[k] for k in ("speedup", "speedup_ci", "units", "cost_ratio")}
        if len(idx) < 2:  # one unit's ratio has no spread to bootstrap: no interval rather than a point posing as one
            out[category]["speedup_ci"] = None
    return out


def prompt_length_bucket(n: int, edges: tuple[int, ...] = PROMPT_LENGTH_EDGES) -> str:
    """The bucket of a prompt of n tokens, named by its edges: '<=64', '65-256' or '>256' for the default edges."""
    i = bisect.bisect_left(edges, n)  # the first edge >= n: a prompt of exactly 64 tokens is in <=64
    if i == 0:
        return f"<={edges[0]}"
    return f">{edges[-1]}" if i == len(edges) else f"{edges[i - 1] + 1}-{edges[i]}"


def _paired_by_prompt_length(runs: dict, units: list[list], gamma: int) -> dict[str, dict]:
    """Per prompt-length bucket, from the shortest prompts up: the paired speedup (its interval from 2 units on),
    acceptance and both arms' TTFT / TPOT per request over the units whose prompts all fall in it (at batch size 1
    every unit). A unit mixing buckets counts in none: its short prompts wait for its long prompt's prefill.
    `prompt_tokens` is the [shortest, longest] prompt measured in the bucket."""
    out = {}
    for bucket, idx in _units_by(units, lambda p: prompt_length_bucket(len(p.ids))).items():
        m = _paired({arm: [runs[arm][i] for i in idx] for arm in ("target_only", "speculative")}, gamma)
        lengths = [len(p.ids) for i in idx for p in units[i]]
        out[bucket] = {
            "prompt_tokens": [min(lengths), max(lengths)],
            **{k: m[k] for k in ("units", "speedup", "speedup_ci", "acceptance_rate", "ttft_s", "tpot_s")},
            "target_only": {k: m["target_only"][k] for k in ("ttft_s", "tpot_s")},
        }
        if m["units"] < 2:  # as per category: one unit's ratio has no spread to bootstrap
            out[bucket]["speedup_ci"] = None
    return dict(sorted(out.items(), key=lambda item: item[1]["prompt_tokens"][0]))


def _add_peaks(row: dict, measured: list[dict]) -> None:
    """Each arm's peak memory, the maximum over ranks: the speculative arm's as `peak_memory_bytes`, target-only's
    as `target_only.peak_memory_bytes`."""
    row["peak_memory_bytes"] = max(m["peak"].get("speculative", 0) for m in measured)
    row["target_only"]["peak_memory_bytes"] = max(m["peak"].get("target_only", 0) for m in measured)


def group_requests(requests: list, keys: list[str], prompt_ids: list[str]) -> dict[str, dict]:
    """Acceptance per group: requests (every repeat of every prompt) under keys, one per request -> {key: stats};
    `count` is the number of distinct prompts in the group (not prompts x repeats)."""
    groups: dict[str, list] = {}
    for key, req, pid in zip(keys, requests, prompt_ids, strict=True):
        groups.setdefault(key, []).append((req, pid))
    out = {}
    for key, members in sorted(groups.items()):
        reqs = [req for req, _ in members]
        agg = GenerationStats(requests=reqs, wall_s=0.0, target_forwards=0, draft_forwards=0).aggregate()
        out[key] = {
            "acceptance_rate": agg["acceptance_rate"],
            "mean_accepted_length": agg["mean_accepted_length"],
            "count": len({pid for _, pid in members}),
        }
    return out


def length_bucket(n: int, max_new_tokens: int) -> str:
    return LENGTH_BUCKETS[min(2, 3 * n // max(max_new_tokens, 1))]


def length_keys(requests: list, prompt_ids: list[str], max_new_tokens: int) -> list[str]:
    """Each request's output-length bucket, from its prompt's median output length over the repeats (the lower
    median): at T > 0 a prompt's repeats differ in length, and every repeat of one prompt must count in one bucket."""
    lengths: dict[str, list[int]] = {}
    for req, pid in zip(requests, prompt_ids, strict=True):
        lengths.setdefault(pid, []).append(req.new_tokens)
    bucket = {pid: length_bucket(statistics.median_low(ns), max_new_tokens) for pid, ns in lengths.items()}
    return [bucket[pid] for pid in prompt_ids]


def _setting(point: Setting, rows: list[dict], offline: float, cfg: EvalConfig) -> dict:
    """One setting of the report from every rank's measurement of it."""
    runs = {arm: [u for row in rows for u in row["runs"][arm]] for arm in ("target_only", "speculative")}
    prompts = [p for row in rows for p in row["prompts"]]
    once = merge_stats([unit[0] for unit in runs["speculative"]]).aggregate()  # each prompt once: counts and sizes
    spec = pooled(runs["speculative"])
    # pooled requests run unit by unit, each unit's repeats in turn: the prompt keys in the same order
    units = [prompts[i : i + point.batch_size] for i in range(0, len(prompts), point.batch_size)]
    order = [p for unit in units for _ in range(cfg.repeats) for p in unit]
    ids = [p.id for p in order]
    paired = _paired(runs, point.num_draft_tokens)
    _add_peaks(paired, rows)
    by_category = group_requests(spec.requests, [p.category for p in order], ids)
    for category, speed in _paired_by_category(runs, units, point.num_draft_tokens).items():
        by_category[category].update(speed)
    return {
        "num_draft_tokens": point.num_draft_tokens,
        "temperature": point.temperature,
        "draft_rule": point.draft_rule,
        "tree": point.tree,
        "batch_size": point.batch_size,
        **paired,
        "expected_acceptance": offline,
        "wall_s": once["wall_s"],
        "new_tokens": once["new_tokens"],
        "target_forwards": once["target_forwards"],
        "draft_forwards": once["draft_forwards"],
        "by_category": by_category,
        "by_length": group_requests(spec.requests, length_keys(spec.requests, ids, cfg.max_new_tokens), ids),
        "by_prompt_length": _paired_by_prompt_length(runs, units, point.num_draft_tokens),
    }


def _target_only(parts: list[dict], temperature: float) -> dict:
    """Target-only decoding at one temperature, pooled over every setting's paired runs at that temperature."""
    rows = [
        cand["rows"][i]
        for part in parts
        for cand in part["candidates"]
        for i, point in enumerate(part["points"])
        if point.temperature == temperature and cand["rows"][i] is not None
    ]
    # settings measured together share one target-only arm (`sweep.measure_arms`): count its calls once
    shared = {id(row["runs"]["target_only"]): row["runs"]["target_only"] for row in rows}
    calls = [call for runs in shared.values() for unit in runs for call in unit]
    agg = merge_stats(calls).aggregate()
    return {
        "temperature": temperature,
        **{k: agg[k] for k in ("tokens_per_s", "ttft_s", "tpot_s", "decode_s")},
        "calls": len(calls),
        "peak_memory_bytes": max(row["peak"].get("target_only", 0) for row in rows),  # the target-only arm's
    }


# ----------------------------------------------------------------------------------------------------------------
# The report


def _mean(values: list[float | None]) -> float | None:
    """Mean over ranks; None where there is no estimate (a lookup draft has no distribution to compare)."""
    return None if any(v is None for v in values) else sum(values) / len(values)


def build_report(
    parts: list[dict],
    candidates: list[Candidate],
    cfg: EvalConfig,
    *,
    target_spec: str,
    fingerprint: str,
    device,
    backend: str,
    stop_ids: tuple[int, ...],
    split_counts: tuple[int, int],
) -> dict:
    """Merge per-rank measurements into the report dict (the selection half's sweep)."""
    points = parts[0]["points"]
    categories: dict[str, int] = {}
    for row in (part["candidates"][0]["rows"][0] for part in parts):
        for p in row["prompts"]:
            categories[p.category] = categories.get(p.category, 0) + 1
    report_candidates = []
    for c_idx, cand in enumerate(candidates):
        per_rank = [part["candidates"][c_idx] for part in parts]
        settings = [
            _setting(
                point,
                [m["rows"][s_idx] for m in per_rank],
                _mean([m["offline"][(point.temperature, point.draft_rule)] for m in per_rank]),
                cfg,
            )
            for s_idx, point in enumerate(points)
            if per_rank[0]["rows"][s_idx] is not None  # a lookup's tree points are not measured
        ]
        report_candidates.append(
            {
                "name": cand.name,
                "draft": cand.draft,
                "kind": cand.kind,
                "run_dir": str(cand.run_dir) if cand.run_dir else None,
                "num_parameters": per_rank[0]["params"],
                "expected_acceptance": _mean([m["offline_t1"] for m in per_rank]),
                "expected_acceptance_temperature": 1.0,
                "settings": settings,
            }
        )
    return {
        "schema_version": 1,
        "created_at": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "target": target_spec,
        "target_fingerprint": fingerprint,
        "device": _device_name(device),
        "prompts": {
            "source": cfg.prompts,
            "count": sum(split_counts),
            "selection": split_counts[0],
            "confirmation": split_counts[1],
            "categories": categories,
        },
        "sweep": {
            "num_draft_tokens": cfg.num_draft_tokens,
            "temperatures": cfg.temperatures,
            "draft_rules": cfg.draft_rules,
            "trees": cfg.trees,
            "max_new_tokens": cfg.max_new_tokens,
            "batch_size": min(cfg.batch_sizes),
            "batch_sizes": cfg.batch_sizes,
        },
        "settings": {
            "backend": backend,
            "split": "selection",
            "repeats": cfg.repeats,
            "warmup": cfg.warmup,
            "stop_token_ids": list(stop_ids),
        },
        "target_only": [_target_only(parts, t) for t in cfg.temperatures],
        "candidates": report_candidates,
    }


def confirmation_block(parts: list[list[dict]], name: str, draft: str, best: dict, batch_sizes: list[int]) -> dict:
    """The report's `confirmation` block: the chosen setting `best` of candidate `name` (its folder `draft`),
    measured once per batch size (sorted) on every rank's confirmation prompts."""
    by_batch = []
    for i, b in enumerate(sorted(batch_sizes)):
        runs = {arm: [u for part in parts for u in part[i]["runs"][arm]] for arm in ("target_only", "speculative")}
        row = {"batch_size": b, **_paired(runs, best["num_draft_tokens"])}
        _add_peaks(row, [part[i] for part in parts])
        by_batch.append(row)
    return {
        "name": name,
        "draft": draft,
        "num_draft_tokens": best["num_draft_tokens"],
        "draft_rule": best["draft_rule"],
        "temperature": best["temperature"],
        "split": "confirmation",
        "prompts": sum(len(part[0]["prompts"]) for part in parts),
        "by_batch_size": by_batch,
    }


def _device_name(device) -> str:
    device = torch.device(device)
    if device.type == "cuda":
        return f"{device} ({torch.cuda.get_device_name(device)})"
    return "cpu"


def write_json_atomic(obj, path: Path) -> Path:
    """Write `obj` as JSON through `specdec_runtime.atomic`: readers see the old file or the new one, never half."""
    return atomic.write_text(Path(path), json.dumps(obj, indent=2))


def save_report(report: dict, out_dir: Path) -> Path:
    """report.json, written atomically."""
    return write_json_atomic(report, out_dir / "report.json")
