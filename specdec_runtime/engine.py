"""Batched speculative decoding (Leviathan et al. 2023; Chen et al. 2023) and target-only decoding in one loop.

Prefill feeds every prompt token to both models and samples each row's first token from the target's prefill, as
serving engines do (TTFT pays no draft or verify step). Each step: the draft proposes gamma tokens per row from its
own cache, the target scores all of them in one forward, each row keeps its longest accepted prefix plus one
correction (or bonus) token, and both caches roll back to the accepted length. Finished rows leave the batch at the
step's host sync, so no forward computes a row with nothing left to emit. With draft=None the same loop runs with
gamma = 0 (plain sampling from the target), so A/B runs share every other cost. Temperature 0 output equals
target-only greedy decoding token for token; at temperature > 0 the output is distributed exactly as target-only
sampling with the same warping. The loop times its own phases (`metrics.Phases`: prefill, draft and verify forwards,
the rest) into `stats.phases`.

With `tree` the draft proposes a token tree instead of a chain (SpecInfer, Miao et al. 2023; EAGLE-2, Li et al. 2024):
the loop runs `tree_step.tree_step` where it would run `chain_step`, and the tree's depth plays gamma's part in the
loop and the stats.

    from specdec_runtime.engine import SamplingParams, generate
    result = generate(target, draft, [[1, 2, 3], [4, 5]], num_draft_tokens=4, sampling=SamplingParams(0.7),
                      max_new_tokens=64, stop_token_ids=[2], generator=torch.Generator().manual_seed(0))
    result.tokens, result.stats.aggregate()
    generate(target, draft, [[1, 2, 3]], tree="4,2,2,1")        # static tree: branching per depth
    generate(target, draft, [[1, 2, 3]], tree="dynamic:16")     # EAGLE-2 dynamic tree of 16 nodes

An EAGLE-3 head (`eagle3.Eagle3Draft`) drafts through the same steps: `_states` pairs it with the target's state
(eagle3_state.py), which hands over the target's aux hidden states of every verified token. A zero-training draft
(`lookup.NgramDraft`, `lookup.SuffixDraft`) proposes from tokens alone, a chain of its own length per row
(`lookup.lookup_step`).
"""

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from functools import partial

import torch
import torch.nn.functional as F

from .eagle3 import Eagle3Draft
from .eagle3_state import eagle3_states
from .errors import UserError
from .kv import make_state
from .llama import Llama
from .lookup import NgramDraft, SuffixDraft, lookup_state, lookup_step
from .metrics import GenerationStats, Phases, PhaseTimer, RequestStats
from .sampling import DraftRule, SamplingParams, sample, verify, warp_logits
from .step import Decoding, Feed, State, TimedState, Verdict
from .tree import DynamicTreeShape, Tree
from .tree_step import TreePlan, plan_tree, tree_step

__all__ = ["GenerationResult", "SamplingParams", "generate", "validate_request"]

Step = Callable[[Decoding, Feed], Verdict]
"""(decoding, feed) -> verdict for every row of the batch; both caches end at each row's accepted length."""


@dataclass
class GenerationResult:
    """New tokens per prompt and the run's metrics."""

    tokens: list[list[int]]
    """New tokens of each prompt (stop token included, at most max_new_tokens), in prompt order."""
    stats: GenerationStats
    """Per-request counters and timings; `stats.aggregate()` gives the DESIGN.md metrics."""


def validate_request(
    target: torch.nn.Module,
    draft: torch.nn.Module | NgramDraft | SuffixDraft | None,
    prompts: Sequence[Sequence[int]],
    num_draft_tokens: int,
    draft_rule: str,
    max_new_tokens: int,
) -> None:
    """Raise one clear error (problem and fix) for a request the engine cannot run: a ValueError for arguments our
    callers check first, a UserError for what only the models reveal (their vocabularies, their context window)."""
    if num_draft_tokens < 1:
        raise ValueError(f"num_draft_tokens must be >= 1 (got {num_draft_tokens}); pass draft=None for target-only")
    if draft_rule not in ("sample", "greedy"):
        raise ValueError(f"draft_rule must be 'greedy' (vLLM's default) or 'sample' (got {draft_rule!r})")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1 (got {max_new_tokens}); ask for at least one new token")
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token (got an empty prompt or no prompts); drop empty ones")
    lookup = isinstance(draft, NgramDraft | SuffixDraft)
    if draft is not None and not lookup and draft.config.vocab_size != target.config.vocab_size:
        raise UserError(
            f"target and draft logits differ in width ({target.config.vocab_size} vs {draft.config.vocab_size}); "
            "speculative decoding needs a draft that shares the target's vocabulary"
        )
    if draft is target and isinstance(target, Llama):
        raise ValueError(
            "target and draft are one compact Llama object, and its static cache cannot hold both; "
            "build the draft with its own Llama.from_hf(...) call"
        )
    gamma = num_draft_tokens if draft is not None else 0
    models = (target,) if draft is None or lookup else (target, draft)
    window = min(m.config.max_position_embeddings for m in models)
    longest = max(len(p) for p in prompts)
    if longest + max_new_tokens + gamma > window:
        raise UserError(
            f"a prompt of {longest} tokens + max_new_tokens={max_new_tokens} + num_draft_tokens={gamma} exceeds the "
            f"context window of {window} positions; shorten the prompt, or lower max_new_tokens or num_draft_tokens"
        )


# ------------------------------------------------------------------------------ the chain step (target-only: G = 0)


def _draw(logits: torch.Tensor, dec: Decoding) -> tuple[torch.Tensor, torch.Tensor]:
    """One draft token per row from logits (B, V) -> x (B,) and q (B, V), the distribution x was drawn from."""
    if dec.rule == "greedy":  # argmax q, and q treated as one-hot (vLLM's default draft rule)
        x = logits.argmax(-1)
        return x, F.one_hot(x, logits.shape[-1]).float()
    q = warp_logits(logits, dec.sampling)
    return sample(q, dec.generator, dec.sampling.greedy), q


def draft_chain(dec: Decoding, feed: Feed, gamma: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Draft gamma tokens per row after feeding its pending tokens -> x (B, G) and proposal probs q (B, G, V)."""
    logits = dec.draft.extend(feed.draft_tokens, feed.draft_counts, last_only=True, new_rows=feed.draft_rows)[:, -1]
    xs, qs = [], []
    for k in range(gamma):
        x, q = _draw(logits, dec)
        xs.append(x)
        qs.append(q)
        if k + 1 < gamma:  # no forward for the last draft: if the target accepts it, the next step feeds it
            logits = dec.draft.draft_step(x)
    return torch.stack(xs, 1), torch.stack(qs, 1)


def _no_drafts(target: State, pending: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Target-only decoding's empty x (B, 0) and q (B, 0, V): `verify` then samples straight from p."""
    B, V, dev = pending.shape[0], target.model.config.vocab_size, pending.device
    return torch.zeros(B, 0, dtype=torch.long, device=dev), torch.zeros(B, 0, V, device=dev)


def chain_step(dec: Decoding, feed: Feed, *, gamma: int) -> Verdict:
    """One speculative step: draft gamma tokens, verify them in one target forward, keep each row's accepted prefix.

    Both caches end at each row's accepted length.
    """
    x, q = draft_chain(dec, feed, gamma) if gamma else _no_drafts(dec.target, feed.target)  # (B, G), (B, G, V)
    width = torch.full_like(feed.target, gamma + 1)
    logits = dec.target.extend(torch.cat([feed.target[:, None], x], 1), width)  # (B, G+1, V)
    n, nxt = verify(warp_logits(logits, dec.sampling), q, x, dec.generator, dec.sampling.greedy)  # (B,), (B,)
    if gamma:  # target-only decoding has nothing to roll back
        dec.target.rollback(gamma - n)  # keep pending + the n accepted drafts
        # the draft cached its pending tokens + x_1..x_{G-1}; keep those and the accepted drafts
        dec.draft.rollback(gamma - 1 - n.clamp(max=gamma - 1))
    return Verdict(x, n, nxt, refeed=n == gamma)


# ---------------------------------------------------------------------------------------------------- the loop


def _left_pad(rows: Sequence[Sequence[int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Ragged token lists -> left-padded (B, T) tokens and (B,) real counts."""
    width = max(len(r) for r in rows)
    tokens = torch.tensor([[0] * (width - len(r)) + list(r) for r in rows], dtype=torch.long, device=device)
    return tokens, torch.tensor([len(r) for r in rows], device=device)


def _prefill(dec: Decoding, prompts: Sequence[Sequence[int]], dev: torch.device) -> torch.Tensor:
    """Feed every prompt token to both caches -> each row's first token (B,), sampled from the target's prefill.

    The first token comes from the target's prefill as in serving engines, so TTFT pays no draft or verify step.
    """
    tokens, counts = _left_pad(prompts, dev)
    logits = dec.target.extend(tokens, counts, last_only=True)[:, -1]  # (B, V)
    first = sample(warp_logits(logits, dec.sampling), dec.generator, dec.sampling.greedy)  # target-only sampling
    if dec.draft is not None:  # an EAGLE-3 head computes a row per prompt token but the last (the longest: T - 1)
        dec.draft.extend(tokens, counts, last_only=True, new_rows=tokens.shape[1] - 1)
    return first


def _emit(verdict: Verdict, stop_ids: torch.Tensor, room: torch.Tensor):
    """Row tokens of this step (accepted drafts, then the correction/bonus token), cut after a stop token and at room.

    Returns tokens (B, G+1), counts (B,) to keep, and (B,) whether a stop token was kept.
    """
    x, n, nxt, G = verdict.x, verdict.n, verdict.nxt, verdict.x.shape[1]
    tokens = torch.cat([x, nxt[:, None]], 1).scatter(1, n[:, None], nxt[:, None])  # (B, G+1)
    idx = torch.arange(G + 1, device=x.device)
    is_stop = torch.isin(tokens, stop_ids) & (idx <= n[:, None])
    upto_stop = torch.where(is_stop.any(1), is_stop.long().argmax(1) + 1, G + 2)
    count = torch.minimum(torch.minimum(n + 1, room), upto_stop)
    return tokens, count, upto_stop <= count


@dataclass
class _Output:
    """Emitted tokens and per-row counters of every prompt (prompt order), written through the batch's prompt ids."""

    tokens: torch.Tensor  # (prompts, max_new_tokens + G + 1): a step writes G + 1 columns, past its count junk
    counts: torch.Tensor  # (prompts,) tokens kept
    steps: torch.Tensor  # (prompts,) verify steps taken
    accepted: torch.Tensor  # (prompts,) accepted draft tokens
    drafted: torch.Tensor  # (prompts,) draft tokens proposed
    reached: torch.Tensor  # (prompts, G) steps in which draft position i was judged
    hits: torch.Tensor  # (prompts, G) steps in which draft position i was accepted

    @classmethod
    def empty(cls, prompts: int, G: int, max_new_tokens: int, device: torch.device) -> "_Output":
        shapes = ((prompts, max_new_tokens + G + 1), *[(prompts,)] * 4, (prompts, G), (prompts, G))
        return cls(*(torch.zeros(shape, dtype=torch.long, device=device) for shape in shapes))

    def write(self, rows: torch.Tensor, tokens: torch.Tensor, count: torch.Tensor) -> None:
        """Append tokens (B, W) to the prompts `rows` (B,); each keeps its first count[b]."""
        cols = self.counts[rows, None] + torch.arange(tokens.shape[1], device=rows.device)  # (B, W)
        self.tokens[rows[:, None], cols] = tokens
        self.counts[rows] += count

    def tally(self, rows: torch.Tensor, n: torch.Tensor, drafted: torch.Tensor | int) -> None:
        """Count one verify step of the prompts `rows` (B,) that proposed `drafted` (B,) or (all rows) draft tokens
        and accepted n (B,); a position past a row's proposal was never judged."""
        idx = torch.arange(self.reached.shape[1], device=n.device)
        drafted = torch.as_tensor(drafted, device=n.device).expand_as(n)
        self.steps[rows] += 1
        self.accepted[rows] += n
        self.drafted[rows] += drafted
        self.reached[rows] += ((idx <= n[:, None]) & (idx < drafted[:, None])).long()
        self.hits[rows] += (idx < n[:, None]).long()


def _leave(dec: Decoding, feed: Feed, ids: list[int], done: list[bool]) -> tuple[Feed, list[int]]:
    """Finished rows leave the batch: both caches and the feed keep the rows still decoding -> feed, and their ids."""
    keep = [i for i, finished in enumerate(done) if not finished]
    if keep and len(keep) < len(ids):  # nothing to do when all stay, and nothing left to decode when none does
        for state in (dec.target, dec.draft):
            if state is not None:
                state.select(keep)
        feed = feed.select(torch.tensor(keep, device=feed.target.device))
    return feed, [ids[i] for i in keep]


def _choose_step(plan: TreePlan | None, G: int, draft) -> tuple[Step, int, int]:
    """The step the loop runs -> (step, draft tokens it verifies, cache room it needs past the emitted tokens)."""
    if plan is not None:  # the one place the tree path branches off
        return partial(tree_step, plan=plan), plan.nodes, plan.slack
    if isinstance(draft, NgramDraft | SuffixDraft):
        return partial(lookup_step, gamma=G), G, G
    # the verify forward caches G drafts past the emitted tokens until the rollback drops the rejected ones
    return partial(chain_step, gamma=G), G, G


def _states(target: torch.nn.Module, draft, prompts: Sequence[Sequence[int]], max_len: int):
    """The target's and the draft's cache states; an EAGLE-3 head reads the target's aux hidden states, so that pair
    is built together (eagle3_state.py); a lookup draft's state holds tokens only (lookup.py)."""
    batch_size = len(prompts)
    if isinstance(draft, NgramDraft | SuffixDraft):
        return make_state(target, batch_size, max_len), lookup_state(draft, prompts, max_len, target.device)
    if isinstance(draft, Eagle3Draft):
        return eagle3_states(target, draft, batch_size, max_len)
    draft_state = make_state(draft, batch_size, max_len) if draft is not None else None
    return make_state(target, batch_size, max_len), draft_state


def _timed(dec: Decoding, timer: PhaseTimer) -> Decoding:
    """The decode loop's view of the caches: target forwards count as verify time, draft forwards as draft time."""
    draft = TimedState(dec.draft, timer, "draft") if dec.draft is not None else None
    return replace(dec, target=TimedState(dec.target, timer, "verify"), draft=draft)


def generate(
    target: torch.nn.Module,
    draft: torch.nn.Module | NgramDraft | SuffixDraft | None,
    prompts: Sequence[Sequence[int]],
    *,
    num_draft_tokens: int = 4,
    draft_rule: DraftRule = "greedy",
    sampling: SamplingParams = SamplingParams(),  # noqa: B008 (frozen dataclass, safe as a default)
    max_new_tokens: int = 128,
    stop_token_ids: Sequence[int] = (),
    generator: torch.Generator | None = None,
    tree: str | Tree | DynamicTreeShape | None = None,
    clock: Callable[[], float] | None = None,
) -> GenerationResult:
    """Speculative decoding of a ragged batch (draft=None: target-only decoding through the same loop).

    tree: None drafts a chain of num_draft_tokens; '4,2,2,1' (branching per depth), a static `Tree`, 'dynamic:NODES'
    or a `DynamicTreeShape` drafts a token tree, whose depth replaces num_draft_tokens. Static trees draw siblings
    with draft_rule greedy as the draft's top-k and with sample without replacement; dynamic trees always take top-k.
    clock: the time source of the phases and request timings, called at phase boundaries only (default: perf_counter;
    on CUDA the phases come from CUDA events).
    """
    dev = target.device
    plan = plan_tree(tree, dev) if tree is not None else None
    if plan is not None and (draft is None or isinstance(draft, NgramDraft | SuffixDraft)):
        raise ValueError("a token tree needs a draft model to propose it; pass a draft model or tree=None")
    gamma = plan.depth if plan is not None else num_draft_tokens
    validate_request(target, draft, prompts, gamma, draft_rule, max_new_tokens)
    G = gamma if draft is not None else 0  # draft forwards per step after the first; 0: target-only decoding
    step, nodes, slack = _choose_step(plan, G, draft)
    num_prompts, wall, timer = len(prompts), clock or time.perf_counter, PhaseTimer(clock, dev)
    with torch.no_grad():
        start = wall()
        max_len = max(len(p) for p in prompts) + max_new_tokens + slack
        dec = Decoding(*_states(target, draft, prompts, max_len), sampling, draft_rule, generator)
        stop_ids = torch.tensor(list(stop_token_ids), dtype=torch.long, device=dev)
        out = _Output.empty(num_prompts, G, max_new_tokens, dev)
        with timer.span("prefill"):
            first = _prefill(dec, prompts, dev)  # (B,)
        rows = torch.arange(num_prompts, device=dev)  # (B,) prompt index of each batch row
        out.write(rows, first[:, None], torch.ones_like(first))
        done = (torch.isin(first, stop_ids) | (max_new_tokens == 1)).tolist()
        ttft_s = wall() - start
        # per prompt: seconds from the start to its last token, and in the decode loop (0: done at its first token)
        finished_s, decode_s = [ttft_s] * num_prompts, [0.0] * num_prompts
        feed, ids = _leave(dec, Feed.first(first), list(range(num_prompts)), done)
        dec, decode_start = _timed(dec, timer), wall()
        with timer.span("decode"):
            while ids:
                if len(ids) < rows.shape[0]:  # rows only ever leave: a shorter list is a smaller batch
                    rows = torch.tensor(ids, device=dev)
                verdict = step(dec, feed)
                feed = feed.advance(verdict, drafting=G > 0)
                room = max_new_tokens - out.counts[rows]
                tokens, count, stopped = _emit(verdict, stop_ids, room)  # (B, G+1), (B,), (B,)
                out.write(rows, tokens, count)
                out.tally(rows, verdict.n, verdict.drafted if verdict.drafted is not None else nodes)
                flags = torch.stack([stopped | (count >= room), feed.draft_counts == 2, verdict.n])
                finished, two, accepted = flags.tolist()  # the step's one host sync
                now = wall()
                for i, fin in zip(ids, finished):
                    if fin:
                        finished_s[i], decode_s[i] = now - start, now - decode_start
                staying = [(t, n) for fin, t, n in zip(finished, two, accepted) if not fin]
                feed.width = 2 if any(t for t, _ in staying) else 1
                feed.draft_rows = 1 + max((n for _, n in staying), default=0)
                feed, ids = _leave(dec, feed, ids, finished)
        wall_s = wall() - start

    lengths = out.counts.tolist()
    tokens = [row[:k] for row, k in zip(out.tokens.tolist(), lengths)]
    if isinstance(draft, SuffixDraft):  # its cache of earlier responses files what was emitted
        draft.finish(tokens)
    timing = [(ttft_s, done_s, dec_s) for done_s, dec_s in zip(finished_s, decode_s)]
    forwards = isinstance(draft, torch.nn.Module)  # a lookup draft runs no forward
    stats = _stats(out, lengths, timing, wall_s, timer.phases(), gamma=G, has_draft=forwards)
    return GenerationResult(tokens=tokens, stats=stats)


def _stats(
    out: _Output,
    lengths: list[int],
    timing: list[tuple[float, float, float]],
    wall_s: float,
    phases: Phases,
    *,
    gamma: int,
    has_draft: bool,
) -> GenerationStats:
    """Device counters -> per-request stats; batched forward counts follow from the longest-running row.

    Every request takes part in the prefill (one forward of each model); then a step drafts the tokens `out.drafted`
    counts (gamma for a chain, the tree's nodes, a lookup's own number per row) in gamma draft forwards (the pending
    tokens, then one per drafted token or level but the last; none for a lookup). timing: per request (ttft_s,
    wall_s, decode_s).
    """
    counters = (out.steps, out.accepted, out.drafted, out.reached, out.hits)
    columns = zip(*(c.tolist() for c in counters))
    requests = [
        RequestStats(
            new_tokens=length,
            verify_steps=s,
            drafted=d,
            accepted=a,
            position_reached=r,
            position_accepted=h,
            target_forwards=s + 1,
            draft_forwards=(s * gamma + 1) * has_draft,
            ttft_s=ttft,
            wall_s=done,
            decode_s=decode,
        )
        for (s, a, d, r, h), length, (ttft, done, decode) in zip(columns, lengths, timing)
    ]
    steps = max(r.verify_steps for r in requests)
    return GenerationStats(
        requests=requests,
        wall_s=wall_s,
        target_forwards=steps + 1,
        draft_forwards=(steps * gamma + 1) * has_draft,
        phases=phases,
    )
