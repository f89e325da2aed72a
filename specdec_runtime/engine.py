"""Batched speculative decoding (Leviathan et al. 2023; Chen et al. 2023) and target-only decoding in one loop.

Each step: the draft proposes gamma tokens per row from its own cache, the target scores all of them in one forward,
each row keeps its longest accepted prefix plus one correction (or bonus) token, and both caches roll back to the
accepted length. With draft=None the same loop runs with gamma = 0 (plain sampling from the target), so A/B runs
share every other cost. Temperature 0 output equals target-only greedy decoding token for token; at temperature > 0
the output is distributed exactly as target-only sampling with the same warping.

    from specdec_runtime.engine import SamplingParams, generate
    result = generate(target, draft, [[1, 2, 3], [4, 5]], num_draft_tokens=4, sampling=SamplingParams(0.7),
                      max_new_tokens=64, stop_token_ids=[2], generator=torch.Generator().manual_seed(0))
    result.tokens, result.stats.aggregate()
"""

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .kv import make_state
from .llama import Llama
from .metrics import GenerationStats, RequestStats
from .sampling import DraftRule, SamplingParams, sample, verify, warp_logits

__all__ = ["GenerationResult", "SamplingParams", "generate", "validate_request"]


@dataclass
class GenerationResult:
    """New tokens per prompt and the run's metrics."""

    tokens: list[list[int]]
    """New tokens of each prompt (stop token included, at most max_new_tokens), in prompt order."""
    stats: GenerationStats
    """Per-request counters and timings; `stats.aggregate()` gives the DESIGN.md metrics."""


def validate_request(
    target: torch.nn.Module,
    draft: torch.nn.Module | None,
    prompts: Sequence[Sequence[int]],
    num_draft_tokens: int,
    draft_rule: str,
    max_new_tokens: int,
) -> None:
    """Raise one clear ValueError (problem and fix) for a request the engine cannot run."""
    if num_draft_tokens < 1:
        raise ValueError(f"num_draft_tokens must be >= 1 (got {num_draft_tokens}); pass draft=None for target-only")
    if draft_rule not in ("sample", "greedy"):
        raise ValueError(f"draft_rule must be 'greedy' (vLLM's default) or 'sample' (got {draft_rule!r})")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1 (got {max_new_tokens}); ask for at least one new token")
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token (got an empty prompt or no prompts); drop empty ones")
    if draft is not None and draft.config.vocab_size != target.config.vocab_size:
        raise ValueError(
            f"target and draft logits differ in width ({target.config.vocab_size} vs {draft.config.vocab_size}); "
            "speculative decoding needs a draft that shares the target's vocabulary"
        )
    if draft is target and isinstance(target, Llama):
        raise ValueError(
            "target and draft are one compact Llama object, and its static cache cannot hold both; "
            "build the draft with its own Llama.from_hf(...) call"
        )
    gamma = num_draft_tokens if draft is not None else 0
    models = (target,) if draft is None else (target, draft)
    window = min(m.config.max_position_embeddings for m in models)
    longest = max(len(p) for p in prompts)
    if longest + max_new_tokens + gamma > window:
        raise ValueError(
            f"a prompt of {longest} tokens + max_new_tokens={max_new_tokens} + num_draft_tokens={gamma} exceeds the "
            f"context window of {window} positions; shorten the prompt or lower max_new_tokens"
        )


def _left_pad(rows: list[list[int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Ragged token lists -> left-padded (B, T) tokens and (B,) real counts."""
    width = max(len(r) for r in rows)
    tokens = torch.tensor([[0] * (width - len(r)) + list(r) for r in rows], dtype=torch.long, device=device)
    return tokens, torch.tensor([len(r) for r in rows], device=device)


def _propose(state, pending, counts, active, gamma: int, sampling: SamplingParams, rule: DraftRule, generator):
    """Draft gamma tokens per row after feeding its pending tokens -> x (B, G) and proposal probs q (B, G, V)."""
    logits = state.extend(pending, counts, last_only=True)[:, -1]  # (B, V)
    xs, qs = [], []
    for k in range(gamma):
        if rule == "greedy":  # argmax q, and q treated as one-hot (vLLM's default draft rule)
            x = logits.argmax(-1)
            q = F.one_hot(x, logits.shape[-1]).float()
        else:
            q = warp_logits(logits, sampling)
            x = sample(q, generator, sampling.greedy)
        xs.append(x)
        qs.append(q)
        if k + 1 < gamma:
            logits = state.extend(x[:, None], active, last_only=True)[:, -1]
    return torch.stack(xs, 1), torch.stack(qs, 1)


def _emit(x, n, nxt, stop_ids, room):
    """Row tokens of this step (accepted drafts, then the correction/bonus token), cut after a stop token and at room.

    Returns tokens (B, G+1), counts (B,) to keep, and (B,) whether a stop token was kept.
    """
    G = x.shape[1]
    tokens = torch.cat([x, nxt[:, None]], 1).scatter(1, n[:, None], nxt[:, None])  # (B, G+1)
    idx = torch.arange(G + 1, device=x.device)
    is_stop = torch.isin(tokens, stop_ids) & (idx <= n[:, None])
    upto_stop = torch.where(is_stop.any(1), is_stop.long().argmax(1) + 1, G + 2)
    count = torch.minimum(torch.minimum(n + 1, room), upto_stop)
    return tokens, count, upto_stop <= count


@dataclass
class _Tally:
    """Per-row counters, on device until the end of the call."""

    steps: torch.Tensor  # (B,) verify steps taken while active
    accepted: torch.Tensor  # (B,) accepted draft tokens
    reached: torch.Tensor  # (B, G) steps in which draft position i was judged
    hits: torch.Tensor  # (B, G) steps in which draft position i was accepted

    @classmethod
    def zeros(cls, B: int, G: int, device: torch.device) -> "_Tally":
        return cls(*(torch.zeros(shape, dtype=torch.long, device=device) for shape in ((B,), (B,), (B, G), (B, G))))

    def add(self, n: torch.Tensor, act: torch.Tensor) -> None:
        idx = torch.arange(self.reached.shape[1], device=n.device)
        self.steps, self.accepted = self.steps + act, self.accepted + n * act
        self.reached = self.reached + (idx <= n[:, None]) * act[:, None]
        self.hits = self.hits + (idx < n[:, None]) * act[:, None]


def _step(models: dict, pending, d_pending, d_counts, act, G: int, sampling, rule: DraftRule, generator):
    """One draft-then-verify step; both caches end at each row's accepted length -> x (B, G), n (B,), next (B,)."""
    B, dev = pending.shape[0], pending.device
    x = torch.zeros(B, 0, dtype=torch.long, device=dev)
    q = torch.zeros(B, 0, models["target"].model.config.vocab_size, device=dev)
    if G:
        x, q = _propose(models["draft"], d_pending, d_counts * act, act, G, sampling, rule, generator)
    p = warp_logits(models["target"].extend(torch.cat([pending[:, None], x], 1), act * (G + 1)), sampling)
    n, nxt = verify(p, q, x, generator, sampling.greedy)  # (B,), (B,)
    models["target"].rollback((G - n) * act)  # keep pending + the n accepted drafts
    if G:  # the draft cached its pending tokens + x_1..x_{G-1}; keep those and the accepted drafts
        models["draft"].rollback((G - 1 - n.clamp(max=G - 1)) * act)
    return x, n, nxt


def generate(
    target: torch.nn.Module,
    draft: torch.nn.Module | None,
    prompts: Sequence[Sequence[int]],
    *,
    num_draft_tokens: int = 4,
    draft_rule: DraftRule = "greedy",
    sampling: SamplingParams = SamplingParams(),  # noqa: B008 (frozen dataclass, safe as a default)
    max_new_tokens: int = 128,
    stop_token_ids: Sequence[int] = (),
    generator: torch.Generator | None = None,
) -> GenerationResult:
    """Speculative decoding of a ragged batch (draft=None: target-only decoding through the same loop)."""
    validate_request(target, draft, prompts, num_draft_tokens, draft_rule, max_new_tokens)
    B, G, dev = len(prompts), (num_draft_tokens if draft is not None else 0), target.device
    with torch.no_grad():
        start = time.perf_counter()
        max_len = max(len(p) for p in prompts) + max_new_tokens + G
        models = {"target": make_state(target, B, max_len)}
        if draft is not None:
            models["draft"] = make_state(draft, B, max_len)
        context, context_counts = _left_pad([list(p[:-1]) for p in prompts], dev)
        if context.shape[1]:  # prefill all but the last prompt token, which each model sees as pending
            for state in models.values():
                state.extend(context, context_counts, last_only=True)

        pending = torch.tensor([p[-1] for p in prompts], device=dev)  # (B,) last token, not yet in the target cache
        d_pending = torch.stack([pending, pending], 1)  # (B, 2) right-aligned tokens not yet in the draft cache
        d_counts = torch.ones(B, dtype=torch.long, device=dev)  # (B,) real tokens in d_pending
        stop_ids = torch.tensor(list(stop_token_ids), dtype=torch.long, device=dev)
        out = torch.zeros(B, max_new_tokens + G + 1, dtype=torch.long, device=dev)
        n_out = torch.zeros(B, dtype=torch.long, device=dev)
        active = torch.ones(B, dtype=torch.bool, device=dev)
        tally = _Tally.zeros(B, G, dev)
        first_s, done_s, alive, width = None, [0.0] * B, [True] * B, 1
        while any(alive):
            act = active.long()
            x, n, nxt = _step(models, pending, d_pending[:, -width:], d_counts, act, G, sampling, draft_rule, generator)
            if G:  # all accepted: the draft has not seen x_G yet, so it gets x_G and the bonus token next time
                full = n == G
                next_pending = torch.where(full[:, None], torch.stack([x[:, -1], nxt], 1), nxt[:, None].expand(B, 2))
                d_pending = torch.where(active[:, None], next_pending, d_pending)
                d_counts = torch.where(active, 1 + full.long(), d_counts)
            pending = torch.where(active, nxt, pending)

            tokens, count, stopped = _emit(x, n, nxt, stop_ids, max_new_tokens - n_out)
            out.scatter_(1, n_out[:, None] + torch.arange(G + 1, device=dev), tokens)  # past count: overwritten later
            n_out = n_out + count * act
            tally.add(n, act)
            active = active & ~stopped & (n_out < max_new_tokens)

            flags = torch.cat([active, (d_counts == 2).any()[None]]).tolist()  # the step's one host sync
            now = time.perf_counter() - start
            first_s = now if first_s is None else first_s
            done_s = [now if was and not still else t for was, still, t in zip(alive, flags, done_s)]
            alive, width = flags[:B], 2 if flags[B] else 1
        wall_s = time.perf_counter() - start

    lengths = n_out.tolist()
    prefilled = (context_counts > 0).long().tolist()
    stats = _stats(tally, lengths, prefilled, G, draft is not None, first_s, done_s, wall_s)
    return GenerationResult(tokens=[row[:k] for row, k in zip(out.tolist(), lengths)], stats=stats)


def _stats(tally: _Tally, lengths, prefilled, G: int, has_draft: bool, first_s, done_s, wall_s) -> GenerationStats:
    """Device counters -> per-request stats; batched forward counts follow from the longest-running row."""
    columns = zip(tally.steps.tolist(), tally.accepted.tolist(), tally.reached.tolist(), tally.hits.tolist())
    requests = [
        RequestStats(
            new_tokens=length,
            verify_steps=s,
            drafted=s * G,
            accepted=a,
            position_reached=r,
            position_accepted=h,
            target_forwards=s + pre,
            draft_forwards=(s * G + pre) * has_draft,
            ttft_s=first_s,
            wall_s=done,
        )
        for (s, a, r, h), length, pre, done in zip(columns, lengths, prefilled, done_s)
    ]
    steps, prefill = max(r.verify_steps for r in requests), int(any(prefilled))
    return GenerationStats(
        requests=requests,
        wall_s=wall_s,
        target_forwards=steps + prefill,
        draft_forwards=(steps * G + prefill) * has_draft,
    )
