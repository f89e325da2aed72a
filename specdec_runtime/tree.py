"""Token-tree speculation as pure tensor functions: tree shapes, drafting by level, tree masks, exact verification.

A chain draft wastes everything after its first rejected token; a tree proposes several candidates where the draft is
unsure and the target scores every node in one forward under a tree attention mask (SpecInfer, Miao et al. 2023;
Medusa; EAGLE-2, Li et al. 2024; Sequoia). Conventions shared by every function here:

- The root is the pending token (the last emitted one, not yet in the target's cache). Tree nodes 0..N-1 are the
  drafted tokens below it, numbered parents before children, siblings in draw order (lower index = drawn first).
- `parents[i]` is node i's parent, -1 for children of the root; `depth[i]` counts from 1 for the root's children, so
  a node's position is the root's position + its depth.
- The target's verify forward sees [root, node 0, ..., node N-1]: its row 0 is the root, row 1 + i is node i (see
  `verify_layout`), so target and draft tensors are (B, N + 1, V) with the root first.
- Trees are batched: tensors are (N,) for one static shape shared by every row or (B, N) for per-row (dynamic) trees.

How siblings are drawn (`SiblingRule`) decides the exact acceptance rule at temperature > 0; `verify_tree_sample`
documents why each is exact. Temperature 0 goes through `verify_tree_greedy` (longest path matching the target's
argmax, token-identical to target-only greedy decoding).

Drafting a static tree (phase B wires this into the engine; q_* are warped draft probs, or logits for top_k):
    levels = tree_levels(tree, device)                                       # once per tree and device
    tokens_1 = draft_level(levels[0], q_root[:, None], rule, generator)      # (B, n_1)
    tokens_2 = draft_level(levels[1], q_level_1, rule, generator)            # q at the n_1 depth-1 nodes
    ...
    mask, positions = verify_layout(tree, key_valid, root_positions, dtype)  # target: [root, nodes] in one forward
    path, nxt = verify_tree_sample(tree, tokens, p, q, rule, generator)      # p, q: (B, N + 1, V), root first
"""

from dataclasses import dataclass, replace
from itertools import product
from typing import Literal

import torch
import torch.nn.functional as F

from .errors import UserError
from .sampling import sample

SiblingRule = Literal["top_k", "sample", "sample_iid"]
"""How a node's children are drawn from the draft's distribution q at that node.

top_k: the k most likely tokens (deterministic; `draft_rule=greedy`, and the only sensible choice at temperature 0).
sample: k tokens sampled from q without replacement (so siblings never repeat).
sample_iid: k tokens sampled i.i.d. from q (siblings may repeat; Miao et al. 2023's scheme).
"""


@dataclass(frozen=True)
class Tree:
    """Shape of a token tree below the root; tensors are (N,) for a shape shared by all rows or (B, N) per row."""

    parents: torch.Tensor
    """Parent node of each node, -1 for the root's children; parents come before their children."""
    depth: torch.Tensor
    """Depth of each node, 1 for the root's children: the node's position is the root's position + depth."""
    rank: torch.Tensor
    """Index of each node among its siblings, in draw order (0 = drawn first)."""
    max_depth: int
    """Deepest level (the longest path's length)."""
    max_children: int
    """Most children of any node, the root included."""
    level_sizes: tuple[int, ...] | None = None
    """Nodes per depth when all rows share one level-ordered shape (drafting by level); None for per-row trees."""

    @property
    def num_nodes(self) -> int:
        return self.parents.shape[-1]

    def to(self, device: torch.device | str) -> "Tree":
        return replace(self, parents=self.parents.to(device), depth=self.depth.to(device), rank=self.rank.to(device))


def tree_from_paths(paths: list[list[int]] | list[tuple[int, ...]]) -> Tree:
    """Static tree from explicit paths of sibling ranks (Medusa-style choices), e.g. [[0], [1], [0, 0], [0, 1]].

    [0, 1] is the second child (in draw order) of the root's first child. Every prefix of a path must be present, and
    a node's children must be ranks 0..c-1: the verifier tries siblings in draw order, and the exact sampling rule
    needs every drawn sibling before the last one in the tree.
    """
    nodes = sorted({tuple(p) for p in paths}, key=lambda p: (len(p), p))  # level order, siblings by rank
    if not nodes or any(len(p) == 0 or min(p) < 0 for p in nodes):
        raise ValueError(f"paths must be non-empty lists of ranks >= 0 (got {paths!r}), e.g. [[0], [1], [0, 0]]")
    index = {p: i for i, p in enumerate(nodes)}
    for p in nodes:
        if len(p) > 1 and p[:-1] not in index:
            raise ValueError(f"path {list(p)} needs its parent path {list(p[:-1])} in the tree as well")
        if p[-1] > 0 and p[:-1] + (p[-1] - 1,) not in index:
            raise ValueError(
                f"path {list(p)} needs its elder sibling {list(p[:-1]) + [p[-1] - 1]}: siblings are drawn and "
                "verified in order, so a node's children must be ranks 0..c-1"
            )
    depths = [len(p) for p in nodes]
    return Tree(
        parents=torch.tensor([index[p[:-1]] if len(p) > 1 else -1 for p in nodes]),
        depth=torch.tensor(depths),
        rank=torch.tensor([p[-1] for p in nodes]),
        max_depth=max(depths),
        max_children=max(p[-1] for p in nodes) + 1,
        level_sizes=tuple(depths.count(d) for d in range(1, max(depths) + 1)),
    )


def static_tree(branching: list[int]) -> Tree:
    """Full tree where every node at depth d has branching[d] children ([4, 2, 2, 1]: 4 + 8 + 16 + 16 nodes)."""
    if not branching or min(branching) < 1:
        raise ValueError(f"branching must be a non-empty list of counts >= 1 (got {branching!r}), e.g. [4, 2, 2, 1]")
    paths = [p for d in range(1, len(branching) + 1) for p in product(*(range(b) for b in branching[:d]))]
    return tree_from_paths(paths)


@dataclass(frozen=True)
class DynamicTreeShape:
    """An EAGLE-2 dynamic tree (Li et al. 2024): expand the best nodes level by level, keep the best `nodes`."""

    nodes: int
    """Node budget: draft tokens the target verifies per step."""
    depth: int
    """Levels drafted (the deepest possible path)."""
    top_k: int
    """Children per expanded node, and nodes expanded per level."""

    def __post_init__(self):
        if min(self.nodes, self.depth, self.top_k) < 1:
            raise ValueError(f"dynamic tree needs nodes, depth, top_k >= 1 (got {self})")
        if self.nodes > self.top_k + (self.depth - 1) * self.top_k**2:
            raise ValueError(
                f"dynamic tree of depth {self.depth} and top_k {self.top_k} drafts only "
                f"{self.top_k + (self.depth - 1) * self.top_k**2} candidates, fewer than nodes={self.nodes}; "
                "raise depth or top_k"
            )


DYNAMIC_DEPTH, DYNAMIC_TOP_K = 6, 8  # EAGLE-2's defaults are depth 6, top_k 10 for 60 nodes; cut for small budgets


def parse_tree(spec: str) -> Tree | DynamicTreeShape:
    """Tree spec string -> static Tree or DynamicTreeShape.

    '4,2,2,1': static tree, branching per depth (`static_tree`). 'dynamic:NODES': EAGLE-2 tree of NODES nodes,
    depth min(6, NODES), top_k min(8, NODES); 'dynamic:NODES:DEPTH:TOP_K' sets both.
    """
    text = spec.strip()
    dynamic = text.startswith("dynamic:")
    parts = text.removeprefix("dynamic:").split(":" if dynamic else ",")
    if not all(part.strip().isdigit() for part in parts) or (dynamic and len(parts) not in (1, 3)):
        raise UserError(
            f"tree spec {spec!r} is not '4,2,2,1' (branching per depth), 'dynamic:NODES' or 'dynamic:NODES:DEPTH:TOP_K'"
        )
    numbers = [int(part) for part in parts]
    try:  # the shapes' own range checks, said as a problem of the spec the user wrote
        if not dynamic:
            return static_tree(numbers)
        nodes = numbers[0]
        depth, top_k = numbers[1:] if len(numbers) == 3 else (min(DYNAMIC_DEPTH, nodes), min(DYNAMIC_TOP_K, nodes))
        return DynamicTreeShape(nodes=nodes, depth=depth, top_k=top_k)
    except ValueError as e:
        raise UserError(f"tree spec {spec!r}: {e}") from None


def tree_size(shape: Tree | DynamicTreeShape) -> tuple[int, int]:
    """(depth, nodes) of a tree shape: the levels drafted per step (gamma's part) and the tokens verified per step."""
    if isinstance(shape, DynamicTreeShape):
        return shape.depth, shape.nodes
    return shape.max_depth, shape.num_nodes


def sibling_rank(parents: torch.Tensor) -> torch.Tensor:
    """Index of each node among its siblings (B, N) from parents (B, N), given siblings appear in draw order."""
    N = parents.shape[-1]
    earlier = torch.ones(N, N, dtype=torch.bool, device=parents.device).tril(-1)  # [i, j]: j < i
    return ((parents[..., :, None] == parents[..., None, :]) & earlier).sum(-1)


def draw_children(q: torch.Tensor, k: int, rule: SiblingRule, generator: torch.Generator | None) -> torch.Tensor:
    """k children per node from the draft's q (B, F, V) -> tokens (B, F, k) in draw order.

    For sample, q must be probabilities (zeros allowed); for top_k any scores (logits work).
    """
    if rule == "top_k":
        return q.topk(k, dim=-1).indices
    if rule == "sample_iid":
        return sample(q[..., None, :].expand(*q.shape[:-1], k, q.shape[-1]), generator)
    # Exponential race, top k: the order of the k smallest E_v / q_v is sequential sampling without replacement
    # (Kool et al. 2019). Once q's support is used up, zero-mass tokens follow by index, a deterministic choice the
    # verifier models as a one-hot proposal.
    race = torch.empty_like(q).exponential_(1, generator=generator)
    fallback = -1.0 - torch.arange(q.shape[-1], device=q.device, dtype=q.dtype)
    return torch.where(q > 0, q / race, fallback).topk(k, dim=-1).indices


@dataclass(frozen=True)
class Level:
    """One level of a static tree, indexed on the models' device once per tree (`tree_levels`): drafting a level
    then copies nothing from the host and reads nothing back, level after level and step after step (issue 22)."""

    k: int
    """Children each parent draws: as many as the level's widest parent needs."""
    parent: torch.Tensor
    """(n,) each node's parent among the F nodes of the level above (0: the root, for depth 1)."""
    rank: torch.Tensor
    """(n,) each node's rank among its siblings."""


def tree_levels(tree: Tree, device: torch.device | str) -> tuple[Level, ...]:
    """A static tree's levels, depth 1 first, their index tensors on `device` (read from the tree on the host)."""
    if tree.level_sizes is None:
        raise ValueError("tree_levels needs a static tree (static_tree / tree_from_paths); use dynamic_tree_* here")
    parents, rank = tree.parents.cpu(), tree.rank.cpu()
    levels, start, parent_start = [], 0, -1  # the root's children have parent -1
    for size in tree.level_sizes:
        nodes = slice(start, start + size)
        k = int(rank[nodes].max()) + 1
        levels.append(Level(k, (parents[nodes] - parent_start).to(device), rank[nodes].to(device)))
        start, parent_start = start + size, start
    return tuple(levels)


def draft_level(level: Level, q: torch.Tensor, rule: SiblingRule, generator: torch.Generator | None) -> torch.Tensor:
    """Tokens of a static tree's nodes at one level (B, n) from q (B, F, V) at the F nodes of the level above.

    F is 1 (the root) for depth 1. Each parent draws as many children as the widest parent of the level needs and
    keeps its first c, which are still a draw of c children under every `SiblingRule`.
    """
    children = draw_children(q, level.k, rule, generator)  # (B, F, k)
    return children[:, level.parent, level.rank]  # (B, n)


@dataclass(frozen=True)
class DynamicTree:
    """EAGLE-2 candidate pool while drafting (Li et al. 2024): every child proposed so far and its path score."""

    tokens: torch.Tensor
    """(B, M) token of each candidate; level order, each expanded node's top_k children contiguous by rank."""
    parents: torch.Tensor
    """(B, M) parent candidate of each candidate, -1 for the root's children."""
    scores: torch.Tensor
    """(B, M) cumulative draft log-prob of the path from the root to each candidate."""
    depth: torch.Tensor
    """(M,) depth of each candidate (the same on every row)."""
    frontier: torch.Tensor
    """(B, top_k) candidates the draft forwards next: the best top_k of the newest level."""
    top_k: int
    """Children per expanded node, and nodes expanded per level."""
    num_levels: int
    """Levels drafted so far."""


def dynamic_tree_start(logprobs: torch.Tensor, top_k: int) -> DynamicTree:
    """Pool of the root's top_k children from the draft's log-probs at the root (B, V)."""
    scores, tokens = logprobs.float().topk(top_k, dim=-1)  # (B, K)
    B, dev = tokens.shape[0], tokens.device
    return DynamicTree(
        tokens=tokens,
        parents=torch.full((B, top_k), -1, device=dev),
        scores=scores,
        depth=torch.ones(top_k, dtype=torch.long, device=dev),
        frontier=torch.arange(top_k, device=dev).expand(B, top_k),
        top_k=top_k,
        num_levels=1,
    )


def dynamic_tree_expand(tree: DynamicTree, logprobs: torch.Tensor) -> DynamicTree:
    """Add the top_k children of each frontier node, given the draft's log-probs there (B, top_k, V).

    The next frontier is the top_k new candidates by cumulative log-prob (EAGLE-2's expansion phase).
    """
    B, K, M = tree.tokens.shape[0], tree.top_k, tree.tokens.shape[1]
    child_scores, child_tokens = logprobs.float().topk(K, dim=-1)  # (B, K, K)
    scores = (tree.scores.gather(1, tree.frontier)[..., None] + child_scores).flatten(1)  # (B, K*K)
    return DynamicTree(
        tokens=torch.cat([tree.tokens, child_tokens.flatten(1)], 1),
        parents=torch.cat([tree.parents, tree.frontier[..., None].expand(B, K, K).flatten(1)], 1),
        scores=torch.cat([tree.scores, scores], 1),
        depth=torch.cat([tree.depth, torch.full((K * K,), tree.num_levels + 1, device=tree.depth.device)]),
        frontier=M + scores.topk(K, dim=-1).indices,
        top_k=K,
        num_levels=tree.num_levels + 1,
    )


def dynamic_tree_select(tree: DynamicTree, budget: int) -> tuple[Tree, torch.Tensor, torch.Tensor]:
    """Keep the `budget` candidates with the best scores (EAGLE-2's reranking).

    Returns the per-row Tree, its tokens (B, budget) and the kept pool indices (B, budget), which map tree nodes
    back to the pool (e.g. to the draft cache columns of the candidates the draft forwarded).

    A child's score is its parent's plus a log-prob <= 0, and parents precede children in the pool, so a stable sort
    ranks every parent before its children: the kept set is always a tree. Siblings are top-k picks (deterministic),
    so verify with rule top_k, which is exact at any temperature.
    """
    M = tree.tokens.shape[1]
    if not 1 <= budget <= M:
        raise ValueError(f"budget must be in [1, {M}] (the candidates drafted so far), got {budget}")
    best = tree.scores.sort(dim=1, descending=True, stable=True).indices[:, :budget]  # (B, n)
    keep = best.sort(1).values  # back to level order: parents first, siblings by rank
    B, dev = keep.shape[0], keep.device
    new_index = torch.full((B, M), -1, device=dev).scatter(1, keep, torch.arange(budget, device=dev).expand(B, -1))
    old_parents = tree.parents.gather(1, keep)  # (B, n)
    parents = torch.where(old_parents >= 0, new_index.gather(1, old_parents.clamp_min(0)), -1)
    shape = Tree(
        parents=parents,
        depth=tree.depth[keep],
        rank=sibling_rank(parents),
        max_depth=tree.num_levels,
        max_children=tree.top_k,
    )
    return shape, tree.tokens.gather(1, keep), keep


def tree_ancestors(parents: torch.Tensor) -> torch.Tensor:
    """[..., i, j] = node j is node i or one of its ancestors: (..., N, N) bool from parents (..., N)."""
    N = parents.shape[-1]
    # Reachability by repeated squaring: after s squarings, paths of up to 2**s parent steps; no host sync.
    reach = F.one_hot(parents + 1, N + 1)[..., 1:].float() + torch.eye(N, device=parents.device)
    for _ in range(max(N - 1, 1).bit_length()):
        reach = (reach @ reach).clamp_max(1)
    return reach > 0


def tree_attention_mask(
    parents: torch.Tensor, key_valid: torch.Tensor, dtype: torch.dtype | None = None
) -> torch.Tensor:
    """Mask of N tree queries over L cached keys then the N tree keys -> (B, 1, N, L + N).

    parents: (N,) or (B, N), -1 = sees only the cache (the top of the tree in this forward).
    key_valid: (B, L) bool, False at cache holes (left padding, rejected drafts).
    Returns bool (True = attend) when dtype is None, else an additive mask (0 / dtype's min), which HF eager attention
    needs (it adds the mask to the scores) and SDPA accepts too.
    """
    B, L, N = key_valid.shape[0], key_valid.shape[1], parents.shape[-1]
    tree = tree_ancestors(parents).expand(B, N, N)
    mask = torch.cat([key_valid[:, None, :].expand(B, N, L), tree], -1)[:, None]  # (B, 1, N, L + N)
    if dtype is None:
        return mask
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, torch.finfo(dtype).min)


def tree_position_ids(depth: torch.Tensor, base_positions: torch.Tensor) -> torch.Tensor:
    """Rope positions (B, N): the root's position (B,) + each node's depth (N,) or (B, N); siblings share one."""
    return base_positions[:, None] + depth


def verify_layout(
    tree: Tree, key_valid: torch.Tensor, root_positions: torch.Tensor, dtype: torch.dtype | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Mask (B, 1, N+1, L+N+1) and positions (B, N+1) for the target forward over [root, nodes] after L cached keys.

    root_positions: (B,) position of the pending token, i.e. each row's real cached tokens.
    """
    B = key_valid.shape[0]
    parents = torch.cat([torch.full((B, 1), -1, device=key_valid.device), tree.parents.expand(B, -1) + 1], 1)
    depth = torch.cat([torch.zeros(B, 1, dtype=torch.long, device=key_valid.device), tree.depth.expand(B, -1)], 1)
    return tree_attention_mask(parents, key_valid, dtype), tree_position_ids(depth, root_positions)


def accepted_path_indices(parents: torch.Tensor, last: torch.Tensor, max_depth: int) -> torch.Tensor:
    """Nodes on the path from the root to `last` (B,) (-1: none accepted) -> (B, max_depth) by depth, -1 padded.

    The cache layer keeps the root's column and these nodes' columns (column 1 + node in the verify forward).
    """
    B = last.shape[0]
    parents = parents.expand(B, -1)
    up = [last]  # deepest first
    for _ in range(max_depth - 1):
        up.append(torch.where(up[-1] >= 0, parents.gather(1, up[-1].clamp_min(0)[:, None])[:, 0], -1))
    up = torch.stack(up, 1)  # (B, D): last, its parent, ..., then -1
    n = (up >= 0).sum(1, keepdim=True)  # (B, 1) accepted count
    j = torch.arange(max_depth, device=last.device)
    return torch.where(j < n, up.gather(1, (n - 1 - j).clamp_min(0)), -1)


def verify_tree_greedy(
    tree: Tree, tokens: torch.Tensor, target_logits: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Temperature 0: accept the deepest node whose whole path matches the target's argmax.

    tokens: (B, N) node tokens; target_logits: (B, N+1, V) at [root, nodes] (probs work too).
    Returns the accepted path (B, max_depth) of node indices (-1 padded) and the next token (B,): the target's argmax
    after the path (a correction, or a bonus token after a leaf). Emitting path tokens then it equals target-only
    greedy decoding, since every accepted node is the target's argmax given its ancestors.
    """
    B = tokens.shape[0]
    parents = tree.parents.expand(B, -1)
    argmax = target_logits.argmax(-1)  # (B, N+1)
    match = tokens == argmax.gather(1, parents + 1)  # (B, N): node is the target's choice after its parent
    ok = ~(tree_ancestors(parents) & ~match[:, None, :]).any(-1)  # (B, N): node and all its ancestors match
    last = torch.where(ok, tree.depth.expand(B, -1), 0).argmax(1)  # deepest matching node (first on ties)
    last = torch.where(ok.any(1), last, -1)
    return accepted_path_indices(parents, last, tree.max_depth), argmax.gather(1, (last + 1)[:, None])[:, 0]


def _proposal(q_left: torch.Tensor | None, x: torch.Tensor, rule: SiblingRule, V: int) -> torch.Tensor:
    """Distribution (B, V) sibling x (B,) was drawn from, given the earlier siblings (already removed from q_left)."""
    one_hot = F.one_hot(x, V).float()
    if rule == "top_k":
        return one_hot
    mass = q_left.sum(-1, keepdim=True)
    # Support used up (sample rule): draw_children then picks tokens deterministically, a one-hot proposal.
    return torch.where(mass > 0, q_left / mass.clamp_min(torch.finfo(q_left.dtype).tiny), one_hot)


def verify_tree_sample(
    tree: Tree,
    tokens: torch.Tensor,
    p: torch.Tensor,
    q: torch.Tensor | None,
    rule: SiblingRule,
    generator: torch.Generator | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Multi-candidate recursive rejection sampling over a tree; the emitted tokens are distributed exactly as p.

    tokens: (B, N); p: (B, N+1, V) warped target probs at [root, nodes]; q: (B, N+1, V) warped draft probs the
    children of [root, nodes] were drawn from (leaf rows unused), or None for rule top_k.
    Returns the accepted path (B, max_depth) of node indices (-1 padded) and the next token (B,).

    At a node with target distribution p, children x_1..x_k are tried in draw order. Sibling i was drawn from a
    proposal Q_i that depends only on x_1..x_{i-1}: q (sample_iid, Miao et al. 2023 SpecInfer Thm. 4.2), q with
    x_1..x_{i-1} removed and renormalised (sample: without replacement, Jeon et al. 2024 "Recursive Speculative
    Decoding"), or one-hot(x_i) (top_k: deterministic picks; the residual is p with x_i zeroed). x_i is accepted with
    probability min(1, p(x_i) / Q_i(x_i)); on rejection p <- norm(max(0, p - Q_i)) and the next sibling is tried; if
    all are rejected the token is sampled from the last residual; an accepted node repeats this with its own p and
    children, and after an accepted leaf the bonus token comes from p at the leaf.
    Why it is exact: given x_1..x_{i-1} and the earlier coins, x_i ~ Q_i and the residual does not depend on x_i, so
    one trial emits v with probability min(p(v), Q_i(v)) + (1 - sum min(p, Q_i)) * norm(max(0, p - Q_i))(v) = p(v)
    once the remaining trials emit the residual exactly; backward induction over siblings and depth gives p for every
    emitted token. Using q unchanged for siblings drawn without replacement, or skipping the residual update, is
    biased (tests/test_tree.py shows the bias is detected).
    """
    if q is None and rule != "top_k":
        raise ValueError(f"rule {rule!r} needs the draft probs q its siblings were sampled from; got q=None")
    B, N = tokens.shape
    parents, rows = tree.parents.expand(B, -1), torch.arange(B, device=tokens.device)
    children = torch.full((B, (N + 1) * tree.max_children), -1, device=tokens.device)
    slot = (parents + 1) * tree.max_children + tree.rank.expand(B, -1)
    children = children.scatter(1, slot, torch.arange(N, device=tokens.device).expand(B, -1))
    children = children.view(B, N + 1, tree.max_children)  # (B, N+1, K): children of [root, nodes] by rank
    coins = torch.rand(B, tree.max_depth, tree.max_children, device=p.device, generator=generator)
    at = torch.zeros(B, dtype=torch.long, device=tokens.device)  # current node, as a row of p / q (0 = root)
    p_now = p[:, 0]  # (B, V) target distribution left at the current node
    q_left = q[:, 0] if q is not None else None  # (B, V) draft mass not yet drawn at the current node
    searching = torch.ones(B, dtype=torch.bool, device=tokens.device)
    for d in range(tree.max_depth):
        moved = torch.zeros_like(searching)
        for r in range(tree.max_children):
            child = children[rows, at, r]  # (B,)
            trying = searching & ~moved & (child >= 0)
            x = tokens.gather(1, child.clamp_min(0)[:, None])[:, 0]  # (B,)
            Q = _proposal(q_left, x, rule, p.shape[-1])  # (B, V)
            p_x, Q_x = p_now.gather(1, x[:, None])[:, 0], Q.gather(1, x[:, None])[:, 0]
            accept = trying & (coins[:, d, r] * Q_x < p_x)  # u < p/Q without dividing by Q
            reject = trying & ~accept
            residual = (p_now - Q).clamp_min(0)
            total = residual.sum(-1, keepdim=True)
            # p == Q leaves a zero residual, reachable only by rounding (x is then always accepted): keep p.
            residual = torch.where(total > 0, residual / total.clamp_min(torch.finfo(p.dtype).tiny), p_now)
            p_now = torch.where(accept[:, None], p[rows, child + 1], torch.where(reject[:, None], residual, p_now))
            if q is not None:
                drawn = q_left.scatter(1, x[:, None], 0.0) if rule == "sample" else q_left  # without replacement
                q_left = torch.where(accept[:, None], q[rows, child + 1], torch.where(reject[:, None], drawn, q_left))
            at = torch.where(accept, child + 1, at)
            moved = moved | accept
        searching = searching & moved
    return accepted_path_indices(parents, at - 1, tree.max_depth), sample(p_now, generator)
