"""Batched speculative decoding (Leviathan et al. 2023; Chen et al. 2023) and target-only decoding in one loop.

Each step: the draft proposes gamma tokens per row from its own cache, the target scores all of them in one forward,
each row keeps its longest accepted prefix plus one correction (or bonus) token, and both caches roll back to the
accepted length. With draft=None the same loop runs with gamma = 0 (plain sampling from the target), so A/B runs
share every other cost. Temperature 0 output equals target-only greedy decoding token for token; at temperature > 0
the output is distributed exactly as target-only sampling with the same warping.

With `tree` the draft proposes a token tree instead of a chain (SpecInfer, Miao et al. 2023; EAGLE-2, Li et al. 2024):
it drafts level by level from its own cache (each level one forward under a tree mask), the target scores every node
in one forward (position ids by depth, each node sees the prefix and its ancestors), the longest accepted path is kept
(`tree.verify_tree_greedy` / `tree.verify_tree_sample`, as exact as the chain), and both caches are compacted to that
path. The tree's depth plays gamma's part in the loop and the stats.

    from specdec_runtime.engine import SamplingParams, generate
    result = generate(target, draft, [[1, 2, 3], [4, 5]], num_draft_tokens=4, sampling=SamplingParams(0.7),
                      max_new_tokens=64, stop_token_ids=[2], generator=torch.Generator().manual_seed(0))
    result.tokens, result.stats.aggregate()
    generate(target, draft, [[1, 2, 3]], tree="4,2,2,1")        # static tree: branching per depth
    generate(target, draft, [[1, 2, 3]], tree="dynamic:16")     # EAGLE-2 dynamic tree of 16 nodes
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
from .tree import (
    DynamicTreeShape,
    SiblingRule,
    Tree,
    draft_level,
    dynamic_tree_expand,
    dynamic_tree_select,
    dynamic_tree_start,
    parse_tree,
    tree_ancestors,
    tree_size,
    verify_layout,
    verify_tree_greedy,
    verify_tree_sample,
)

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
    """One draft-then-verify step; both caches end at each row's accepted length.

    Returns x (B, G), n (B,) accepted, next (B,), and (B,) whether the last accepted draft is missing from the draft's
    cache (it must be fed again with the next token).
    """
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
    return x, n, nxt, n == G


@dataclass(frozen=True)
class _StaticPlan:
    """A static tree's tensors, prepared once per generate call."""

    tree: Tree
    """The shape on the CPU: `draft_level` reads its level bookkeeping on the host."""
    on_device: Tree
    """The same shape on the models' device, for masks, positions and verification."""
    ancestors: torch.Tensor
    """(N, N) node j is node i or one of its ancestors."""
    columns: torch.Tensor
    """(N,) draft cache segment column of each node: nodes are forwarded in order, all levels but the last."""

    @classmethod
    def build(cls, tree: Tree, device: torch.device) -> "_StaticPlan":
        tree, on_device = tree.to("cpu"), tree.to(device)
        N = tree.num_nodes
        columns = torch.where(on_device.depth < tree.max_depth, torch.arange(N, device=device), -1)
        return cls(tree, on_device, tree_ancestors(on_device.parents), columns)


def _draft_static(state, root_logits, plan: _StaticPlan, sampling, rule: SiblingRule, generator):
    """Draft a static tree level by level -> tokens (B, N), q (B, N+1, V) or None for top_k, segment columns (N,).

    q row 0 is the root's and row 1 + i node i's: the distributions their children were drawn from (leaves: zeros).
    """
    tree, B = plan.tree, root_logits.shape[0]
    scores, tokens, qs, start = root_logits[:, None], [], [], 0  # scores: (B, F, V) at the F nodes of level d - 1
    for d, size in enumerate(tree.level_sizes, 1):
        q = scores if rule == "top_k" else warp_logits(scores, sampling)  # top_k ranks raw logits
        qs.append(q)
        tokens.append(draft_level(tree, d, q, rule, generator))  # (B, size)
        if d < tree.max_depth:  # the last level's children are never drawn: no forward
            positions = (state.lengths - 1 + d)[:, None].expand(B, size)  # the root sits at lengths - 1
            seen = plan.ancestors[start : start + size, : start + size].expand(B, -1, -1)  # (B, size, W + size)
            scores = state.tree_forward(tokens[-1], positions, seen)
        start += size
    q = None
    if rule != "top_k":
        q = torch.cat([*qs, torch.zeros_like(qs[0][:, :1]).expand(B, tree.level_sizes[-1], -1)], 1)
    return torch.cat(tokens, 1), q, plan.columns


def _grow_ancestors(ancestors: torch.Tensor, parent_col: torch.Tensor) -> torch.Tensor:
    """Ancestors (B, W, W) of the forwarded nodes + T new nodes under parent columns (B, T), -1: the root.

    Returns (B, W+T, W+T): a new node's row is its parent's plus itself.
    """
    B, W, T = ancestors.shape[0], ancestors.shape[1], parent_col.shape[1]
    inherited = ancestors.gather(1, parent_col.clamp_min(0)[..., None].expand(B, T, W)) & (parent_col >= 0)[..., None]
    own = torch.eye(T, dtype=torch.bool, device=parent_col.device).expand(B, T, T)
    return torch.cat([F.pad(ancestors, (0, T)), torch.cat([inherited, own], -1)], 1)


def _tree_logprobs(logits: torch.Tensor, sampling: SamplingParams) -> torch.Tensor:
    """Scores a dynamic tree ranks candidates by: the draft's warped log-probs, its raw log-softmax at temperature 0."""
    return logits.float().log_softmax(-1) if sampling.greedy else warp_logits(logits, sampling).log()


def _draft_dynamic(state, root_logits, shape: DynamicTreeShape, sampling):
    """Draft an EAGLE-2 tree: forward each level's top_k frontier, then keep the best `nodes` candidates.

    Returns the per-row Tree, tokens (B, N) and the draft cache segment column of each node (B, N), -1 for candidates
    the draft never forwarded (a kept node has children only if it was on a frontier, so -1 marks leaves only).
    """
    B, K, dev = root_logits.shape[0], shape.top_k, root_logits.device
    pool = dynamic_tree_start(_tree_logprobs(root_logits, sampling), K)
    column = torch.full((B, K + (shape.depth - 1) * K * K), -1, device=dev)  # (B, M) segment column per candidate
    ancestors = torch.zeros(B, 0, 0, dtype=torch.bool, device=dev)
    for level in range(1, shape.depth):
        W, front = ancestors.shape[1], pool.frontier  # (B, K) candidates of the newest level
        column = column.scatter(1, front, W + torch.arange(K, device=dev).expand(B, K))
        parent = pool.parents.gather(1, front)
        ancestors = _grow_ancestors(ancestors, torch.where(parent >= 0, column.gather(1, parent.clamp_min(0)), -1))
        positions = (state.lengths - 1 + level)[:, None].expand(B, K)
        logits = state.tree_forward(pool.tokens.gather(1, front), positions, ancestors[:, W:])  # (B, K, V)
        pool = dynamic_tree_expand(pool, _tree_logprobs(logits, sampling))
    tree, tokens, keep = dynamic_tree_select(pool, shape.nodes)
    return tree, tokens, column.gather(1, keep)


def _tree_step(models: dict, pending, d_pending, d_counts, act, shape, sampling, rule: DraftRule, generator):
    """One tree draft-then-verify step; both caches end compacted to each row's accepted path.

    Returns the path's tokens x (B, D), n (B,) accepted, next (B,), and (B,) whether the last accepted node is
    missing from the draft's cache, as `_step` does.
    """
    target, draft = models["target"], models["draft"]
    B, dev = pending.shape[0], pending.device
    root_logits = draft.extend(d_pending, d_counts * act, last_only=True)[:, -1]  # (B, V) at the pending token
    if isinstance(shape, DynamicTreeShape):  # top_k children: verification is exact at any temperature
        sibling: SiblingRule = "top_k"
        tree, tokens, columns = _draft_dynamic(draft, root_logits, shape, sampling)
        q = None
    else:  # temperature 0 ranks by the draft's logits whatever the draft rule: its best guesses
        sibling = "top_k" if sampling.greedy or rule == "greedy" else "sample"
        tokens, q, columns = _draft_static(draft, root_logits, shape, sampling, sibling, generator)
        tree = shape.on_device
    visible, positions = verify_layout(tree, torch.zeros(B, 0, dtype=torch.bool, device=dev), target.lengths)
    logits = target.tree_forward(torch.cat([pending[:, None], tokens], 1), positions, visible[:, 0])  # (B, N+1, V)
    if sampling.greedy:
        path, nxt = verify_tree_greedy(tree, tokens, logits)  # (B, D) node indices, -1 padded
    else:
        path, nxt = verify_tree_sample(tree, tokens, warp_logits(logits, sampling), q, sibling, generator)
    n = (path >= 0).sum(1)
    target.tree_commit(F.pad(path + 1, (1, 0)), (1 + n) * act)  # verify column 0 is the root, 1 + i node i
    cols = torch.where(path >= 0, columns.expand(B, -1).gather(1, path.clamp_min(0)), -1)
    kept = (cols >= 0).sum(1)  # the draft forwarded every path node but maybe the last
    draft.tree_commit(cols, kept * act)
    return tokens.gather(1, path.clamp_min(0)), n, nxt, n > kept


def _resolve_tree(tree: str | Tree | DynamicTreeShape | None, device) -> _StaticPlan | DynamicTreeShape | None:
    """generate's `tree` argument -> a static plan, a dynamic shape, or None for a chain."""
    if isinstance(tree, str):
        tree = parse_tree(tree)
    if isinstance(tree, Tree):
        if tree.level_sizes is None:
            raise ValueError("tree must be one static shape for all rows (static_tree / tree_from_paths / '4,2,2,1')")
        return _StaticPlan.build(tree, device)
    return tree


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
    tree: str | Tree | DynamicTreeShape | None = None,
) -> GenerationResult:
    """Speculative decoding of a ragged batch (draft=None: target-only decoding through the same loop).

    tree: None drafts a chain of num_draft_tokens; '4,2,2,1' (branching per depth), a static `Tree`, 'dynamic:NODES'
    or a `DynamicTreeShape` drafts a token tree, whose depth replaces num_draft_tokens. Static trees draw siblings
    with draft_rule greedy as the draft's top-k and with sample without replacement; dynamic trees always take top-k.
    """
    dev = target.device
    shape = _resolve_tree(tree, dev)
    nodes = num_draft_tokens  # draft tokens verified per step
    if shape is not None:
        if draft is None:
            raise ValueError("a token tree needs a draft model to propose it; pass draft=... or tree=None")
        num_draft_tokens, nodes = tree_size(shape.tree if isinstance(shape, _StaticPlan) else shape)
    validate_request(target, draft, prompts, num_draft_tokens, draft_rule, max_new_tokens)
    B = len(prompts)
    G, nodes = (num_draft_tokens, nodes) if draft is not None else (0, 0)
    slack = G  # cache room a step needs past the emitted tokens: the verify forward's, or the draft's tree segment
    if shape is not None:
        draft_segment = (shape.depth - 1) * shape.top_k if isinstance(shape, DynamicTreeShape) else nodes
        slack = max(nodes + 1, draft_segment) + 2
    with torch.no_grad():
        start = time.perf_counter()
        max_len = max(len(p) for p in prompts) + max_new_tokens + slack
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
            step_args = (models, pending, d_pending[:, -width:], d_counts, act)
            if shape is None:
                x, n, nxt, carry = _step(*step_args, G, sampling, draft_rule, generator)
            else:
                x, n, nxt, carry = _tree_step(*step_args, shape, sampling, draft_rule, generator)
            if G:  # the last accepted draft missing from the draft cache is fed again, before the next token
                last = x.gather(1, (n - 1).clamp_min(0)[:, None])[:, 0]
                next_pending = torch.where(carry[:, None], torch.stack([last, nxt], 1), nxt[:, None].expand(B, 2))
                d_pending = torch.where(active[:, None], next_pending, d_pending)
                d_counts = torch.where(active, 1 + carry.long(), d_counts)
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
    stats = _stats(tally, lengths, prefilled, G, nodes, draft is not None, first_s, done_s, wall_s)
    return GenerationResult(tokens=[row[:k] for row, k in zip(out.tolist(), lengths)], stats=stats)


def _stats(
    tally: _Tally, lengths, prefilled, G: int, nodes: int, has_draft: bool, first_s, done_s, wall_s
) -> GenerationStats:
    """Device counters -> per-request stats; batched forward counts follow from the longest-running row.

    A step drafts `nodes` tokens (gamma for a chain, the tree's nodes) in G draft forwards (the pending tokens, then
    one per drafted level but the last).
    """
    columns = zip(tally.steps.tolist(), tally.accepted.tolist(), tally.reached.tolist(), tally.hits.tolist())
    requests = [
        RequestStats(
            new_tokens=length,
            verify_steps=s,
            drafted=s * nodes,
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
