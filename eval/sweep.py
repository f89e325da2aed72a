"""Acceptance-rate evaluation: every candidate draft x num_draft_tokens x temperature x draft_rule, measured with
`specdec_runtime` against target-only decoding on the same prompts in the same process (paired A/B). Token trees
(`eval.trees`) are one more axis: each tree spec adds one setting per temperature x draft_rule, with `tree` set and
num_draft_tokens = the tree's depth (chains have `tree: null`); promotion only considers chains, the drafting that
serving engines run.

    specdistill eval configs/quickstart.yaml                                   # the run's candidates
    specdistill eval --target embedded:smollm2-135m-instruct --drafts runs/quickstart/candidates/trunc4-fkl \\
        --prompts my_prompts.jsonl --out runs/my-eval                          # any drafts, any prompt file
    accelerate launch --config_file configs/accelerate/ddp.yaml -m specdistill eval configs/llama-3.1-8b.yaml

The test prompts are split deterministically into two halves: the sweep measures every setting on the selection
half, the recommendation picks one setting from those numbers, and that setting is measured again on the
confirmation half (the choice never saw it) at every concurrency of `eval.batch_sizes`; eval/recommend.py decides
from the confirmation numbers. Every measurement is paired and repeated (`specdec_runtime.ab`): per unit (one batch
of prompts) target-only decoding and every speculative setting at the same temperature (all candidates, all
num_draft_tokens) run once each, in an order that reverses from one unit and repeat to the next, `eval.repeats`
times, after untimed warm-up calls on the unit holding the longest prompt; the settings share that one target-only
arm (k settings cost k + 1 calls per unit and repeat, not 2k), so every candidate's draft is loaded at once.
Decoding runs through `specdec_runtime.backends.fast_model`, the backend `bench` times (compact model + static cache
+ CUDA graphs on CUDA, its fast CPU path on the CPU unless `target.cpu_fast_path: false`); the report names it
(`settings.backend`).

Prompts are split over processes (rank r takes every world-th prompt of each half); per-unit runs are gathered on
every rank (the confirmation needs the choice); eval/results.py assembles the report, and rank 0 writes it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from eval.config import EvalConfig, ServingConfig
from eval.recommend import choose
from eval.results import Candidate, Setting, build_report, confirmation_block, target_fingerprint
from specdec_runtime.ab import ArmPeaks, capture_graphs, paired_runs, pooled
from specdec_runtime.backends import (
    BackendOptions,
    backend_name,
    fast_model,
    full_units,
    longest_unit,
    machine_block,
    plan_rows,
)
from specdec_runtime.eagle3 import Eagle3Draft, first_step_logits
from specdec_runtime.engine import SamplingParams, generate
from specdec_runtime.errors import UserError
from specdec_runtime.loading import (
    check_draft_folder,
    check_model_files,
    check_vocab_compatible,
    load_checkpoint,
    load_eagle3,
    load_model,
    resolve_dtype,
    stop_token_ids,
)
from specdec_runtime.lookup import NgramDraft, SuffixDraft, is_lookup_spec, lookup_draft
from specdec_runtime.metrics import GenerationStats, expected_acceptance
from specdec_runtime.tree import parse_tree, tree_size


@dataclass
class EvalPrompt:
    """One eval prompt, already rendered with the chat template."""

    id: str
    category: str
    ids: list[int]


# ----------------------------------------------------------------------------------------------------------------
# Candidates


def resolve_candidates(paths: list[str | Path]) -> list[Candidate]:
    """Draft folders, checkpoint folders, distillation run directories (their best/ and kept checkpoints), or a
    zero-training draft spelled `ngram[:max=N,min=N]` / `suffix[:depth=N,factor=F,prob=P]` (no such folder here)."""
    found: list[Candidate] = []
    for raw in paths:
        path = Path(raw)
        if is_lookup_spec(str(raw)) and not path.exists():
            lookup_draft(str(raw))  # a misspelt knob fails here, before any model loads
            found.append(Candidate(name=str(raw), path=None, lookup=str(raw)))
        elif (path / "best").is_dir() or (path / "checkpoints").is_dir():
            found += _run_dir_candidates(path)
        elif path.is_dir():
            check_draft_folder(path)
            found.append(Candidate(name=path.name, path=path))
        else:
            raise UserError(
                f"candidate {path} does not exist; pass a draft folder, a checkpoint folder, a "
                "distillation run directory (candidates/<name>/), or ngram / suffix for a zero-training draft"
            )
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
            check_model_files(ckpt)
            out.append(Candidate(name=f"{run_dir.name}@{ckpt.name}", path=ckpt, run_dir=run_dir))
    if not out:
        raise UserError(f"{run_dir} has no best/ and no complete checkpoint; has its distillation finished?")
    return out


def load_draft(cand: Candidate, device: str, dtype: str):
    """Load a candidate's draft (tokenizer None for an EAGLE-3 head saved without one, and for a lookup, which reads
    the target's tokens); a LoRA adapter folder is merged into its base for decoding."""
    if cand.lookup is not None:
        return lookup_draft(cand.lookup), None
    if cand.kind == "eagle3":
        return load_eagle3(cand.path, dtype=dtype, device=device)
    if (cand.path / "adapter_config.json").is_file():
        # `load_checkpoint` finds the adapters' real base (a truncated student's lora_base/) and refuses a base whose
        # architecture is not the one the adapters were trained on.
        model, tokenizer, _ = load_checkpoint(cand.path)
        return model.to(device=device, dtype=resolve_dtype(dtype, device)).eval(), tokenizer
    return load_model(str(cand.path), dtype=dtype, device=device)


# ----------------------------------------------------------------------------------------------------------------
# Measurement helpers


def selection_confirmation_split(prompts: list) -> tuple[list, list]:
    """(selection, confirmation): alternate prompts, so each half spans the categories of a file sorted by them."""
    return prompts[0::2], prompts[1::2]


@dataclass(frozen=True)
class Bench:
    """What every paired measurement shares: the target as decoded (fast path) and the run parameters."""

    target: torch.nn.Module
    max_new_tokens: int
    stop_ids: tuple[int, ...]
    seed: int
    repeats: int
    warmup: int


def measure(bench: Bench, draft, prompts: list[EvalPrompt], setting: Setting, outputs: dict | None = None) -> dict:
    """Paired, repeated A/B of one setting on `prompts` (`measure_arms` with one speculative arm) -> {"prompts",
    "runs": {arm: per unit, per repeat stats}, "peak": {arm: peak memory bytes over its timed calls}}."""
    return measure_arms(bench, {"speculative": (draft, setting)}, prompts, outputs)["speculative"]


def measure_arms(
    bench: Bench, arms: dict, prompts: list[EvalPrompt], outputs: dict | None = None, on_call=None
) -> dict[object, dict]:
    """Paired, repeated timing of target-only decoding against every speculative arm {key: (draft, setting)} on
    `prompts` -> per key {"prompts", "runs": {"target_only", "speculative"}, "peak": {"target_only", "speculative"}}.

    The arms must share temperature and batch size: one target-only arm is their common baseline, and per unit and
    repeat every arm runs once, in an order that reverses from one (unit, repeat) to the next (`ab.abba_order`), so
    each arm sits at the same mean position of the sequence as target-only. With k speculative arms a unit costs
    k + 1 calls per repeat instead of 2k. Every key's runs hold the same target-only list (one set of calls).

    Warm-up: `bench.warmup` untimed calls per arm on the unit with the longest prompt, speculative arms first (they
    size the target's static cache, which target-only reuses), then every CUDA graph a shrinking batch can replay
    (`ab.capture_graphs`). `outputs` collects the target-only tokens per prompt id (for the offline estimate);
    `on_call()` runs after each timed call (a progress bar)."""
    settings = [setting for _, setting in arms.values()]
    if len({(s.temperature, s.batch_size) for s in settings}) != 1:
        raise ValueError("measure_arms: every arm must share temperature and batch size (one target-only baseline)")
    temperature, batch_size = settings[0].temperature, settings[0].batch_size
    units = full_units(prompts, batch_size)
    names = {f"speculative:{i}": key for i, key in enumerate(arms)}  # arm names for the schedule and the peaks

    def run(unit: int, arm: str, repeat: int) -> GenerationStats:
        gen = torch.Generator(device=bench.target.device).manual_seed(bench.seed + 7919 * repeat + unit)
        draft, setting = arms[names[arm]] if arm in names else (None, None)
        ids = [p.ids for p in units[unit]]
        result = generate(
            bench.target,
            draft,
            ids,
            generator=gen,
            tree=setting.tree if setting else None,
            num_draft_tokens=setting.num_draft_tokens if setting else 1,
            draft_rule=setting.draft_rule if setting else "greedy",
            sampling=SamplingParams(temperature=temperature),
            max_new_tokens=bench.max_new_tokens,
            stop_token_ids=bench.stop_ids,
        )
        if outputs is not None and draft is None and repeat == 0:
            outputs.update({p.id: tokens for p, tokens in zip(units[unit], result.tokens)})
        return result.stats

    warm = longest_unit([[p.ids for p in unit] for unit in units])
    for arm in [*names, "target_only"]:
        for _ in range(bench.warmup):
            run(warm, arm, 0)
    for draft, setting in arms.values():
        capture_graphs(bench.target, draft, batch_size=batch_size, gamma=setting.num_draft_tokens, tree=setting.tree)
    peaks = ArmPeaks(run, bench.target.device)  # each arm's own peak over its timed calls

    def timed(unit: int, arm: str, repeat: int) -> GenerationStats:
        stats = peaks(unit, arm, repeat)
        if on_call is not None:
            on_call()
        return stats

    runs = paired_runs(timed, units=len(units), arms=("target_only", *names), repeats=bench.repeats)
    flat = [p for unit in units for p in unit]
    return {
        key: {
            "prompts": flat,
            "runs": {"target_only": runs["target_only"], "speculative": runs[arm]},
            "peak": {"target_only": peaks.bytes["target_only"], "speculative": peaks.bytes[arm]},
        }
        for arm, key in names.items()
    }


def offline_acceptance(
    target, draft, prompts: list[EvalPrompt], outputs: dict[str, list[int]], temperature: float, rule: str
) -> float:
    """`expected_acceptance` (sum_v min(p, q), or p(argmax q) for greedy) over the target's own outputs; None for a
    lookup draft, which has no distribution to compare before it runs."""
    if isinstance(draft, NgramDraft | SuffixDraft):
        return None
    sampling = SamplingParams(temperature=temperature)
    total, count = 0.0, 0
    with torch.no_grad():
        for prompt in prompts:
            out = outputs.get(prompt.id) or []
            if not out:
                continue
            ids = torch.tensor([prompt.ids + out], device=target.device)
            start = len(prompt.ids) - 1  # logits at position t predict token t + 1: the response's predictors
            t_logits = target(ids).logits[:, start:-1]
            # an EAGLE-3 head's first draft step, from the target's features (its later steps read its own)
            d_logits = first_step_logits(draft, target, ids) if isinstance(draft, Eagle3Draft) else draft(ids).logits
            d_logits = d_logits[:, start:-1]
            mask = torch.ones(t_logits.shape[:2], device=target.device)
            total += float(expected_acceptance(t_logits, d_logits, mask, sampling, rule)) * len(out)
            count += len(out)
    return total / max(count, 1)


def _check_split_sizes(selection: list, confirmation: list, cfg: EvalConfig, world_size: int) -> None:
    """Every rank's share of each half must fill one batch at every concurrency it is measured at."""
    need = {
        "selection": (len(selection) // world_size, min(cfg.batch_sizes)),
        "confirmation": (len(confirmation) // world_size, max(cfg.batch_sizes)),
    }
    for half, (have, batch) in need.items():
        if have < batch:
            raise UserError(
                f"the {half} half of the eval prompts has {have} prompt(s) per process, fewer than batch size {batch} "
                f"(eval.batch_sizes={cfg.batch_sizes}, {world_size} process(es)); raise eval.max_prompts, pass more "
                "prompts or lower eval.batch_sizes"
            )


# ----------------------------------------------------------------------------------------------------------------
# The sweep


def run_sweep(
    target,
    tokenizer,
    candidates: list[Candidate],
    prompts: list[EvalPrompt],
    cfg: EvalConfig,
    *,
    target_spec: str,
    serving: ServingConfig | None = None,
    seed: int = 0,
    device: str = "cpu",
    dtype: str = "auto",
    rank: int = 0,
    world_size: int = 1,
    gather=None,
    progress: bool = True,
    backend: BackendOptions = BackendOptions(),
) -> dict:
    """Run the sweep on the selection half and, with `serving`, measure the setting `eval.recommend.choose` picks for
    it on the confirmation half at every batch size (`report["confirmation"]`); returns the report dict (keys of
    DESIGN.md; eval/results.py assembles it, eval/report.py renders it, `eval.recommend.recommend` decides from it).

    `gather(obj) -> list[obj]` collects per-rank results on every rank (accelerate's gather_object); with one
    process it is not needed.
    """
    if len(prompts) < 2:
        raise UserError("the eval prompt set needs at least 2 prompts (a selection and a confirmation half)")
    if not candidates:
        raise UserError("no candidate drafts to evaluate; pass draft folders or a run with finished candidates")
    selection, confirmation = selection_confirmation_split(prompts)
    _check_split_sizes(selection, confirmation, cfg, world_size)
    # At temperature 0 both draft rules propose argmax q, so `sample` would repeat `greedy` exactly.
    groups = [(t, r) for t in cfg.temperatures for r in cfg.draft_rules if not (t == 0 and r == "sample")]
    groups = groups or [(t, "greedy") for t in cfg.temperatures]
    if serving is not None and (serving.temperature, _serving_rule(serving)) not in groups:
        raise UserError(
            f"serving.temperature={serving.temperature} / draft_rule={serving.draft_rule} is not swept; add them to "
            "eval.temperatures / eval.draft_rules or change the serving section"
        )
    trees = {spec: tree_size(parse_tree(spec))[0] for spec in cfg.trees}  # spec -> depth
    batch = min(cfg.batch_sizes)
    points = [  # per (temperature, draft_rule): the chains, then the trees
        point
        for t, r in groups
        for point in [Setting(t, r, g, None, batch) for g in cfg.num_draft_tokens]
        + [Setting(t, r, depth, spec, batch) for spec, depth in trees.items()]
    ]
    # the CPU fast path plans its weight layouts for every GEMM row count the sweep and confirmation run
    widths = {1, 2, *(g + 1 for g in cfg.num_draft_tokens), *(tree_size(parse_tree(t))[1] + 1 for t in cfg.trees)}
    backend = plan_rows(backend, max(cfg.batch_sizes), widths)
    fast_target = fast_model(target, backend)
    bench = Bench(fast_target, cfg.max_new_tokens, stop_token_ids(target, tokenizer), seed, cfg.repeats, cfg.warmup)
    mine = selection[rank::world_size]

    outputs: dict[float, dict[str, list[int]]] = {}  # temperature -> prompt id -> target-only tokens
    # Every candidate's draft is loaded at once: all settings at one temperature share one target-only arm.
    loaded = []
    for cand in candidates:
        draft, draft_tokenizer = load_draft(cand, device, dtype)
        if draft_tokenizer is not None:  # an EAGLE-3 head's ids are the target's by construction
            check_vocab_compatible(tokenizer, draft_tokenizer, draft.config.vocab_size)
        # a suffix draft keeps the responses of the candidate's earlier calls, as a serving engine's cache does
        loaded.append((draft, fast_model(draft, backend, draft=True) if cand.lookup is None else draft))
    by_temperature = {  # a lookup proposes chains only: its tree points stay unmeasured (None)
        temperature: {
            (c, i): (loaded[c][1], point)
            for c, cand in enumerate(candidates)
            for i, point in enumerate(points)
            if point.temperature == temperature and not (cand.lookup is not None and point.tree is not None)
        }
        for temperature in dict.fromkeys(point.temperature for point in points)
    }
    calls = sum(len(arms) + 1 for arms in by_temperature.values() if arms) * len(full_units(mine, batch)) * cfg.repeats
    bar = tqdm(total=calls, desc="eval (timed calls)", disable=not progress or rank != 0)
    rows: dict[tuple[int, int], dict] = {}
    for temperature, arms in by_temperature.items():
        if arms:
            rows.update(measure_arms(bench, arms, mine, outputs.setdefault(temperature, {}), on_call=bar.update))
    bar.close()
    measured = []
    for c, (draft, _) in enumerate(loaded):
        offline = {(t, r): offline_acceptance(target, draft, mine, outputs[t], t, r) for t, r in groups}
        offline_t1 = offline_acceptance(target, draft, mine, outputs[cfg.temperatures[-1]], 1.0, "sample")
        measured.append(
            dict(
                rows=[rows.get((c, i)) for i in range(len(points))],
                offline=offline,
                offline_t1=offline_t1,
                params=_num_parameters(draft),
            )
        )
    del loaded

    local = dict(points=points, candidates=measured)
    parts = gather(local) if gather is not None and world_size > 1 else [local]
    report = build_report(
        parts,
        candidates,
        cfg,
        target_spec=target_spec,
        fingerprint=target_fingerprint(target, tokenizer),
        device=target.device,
        backend=backend_name(fast_target),
        stop_ids=bench.stop_ids,
        split_counts=(len(selection), len(confirmation)),
    )
    # what the numbers were measured on, and the target's decode step against the machine's weight-streaming floor
    # (every setting at a temperature shares one target-only arm: the first one's calls)
    first = next(row for row in rows.values() if row is not None)  # every candidate has chain settings
    report["machine"] = machine_block(fast_target, None, pooled(first["runs"]["target_only"]).phases)
    if serving is not None:
        report["confirmation"] = confirm(
            report,
            candidates,
            bench,
            confirmation[rank::world_size],
            cfg,
            serving,
            device=device,
            dtype=dtype,
            gather=gather if world_size > 1 else None,
            backend=backend,
        )
    return report


def _serving_rule(serving: ServingConfig) -> str:
    return "greedy" if serving.temperature == 0 else serving.draft_rule  # the sweep runs only greedy at T=0


def _num_parameters(model) -> int:
    return sum(p.numel() for p in model.parameters()) if isinstance(model, torch.nn.Module) else 0


def confirm(
    report: dict,
    candidates: list[Candidate],
    bench: Bench,
    prompts: list[EvalPrompt],
    cfg: EvalConfig,
    serving: ServingConfig,
    *,
    device: str,
    dtype: str,
    gather=None,
    backend: BackendOptions = BackendOptions(),
) -> dict:
    """Measure the setting `choose` picks from the selection numbers on this rank's confirmation prompts, once per
    batch size -> the report's `confirmation` block (merged over ranks)."""
    cand_report, best = choose(report, serving.temperature, _serving_rule(serving), serving.min_acceptance)
    cand = next(c for c in candidates if c.name == cand_report["name"])
    draft, _ = load_draft(cand, device, dtype)
    fast_draft = fast_model(draft, backend, draft=True) if cand.lookup is None else draft
    local = [
        measure(
            bench,
            fast_draft,
            prompts,
            Setting(best["temperature"], best["draft_rule"], best["num_draft_tokens"], None, b),
        )
        for b in sorted(cfg.batch_sizes)
    ]
    parts = gather(local) if gather is not None else [local]
    return confirmation_block(parts, cand_report["name"], cand_report["draft"], best, cfg.batch_sizes)
