"""The token-tree step of the engine (SpecInfer, Miao et al. 2023; EAGLE-2, Li et al. 2024).

The draft proposes a token tree instead of a chain: it drafts level by level from its own cache (each level one forward
under a tree mask), the target scores every node in one forward (position ids by depth, each node sees the prefix and
its ancestors), the longest accepted path is kept (`tree.verify_tree_greedy` / `tree.verify_tree_sample`, as exact as
the chain), and both caches are compacted to that path. The tree's depth plays gamma's part in the loop and the stats.

`generate(..., tree=...)` prepares a `TreePlan` once and runs `tree_step` where a chain runs `chain_step`; the pure
tensor functions (shapes, masks, exact verification) live in tree.py.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .sampling import SamplingParams, warp_logits
from .step import Decoding, Feed, State, Verdict
from .tree import (
    DynamicTreeShape,
    Level,
    SiblingRule,
    Tree,
    draft_level,
    dynamic_tree_expand,
    dynamic_tree_select,
    dynamic_tree_start,
    parse_tree,
    tree_ancestors,
    tree_levels,
    tree_size,
    verify_layout,
    verify_tree_greedy,
    verify_tree_sample,
)


@dataclass(frozen=True)
class StaticPlan:
    """A static tree's tensors on the models' device, prepared once per generate call: a step copies nothing from the
    host to draft, mask or verify the tree."""

    on_device: Tree
    """The shape on the models' device, for masks, positions and verification."""
    levels: tuple[Level, ...]
    """Each level's parent and rank indices, for drafting it (`tree.tree_levels`)."""
    ancestors: torch.Tensor
    """(N, N) node j is node i or one of its ancestors."""
    columns: torch.Tensor
    """(N,) draft cache segment column of each node: nodes are forwarded in order, all levels but the last."""

    @classmethod
    def build(cls, tree: Tree, device: torch.device) -> "StaticPlan":
        on_device = tree.to(device)
        N = tree.num_nodes
        columns = torch.where(on_device.depth < tree.max_depth, torch.arange(N, device=device), -1)
        return cls(on_device, tree_levels(tree, device), tree_ancestors(on_device.parents), columns)


@dataclass(frozen=True)
class TreePlan:
    """generate's `tree` argument, prepared once per call."""

    shape: StaticPlan | DynamicTreeShape
    depth: int
    """Levels drafted per step: gamma's part in the loop and the stats."""
    nodes: int
    """Draft tokens the target verifies per step."""
    slack: int
    """Cache room a step needs past the emitted tokens: the verify forward's, or the draft's tree segment."""


def plan_tree(tree: str | Tree | DynamicTreeShape, device: torch.device) -> TreePlan:
    """A tree spec ('4,2,2,1', 'dynamic:16'), a static `Tree` or a `DynamicTreeShape` -> the call's TreePlan."""
    if isinstance(tree, str):
        tree = parse_tree(tree)
    depth, nodes = tree_size(tree)
    if isinstance(tree, Tree):
        if tree.level_sizes is None:
            raise ValueError("tree must be one static shape for all rows (static_tree / tree_from_paths / '4,2,2,1')")
        shape, draft_segment = StaticPlan.build(tree, device), nodes
    else:
        shape, draft_segment = tree, (tree.depth - 1) * tree.top_k
    return TreePlan(shape, depth, nodes, slack=max(nodes + 1, draft_segment) + 2)


@dataclass(frozen=True)
class _DraftedTree:
    """One step's draft tree, with what verification and cache compaction need."""

    tree: Tree
    """On the models' device: one static shape (N,) or per-row (B, N)."""
    tokens: torch.Tensor
    """(B, N) node tokens."""
    q: torch.Tensor | None
    """(B, N+1, V) distributions the children of [root, nodes] were drawn from; None for top_k siblings."""
    columns: torch.Tensor
    """(N,) or (B, N) draft cache segment column of each node, -1 for nodes the draft never forwarded."""
    sibling: SiblingRule


def tree_step(dec: Decoding, feed: Feed, *, plan: TreePlan) -> Verdict:
    """One tree draft-then-verify step; both caches end compacted to each row's accepted path.

    The verdict's x is the path's tokens (B, D); refeed marks rows whose last path node the draft never forwarded.
    """
    B = feed.target.shape[0]
    root = dec.draft.extend(feed.draft_tokens, feed.draft_counts, last_only=True, new_rows=feed.draft_rows)
    root_logits = root[:, -1]  # (B, V)
    drafted = _draft_tree(dec, root_logits, plan.shape)
    path, nxt = _verify_tree(dec, feed.target, drafted)  # (B, D) node indices, -1 padded; (B,)
    n = (path >= 0).sum(1)
    dec.target.tree_commit(F.pad(path + 1, (1, 0)), 1 + n)  # verify column 0 is the root, 1 + i node i
    cols = torch.where(path >= 0, drafted.columns.expand(B, -1).gather(1, path.clamp_min(0)), -1)
    kept = (cols >= 0).sum(1)  # the draft forwarded every path node but maybe the last
    dec.draft.tree_commit(cols, kept)
    return Verdict(drafted.tokens.gather(1, path.clamp_min(0)), n, nxt, refeed=n > kept)


def _draft_tree(dec: Decoding, root_logits: torch.Tensor, shape: StaticPlan | DynamicTreeShape) -> _DraftedTree:
    if isinstance(shape, DynamicTreeShape):  # top_k children: verification is exact at any temperature
        tree, tokens, columns = _draft_dynamic(dec.draft, root_logits, shape, dec.sampling)
        return _DraftedTree(tree, tokens, None, columns, "top_k")
    # temperature 0 ranks by the draft's logits whatever the draft rule: its best guesses
    sibling: SiblingRule = "top_k" if dec.sampling.greedy or dec.rule == "greedy" else "sample"
    tokens, q = _draft_static(dec, root_logits, shape, sibling)
    return _DraftedTree(shape.on_device, tokens, q, shape.columns, sibling)


def _verify_tree(dec: Decoding, root: torch.Tensor, drafted: _DraftedTree) -> tuple[torch.Tensor, torch.Tensor]:
    """One target forward over [root (B,), nodes] under the tree mask -> accepted path (B, D) and next token (B,)."""
    tree, tokens, B = drafted.tree, drafted.tokens, root.shape[0]
    no_cache = torch.zeros(B, 0, dtype=torch.bool, device=root.device)  # the state adds its own cached columns
    visible, positions = verify_layout(tree, no_cache, dec.target.lengths)
    logits = dec.target.tree_forward(torch.cat([root[:, None], tokens], 1), positions, visible[:, 0])  # (B, N+1, V)
    if dec.sampling.greedy:
        return verify_tree_greedy(tree, tokens, logits)
    p = warp_logits(logits, dec.sampling)
    return verify_tree_sample(tree, tokens, p, drafted.q, drafted.sibling, dec.generator)


def _draft_static(
    dec: Decoding, root_logits: torch.Tensor, plan: StaticPlan, rule: SiblingRule
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Draft a static tree level by level -> tokens (B, N) and q (B, N+1, V), or None for top_k.

    q row 0 is the root's and row 1 + i node i's: the distributions their children were drawn from (leaves: zeros).
    """
    tree, state, B = plan.on_device, dec.draft, root_logits.shape[0]
    scores, tokens, qs, start = root_logits[:, None], [], [], 0  # scores: (B, F, V) at the F nodes of level d - 1
    for d, (size, level) in enumerate(zip(tree.level_sizes, plan.levels), 1):
        q = scores if rule == "top_k" else warp_logits(scores, dec.sampling)  # top_k ranks raw logits
        qs.append(q)
        tokens.append(draft_level(level, q, rule, dec.generator))  # (B, size)
        if d < tree.max_depth:  # the last level's children are never drawn: no forward
            positions = (state.lengths - 1 + d)[:, None].expand(B, size)  # the root sits at lengths - 1
            seen = plan.ancestors[start : start + size, : start + size].expand(B, -1, -1)  # (B, size, W + size)
            scores = state.tree_forward(tokens[-1], positions, seen)
        start += size
    q = None
    if rule != "top_k":
        q = torch.cat([*qs, torch.zeros_like(qs[0][:, :1]).expand(B, tree.level_sizes[-1], -1)], 1)
    return torch.cat(tokens, 1), q


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


def _draft_dynamic(
    state: State, root_logits: torch.Tensor, shape: DynamicTreeShape, sampling: SamplingParams
) -> tuple[Tree, torch.Tensor, torch.Tensor]:
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
