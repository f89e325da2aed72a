"""Speculative decoding metrics, named as in DESIGN.md: counters per request, in-run phases, aggregates, cost ratios,
speedup models.

`expected_acceptance` is the offline estimate the distillation trainer logs; it warps logits with the runtime's own
`warp_logits`, so the estimate and the measured `acceptance_rate` describe the same distributions.
"""

import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, fields

import torch

from .sampling import DraftRule, SamplingParams, warp_logits


def _ratio(num: float, den: float) -> float | None:
    return num / den if den else None


@dataclass
class Phases:
    """Where a generate call's time went, timed inside its own loop (target-only and speculative runs alike)."""

    prefill_s: float = 0.0
    """Prefill forwards of the target (and draft), the first token included: it comes from the target's prefill."""
    draft_s: float = 0.0
    """Draft forwards during decoding."""
    verify_s: float = 0.0
    """Target forwards during decoding: verify steps, or target-only decoding's decode steps."""
    other_s: float = 0.0
    """The rest of the decode loop: sampling, accept/reject, cache rollback and compaction, bookkeeping, host syncs."""
    draft_forwards: int = 0
    """Batched draft forward calls during decoding."""
    verify_forwards: int = 0
    """Batched target forward calls during decoding (= decode steps of the longest-running row)."""

    @property
    def decode_s(self) -> float:
        return self.draft_s + self.verify_s + self.other_s

    def __add__(self, other: "Phases") -> "Phases":
        return Phases(*(getattr(self, f.name) + getattr(other, f.name) for f in fields(self)))

    def to_dict(self) -> dict:
        """The phases under their JSON names, decode_s included."""
        return {**asdict(self), "decode_s": self.decode_s}


class PhaseTimer:
    """Spans of a generate call's phases -> `Phases`.

    clock: called at phase boundaries only (an injected clock makes the phases exact in tests). Without one, CPU runs
    read perf_counter and CUDA runs record event pairs on the current stream, resolved once in `phases()`: a
    synchronize per forward would serialise the host and the GPU and time the sync instead of the loop.
    """

    def __init__(self, clock: Callable[[], float] | None, device: torch.device):
        self.events = clock is None and device.type == "cuda"
        self.clock = clock or time.perf_counter
        self.spans: dict[str, list[tuple]] = {"prefill": [], "draft": [], "verify": [], "decode": []}

    def _stamp(self):
        if not self.events:
            return self.clock()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    @contextmanager
    def span(self, phase: str) -> Iterator[None]:
        start = self._stamp()
        yield
        self.spans[phase].append((start, self._stamp()))

    def _seconds(self, phase: str) -> float:
        if self.events:
            return sum((a.elapsed_time(b) for a, b in self.spans[phase]), 0.0) / 1000  # ms -> s
        return sum((b - a for a, b in self.spans[phase]), 0.0)

    def phases(self) -> Phases:
        if self.events:
            torch.cuda.synchronize()
        draft, verify = self._seconds("draft"), self._seconds("verify")
        return Phases(
            prefill_s=self._seconds("prefill"),
            draft_s=draft,
            verify_s=verify,
            other_s=self._seconds("decode") - draft - verify,
            draft_forwards=len(self.spans["draft"]),
            verify_forwards=len(self.spans["verify"]),
        )


@dataclass
class RequestStats:
    """Counters and timings of one request (one prompt) in a generate call."""

    new_tokens: int
    """Tokens emitted, stop token included."""
    verify_steps: int
    """Target verify steps the request took part in (each emits accepted drafts + 1 correction/bonus token)."""
    drafted: int
    """Draft tokens proposed for this request (gamma per verify step, or the tree's nodes)."""
    accepted: int
    """Draft tokens the target accepted."""
    position_reached: list[int]
    """Per draft position i: steps in which draft tokens 0..i-1 were all accepted, so token i was judged."""
    position_accepted: list[int]
    """Per draft position i: steps in which draft token i was accepted."""
    target_forwards: int
    """Target forward passes this request took part in (prefill included)."""
    draft_forwards: int
    """Draft forward passes this request took part in (prefill included)."""
    ttft_s: float
    """Seconds from the call's start to this request's first token (the target's prefill, both prefills done)."""
    wall_s: float
    """Seconds from the call's start to this request's last token."""
    decode_s: float = 0.0
    """Seconds of the decode loop while this request was in the batch (0 when its first token was its last)."""

    @property
    def acceptance_rate(self) -> float | None:
        # Over the draft tokens the target ruled on (up to the first rejection): Leviathan et al.'s alpha, the
        # per-token acceptance probability that `expected_acceptance` estimates and `analytic_speedup` takes.
        # Tokens drafted past a rejection were never judged; counting them would make alpha depend on gamma.
        return _ratio(self.accepted, sum(self.position_reached))

    @property
    def mean_accepted_length(self) -> float | None:
        # Counts the verify outcome (accepted + 1), not the cut a stop token or max_new_tokens makes at the end.
        return _ratio(self.accepted + self.verify_steps, self.verify_steps)

    @property
    def nodes_per_step(self) -> float | None:
        # Draft tokens the target verifies per step: gamma for a chain, the node count for a token tree.
        return _ratio(self.drafted, self.verify_steps)

    @property
    def tpot_s(self) -> float | None:
        return _ratio(self.wall_s - self.ttft_s, self.new_tokens - 1)

    def summary(self) -> dict:
        """This request's metrics under the DESIGN.md names."""
        return {
            "acceptance_rate": self.acceptance_rate,
            "mean_accepted_length": self.mean_accepted_length,
            "nodes_per_step": self.nodes_per_step,
            "per_position_acceptance": [_ratio(a, r) for a, r in zip(self.position_accepted, self.position_reached)],
            "target_forwards": self.target_forwards,
            "draft_forwards": self.draft_forwards,
            "ttft_s": self.ttft_s,
            "tpot_s": self.tpot_s,
            "tokens_per_s": _ratio(self.new_tokens, self.wall_s),
            "new_tokens": self.new_tokens,
            "wall_s": self.wall_s,
            "decode_s": self.decode_s,
        }


@dataclass
class GenerationStats:
    """Per-request stats of one or more generate calls, plus the batched forward counts and total wall time."""

    requests: list[RequestStats]
    """One entry per prompt, in prompt order."""
    wall_s: float
    """Wall time of the call(s), prefill included."""
    target_forwards: int
    """Batched target forward calls (a batch of B rows in one call counts once)."""
    draft_forwards: int
    """Batched draft forward calls."""
    phases: Phases = field(default_factory=Phases)
    """Time per phase inside the loop(s), summed over calls."""

    def aggregate(self) -> dict:
        """Metrics over all requests under the DESIGN.md names; ratios are pooled (sums over sums)."""
        req = self.requests
        steps, accepted = sum(r.verify_steps for r in req), sum(r.accepted for r in req)
        reached = [sum(col) for col in zip(*(r.position_reached for r in req))]
        hits = [sum(col) for col in zip(*(r.position_accepted for r in req))]
        new_tokens = sum(r.new_tokens for r in req)
        tpots = [r.tpot_s for r in req if r.tpot_s is not None]
        return {
            "acceptance_rate": _ratio(sum(hits), sum(reached)),
            "mean_accepted_length": _ratio(accepted + steps, steps),
            "nodes_per_step": _ratio(sum(r.drafted for r in req), steps),
            "per_position_acceptance": [_ratio(a, r) for a, r in zip(hits, reached)],
            "target_forwards": self.target_forwards,
            "draft_forwards": self.draft_forwards,
            "ttft_s": statistics.fmean(r.ttft_s for r in req),
            "tpot_s": statistics.fmean(tpots) if tpots else None,
            "tokens_per_s": _ratio(new_tokens, self.wall_s),
            "new_tokens": new_tokens,
            "wall_s": self.wall_s,
            "decode_s": self.phases.decode_s,
        }


def merge_stats(parts: list[GenerationStats]) -> GenerationStats:
    """Stats of several generate calls run one after another (e.g. the batches of a benchmark)."""
    return GenerationStats(
        requests=[r for part in parts for r in part.requests],
        wall_s=sum(part.wall_s for part in parts),
        target_forwards=sum(part.target_forwards for part in parts),
        draft_forwards=sum(part.draft_forwards for part in parts),
        phases=sum((part.phases for part in parts), Phases()),
    )


def expected_acceptance(
    target_logits: torch.Tensor,
    draft_logits: torch.Tensor,
    mask: torch.Tensor,
    sampling: SamplingParams,
    draft_rule: DraftRule = "sample",
) -> torch.Tensor:
    """Mean over valid positions of the per-token acceptance probability -> scalar tensor.

    target_logits, draft_logits: (..., V) on the same positions; mask: (...) bool/0-1 of positions to count.
    `sample`: sum_v min(p_v, q_v) = 1 - TV(p, q); `greedy`: p(argmax q). Both after `warp_logits`.
    """
    p = warp_logits(target_logits, sampling)
    if draft_rule == "greedy":
        per_token = p.gather(-1, draft_logits.argmax(-1, keepdim=True))[..., 0]
    else:
        per_token = torch.minimum(p, warp_logits(draft_logits, sampling)).sum(-1)
    mask = mask.to(per_token.dtype)
    return (per_token * mask).sum() / mask.sum().clamp_min(1)


def analytic_speedup(alpha: float, gamma: int, c: float) -> float:
    """Expected speedup with i.i.d. acceptance alpha, gamma drafts, cost ratio c (Leviathan et al. 2023, eq. 1)."""
    tokens_per_step = gamma + 1 if alpha >= 1 else (1 - alpha ** (gamma + 1)) / (1 - alpha)
    return tokens_per_step / (gamma * c + 1)


def predicted_speedup(tau: float, gamma: int, c: float, v: float) -> float:
    """Speedup the model forwards alone allow: tokens per step over the step's cost in target decode steps."""
    return tau / (gamma * c + v)


def cost_ratios(spec: Phases, target_only: Phases, gamma: int, tokens_per_step: float) -> dict[str, float | None]:
    """In-run cost ratios of a speculative run against the target-only run on the same prompts and batch size.

    The unit is the target-only run's decode step: its decode seconds per step, forward and everything around it.
    c = one draft forward / that step; v = one verify forward / that step; predicted_speedup = tokens_per_step /
    (gamma c + v) = tokens per step x step time / (a step's draft + verify time), with gamma draft forwards per
    verify step as both the chain and the tree (gamma = depth) run them; overhead_fraction = other_s / decode_s of the
    speculative run. So speedup / predicted_speedup = 1 - overhead_fraction when both runs emit tokens_per_step per
    step: the share of the forwards' promise the loop keeps, at most 1. tokens_per_step: decode tokens emitted per
    verify step (mean_accepted_length, or a run's decode tokens over its verify steps).
    """
    step = _ratio(target_only.decode_s, target_only.verify_forwards)  # the target-only decode step, all of it
    draft, verify = _ratio(spec.draft_s, spec.draft_forwards), _ratio(spec.verify_s, spec.verify_forwards)
    if not step or draft is None or verify is None:  # a run without decode steps has no costs to compare
        return dict.fromkeys(("cost_ratio", "verify_cost_ratio", "predicted_speedup", "overhead_fraction"))
    c, v = draft / step, verify / step
    return {
        "cost_ratio": c,
        "verify_cost_ratio": v,
        "predicted_speedup": _ratio(tokens_per_step, gamma * c + v),
        "overhead_fraction": _ratio(spec.other_s, spec.decode_s),
    }
