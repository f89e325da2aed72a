"""Token trees through the whole engine: greedy identity, exact sampling, KV compaction, CLI, bench and eval sweep.

The toy model reads the previous token back from its KV cache as the last column its query may see before its own,
so a tree node reads its parent: a wrong tree mask, a wrong position id or a wrong cache compaction after a step all
change the distribution of the emitted tokens.

Run the CUDA checks on a GPU machine: python -m pytest tests/test_runtime_tree.py -q -m gpu
"""

import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from helpers.models import (
    GPU_PROMPTS,
    LLAMA_PROMPTS,
    assert_same_up_to_ties,
    gpu_llama,
    gpu_perturbed,
    hf_greedy,
    per_row_tree,
    perturbed,
    spread_llama,
    tiny_llama,
)
from helpers.stats import (
    CUDA_SAMPLING,
    JOINT_PROMPTS,
    SEQ_LEN,
    SEQ_PROMPTS,
    SEQ_STOP,
    TrigramLM,
    V,
    chi_square_pvalue,
    exact_joint,
    g_test_pvalue,
    llama_joint2,
    llama_joint_pvalues,
    sequence_pvalues,
    sequence_tables,
)
from helpers.syncs import count_host_syncs

import specdec_runtime.tree_step as tree_step
from specdec_runtime.bench import format_bench_table, run_bench
from specdec_runtime.engine import SamplingParams, generate
from specdec_runtime.kv import make_state
from specdec_runtime.llama import Llama
from specdec_runtime.tree import DynamicTreeShape, accepted_path_indices, parse_tree, tree_size, verify_layout

# Tiny models: intra-op thread wake-ups cost more than the maths on a shared 2-core machine.
pytestmark = pytest.mark.usefixtures("one_thread")


# ------------------------------------------------------------------------------------------------- greedy identity

TREES = ["2,2", "3,2,1", "1,1,1,1", "dynamic:8:3:4", "dynamic:5"]


@pytest.fixture(scope="module")
def llamas():
    target = tiny_llama(0)
    return {"target": target, "near": perturbed(target, 0.004, seed=2)}


@pytest.mark.parametrize("backend", ["hf", "compact"])
@pytest.mark.parametrize("draft_name", ["near", "self"])
def test_tree_greedy_identity_with_target_only(llamas, backend, draft_name):
    target = llamas["target"]
    draft = target if draft_name == "self" else llamas[draft_name]
    reference = hf_greedy(target, LLAMA_PROMPTS, 24)  # ragged batch: prompts of 1 to 9 tokens
    if backend == "compact":
        target, draft = Llama.from_hf(target), Llama.from_hf(draft)
    taus = {}
    for spec in TREES:
        result = generate(target, draft, LLAMA_PROMPTS, tree=spec, max_new_tokens=24)
        assert result.tokens == reference, spec
        agg = result.stats.aggregate()
        depth, nodes = tree_size(parse_tree(spec))
        assert agg["nodes_per_step"] == nodes and len(agg["per_position_acceptance"]) == depth
        taus[spec] = agg["mean_accepted_length"]
    if draft_name == "self":  # every static path is the target's own: the whole depth plus the bonus token
        assert taus["2,2"] == 3.0 and taus["3,2,1"] == 4.0 and taus["1,1,1,1"] == 5.0
    if draft_name == "near":  # rejections and acceptances both exercised
        assert all(1 < tau < 5 for tau in taus.values()), taus


@pytest.mark.parametrize("backend", ["hf", "compact"])
def test_tree_greedy_identity_with_eos_inside_the_tree(llamas, backend):
    target, draft = llamas["target"], llamas["near"]
    free = hf_greedy(target, LLAMA_PROMPTS, 24)
    eos = free[0][6]
    reference = hf_greedy(target, LLAMA_PROMPTS, 24, eos=eos)
    assert reference[0][-1] == eos and len(reference[0]) < 24
    if backend == "compact":
        target, draft = Llama.from_hf(target), Llama.from_hf(draft)
    for spec in ("3,2,1", "dynamic:6:3:2"):
        for max_new in (24, 5):
            result = generate(target, draft, LLAMA_PROMPTS, tree=spec, max_new_tokens=max_new, stop_token_ids=[eos])
            assert result.tokens == [row[:max_new] for row in reference], (spec, max_new)


def test_static_tree_steps_draft_without_host_syncs(llamas, monkeypatch):
    """Issue 22: every level of a static tree is drafted with index tensors the plan put on the models' device once
    (`tree.tree_levels`), so no step copies an index from the host or reads one back; on CUDA each did, per level
    and step. Greedy output stays the target's."""
    target, draft = Llama.from_hf(llamas["target"]), Llama.from_hf(llamas["near"])
    reference = hf_greedy(llamas["target"], LLAMA_PROMPTS, 16)
    syncs = count_host_syncs(monkeypatch, tree_step, ("_draft_static",))
    draft_level, levels = tree_step.draft_level, []

    def recorded(level, *args):
        levels.append(level)
        return draft_level(level, *args)

    monkeypatch.setattr(tree_step, "draft_level", recorded)
    for spec in ("3,2,1", "2,2,2,2"):
        assert generate(target, draft, LLAMA_PROMPTS, tree=spec, max_new_tokens=16).tokens == reference, spec
    assert not syncs, syncs
    assert len(levels) > 3 * (3 + 4) and len({id(level.parent) for level in levels}) == 3 + 4  # one per level


def test_tree_and_chain_agree_on_a_chain_shaped_tree(llamas):
    """A '1,1,1' tree is the chain of 3 (greedy draft rule): same tokens and counts, at T = 0 and at T > 0."""
    target, draft = llamas["target"], llamas["near"]
    for sampling, rule in ((SamplingParams(), "greedy"), (SamplingParams(1.0), "greedy")):
        kwargs = dict(draft_rule=rule, sampling=sampling, max_new_tokens=16)
        chain = generate(
            target, draft, LLAMA_PROMPTS, num_draft_tokens=3, generator=torch.Generator().manual_seed(0), **kwargs
        )
        tree = generate(
            target, draft, LLAMA_PROMPTS, tree="1,1,1", generator=torch.Generator().manual_seed(0), **kwargs
        )
        # Same draws too: one coin per position, then the correction from p with the rejected token removed.
        assert tree.tokens == chain.tokens, sampling
        a, b = chain.stats.aggregate(), tree.stats.aggregate()
        assert b["nodes_per_step"] == a["nodes_per_step"] == 3
        assert b["draft_forwards"] == 3 * (b["target_forwards"] - 1) + 1  # one draft forward per level, as a chain
        assert a["per_position_acceptance"] == b["per_position_acceptance"]


def test_bad_tree_requests_raise_clear_errors(llamas):
    target, draft = llamas["target"], llamas["near"]
    with pytest.raises(ValueError, match="needs a draft model"):
        generate(target, None, [[1, 2]], tree="2,2")
    with pytest.raises(ValueError, match="is not '4,2,2,1'"):
        generate(target, draft, [[1, 2]], tree="2;2")
    with pytest.raises(ValueError, match="one static shape for all rows"):
        generate(target, draft, [[1, 2]], tree=per_row_tree([[-1, 0]]))
    with pytest.raises(ValueError, match="exceeds the context window"):  # the tree's depth counts as gamma
        generate(target, draft, [[1] * 240], tree="1,1,1,1,1,1,1,1,1,1", max_new_tokens=8)


def test_parse_tree():
    tree = parse_tree("4,2,2,1")
    assert tree.num_nodes == 4 + 8 + 16 + 16 and tree.max_depth == 4 and tree.level_sizes == (4, 8, 16, 16)
    assert parse_tree("dynamic:16") == DynamicTreeShape(nodes=16, depth=6, top_k=8)
    assert parse_tree("dynamic:3") == DynamicTreeShape(nodes=3, depth=3, top_k=3)
    assert parse_tree(" dynamic:30:3:4 ") == DynamicTreeShape(nodes=30, depth=3, top_k=4)
    for bad, match in [
        ("", "is not"),
        ("4,x", "is not"),
        ("dynamic:", "is not"),
        ("dynamic:4:2", "is not"),
        ("0,2", "counts >= 1"),
        ("dynamic:0", "nodes, depth, top_k >= 1"),
        ("dynamic:100:2:4", "fewer than nodes=100"),
    ]:
        with pytest.raises(ValueError, match=match):
            parse_tree(bad)


# ----------------------------------------------------------------------------------- exact sampling, full engine


def colliding_tables(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Target and draft tables where the draft's favourite is the token after the target's mode, so the target's mode
    is usually a later sibling: the first sibling gets rejected and the residual decides. The draft also proposes
    token 0, which the target never emits."""
    gen = torch.Generator().manual_seed(seed)
    target = 2.0 * torch.randn(V + 1, V, 2, V, generator=gen)
    target[..., 0] = float("-inf")
    draft = target.clamp_min(-10.0) + torch.randn(V + 1, V, 2, V, generator=gen)
    draft = draft.scatter_add(-1, (target.argmax(-1, keepdim=True) + 1) % V, torch.full((V + 1, V, 2, 1), 3.0))
    draft[..., 0] += 1.0
    return target, draft


PROMPTS = {"short": [3], "long": [4, 1, 5, 2]}
DRAWS = 12_000  # per prompt kind


def sample_tree_joint(target, draft, sampling, rule, tree, seed=0) -> dict[str, torch.Tensor]:
    """(DRAWS, 3) first three emitted tokens per prompt kind, from one ragged batch of interleaved prompts."""
    result = generate(
        target,
        draft,
        [PROMPTS["short"], PROMPTS["long"]] * DRAWS,
        draft_rule=rule,
        sampling=sampling,
        max_new_tokens=3,
        generator=torch.Generator().manual_seed(seed),
        tree=tree,
    )
    tokens = torch.tensor(result.tokens)  # (2 * DRAWS, 3)
    return {kind: tokens[i::2] for i, kind in enumerate(("short", "long"))}


def assert_target_distributed(draws: torch.Tensor, joint: torch.Tensor, label: str) -> None:
    """G-test per emitted position (its marginal) and a chi-square test of the joint of all three."""
    for i in range(3):
        marginal = joint.sum(dim=tuple(d for d in range(3) if d != i)).double()
        if (marginal > 0).sum() == 1:  # a certain token (top-p can leave one): the G-test has no degree of freedom
            assert (draws[:, i] == marginal.argmax()).all(), f"{label}: position {i}"
        else:
            assert g_test_pvalue(draws[:, i], marginal) > 1e-4, f"{label}: position {i}"
    flat = (draws * torch.tensor([V * V, V, 1])).sum(1)
    assert chi_square_pvalue(torch.bincount(flat, minlength=V**3), joint) > 1e-4, f"{label}: joint"


@pytest.fixture(scope="module")
def toys():
    target, draft = colliding_tables(0)
    return TrigramLM(target), TrigramLM(draft), target


@pytest.mark.parametrize(
    "tree,sampling,rule",
    [
        ("2,2", SamplingParams(1.0), "sample"),  # siblings without replacement, recursive rejection
        ("3,1", SamplingParams(1.0), "greedy"),  # top-k siblings: one-hot proposals
        ("2,1,1", SamplingParams(0.7, top_k=3), "sample"),  # three levels: a bonus token after a full path
        ("3,2", SamplingParams(1.3, top_p=0.8), "sample"),  # more siblings than the warped support at times
        ("dynamic:5:3:2", SamplingParams(1.0), "sample"),  # EAGLE-2 tree: top-k picks, per-row shapes
        ("dynamic:4:2:3", SamplingParams(0.8, top_p=0.9), "greedy"),
    ],
    ids=["static-sample", "static-topk", "deep-topk3", "wide-topp", "dynamic", "dynamic-topp"],
)
def test_tree_output_is_distributed_as_target_only_sampling(toys, tree, sampling, rule):
    target, draft, table = toys
    for kind, draws in sample_tree_joint(target, draft, sampling, rule, tree).items():
        assert_target_distributed(draws, exact_joint(table, PROMPTS[kind], sampling), f"{tree} {kind}")


def test_tree_acceptance_is_partial_on_the_toys(toys):
    target, draft, _ = toys
    result = generate(
        target,
        draft,
        [PROMPTS["long"]] * 2000,
        tree="2,2",
        draft_rule="sample",
        sampling=SamplingParams(1.0),
        max_new_tokens=8,
        generator=torch.Generator().manual_seed(0),
    )
    tau = result.stats.aggregate()["mean_accepted_length"]
    assert 1.3 < tau < 2.8  # both sibling acceptances and full rejections happen


def test_a_mismatched_sibling_rule_is_caught(toys, monkeypatch):
    """Guard on the test itself: siblings drawn without replacement but verified as i.i.d. draws must fail."""
    target, draft, table = toys
    verify_tree_sample = tree_step.verify_tree_sample

    def iid_rule(tree, tokens, p, q, rule, generator):
        return verify_tree_sample(tree, tokens, p, q, "sample_iid", generator)

    monkeypatch.setattr(tree_step, "verify_tree_sample", iid_rule)
    sampling = SamplingParams(1.0)
    pvalues = []
    for kind, draws in sample_tree_joint(target, draft, sampling, "sample", "3,1").items():
        flat = (draws * torch.tensor([V * V, V, 1])).sum(1)
        pvalues.append(
            chi_square_pvalue(torch.bincount(flat, minlength=V**3), exact_joint(table, PROMPTS[kind], sampling))
        )
    assert min(pvalues) < 1e-6


@pytest.mark.parametrize(
    "backend,tree,rule", [("hf", "2,2", "sample"), ("compact", "2,2", "sample"), ("compact", "dynamic:4:2:2", "greedy")]
)
def test_tree_joint_on_tiny_llamas(backend, tree, rule):
    target, draft = spread_llama(0), spread_llama(1)
    sampling = SamplingParams(temperature=1.0, top_k=8)
    exact = {kind: llama_joint2(target, prompt, sampling) for kind, prompt in JOINT_PROMPTS.items()}
    if backend == "compact":
        target, draft = Llama.from_hf(target), Llama.from_hf(draft)
    result, pvalues = llama_joint_pvalues(
        target,
        draft,
        exact,
        sampling,
        draws=4000,
        generator=torch.Generator().manual_seed(1),
        draft_rule=rule,
        tree=tree,
    )
    assert 1.05 < result.stats.aggregate()["mean_accepted_length"] < 2.9
    for kind, pvalue in pvalues.items():
        assert pvalue > 1e-4, kind


@pytest.mark.parametrize(
    "tree,rule",
    [("2,2", "sample"), ("3,1", "greedy"), ("dynamic:4:2:2", "sample")],
    ids=["static-sample", "static-topk", "dynamic"],
)
def test_tree_whole_sequences_are_distributed_as_target_only(tree, rule):
    """Sequences of 2 (depth + 1) tokens with a stop token: full paths, bonus tokens and compactions feed forward,
    and rows leave the batch at different steps."""
    table, draft = sequence_tables(0)
    sampling, draws = SamplingParams(1.0), 12_000
    result = generate(
        TrigramLM(table),
        TrigramLM(draft),
        [SEQ_PROMPTS["short"], SEQ_PROMPTS["long"]] * draws,
        draft_rule=rule,
        sampling=sampling,
        max_new_tokens=SEQ_LEN,
        stop_token_ids=[SEQ_STOP],
        generator=torch.Generator().manual_seed(0),
        tree=tree,
    )
    assert result.stats.aggregate()["mean_accepted_length"] > 2  # full paths with their bonus token are common
    for kind, pvalue in sequence_pvalues(result.tokens, table, sampling).items():
        assert pvalue > 1e-4, kind


# ------------------------------------------------------------------------------------------------- KV compaction


def random_tree(B: int, N: int, seed: int):
    """Per-row random trees (parents before children), as tests/test_tree.py builds them."""
    gen = torch.Generator().manual_seed(seed)
    parents = [[int(torch.randint(-1, i, (1,), generator=gen)) for i in range(N)] for _ in range(B)]
    return per_row_tree(parents)


@pytest.mark.parametrize("backend", ["hf", "compact"])
def test_compacted_cache_matches_a_fresh_forward(backend):
    """Tree forwards (split in two calls, as the draft runs them) then commits of random paths, three rounds; the next
    token's logits must equal a fresh forward over the accepted sequence, row by row, and so must every node's."""
    hf = tiny_llama(4)
    model = Llama.from_hf(hf) if backend == "compact" else hf
    prompts = [[5, 17, 3, 40, 22, 9], [11], [60, 2, 33]]
    B, N = len(prompts), 7
    gen = torch.Generator().manual_seed(0)
    state = make_state(model, B, 64)
    width = max(len(p) for p in prompts)
    padded = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    with torch.no_grad():
        state.extend(padded, torch.tensor([len(p) for p in prompts]), last_only=True)
        seqs = [list(p) for p in prompts]
        for step in range(3):
            tree = random_tree(B, N, seed=step)
            tokens = torch.randint(64, (B, N + 1), generator=gen)  # [root, nodes]
            visible, positions = verify_layout(tree, torch.zeros(B, 0, dtype=torch.bool), state.lengths)
            visible = visible[:, 0]  # (B, N+1, N+1)
            split = 3
            logits = torch.cat(
                [
                    state.tree_forward(tokens[:, :split], positions[:, :split], visible[:, :split, :split]),
                    state.tree_forward(tokens[:, split:], positions[:, split:], visible[:, split:]),
                ],
                1,
            )  # (B, N+1, V)
            for b in range(B):
                for i in range(N + 1):
                    path = visible[b, i].nonzero()[:, 0].tolist()  # the root, the node's ancestors, itself
                    expected = hf(torch.tensor([seqs[b] + tokens[b, path].tolist()])).logits[0, -1]
                    torch.testing.assert_close(logits[b, i], expected, atol=1e-5, rtol=1e-4)
            last = torch.randint(-1, N, (B,), generator=gen)
            path = accepted_path_indices(tree.parents, last, tree.max_depth)  # (B, D)
            n = (path >= 0).sum(1)
            counts = (1 + n) * torch.tensor([1, 1, int(step != 1)])  # row 2 idles in step 1, as a finished row does
            state.tree_commit(F.pad(path + 1, (1, 0)), counts)
            for b in range(B):
                seqs[b] += tokens[b, F.pad(path[b] + 1, (1, 0))[: counts[b]]].tolist()
        assert state.lengths.tolist() == [len(s) for s in seqs]
        nxt = torch.randint(64, (B, 1), generator=gen)
        got = state.extend(nxt, torch.ones(B, dtype=torch.long))[:, -1]
        for b in range(B):
            expected = hf(torch.tensor([seqs[b] + [int(nxt[b])]])).logits[0, -1]
            torch.testing.assert_close(got[b], expected, atol=1e-5, rtol=1e-4)


# ---------------------------------------------------------------------------------------- CLI, bench, eval sweep


def test_cli_generate_with_a_tree(tmp_path):
    env = {**os.environ, "SPECDISTILL_CACHE": str(tmp_path / "cache")}
    cmd = [
        sys.executable,
        "-m",
        "specdistill",
        "generate",
        "--target",
        "random:tiny-llama",
        "--draft",
        "random:tiny-llama",
        "--max-new-tokens",
        "12",
        "--tree",
        "2,2",
        "hi",
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "nodes_per_step=6.0" in out.stderr
    assert "mean_accepted_length=3.00" in out.stderr  # the draft is the target: every path accepted


@pytest.mark.parametrize("command", ["generate", "bench"])
def test_cli_rejects_a_bad_tree_before_loading_models(command, capsys):
    from specdistill.cli import main

    draft = ["--draft", "no/such-model"]
    tail = ["hi"] if command == "generate" else []
    assert main([command, "--target", "no/such-model", *draft, "--tree", "dynamic:x", *tail]) == 2
    assert "tree spec 'dynamic:x'" in capsys.readouterr().err


def test_run_bench_reports_the_tree_next_to_the_chain(llamas):
    target, draft = llamas["target"], llamas["near"]
    tokenizer = SimpleNamespace(eos_token_id=None, pad_token_id=0)
    result = run_bench(
        target,
        draft,
        tokenizer,
        [[1, 2, 3, 4], [5, 6], [7, 8, 9]],
        num_draft_tokens=3,
        max_new_tokens=8,
        temperature=0.0,
        batch_size=2,
        seed=0,
        tree="3,2,1",
    )
    tree = result["tree"]
    assert tree["tree"] == "3,2,1" and result["settings"]["tree"] == "3,2,1"
    assert tree["new_tokens"] == result["speculative"]["new_tokens"] == 2 * 8 * 3  # 1 batch of 2, 8 tokens, 3 repeats
    assert tree["nodes_per_step"] == 3 + 6 + 6 and 1 <= tree["mean_accepted_length"] <= 4
    assert tree["speedup_ci"][0] <= tree["speedup"] <= tree["speedup_ci"][1]  # paired, per token
    assert tree["speedup_vs_chain_ci"][0] <= tree["speedup_vs_chain"] <= tree["speedup_vs_chain_ci"][1]
    assert tree["verify_cost_ratio"] > 0
    assert "tree 3,2,1" in format_bench_table(result) and "speedup_vs_chain" in format_bench_table(result)


def test_eval_sweep_has_tree_settings(tmp_path):
    from eval.config import EvalConfig, ServingConfig
    from eval.recommend import recommend
    from eval.results import Candidate
    from eval.sweep import EvalPrompt, run_sweep
    from specdec_runtime.loading import load_model
    from specdec_runtime.tiny import build_tiny_model

    folder = build_tiny_model("tiny-llama", tmp_path / "tiny")
    target, tokenizer = load_model(str(folder), device="cpu")
    prompts = [EvalPrompt(id=str(i), category="c", ids=tokenizer.encode(text)) for i, text in enumerate(["hi", "yo"])]
    cfg = EvalConfig(
        num_draft_tokens=[2],
        temperatures=[0.0, 1.0],
        draft_rules=["greedy"],
        trees=["2,2", "dynamic:4:2:2"],
        max_new_tokens=6,
        warmup=0,
    )
    report = run_sweep(
        target,
        tokenizer,
        [Candidate(name="self", path=folder)],
        prompts,
        cfg,
        target_spec=str(folder),
        serving=ServingConfig(min_acceptance=0.0),
        progress=False,
    )
    settings = report["candidates"][0]["settings"]
    assert [(s["temperature"], s["tree"], s["num_draft_tokens"]) for s in settings] == [
        (0.0, None, 2),
        (0.0, "2,2", 2),
        (0.0, "dynamic:4:2:2", 2),
        (1.0, None, 2),
        (1.0, "2,2", 2),
        (1.0, "dynamic:4:2:2", 2),
    ]
    assert [s["nodes_per_step"] for s in settings] == [2, 6, 4] * 2
    greedy_tree = settings[1]
    assert greedy_tree["mean_accepted_length"] == 3.0  # the draft is the target
    assert report["sweep"]["trees"] == cfg.trees
    json.dumps(report)  # the report stays JSON
    rec = recommend(report, ServingConfig(min_acceptance=0.0))
    assert rec["num_draft_tokens"] == 2 and "tree" not in rec  # promotion only picks chains


def test_eval_config_validates_tree_specs():
    from eval.config import EvalConfig

    EvalConfig(trees=["4,2,2,1", "dynamic:16"])
    with pytest.raises(ValueError, match="trees: tree spec 'four'"):
        EvalConfig(trees=["four"])
    assert EvalConfig().trees == []


# -------------------------------------------------------------------------------------------------- CUDA fast path


@pytest.mark.gpu
def test_bf16_graphs_tree_greedy_and_compaction_on_cuda():
    hf_target = gpu_llama(0)
    target = Llama.from_hf(hf_target, dtype=torch.bfloat16)
    draft = Llama.from_hf(gpu_perturbed(hf_target, 0.05), dtype=torch.bfloat16)
    reference = generate(target, None, GPU_PROMPTS, max_new_tokens=48).tokens
    taus = {}
    for spec in ("4,2,2,1", "1,1,1,1", "dynamic:16:4:4"):
        result = generate(target, draft, GPU_PROMPTS, tree=spec, max_new_tokens=48)
        taus[spec] = result.stats.aggregate()["mean_accepted_length"]
        assert_same_up_to_ties(hf_target, GPU_PROMPTS, result.tokens, reference, spec)
    assert 45 in target.graphs and 17 in target.graphs  # tree verify steps replay as CUDA graphs
    assert taus["4,2,2,1"] > taus["1,1,1,1"] > 1, taus


@pytest.mark.gpu
def test_tree_distribution_on_cuda():
    hf_target, hf_draft = gpu_llama(0, vocab_size=12, init=0.1), gpu_llama(1, vocab_size=12, init=0.1)
    target = Llama.from_hf(hf_target, dtype=torch.bfloat16)
    draft = Llama.from_hf(hf_draft, dtype=torch.bfloat16)
    sampling = CUDA_SAMPLING  # no nucleus: bf16 would move tokens across its boundary
    prompts = {"short": [5], "long": [3, 9, 1, 7, 2]}
    draws = 20_000
    for tree in ("3,2", "dynamic:6:3:3"):
        result = generate(
            target,
            draft,
            [prompts["short"], prompts["long"]] * draws,
            draft_rule="sample",
            sampling=sampling,
            max_new_tokens=2,
            generator=torch.Generator(device="cuda").manual_seed(0),
            tree=tree,
        )
        tokens = torch.tensor(result.tokens)
        flat = tokens[:, 0] * 12 + tokens[:, 1]
        for i, kind in enumerate(("short", "long")):
            counts = torch.bincount(flat[i::2], minlength=144).double()
            assert chi_square_pvalue(counts, llama_joint2(hf_target, prompts[kind], sampling)) > 1e-4, (tree, kind)
