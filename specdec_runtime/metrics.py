"""Speculative decoding metrics, named as in DESIGN.md: counters per request, aggregates, cost ratios, speedup models.

`expected_acceptance` is the offline estimate the distillation trainer logs; it warps logits with the runtime's own
`warp_logits`, so the estimate and the measured `acceptance_rate` describe the same distributions.
"""

import statistics
import time
from dataclasses import dataclass

import torch

from .kv import make_state
from .sampling import DraftRule, SamplingParams, warp_logits


def _ratio(num: float, den: float) -> float | None:
    return num / den if den else None


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
    """Seconds from the call's start to this request's first token."""
    wall_s: float
    """Seconds from the call's start to this request's last token."""

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
        }


def merge_stats(parts: list[GenerationStats]) -> GenerationStats:
    """Stats of several generate calls run one after another (e.g. the batches of a benchmark)."""
    return GenerationStats(
        requests=[r for part in parts for r in part.requests],
        wall_s=sum(part.wall_s for part in parts),
        target_forwards=sum(part.target_forwards for part in parts),
        draft_forwards=sum(part.draft_forwards for part in parts),
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


def _median_step_s(step, warmup: int, iters: int, cuda: bool) -> float:
    times = []
    for i in range(warmup + iters):
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        step()
        if cuda:
            torch.cuda.synchronize()
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure_cost_ratios(
    target: torch.nn.Module,
    draft: torch.nn.Module,
    *,
    num_draft_tokens: int = 4,
    batch_size: int = 1,
    context_len: int = 64,
    warmup: int = 3,
    iters: int = 10,
    seed: int = 0,
) -> tuple[float, float]:
    """Time the runtime's own steps on random tokens -> (cost_ratio c, verify_cost_ratio v).

    c = one draft decode step / one target decode step (1 token each); v = one target verify step over gamma + 1
    tokens / one target decode step. Each step is a forward plus its cache rollback, exactly as the engine runs it.
    """
    gen = torch.Generator().manual_seed(seed)
    prompt = torch.randint(target.config.vocab_size, (batch_size, context_len + num_draft_tokens + 1), generator=gen)
    prompt = prompt.to(target.device)
    cuda = target.device.type == "cuda"
    full = torch.full((batch_size,), context_len, device=target.device)

    def timed(model, width: int) -> float:
        state = make_state(model, batch_size, context_len + num_draft_tokens + 1)
        with torch.no_grad():
            state.extend(prompt[:, :context_len], full, last_only=True)
            tokens, counts = prompt[:, context_len : context_len + width], torch.full_like(full, width)
            return _median_step_s(lambda: (state.extend(tokens, counts), state.rollback(counts)), warmup, iters, cuda)

    target_step = timed(target, 1)
    return timed(draft, 1) / target_step, timed(target, num_draft_tokens + 1) / target_step
