"""Token trees: shapes, masks against brute force, greedy and exact sampling verification, HF tree forward."""

import pytest
import torch
from helpers.models import per_row_tree, tiny_llama
from helpers.stats import g_test_pvalue
from transformers import DynamicCache

from specdec_runtime.tree import (
    accepted_path_indices,
    draft_level,
    draw_children,
    dynamic_tree_expand,
    dynamic_tree_select,
    dynamic_tree_start,
    sibling_rank,
    static_tree,
    tree_attention_mask,
    tree_from_paths,
    tree_levels,
    tree_position_ids,
    verify_layout,
    verify_tree_greedy,
    verify_tree_sample,
)

# Tiny models: intra-op thread wake-ups cost more than the maths on a shared 2-core machine.
pytestmark = pytest.mark.usefixtures("one_thread")


def ancestors_by_hand(parents: list[int], i: int) -> set[int]:
    seen = {i}
    while parents[i] >= 0:
        i = parents[i]
        seen.add(i)
    return seen


# ---------------------------------------------------------------------------------------------------------- shapes


def test_static_tree_layout():
    tree = static_tree([2, 2])
    assert tree.parents.tolist() == [-1, -1, 0, 0, 1, 1]
    assert tree.depth.tolist() == [1, 1, 2, 2, 2, 2]
    assert tree.rank.tolist() == [0, 1, 0, 1, 0, 1]
    assert (tree.max_depth, tree.max_children, tree.level_sizes) == (2, 2, (2, 4))
    big = static_tree([4, 2, 2, 1])
    assert big.num_nodes == 4 + 8 + 16 + 16 and big.level_sizes == (4, 8, 16, 16) and big.max_children == 4
    assert torch.equal(sibling_rank(big.parents), big.rank)


def test_tree_from_paths_orders_levels_and_validates():
    tree = tree_from_paths([[1, 0], [0], [0, 1], [1], [0, 0], [0]])  # shuffled, with a duplicate
    assert tree.parents.tolist() == [-1, -1, 0, 0, 1]
    assert tree.rank.tolist() == [0, 1, 0, 1, 0]
    assert tree.level_sizes == (2, 3)
    with pytest.raises(ValueError, match="parent path"):
        tree_from_paths([[0], [1, 0]])
    with pytest.raises(ValueError, match="elder sibling"):
        tree_from_paths([[0], [2]])
    with pytest.raises(ValueError, match="non-empty"):
        tree_from_paths([[]])
    with pytest.raises(ValueError, match="branching"):
        static_tree([2, 0])


def test_draft_level_places_ranked_children_under_their_parents():
    tree = tree_from_paths([[0], [1], [0, 0], [0, 1], [0, 2], [1, 0]])
    q_root = torch.tensor([[[0.1, 0.5, 0.0, 0.4, 0.0]]])  # (B=1, F=1, V)
    levels = tree_levels(tree, "cpu")
    assert [(level.k, level.parent.tolist(), level.rank.tolist()) for level in levels] == [
        (2, [0, 0], [0, 1]),
        (3, [0, 0, 0, 1], [0, 1, 2, 0]),
    ]
    assert draft_level(levels[0], q_root, "top_k", None).tolist() == [[1, 3]]
    q_level1 = torch.tensor([[[0.0, 0.2, 0.3, 0.1, 0.4], [0.9, 0.0, 0.05, 0.05, 0.0]]])  # (1, 2, V)
    assert draft_level(levels[1], q_level1, "top_k", None).tolist() == [[4, 2, 1, 0]]


def test_sampled_siblings_are_distinct_even_past_the_support():
    q = torch.tensor([0.6, 0.0, 0.4, 0.0, 0.0]).expand(1000, 1, 5)
    children = draw_children(q, 5, "sample", torch.Generator().manual_seed(0))[:, 0]  # (B, 5)
    assert all(len(set(row)) == 5 for row in children.tolist())
    assert set(children[:, :2].flatten().tolist()) == {0, 2}  # support first
    assert children[:, 2:].tolist() == [[1, 3, 4]] * 1000  # then zero-mass tokens by index (deterministic)
    iid = draw_children(q, 4, "sample_iid", torch.Generator().manual_seed(0))
    assert set(iid.flatten().tolist()) == {0, 2} and (iid[..., 0] == iid[..., 1]).any()


# ---------------------------------------------------------------------------------------------- mask and positions


def random_parents(B: int, N: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [[int(torch.randint(-1, i, (1,), generator=g)) if i else -1 for i in range(N)] for _ in range(B)]


@pytest.mark.parametrize("seed", range(4))
def test_mask_and_positions_match_brute_force(seed):
    B, N, L = 3, 9, 5
    parents = random_parents(B, N, seed)
    tree = per_row_tree(parents)
    key_valid = torch.tensor([[True] * 5, [False, False, True, True, True], [False, True, False, True, True]])
    root_positions = key_valid.sum(1)
    mask = tree_attention_mask(tree.parents, key_valid)
    assert mask.shape == (B, 1, N, L + N) and mask.dtype == torch.bool
    additive = tree_attention_mask(tree.parents, key_valid, torch.float32)
    assert torch.equal(additive == 0, mask) and (additive[~mask] == torch.finfo(torch.float32).min).all()
    full_mask, positions = verify_layout(tree, key_valid, root_positions)
    for b in range(B):
        for i in range(N):
            anc = ancestors_by_hand(parents[b], i)
            expected = key_valid[b].tolist() + [j in anc for j in range(N)]
            assert mask[b, 0, i].tolist() == expected
            assert full_mask[b, 0, 1 + i].tolist() == key_valid[b].tolist() + [True] + [j in anc for j in range(N)]
            assert positions[b, 1 + i] == root_positions[b] + len(anc)
        assert full_mask[b, 0, 0].tolist() == key_valid[b].tolist() + [True] + [False] * N  # root: prefix + itself
        assert positions[b, 0] == root_positions[b]
    shared = static_tree([3, 2])  # (N,) tensors broadcast over rows
    assert torch.equal(tree_position_ids(shared.depth, root_positions), root_positions[:, None] + shared.depth)


# ----------------------------------------------------------------------------------------------- greedy verification


def test_greedy_verification_hand_made_cases():
    tree = static_tree([2, 2])  # nodes 0, 1 at depth 1; 2, 3 under 0; 4, 5 under 1
    tokens = torch.tensor([[1, 2, 3, 4, 5, 6]]).expand(4, 6)
    argmax = torch.tensor(
        [
            [7, 0, 0, 0, 0, 0, 0],  # never: the root's argmax is no child
            [2, 0, 6, 0, 0, 0, 0],  # second branch to its second leaf, bonus 0 from the leaf
            [1, 7, 5, 0, 0, 0, 0],  # node 0 then a correction; node 4 matches node 1's argmax but node 1 is rejected
            [1, 4, 0, 0, 5, 0, 0],  # first branch to its second leaf, bonus 5
        ]
    )
    logits = 10 * torch.nn.functional.one_hot(argmax, 8).float()  # (B, N+1, V)
    path, nxt = verify_tree_greedy(tree, tokens, logits)
    assert path.tolist() == [[-1, -1], [1, 5], [0, -1], [0, 3]]
    assert nxt.tolist() == [7, 0, 7, 5]
    # Temperature 0 through the sampling verifier (one-hot p and proposals) takes the same decisions.
    path_s, nxt_s = verify_tree_sample(tree, tokens, logits.softmax(-1).round(), None, "top_k", None)
    assert torch.equal(path_s, path) and torch.equal(nxt_s, nxt)


def path_node_mask(path: torch.Tensor, num_nodes: int) -> torch.Tensor:
    """Accepted path (B, D) -> (B, N) bool over tree nodes: the column mask a hole-tolerant cache keeps."""
    hit = torch.zeros(path.shape[0], num_nodes + 1, dtype=torch.bool, device=path.device)
    return hit.scatter(1, path + 1, True)[:, 1:]  # -1 padding lands in the dropped column 0


def test_accepted_path_indices_and_node_mask():
    parents = torch.tensor([[-1, -1, 0, 0, 1, 4], [-1, 0, 1, 2, -1, 4]])
    path = accepted_path_indices(parents, torch.tensor([5, -1]), 4)
    assert path.tolist() == [[1, 4, 5, -1], [-1, -1, -1, -1]]
    path = accepted_path_indices(parents, torch.tensor([2, 3]), 4)
    assert path.tolist() == [[0, 2, -1, -1], [0, 1, 2, 3]]
    assert path_node_mask(path, 6).tolist() == [[True, False, True, False, False, False], [True] * 4 + [False] * 2]


# ----------------------------------------------------------------------------------------- dynamic tree (EAGLE-2)


def test_dynamic_tree_pool_and_selection_match_brute_force():
    g = torch.Generator().manual_seed(0)
    B, V, K = 2, 7, 2
    root_lp = torch.randn(B, V, generator=g).log_softmax(-1)
    pool = dynamic_tree_start(root_lp, K)
    level_lps = []
    for _ in range(2):
        level_lps.append(torch.randn(B, K, V, generator=g).log_softmax(-1))
        pool = dynamic_tree_expand(pool, level_lps[-1])
    assert pool.tokens.shape == (B, K + 2 * K * K) and pool.num_levels == 3
    assert pool.depth.tolist() == [1] * K + [2] * K * K + [3] * K * K
    for b in range(B):
        assert pool.tokens[b, :K].tolist() == root_lp[b].topk(K).indices.tolist()
        parents_of_level = list(range(K))  # level 1 is expanded whole
        for level, lp in enumerate(level_lps):
            start = K + level * K * K
            for s, parent in enumerate(parents_of_level):
                children = lp[b, s].topk(K)
                for r in range(K):
                    i = start + s * K + r
                    assert pool.parents[b, i] == parent and pool.tokens[b, i] == children.indices[r]
                    assert torch.isclose(pool.scores[b, i], pool.scores[b, parent] + children.values[r])
            parents_of_level = (start + pool.scores[b, start : start + K * K].topk(K).indices).tolist()
        assert pool.frontier[b].tolist() == parents_of_level  # the best K of the newest level

    tree, tokens, keep = dynamic_tree_select(pool, 5)
    assert torch.equal(tokens, pool.tokens.gather(1, keep)) and torch.equal(tree.depth, pool.depth[keep])
    for b in range(B):
        assert sorted(pool.scores[b, keep[b]].tolist()) == sorted(pool.scores[b].topk(5).values.tolist())
        for i, parent in enumerate(tree.parents[b].tolist()):
            assert parent < i and pool.parents[b, keep[b, i]] == (keep[b, parent] if parent >= 0 else -1)
    path, nxt = verify_tree_greedy(tree, tokens, torch.randn(B, 6, V, generator=g))
    assert path.shape == (B, 3) and nxt.shape == (B,)


def test_dynamic_selection_keeps_a_parent_tied_with_its_child():
    root_lp = torch.tensor([[-0.1, -2.0, -9.0, -9.0]])
    pool = dynamic_tree_start(root_lp, 2)
    pool = dynamic_tree_expand(pool, torch.tensor([[[0.0, -5.0, -9.0, -9.0], [-1.0, -3.0, -9.0, -9.0]]]))
    tree, tokens, _ = dynamic_tree_select(pool, 1)  # node 0 and its child share the best score -0.1
    assert tree.parents.tolist() == [[-1]] and tokens.tolist() == [[0]]
    tree, tokens, _ = dynamic_tree_select(pool, 2)
    assert tree.parents.tolist() == [[-1, 0]] and tokens.tolist() == [[0, 0]] and tree.depth.tolist() == [[1, 2]]


# -------------------------------------------------------------------------------------- sampling exactness (G-test)

V = 4
P_ROOT = torch.tensor([0.5, 0.3, 0.2, 0.0], dtype=torch.float64)
Q_ROOTS = {
    "q_off_target": torch.tensor([0.1, 0.1, 0.3, 0.5], dtype=torch.float64),  # mass where p has none, little on mode
    "q_on_mode": torch.tensor([0.7, 0.0, 0.1, 0.2], dtype=torch.float64),  # iid siblings collide on p's mode
}


def sparse_table(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """Random conditional distributions over V with about a quarter of the entries zero."""
    g = torch.Generator().manual_seed(seed)
    table = torch.rand(*shape, V, generator=g, dtype=torch.float64)
    table = torch.where(torch.rand(*shape, V, generator=g, dtype=torch.float64) < 0.25, 0.0, table)
    table[..., 0] += 1e-3 * (table.sum(-1) == 0)  # no empty row
    return table / table.sum(-1, keepdim=True)


P_NEXT, P_NEXT2 = sparse_table((V,), 1), sparse_table((V, V), 2)  # p(. | t1), p(. | t1, t2)
Q_NEXT = sparse_table((V,), 3)  # q(. | t1)


def run_tree_step(q_root: torch.Tensor, draw: str, check: str, n: int, seed: int) -> torch.Tensor:
    """One speculative step over a [3, 2] tree for n rows, completed to 3 tokens by target-only sampling -> (n, 3)."""
    g = torch.Generator().manual_seed(seed)
    tree = static_tree([3, 2])
    levels = tree_levels(tree, "cpu")
    t1 = draft_level(levels[0], q_root.float().expand(n, 1, V), draw, g)  # (n, 3)
    q1 = Q_NEXT.float()[t1]  # (n, 3, V) draft at the depth-1 nodes
    t2 = draft_level(levels[1], q1, draw, g)  # (n, 6)
    tokens = torch.cat([t1, t2], 1)  # (n, 9)
    t2_parent = t1.gather(1, tree.parents[3:].expand(n, 6))  # (n, 6) token of each leaf's parent
    p = torch.cat([P_ROOT.float().expand(n, 1, V), P_NEXT.float()[t1], P_NEXT2.float()[t2_parent, t2]], 1)
    q = torch.cat([q_root.float().expand(n, 1, V), q1, torch.zeros(n, 6, V)], 1)  # leaves: no children
    path, nxt = verify_tree_sample(tree, tokens, p, q, check, g)
    accepted = (path >= 0).sum(1)  # (n,)
    emitted = torch.where(path >= 0, tokens.gather(1, path.clamp_min(0)), 0)
    out = torch.cat([emitted, torch.zeros(n, 1, dtype=torch.long)], 1).scatter(1, accepted[:, None], nxt[:, None])
    # Fill in the rest of the 3 tokens from the target itself, as the next steps would (exact by induction).
    fill2 = torch.multinomial(P_NEXT.float()[out[:, 0]], 1, generator=g)[:, 0]
    out[:, 1] = torch.where(accepted >= 1, out[:, 1], fill2)
    fill3 = torch.multinomial(P_NEXT2.float()[out[:, 0], out[:, 1]], 1, generator=g)[:, 0]
    out[:, 2] = torch.where(accepted >= 2, out[:, 2], fill3)
    return out


JOINT = P_ROOT[:, None, None] * P_NEXT[:, :, None] * P_NEXT2  # (V, V, V) exact law of the first 3 tokens
N_DRAWS = 40_000  # wrong rules give G in the thousands at this size (df <= 63)


@pytest.mark.parametrize("q_name", list(Q_ROOTS))
@pytest.mark.parametrize("rule", ["sample", "sample_iid", "top_k"])
def test_tree_sampling_is_exactly_target_distributed(q_name, rule):
    out = run_tree_step(Q_ROOTS[q_name], rule, rule, N_DRAWS, seed=0)
    assert g_test_pvalue(out[:, 0], P_ROOT) > 1e-3
    assert g_test_pvalue(out[:, 0] * V + out[:, 1], (P_ROOT[:, None] * P_NEXT).flatten()) > 1e-3
    assert g_test_pvalue(out[:, 0] * V * V + out[:, 1] * V + out[:, 2], JOINT.flatten()) > 1e-3


@pytest.mark.parametrize("draw,check", [("sample", "sample_iid"), ("sample_iid", "sample")])
def test_mismatched_sibling_rule_is_detected(draw, check):
    # Siblings drawn without replacement but verified against q unchanged (or the reverse) are biased; this shows
    # the test above has the power to see a wrong rule.
    out = run_tree_step(Q_ROOTS["q_off_target"], draw, check, N_DRAWS, seed=0)
    assert g_test_pvalue(out[:, 0] * V + out[:, 1], (P_ROOT[:, None] * P_NEXT).flatten()) < 1e-6


# ----------------------------------------------------------------------------------------- HF tree forward (4D mask)


@pytest.mark.parametrize("attn,mask_dtype", [("sdpa", None), ("sdpa", torch.float32), ("eager", torch.float32)])
def test_hf_tree_forward_matches_path_forwards_and_greedy_decoding(attn, mask_dtype):
    model = tiny_llama(seed=0)
    model.set_attn_implementation(attn)
    prompts = [[5, 9, 13, 2, 7], [11, 3, 8]]
    B, L = 2, 4  # context = prompt[:-1], left-padded; the last prompt token is the pending root
    with torch.no_grad():
        greedy = []  # 3 greedy tokens per prompt, by plain forwards
        for prompt in prompts:
            seq = list(prompt)
            for _ in range(3):
                seq.append(int(model(torch.tensor([seq])).logits[0, -1].argmax()))
            greedy.append(seq[len(prompt) :])
        # Row 0: a [2, 2] tree with the greedy path in its second branch; row 1: a chain with a side branch.
        tree = per_row_tree([[-1, -1, 0, 0, 1, 1], [-1, 0, 1, -1, 3, 3]])
        wrong = [[(t + 1) % 64 for t in row] for row in greedy]
        tokens = torch.tensor(
            [
                [wrong[0][0], greedy[0][0], 30, 31, wrong[0][1], greedy[0][1]],
                [greedy[1][0], greedy[1][1], wrong[1][2], 40, 41, 42],
            ]
        )
        context = torch.tensor([[0] * (L - len(p) + 1) + p[:-1] for p in prompts])  # (B, L)
        key_valid = torch.tensor([[i >= L - (len(p) - 1) for i in range(L)] for p in prompts])  # (B, L)
        cache = DynamicCache()
        positions = (key_valid.long().cumsum(1) - 1).clamp_min(0)
        model(input_ids=context, position_ids=positions, attention_mask=key_valid.long(), cache=cache, use_cache=True)

        mask, positions = verify_layout(tree, key_valid, key_valid.sum(1), mask_dtype)
        roots = torch.tensor([p[-1] for p in prompts])
        logits = model(
            input_ids=torch.cat([roots[:, None], tokens], 1),  # (B, N+1): [root, nodes]
            position_ids=positions,
            attention_mask=mask,  # (B, 1, N+1, L+N+1), used as-is by HF
            cache=cache,
            use_cache=True,
        ).logits  # (B, N+1, V)

        for b, prompt in enumerate(prompts):
            for i in range(-1, tree.num_nodes):
                path = sorted(ancestors_by_hand(tree.parents[b].tolist(), i)) if i >= 0 else []
                seq = torch.tensor([prompt + tokens[b, path].tolist()])
                torch.testing.assert_close(logits[b, 1 + i], model(seq).logits[0, -1], atol=1e-5, rtol=1e-4)

    path, nxt = verify_tree_greedy(tree, tokens, logits)
    assert path.tolist() == [[1, 5, -1], [0, 1, -1]]
    for b in range(B):
        emitted = tokens[b, path[b][path[b] >= 0]].tolist() + [int(nxt[b])]
        assert emitted == greedy[b]
