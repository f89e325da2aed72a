"""Paired, repeated A/B timing of decoding modes on the same prompts, and the statistics a deployment decision needs.

Every unit (one batch of prompts at one concurrency) runs every arm (target-only, speculative, ...) `repeats` times;
the arm order alternates from one (unit, repeat) to the next (A B, then B A: ABBA), so drift in clock speed or
cache warmth hits both arms alike. Per unit, each arm's decode seconds per token are pooled over the repeats; the
unit's ratio is target-only over speculative, `speedup` is the median of the units' ratios and `speedup_ci` its
95 % percentile-bootstrap interval over units (fixed seed). Costs come from the runs' own in-run phases
(`GenerationStats.phases`), never from a side micro-benchmark. Used by `specdec_runtime.bench` and `eval/sweep.py`.

    runs = paired_runs(lambda unit, arm, repeat: generate(...).stats, units=4, arms=("target_only", "speculative"),
                       repeats=3)
    paired_speedup(runs["target_only"], runs["speculative"])      # {"speedup": 1.7, "speedup_ci": [1.5, 1.9]}
    cost_model(merge_stats(...target-only...), merge_stats(...speculative...))
"""

import os
import resource
import statistics
import threading
from collections.abc import Callable, Sequence

import torch

from .eagle3 import Eagle3Draft
from .llama import Llama
from .lookup import NgramDraft, SuffixDraft
from .metrics import GenerationStats, analytic_speedup, cost_ratios, merge_stats
from .tree import DynamicTreeShape, Tree, parse_tree, tree_size

Runs = list[list]
"""Per unit, per repeat: what one timed call returned (`GenerationStats` for our engine)."""
SecondsPerToken = Callable[[Sequence], float | None]
"""A unit's repeats -> seconds per token pooled over them (None: no token to divide by)."""

BOOTSTRAP_SAMPLES = 2000
BOOTSTRAP_SEED = 0


# ---------------------------------------------------------------------------------------------------- the schedule


def abba_order(arms: Sequence[str], unit: int, repeat: int) -> list[str]:
    """The order the arms run in for one (unit, repeat): as given, or reversed, alternating (A B | B A | A B ...)."""
    return list(arms) if (unit + repeat) % 2 == 0 else list(reversed(arms))


def paired_runs(
    run: Callable[[int, str, int], object], *, units: int, arms: Sequence[str], repeats: int
) -> dict[str, Runs]:
    """Run every arm on every unit `repeats` times in ABBA order -> {arm: per unit, per repeat stats}.

    run(unit, arm, repeat) does one timed generate call; it seeds its generator from (unit, repeat), so every arm of
    a pair samples with the same seed.
    """
    out: dict[str, Runs] = {arm: [[] for _ in range(units)] for arm in arms}
    for repeat in range(repeats):
        for unit in range(units):
            for arm in abba_order(arms, unit, repeat):
                out[arm][unit].append(run(unit, arm, repeat))
    return out


def pooled(runs: Runs) -> GenerationStats:
    """Every call of every unit and repeat as one set of stats (counters summed, requests concatenated)."""
    return merge_stats([stats for unit in runs for stats in unit])


class ArmPeaks:
    """`run` of `paired_runs`, with the peak memory of each arm over its timed calls (`PeakMemory` around every
    call): `bytes[arm]`, so target-only and speculative decoding each get their own peak.

        peaks = ArmPeaks(run, device)
        runs = paired_runs(peaks, units=..., arms=..., repeats=...)
        peaks.bytes  # {"target_only": ..., "speculative": ...}

    Both arms run in one process, so each peak includes whatever stays resident there (both models' weights,
    static caches and CUDA graph pools); the difference is what the arm itself allocates while it runs.
    """

    def __init__(self, run: Callable[[int, str, int], object], device: torch.device | str):
        self.run, self.device = run, torch.device(device)
        self.bytes: dict[str, int] = {}

    def __call__(self, unit: int, arm: str, repeat: int):
        with PeakMemory(self.device) as peak:
            out = self.run(unit, arm, repeat)
        self.bytes[arm] = max(self.bytes.get(arm, 0), peak.bytes)
        return out


# ------------------------------------------------------------------------------------------- warm-up: CUDA graphs


def graph_widths(gamma: int, tree: str | Tree | DynamicTreeShape | None = None) -> tuple[set[int], set[int]]:
    """Tokens per forward of every fixed-shape step a speculative arm (a chain of gamma, or `tree`) and the
    target-only arm can run -> (target widths, draft widths), the widths `Llama.step` keys its CUDA graphs by.

    Both models: 1 and 2 (a target-only step is 1 wide; the draft feeds 1 pending token, or 2 after a step that
    accepted every draft; a prompt of at most 2 tokens prefills through the same step). The target verifies gamma + 1
    tokens for a chain, nodes + 1 for a tree; the draft forwards every static tree level but the deepest, and top_k
    nodes per dynamic level but the deepest.
    """
    target, draft = {1, 2}, {1, 2}
    if tree is None:
        return target | {gamma + 1}, draft
    shape = parse_tree(tree) if isinstance(tree, str) else tree
    target.add(tree_size(shape)[1] + 1)
    if isinstance(shape, DynamicTreeShape):
        return target, draft | ({shape.top_k} if shape.depth > 1 else set())
    return target, draft | set(shape.level_sizes[:-1])


def capture_graphs(target, draft, *, batch_size: int, gamma: int, tree: str | Tree | DynamicTreeShape | None = None):
    """After the warm-up calls (which set up the static caches): capture every CUDA graph a timed call of up to
    batch_size rows can replay, for every width of `graph_widths` and every power-of-two row count a shrinking
    batch passes through, so no timed call captures one. Any width the warm-up already captured is filled in too.
    Compact models on CUDA have graphs, and on the CPU those with compiled steps (`cpu.compile_steps`: compiled here
    instead); an EAGLE-3 head on CUDA has one graph, its drafting step, per row count (`eagle3_state.HeadCache`);
    anything else (the eager CPU fast path, HF models) is left as is."""
    target_widths, draft_widths = graph_widths(gamma, tree)
    if isinstance(draft, NgramDraft | SuffixDraft):  # a lookup verifies its batch's longest proposal: 0..gamma drafts
        target_widths = set(range(1, gamma + 2))
    for model, widths in ((target, target_widths), (draft, draft_widths)):
        if isinstance(model, Llama):
            model.capture_graphs(widths | set(model.graphs), batch_size)
    if isinstance(draft, Eagle3Draft) and draft.head_cache is not None:
        draft.head_cache.capture_graphs(batch_size)


# ---------------------------------------------------------------------------------------------- per-token speed


def decode_tokens(stats: GenerationStats) -> int:
    """Tokens emitted after each request's first one: the tokens the decode phase produced (TPOT's tokens)."""
    return sum(max(r.new_tokens - 1, 0) for r in stats.requests)


def decode_s_per_token(calls: Sequence[GenerationStats]) -> float | None:
    """Decode seconds (prefill excluded) per token after the first, pooled over calls; None without such tokens."""
    tokens = sum(decode_tokens(stats) for stats in calls)
    return sum(stats.phases.decode_s for stats in calls) / tokens if tokens else None


def unit_ratios(
    base: Runs, spec: Runs, base_cost: SecondsPerToken = decode_s_per_token, spec_cost: SecondsPerToken | None = None
) -> list[float]:
    """Per unit: base seconds per token / spec seconds per token, each pooled over the unit's repeats."""
    spec_cost = spec_cost or base_cost
    ratios = []
    for base_unit, spec_unit in zip(base, spec, strict=True):
        b, s = base_cost(base_unit), spec_cost(spec_unit)
        if b is not None and s:
            ratios.append(b / s)
    return ratios


# -------------------------------------------------------------------------------------------------- statistics


def median(values: Sequence[float]) -> float:
    return float(statistics.median(values))


def bootstrap_ci(
    values: Sequence[float], *, level: float = 0.95, samples: int = BOOTSTRAP_SAMPLES, seed: int = BOOTSTRAP_SEED
) -> list[float]:
    """Percentile-bootstrap interval of the median of `values` (resampled with replacement, fixed seed) -> [lo, hi].

    With one value the interval is that value: one unit says nothing about spread, which the caller must know
    (see `paired_speedup`'s `units`).
    """
    x = torch.tensor(list(values), dtype=torch.float64)  # (N,)
    gen = torch.Generator().manual_seed(seed)
    resampled = x[torch.randint(len(x), (samples, len(x)), generator=gen)].sort(dim=1).values  # (S, N)
    N = len(x)
    medians = resampled[:, (N - 1) // 2 : N // 2 + 1].mean(dim=1)  # (S,) the middle one or two, as statistics.median
    tail = (1 - level) / 2
    lo, hi = torch.quantile(medians, torch.tensor([tail, 1 - tail], dtype=torch.float64)).tolist()
    return [lo, hi]


def paired_speedup(
    base: Runs, spec: Runs, base_cost: SecondsPerToken = decode_s_per_token, spec_cost: SecondsPerToken | None = None
) -> dict:
    """{"speedup": median of the units' paired ratios, "speedup_ci": its 95 % bootstrap interval, "units": N}."""
    ratios = unit_ratios(base, spec, base_cost, spec_cost)
    if not ratios:
        return {"speedup": None, "speedup_ci": None, "units": 0}
    return {"speedup": median(ratios), "speedup_ci": bootstrap_ci(ratios), "units": len(ratios)}


# -------------------------------------------------------------------------------------------- in-run cost model


def cost_model(base: GenerationStats, spec: GenerationStats) -> dict:
    """`metrics.cost_ratios` of a speculative run against the target-only run on the same units (DESIGN.md names).

    Both runs' decode tokens per step are measured, not assumed: at batch size B target-only decoding emits up to B
    tokens per step, and rows that finish early emit none, so the speculative run's tokens per step are taken
    relative to the target-only run's. The draft forwards per step are counted too (gamma for a chain, the depth for
    a tree).
    """
    bp, sp = base.phases, spec.phases
    if not bp.verify_forwards or not sp.verify_forwards or not decode_tokens(base):
        return dict.fromkeys(("cost_ratio", "verify_cost_ratio", "predicted_speedup", "overhead_fraction"))
    relative_tokens_per_step = (decode_tokens(spec) / sp.verify_forwards) / (decode_tokens(base) / bp.verify_forwards)
    return cost_ratios(sp, bp, sp.draft_forwards / sp.verify_forwards, relative_tokens_per_step)


def efficiency(speedup: float | None, predicted: float | None) -> float | None:
    return speedup / predicted if speedup and predicted else None


def paired_metrics(base_runs: Runs, spec_runs: Runs, gamma: int) -> dict:
    """A speculative arm against target-only on the same units: acceptance (pooled over every call), in-run costs,
    the paired speedup with its interval, efficiency (DESIGN.md names)."""
    base, spec = pooled(base_runs), pooled(spec_runs)
    agg = spec.aggregate()
    costs = cost_model(base, spec)
    paired = paired_speedup(base_runs, spec_runs)
    alpha, c = agg["acceptance_rate"], costs["cost_ratio"]
    return {
        "acceptance_rate": alpha,
        "mean_accepted_length": agg["mean_accepted_length"],
        "nodes_per_step": agg["nodes_per_step"],
        "per_position_acceptance": agg["per_position_acceptance"],
        **costs,
        "analytic_speedup": analytic_speedup(alpha, gamma, c) if alpha is not None and c is not None else None,
        **paired,
        "efficiency": efficiency(paired["speedup"], costs["predicted_speedup"]),
    }


# ------------------------------------------------------------------------------------------------- peak memory


def _rss_bytes() -> int | None:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


class PeakMemory:
    """Peak memory while the block runs: CUDA's peak-allocated counter (reset on entry), else the process RSS
    sampled every `interval_s` by a background thread (ru_maxrss is the process-lifetime peak, so a later setting
    would inherit an earlier one's).

        with PeakMemory(device) as peak:
            run()
        peak.bytes
    """

    def __init__(self, device: torch.device | str, interval_s: float = 0.005):
        self.device, self.interval_s, self.bytes = torch.device(device), interval_s, 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> "PeakMemory":
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        elif _rss_bytes() is not None:
            self.bytes = _rss_bytes() or 0
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.bytes = max(self.bytes, _rss_bytes() or 0)

    def __exit__(self, *exc) -> None:
        if self.device.type == "cuda":
            self.bytes = int(torch.cuda.max_memory_allocated(self.device))
        elif self._thread is not None:
            self._stop.set()
            self._thread.join()
            self.bytes = max(self.bytes, _rss_bytes() or 0)
        else:  # no /proc: the lifetime peak is all there is (Linux reports KiB)
            self.bytes = int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024
