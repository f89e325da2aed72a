"""Benchmark one target/draft pair on one prompt set: target-only vs speculative (ours) vs HF assisted generation.

An EAGLE-3 head (`eagle3.Eagle3Draft`) and a suffix draft (`lookup.SuffixDraft`) run without the HF assisted arm:
transformers has no EAGLE-3 path and no suffix decoding, so the JSON says `hf_assisted: {"skipped": "..."}` and
`speedup_vs_hf_assisted` is null. An n-gram draft (`lookup.NgramDraft`) is compared with HF's own prompt lookup
(`prompt_lookup_num_tokens` = gamma, `max_matching_ngram_size` = prompt_lookup_max; HF matches down to one token
whatever prompt_lookup_min, and takes the earliest occurrence, as vLLM and we do).

All arms run in this process on the same prompts with the same stop tokens, paired and repeated (`ab.paired_runs`:
ABBA order per unit, `repeats` times); warm-up runs on the longest unit are excluded from timings. A unit is one
batch of `batch_size` prompts (prompts past the last full batch are left out, so every timed call has one shape and
the static cache and CUDA graphs are never rebuilt inside a timed run). On CUDA, Llama-family models run through the
compact model (bf16 static cache + CUDA graphs) for both of our modes (on the CPU its fast CPU path, `cpu.py`; both
chosen by `backends.fast_model`), while HF assisted generation uses the HF models as given; HF assisted generation
only supports batch size 1, so it runs prompt by prompt whatever `batch_size` is.

HF assisted generation reads its drafting knobs from the *draft's* generation config, not from the arguments of
`generate` (transformers 5, generation/candidate_generator.py: `num_assistant_tokens`,
`num_assistant_tokens_schedule` and `assistant_confidence_threshold` come from `assistant_model.generation_config`;
the default threshold 0.4 stops drafting early). `fair_assistant` sets them on a copy for the run, and a forward
hook on the target records the width HF really verified (`hf_assisted.draft_tokens_per_step`).

With `tree`, a token-tree run of the same pair joins them (our engine, same prompts), reported as `tree`. The lead's
CLI wires this to `specdistill bench`.

The JSON's `machine` block names the machine (`cpu_tune.machine_info`) and, on the CPU, the decode step as a
multiple of the weight-streaming floor at the probed bandwidth, with the fast path's layouts
(`backends.machine_block`); the layouts are planned for the row counts this run makes (`backends.plan_rows`).
"""

import copy
import statistics
import time
from collections.abc import Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field

import torch
from transformers import GenerationConfig

from .ab import (
    capture_graphs,
    decode_s_per_token,
    graph_widths,
    paired_metrics,
    paired_runs,
    paired_speedup,
    pooled,
)
from .backends import BackendOptions, backend_name, fast_model, full_units, longest_unit, machine_block, plan_rows
from .eagle3 import Eagle3Draft
from .engine import generate
from .loading import stop_token_ids
from .lookup import NgramDraft, SuffixDraft
from .metrics import GenerationStats
from .sampling import DraftRule, SamplingParams

# ---------------------------------------------------------------------------------------- HF assisted generation


@dataclass
class HFRun:
    """One HF assisted generate call (or several, summed)."""

    new_tokens: int
    wall_s: float
    widths: list[int] = field(default_factory=list)
    """Draft tokens each target verify forward scored (the first forward's prompt excluded)."""


class VerifyWidths:
    """Forward pre-hook on the target: how many draft tokens each HF assisted verify forward scores.

    A verify forward feeds the tokens the target has not cached (the whole prompt the first time, then the last
    emitted token) plus the candidates, so candidates = input width - uncached tokens.
    """

    def __init__(self, target: torch.nn.Module):
        self.widths: list[int] = []
        self.uncached = 0
        self.handle = target.register_forward_pre_hook(self._hook, with_kwargs=True)

    def start(self, prompt_len: int) -> None:
        self.uncached = prompt_len

    def _hook(self, module, args, kwargs) -> None:
        ids = kwargs["input_ids"] if kwargs.get("input_ids") is not None else args[0]
        self.widths.append(ids.shape[1] - self.uncached)
        self.uncached = 1


@contextmanager
def fair_assistant(draft: torch.nn.Module, num_draft_tokens: int):
    """Inside the block HF assisted generation drafts exactly num_draft_tokens per step (constant schedule, no
    confidence stop), set on a copy of the draft's generation config; the original is put back afterwards."""
    original = draft.generation_config
    fair = copy.deepcopy(original)
    fair.num_assistant_tokens = num_draft_tokens
    fair.num_assistant_tokens_schedule = "constant"
    fair.assistant_confidence_threshold = 0.0  # falsy: transformers skips the confidence stop
    draft.generation_config = fair
    try:
        yield
    finally:
        draft.generation_config = original


def hf_generation_config(tokenizer, stop: tuple[int, ...], max_new_tokens: int, temperature: float):
    """The target-side sampling of HF assisted generation, matching ours (no top-k / top-p)."""
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (stop[0] if stop else 0)
    sampling = dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0) if temperature > 0 else {}
    return GenerationConfig(
        max_new_tokens=max_new_tokens, eos_token_id=list(stop) or None, pad_token_id=pad, **sampling
    )


def hf_assisted(target, draft, prompts: list[list[int]], config: GenerationConfig, hook: VerifyWidths) -> HFRun:
    """HF assisted generation prompt by prompt (it supports batch size 1 only), timed, with the verify widths;
    draft=None: HF prompt lookup (`config.prompt_lookup_num_tokens`)."""
    run = HFRun(0, 0.0)
    for prompt in prompts:
        ids = torch.tensor([prompt], device=target.device)
        hook.start(len(prompt))
        hook.widths = []
        if target.device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        assist = {"assistant_model": draft} if draft is not None else {}
        out = target.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config, **assist)
        if target.device.type == "cuda":
            torch.cuda.synchronize()
        run.wall_s += time.perf_counter() - start
        run.new_tokens += out.shape[1] - ids.shape[1]
        run.widths += hook.widths
    return run


def _wall_s_per_token(calls: Sequence) -> float | None:
    """Wall seconds per emitted token, prefill included: the only split HF assisted generation allows."""
    tokens = sum(c.new_tokens if isinstance(c, HFRun) else sum(r.new_tokens for r in c.requests) for c in calls)
    return sum(c.wall_s for c in calls) / tokens if tokens else None


# ------------------------------------------------------------------------------------------------------ the bench


def run_bench(
    target: torch.nn.Module,
    draft: torch.nn.Module,
    tokenizer,
    prompts: list[list[int]],
    *,
    num_draft_tokens: int,
    max_new_tokens: int,
    temperature: float,
    batch_size: int,
    seed: int,
    warmup: int = 1,
    repeats: int = 3,
    draft_rule: DraftRule = "greedy",
    tree: str | None = None,
    backend: BackendOptions = BackendOptions(),
) -> dict:
    """Bench JSON of DESIGN.md (`bench --json`); the tokenizer is read for its eos/pad token ids only.

    Timings (`wall_s`, `new_tokens`, `phases`) are summed over every unit and repeat; `speedup` is the median of
    the units' paired decode-seconds-per-token ratios with its 95 % bootstrap interval `speedup_ci`.
    tree: a token-tree spec ('4,2,2,1', 'dynamic:NODES'); adds a `tree` block (the same metrics for the tree, plus
    speedup_vs_chain over the chain of num_draft_tokens, paired on the same units).
    backend: how to decode on the CPU (`backends.fast_model`: the fast path, or the HF models, eager; compiled
    steps for the target and a standalone draft, compiled in the warm-up and `capture_graphs`, outside the timed
    runs).
    """
    stop = stop_token_ids(target, tokenizer)
    target_widths, draft_widths = graph_widths(num_draft_tokens, tree)  # a lookup verifies 1..gamma + 1 tokens
    backend = plan_rows(backend, batch_size, {*range(1, num_draft_tokens + 2), *target_widths, *draft_widths})
    fast_target = fast_model(target, backend)
    lookup = isinstance(draft, NgramDraft | SuffixDraft)
    fast_draft = draft if lookup else fast_model(draft, backend, draft=True)
    hf_draft = copy.deepcopy(draft) if draft is target else draft  # the width hook must see target forwards only
    units = full_units(prompts, batch_size)
    ours = dict(
        num_draft_tokens=num_draft_tokens,
        draft_rule=draft_rule,
        sampling=SamplingParams(temperature=temperature),
        max_new_tokens=max_new_tokens,
        stop_token_ids=stop,
    )
    hf_config = hf_generation_config(tokenizer, stop, max_new_tokens, temperature)
    if isinstance(draft, NgramDraft):  # HF's own prompt lookup: gamma tokens after the longest match up to max
        hf_config.prompt_lookup_num_tokens = num_draft_tokens
        hf_config.max_matching_ngram_size = draft.prompt_lookup_max
        hf_draft = None
    hook = VerifyWidths(target)
    kind = draft_kind(draft)
    no_hf = HF_SKIPPED.get(kind)  # transformers has no EAGLE-3 and no suffix decoding path: no HF arm
    arms = ["target_only", "speculative", *(["tree"] if tree is not None else []), *([] if no_hf else ["hf_assisted"])]

    def run(unit: int, arm: str, repeat: int):
        call_seed = seed + 7919 * repeat + unit  # the same seed for every arm of a pair
        if arm == "hf_assisted":
            torch.manual_seed(call_seed)  # HF samples from the global generator
            return hf_assisted(target, hf_draft, units[unit], hf_config, hook)
        gen = torch.Generator(device=target.device).manual_seed(call_seed)
        draft_model = None if arm == "target_only" else fast_draft
        return generate(
            fast_target, draft_model, units[unit], generator=gen, tree=tree if arm == "tree" else None, **ours
        ).stats

    try:
        with nullcontext() if no_hf or lookup else fair_assistant(hf_draft, num_draft_tokens):
            # speculative arms first: they size the target's static cache, which target-only then reuses as is
            for arm in [a for a in arms if a != "target_only"] + ["target_only"]:
                for _ in range(warmup):  # compile kernels, capture CUDA graphs, fill allocator caches
                    run(longest_unit(units), arm, 0)
            for shape in [None, *([tree] if tree is not None else [])]:  # every graph a shrinking batch replays
                capture_graphs(fast_target, fast_draft, batch_size=batch_size, gamma=num_draft_tokens, tree=shape)
            runs = paired_runs(run, units=len(units), arms=arms, repeats=repeats)
    finally:
        hook.handle.remove()
    return _bench_result(runs, num_draft_tokens, tree, no_hf) | {
        "machine": machine_block(fast_target, fast_draft, pooled(runs["target_only"]).phases),
        "settings": {
            "num_draft_tokens": num_draft_tokens,
            "draft_rule": draft_rule,
            "temperature": temperature,
            "max_new_tokens": max_new_tokens,
            "batch_size": batch_size,
            "num_prompts": sum(len(u) for u in units),
            "units": len(units),
            "repeats": repeats,
            "seed": seed,
            "stop_token_ids": list(stop),
            "backend": backend_name(fast_target),
            "compact_model": fast_target is not target,
            "draft_kind": kind,
            "tree": tree,
        },
    }


def _arm(stats: GenerationStats) -> dict:
    agg = stats.aggregate()
    return {k: agg[k] for k in ("tokens_per_s", "wall_s", "new_tokens", "ttft_s", "tpot_s")} | {
        "phases": stats.phases.to_dict()
    }


HF_SKIPPED = {
    "eagle3": "transformers' assisted generation has no EAGLE-3 path (an EAGLE-3 head reads the target's hidden "
    "states and has no embeddings of its own); it is served by vLLM, SGLang, TensorRT-LLM and this runtime",
    "suffix": "transformers has no suffix decoding; it is served by vLLM (`method: suffix`) and this runtime",
}
HF_SKIPPED_EAGLE3 = HF_SKIPPED["eagle3"]


def draft_kind(draft) -> str:
    """standalone, eagle3, ngram or suffix: the bench JSON's `settings.draft_kind`."""
    if isinstance(draft, NgramDraft | SuffixDraft):
        return draft.kind
    return "eagle3" if isinstance(draft, Eagle3Draft) else "standalone"


def _hf_block(runs: dict, skipped: str | None) -> tuple[dict, dict]:
    """The `hf_assisted` block and the paired speedup against it; `{"skipped": why}` when the arm did not run."""
    if "hf_assisted" not in runs:
        return {"skipped": skipped}, {"speedup": None, "speedup_ci": None}
    hf_runs = [c for unit in runs["hf_assisted"] for c in unit]
    widths = [w for c in hf_runs for w in c.widths]
    hf_wall, hf_tokens = sum(c.wall_s for c in hf_runs), sum(c.new_tokens for c in hf_runs)
    block = {
        "tokens_per_s": hf_tokens / hf_wall if hf_wall else None,
        "wall_s": hf_wall,
        "new_tokens": hf_tokens,
        # the median: the last step of a sequence drafts fewer when max_new_tokens cuts it short
        "draft_tokens_per_step": statistics.median(widths) if widths else None,
        "draft_tokens_per_step_mean": statistics.fmean(widths) if widths else None,
        "verify_steps": len(widths),
    }
    return block, paired_speedup(runs["hf_assisted"], runs["speculative"], _wall_s_per_token)


def _bench_result(runs: dict, gamma: int, tree: str | None, skipped: str | None = None) -> dict:
    hf, vs_hf = _hf_block(runs, skipped)
    result = {
        "target_only": _arm(pooled(runs["target_only"])),
        "speculative": _arm(pooled(runs["speculative"])),
        "hf_assisted": hf,
        **paired_metrics(runs["target_only"], runs["speculative"], gamma),
        "speedup_vs_hf_assisted": vs_hf["speedup"],
        "speedup_vs_hf_assisted_ci": vs_hf["speedup_ci"],
    }
    if tree is not None:
        metrics = paired_metrics(runs["target_only"], runs["tree"], gamma)
        vs_chain = paired_speedup(runs["speculative"], runs["tree"], decode_s_per_token)
        result["tree"] = {"tree": tree, **_arm(pooled(runs["tree"])), **metrics} | {
            "speedup_vs_chain": vs_chain["speedup"],
            "speedup_vs_chain_ci": vs_chain["speedup_ci"],
        }
    return result


def _ci(ci) -> str:
    return f"[{ci[0]:.3f}, {ci[1]:.3f}]" if ci else "-"


def format_bench_table(result: dict) -> str:
    """Human-readable summary of a `run_bench` result."""
    lines = [f"{'mode':<13}{'tokens/s':>11}{'wall_s':>10}{'new_tokens':>12}"]
    for mode in ("target_only", "speculative", "hf_assisted"):
        row = result[mode]
        if "skipped" in row:
            lines.append(f"{mode:<13}skipped: {row['skipped']}")
            continue
        lines.append(f"{mode:<13}{row['tokens_per_s'] or 0:>11.1f}{row['wall_s']:>10.3f}{row['new_tokens']:>12d}")
    names = (
        "acceptance_rate",
        "mean_accepted_length",
        "cost_ratio",
        "verify_cost_ratio",
        "analytic_speedup",
        "predicted_speedup",
        "speedup",
        "efficiency",
        "overhead_fraction",
        "speedup_vs_hf_assisted",
    )
    width = max(len(name) for name in names)
    for name in names:
        value = "-" if result[name] is None else f"{result[name]:.3f}"
        ci = result.get(f"{name}_ci") if name != "speedup" else result["speedup_ci"]
        lines.append(f"{name:<{width}}  {value}" + (f"  95% CI {_ci(ci)}" if ci else ""))
    hf = result["hf_assisted"]
    if "skipped" not in hf:
        median = f"{hf['draft_tokens_per_step']} (median over {hf['verify_steps']})"
        lines.append(f"{'hf draft tokens/step':<{width}}  {median}")
    if "tree" in result:
        row = result["tree"]
        lines.append(f"tree {row['tree']}: {row['tokens_per_s']:.1f} tokens/s, {row['wall_s']:.3f} s")
        for name in ("mean_accepted_length", "nodes_per_step", "verify_cost_ratio", "speedup", "speedup_vs_chain"):
            value = "-" if row[name] is None else f"{row[name]:.3f}"
            ci = row.get(f"{name}_ci")
            lines.append(f"  {name:<{width}}{value}" + (f"  95% CI {_ci(ci)}" if ci else ""))
    machine = result.get("machine") or {}
    if machine.get("decode_step_over_floor"):
        lines.append(
            f"machine: {machine['cpu']}, {machine['torch_threads']} threads, {machine['bandwidth_gb_s']:.1f} GB/s; "
            f"decode step {1e3 * machine['decode_step_s']:.2f} ms = {machine['decode_step_over_floor']:.2f}x the "
            f"weight-streaming floor ({1e3 * machine['decode_floor_s']:.2f} ms)"
        )
    return "\n".join(lines)
