"""EAGLE-3 heads in the engine (eagle3_state.py): the aux features the target hands over, every drafted token against
a from-scratch reference, greedy identity, and the exact distribution at T > 0 with a broken twin the same test rejects.

Speculative decoding is exact for any draft, so identity and distribution tests only see the target's side (the aux
capture and the wrapped cache). The draft's side (features lagging by one, rows fed the head's own states dropped on
rollback, tree nodes fed their parent's state) is checked token by token: verification is forced to accept a fixed
pattern of draft tokens, so rollbacks, refeeds and shrinking batches all happen, and every proposal must equal a
reference that recomputes the target and the head from scratch for that one sequence.
"""

from types import SimpleNamespace

import pytest
import torch
from helpers.models import LLAMA_PROMPTS, assert_same_up_to_ties, gpu_llama, hf_greedy, tiny_llama
from helpers.stats import chi_square_pvalue, joint3
from helpers.syncs import count_host_syncs

import specdec_runtime.eagle3_state as eagle3_state
import specdec_runtime.engine as engine
import specdec_runtime.tree_step as tree_step
from specdec_runtime.ab import capture_graphs
from specdec_runtime.backends import fast_model
from specdec_runtime.bench import format_bench_table, run_bench
from specdec_runtime.cpu import FusedLinear, compile_steps, cpu_eagle3, cpu_model, draft_dtype
from specdec_runtime.cpu_tune import bf16_native
from specdec_runtime.eagle3 import (
    Eagle3Cache,
    Eagle3Draft,
    embed,
    first_step_logits,
    target_aux_forward,
    to_target_logits,
)
from specdec_runtime.eagle3_state import AuxCapture, decoder_layers
from specdec_runtime.engine import SamplingParams, generate
from specdec_runtime.llama import Llama
from specdec_runtime.loading import load_draft_model

pytestmark = pytest.mark.usefixtures("one_thread")

DRAFT_IDS = torch.arange(0, 64, 2)  # half the target's vocabulary: q is 0 on every odd id


def random_head(target, ids=DRAFT_IDS, seed=0, scale=0.3) -> Eagle3Draft:
    """A random head (fc, midlayer, norm and lm_head all perturbed, so every weight shows in the proposals)."""
    draft = Eagle3Draft.from_target(target, ids, seed=seed)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(scale * torch.randn_like(p))
    return draft.eval()


@pytest.fixture(scope="module")
def pair():
    target = tiny_llama(seed=1, layers=6)  # aux layers [2, 3, 3]
    return target, random_head(target)


# --------------------------------------------------------------------------------------- the target's aux features


@pytest.mark.parametrize("backend", ["hf", "compact"])
def test_the_hooks_capture_exactly_output_hidden_states(pair, backend):
    target, draft = pair
    layers = draft.aux_layers(target.config.num_hidden_layers)
    tokens = torch.tensor([[5, 17, 3, 40, 22, 9], [11, 2, 60, 7, 7, 1]])
    _, want = target_aux_forward(target, tokens, layers)  # (B, T, 3H)
    model = target if backend == "hf" else Llama.from_hf(target)
    capture = AuxCapture([decoder_layers(model)[i] for i in layers])
    with torch.no_grad():
        if backend == "hf":
            model(input_ids=tokens)
        else:
            T = tokens.shape[1]
            model.setup_cache(2, T)
            mask = torch.ones(T, model.cache_shape[1], dtype=torch.bool).tril()[None, None].expand(2, 1, T, -1)
            pos = torch.arange(T).expand(2, T)
            model(tokens, pos, pos, mask)
    capture.close()
    torch.testing.assert_close(capture.read(2, 6), want, rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------- every proposal against a from-scratch reference


def reference_logits(target, draft, seq: list[int], path: list[int]) -> torch.Tensor:
    """The head's target-id logits (V,) for the token after `path`, drafted after seq = x_0..x_n (x_n not yet scored):
    rows 0..n-1 fed the target's features of a full forward, then one row per path token fed the previous row's
    pre-norm output."""
    n = len(seq) - 1
    with torch.no_grad():
        _, aux = target_aux_forward(target, torch.tensor([seq]), draft.aux_layers(target.config.num_hidden_layers))
        emb = embed(target, torch.tensor([seq[1:] + path]))  # emb[:, j]: the token at position j + 1
        cache = Eagle3Cache()
        logits, pre = draft(aux[:, :n], emb[:, :n], torch.arange(n)[None], cache)
        for k in range(len(path)):
            logits, pre = draft(pre[:, -1:], emb[:, n + k : n + k + 1], torch.tensor([[n + k]]), cache)
    return to_target_logits(logits[0, -1], draft.d2t, draft.target_vocab)


def forced_accepts(tokens: list[int], limit: int) -> int:
    """How many draft tokens the forced verification accepts: a fixed function of the proposals, 0..limit."""
    return sum(t // 2 for t in tokens) % (limit + 1)  # draft ids are even: halve them, or only even counts come


def target_argmax(target, seq: list[int]) -> int:
    with torch.no_grad():
        return int(target(input_ids=torch.tensor([seq])).logits[0, -1].argmax())


def record_chains(monkeypatch) -> list[torch.Tensor]:
    """engine.verify replaced by forced acceptance; returns the list each step's drafts (B, G) are appended to."""
    seen = []

    def forced(p, q, x, generator, greedy=False):  # p: (B, G + 1, V)
        seen.append(x.clone())
        G = x.shape[1]
        n = torch.tensor([forced_accepts(row, G) for row in x.tolist()])
        return n, p[torch.arange(len(n)), n].argmax(-1)

    monkeypatch.setattr(engine, "verify", forced)
    return seen


def replay_chains(target, draft, prompts, steps: list[torch.Tensor], gamma: int, max_new: int) -> list[list[int]]:
    """Check every recorded chain against the reference, prompt by prompt (rows leave the batch in prompt order);
    returns each prompt's emitted tokens under the forced rule."""
    seqs = [list(p) + [target_argmax(target, p)] for p in prompts]
    active = [i for i in range(len(prompts)) if max_new > 1]
    for x in steps:
        assert x.shape[0] == len(active), "rows left the batch at other steps than the reference's"
        for row, i in zip(x.tolist(), active):
            drafted = []
            for tok in row:
                assert tok == int(reference_logits(target, draft, seqs[i], drafted).argmax()), (i, row, drafted)
                drafted.append(tok)
            a = forced_accepts(row, gamma)
            seqs[i] += row[:a] + [target_argmax(target, seqs[i] + row[:a])]
        active = [i for i in active if len(seqs[i]) - len(prompts[i]) < max_new]
    assert not active
    return [s[len(p) :][:max_new] for s, p in zip(seqs, prompts)]


@pytest.mark.parametrize("backend", ["hf", "compact", "cpu-fast"])
def test_every_drafted_token_matches_the_reference(pair, monkeypatch, backend):
    """cpu-fast: the CPU fast path's target and head (fp32 here, so its proposals are the reference's)."""
    target, draft = pair
    steps = record_chains(monkeypatch)
    model = {"hf": lambda: target, "compact": lambda: Llama.from_hf(target), "cpu-fast": lambda: cpu_model(target)}
    fast = cpu_eagle3(draft, torch.float32) if backend == "cpu-fast" else draft
    result = generate(model[backend](), fast, LLAMA_PROMPTS, num_draft_tokens=3, max_new_tokens=16)
    assert result.tokens == replay_chains(target, draft, LLAMA_PROMPTS, steps, 3, 16)
    accepted = torch.cat([torch.tensor([forced_accepts(r, 3) for r in x.tolist()]) for x in steps])
    assert {0, 3} <= set(accepted.tolist())  # rejections and all-accepted steps (bonus + refeed) both happened


@pytest.mark.parametrize(
    "bug",
    ["features_one_position_late", "rollback_keeps_own_rows", "d2t_offset_off_by_one"],
)
def test_a_broken_draft_state_is_caught(pair, monkeypatch, bug):
    """Guard on the test above: each plausible bug changes some proposal."""
    target, draft = pair
    if bug == "d2t_offset_off_by_one":  # exact all the same (x and q agree): only the proposals show it
        scatter = eagle3_state.to_target_logits
        monkeypatch.setattr(eagle3_state, "to_target_logits", lambda logits, d2t, V: scatter(logits, d2t + 1, V))
    elif bug == "features_one_position_late":
        features = eagle3_state.AuxTargetState.features
        monkeypatch.setattr(
            eagle3_state.AuxTargetState, "features", lambda self, r: features(self, (r - 1).clamp_min(0))
        )
    else:

        def keep_own_rows(self, drop):  # crop to the engine's length only, keeping rows fed the head's own states
            c, B = self.cache, self.B
            c.lengths[:B].sub_(drop)
            c.rows[:B].copy_(torch.minimum(c.rows[:B], (c.lengths[:B] - 1).clamp_min(0)))
            c.fed[:B].copy_(torch.minimum(c.fed[:B], c.rows[:B]))

        monkeypatch.setattr(eagle3_state.Eagle3State, "rollback", keep_own_rows)
    steps = record_chains(monkeypatch)
    generate(target, draft, LLAMA_PROMPTS, num_draft_tokens=3, max_new_tokens=16)
    with pytest.raises(AssertionError):
        replay_chains(target, draft, LLAMA_PROMPTS, steps, 3, 16)


def first_child_path(parents: list[int], rank: list[int], limit: int) -> list[int]:
    """Node indices of the path through every level's rank-0 child, at most `limit` long."""
    path, parent = [], -1
    while len(path) < limit:
        child = next((j for j, (p, r) in enumerate(zip(parents, rank)) if p == parent and r == 0), None)
        if child is None:
            break
        path.append(child)
        parent = child
    return path


@pytest.mark.parametrize("tree", ["2,2,1", "dynamic:6:3:2"])
def test_every_tree_node_matches_the_reference(pair, monkeypatch, tree):
    """Each node is its parent's top-k pick under the reference (fed its ancestors' own states); the forced path runs
    through rank-0 children, so refeeds and path commits happen as in the chain."""
    target, draft = pair
    seen = []

    def forced(tree_, tokens, logits):  # logits: (B, N + 1, V), column 1 + i is node i
        B, N = tokens.shape
        parents, rank = tree_.parents.expand(B, N).tolist(), tree_.rank.expand(B, N).tolist()
        seen.append((parents, rank, tokens.tolist()))
        paths, nxt = torch.full((B, tree_.max_depth), -1), []
        for b in range(B):
            full = first_child_path(parents[b], rank[b], tree_.max_depth)
            path = full[: forced_accepts([tokens[b, j].item() for j in full], len(full))]
            paths[b, : len(path)] = torch.tensor(path, dtype=torch.long)
            nxt.append(logits[b, 1 + path[-1] if path else 0].argmax())
        return paths, torch.stack(nxt)

    monkeypatch.setattr(tree_step, "verify_tree_greedy", forced)
    prompts, max_new = LLAMA_PROMPTS, 14
    result = generate(target, draft, prompts, max_new_tokens=max_new, tree=tree)
    seqs = [list(p) + [target_argmax(target, p)] for p in prompts]
    active = list(range(len(prompts)))
    for parents, rank, tokens in seen:
        assert len(tokens) == len(active)
        for b, i in enumerate(active):
            for j, tok in enumerate(tokens[b]):
                ancestors, a = [], parents[b][j]
                while a >= 0:
                    ancestors.insert(0, tokens[b][a])
                    a = parents[b][a]
                top = reference_logits(target, draft, seqs[i], ancestors).topk(2).indices.tolist()
                assert tok == top[rank[b][j]] if tree == "2,2,1" else tok in top, (i, j)
            full = first_child_path(parents[b], rank[b], 99)
            path = [tokens[b][j] for j in full][: forced_accepts([tokens[b][j] for j in full], len(full))]
            seqs[i] += path + [target_argmax(target, seqs[i] + path)]
        active = [i for i in active if len(seqs[i]) - len(prompts[i]) < max_new]
    assert result.tokens == [s[len(p) :][:max_new] for s, p in zip(seqs, prompts)]


# ---------------------------------------------------------------------------------------------- greedy identity


@pytest.mark.parametrize("tree", [None, "2,2,1", "dynamic:6"])
@pytest.mark.parametrize("backend", ["hf", "compact", "cpu-fast", "cpu-compiled"])
def test_greedy_output_equals_target_only_greedy(pair, tree, backend):
    target, draft = pair
    want = hf_greedy(target, LLAMA_PROMPTS, 20)
    stop = want[0][5]  # prompt 0 stops mid-run, most likely in the middle of a drafted chain
    want_stop = hf_greedy(target, LLAMA_PROMPTS, 20, eos=stop)
    model = {
        "hf": lambda: target,
        "compact": lambda: Llama.from_hf(target),
        "cpu-fast": lambda: cpu_model(target),
        "cpu-compiled": lambda: compile_steps(cpu_model(target)),  # the aux hooks keep its steps eager: no graph
    }
    model = model[backend]()
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    if backend.startswith("cpu-"):  # what eval and bench run on the CPU: the head in the machine's draft dtype
        draft = fast_model(draft, draft=True)
        assert draft.cpu_fast and draft.fc.weight.dtype == draft_dtype()
    for stop_ids, expected in (((), want), ((stop,), want_stop)):
        got = generate(model, draft, LLAMA_PROMPTS, num_draft_tokens=4, max_new_tokens=20, stop_token_ids=stop_ids,
                       tree=tree)  # fmt: skip
        assert got.tokens == expected, (tree, stop_ids)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs, "a hooked target must not compile"


def test_the_cpu_fast_head_computes_what_the_head_computes(pair):
    """cpu_eagle3 lays out every linear once and changes nothing else: fp32 logits and pre-norm outputs match the
    head's; in the machine's draft dtype (bf16 where oneDNN has it) within its rounding. The head given is kept."""
    target, draft = pair
    H = target.config.hidden_size
    gen = torch.Generator().manual_seed(0)
    hidden, embeds = torch.randn(2, 5, 3 * H, generator=gen), torch.randn(2, 5, H, generator=gen)
    positions = torch.arange(5).expand(2, 5)
    with torch.no_grad():
        want_logits, want_pre = draft(hidden, embeds, positions)
        for dtype, tol in ((torch.float32, 1e-5), (draft_dtype(), 0.1)):
            fast = cpu_eagle3(draft, dtype)
            assert not any(isinstance(m, torch.nn.Linear) for m in fast.modules())
            assert sum(isinstance(m, FusedLinear) for m in fast.modules()) == 9  # fc, q, k, v, o, gate, up, down, head
            logits, pre = fast(hidden, embeds.to(dtype), positions)
            torch.testing.assert_close(logits.float(), want_logits, atol=tol, rtol=tol)
            torch.testing.assert_close(pre.float(), want_pre, atol=tol, rtol=tol)
    assert any(isinstance(m, torch.nn.Linear) for m in draft.modules()) and not draft.cpu_fast


def test_a_bf16_fast_head_with_speculators_norms_keeps_the_target_output(pair):
    """Found measuring speculators' `recommended` head on an AVX-512 BF16 host, where a draft takes bf16 weights: a
    bf16 `cpu_eagle3` copy keeps its norms fp32, so with speculators' variants (a norm on the residual and on the
    state fed back) the head computed fp32 states that its bf16 cache refused. Forced bf16 layouts (any host): the
    head drafts, chains and trees, and greedy output stays the target's."""
    target, plain = pair
    variants = {"norm_before_residual": True, "norm_before_fc": True, "norm_output": True}
    torch.manual_seed(0)
    draft = Eagle3Draft({**plain.export_config, **variants})
    with torch.no_grad():
        draft.d2t.copy_(plain.d2t)
        draft.t2d.copy_(plain.t2d)
        for p in draft.parameters():
            p.add_(0.3 * torch.randn_like(p))
    fast = cpu_eagle3(draft.eval(), torch.bfloat16, layouts="packed_bf16" if bf16_native() else "kn_bf16")
    assert fast.compute_dtype == torch.bfloat16
    want = hf_greedy(target, LLAMA_PROMPTS, 16)
    for tree in (None, "2,2,1"):
        got = generate(cpu_model(target), fast, LLAMA_PROMPTS, num_draft_tokens=3, max_new_tokens=16, tree=tree)
        assert got.tokens == want, tree


def test_the_head_reads_nothing_back_from_the_device(pair, monkeypatch):
    """Issue 22: the head's forwards (the catch-up after a verify, the drafting steps, the tree levels) take R, the
    most rows a batch row computes, from the engine's host sync, so none reads a tensor back: on CUDA reading R off
    the device was a sync per draft forward. Run as on CUDA (without the CPU's free read that skips fc), greedy
    output stays the target's."""
    target, draft = pair
    monkeypatch.setattr(eagle3_state, "reads_are_free", lambda device: False)
    # reads only: HF's rotary embedding moves its frequencies to the input's device, where they already are
    syncs = count_host_syncs(
        monkeypatch, eagle3_state.Eagle3State, ("extend", "draft_step", "tree_forward"), moves=False
    )
    want = hf_greedy(target, LLAMA_PROMPTS, 20)
    for tree in (None, "2,2,1", "dynamic:6"):
        got = generate(Llama.from_hf(target), draft, LLAMA_PROMPTS, num_draft_tokens=4, max_new_tokens=20, tree=tree)
        assert got.tokens == want, tree
    assert not syncs, syncs


def emulated_graphs(monkeypatch) -> list[int]:
    """The head's drafting-step graphs on the CPU: `_record` warms the step up as on CUDA and returns an output
    buffer that each replay overwrites by running the step again on the same input tensors -> the rows of each
    capture, appended as they happen. What it cannot show is a graph's frozen addresses: the test checks that no
    buffer is reallocated instead."""
    captures = []

    def record(self, step, reset):
        for _ in range(2):
            reset()
            step()
        reset()
        out = step()  # stands in for the capture, which records the kernels without running them
        captures.append(out.shape[0])
        return (lambda: out.copy_(step())), out

    monkeypatch.setattr(eagle3_state.HeadCache, "graphed", lambda self: self.draft.use_graphs)
    monkeypatch.setattr(eagle3_state.HeadCache, "_record", record)
    return captures


@pytest.mark.parametrize("bug", [None, "capture_not_put_back"])
def test_the_drafting_step_graph_replays_the_eager_step(pair, monkeypatch, bug):
    """Issue 22: the head's drafting step replays as one CUDA graph per power-of-two row count. Every proposal equals
    the eager step's, whether the graph is captured inside a call (mid-state: the warm-up must leave the live rows
    as they were) or before it by `ab.capture_graphs`, with a padding row (3 rows replay the 4-row graph) and rows
    leaving the batch; a later call replays the graphs of an earlier one on the same buffers. The broken twin leaves
    the warm-up's bookkeeping behind after a capture, and the same checks reject it."""
    target, draft = pair
    monkeypatch.setattr(draft, "head_cache", None)  # the module's head: start and end without a cache of this test
    monkeypatch.setattr(draft, "use_graphs", False)
    captures = emulated_graphs(monkeypatch)
    if bug == "capture_not_put_back":
        capture = eagle3_state.HeadCache._capture

        def forgetful(self, rows):
            out = capture(self, rows)
            for t in self.bookkeeping():
                t[:rows] = 0  # what the warm-up's padding rows leave
            return out

        monkeypatch.setattr(eagle3_state.HeadCache, "_capture", forgetful)
    fast = Llama.from_hf(target)
    prompts = [*LLAMA_PROMPTS[:2], [9, 4, 4, 30, 12]]  # 3 rows: graph rows 4 of a 6-row cache, one padding row
    stop = hf_greedy(target, prompts, 20)[0][5]  # prompt 0 stops mid-run: the batch shrinks to 2 rows
    drafted = []
    draw = engine._draw

    def recorded(logits, dec):
        x, q = draw(logits, dec)
        drafted.append(x)
        return x, q

    monkeypatch.setattr(engine, "_draw", recorded)

    def proposals(graphs: bool) -> list[list[int]]:
        draft.use_graphs = graphs
        drafted.clear()
        got = generate(fast, draft, prompts, num_draft_tokens=4, max_new_tokens=20, stop_token_ids=(stop,))
        assert got.tokens == hf_greedy(target, prompts, 20, eos=stop)
        return [x.tolist() for x in drafted]

    generate(fast, draft, prompts * 2, num_draft_tokens=4, max_new_tokens=20)  # a 6-row cache, kept for the calls
    cache = draft.head_cache
    addresses = [t.data_ptr() for t in cache.buffers()]
    want = proposals(False)
    assert not captures
    checks = []
    checks.append(proposals(True) == want)  # captured inside the call: 4 rows, then 2 rows as the batch shrinks
    checks.append(captures == [4, 2])
    capture_graphs(fast, draft, batch_size=6, gamma=4)  # every row count a 6-row call can replay
    checks.append(sorted(cache.graphs) == [1, 2, 4, 6] and captures == [4, 2, 1, 6])
    checks.append(proposals(True) == want)  # replays only
    checks.append(captures == [4, 2, 1, 6])
    assert draft.head_cache is cache and [t.data_ptr() for t in cache.buffers()] == addresses
    assert all(checks) == (bug is None), checks


# ---------------------------------------------------------------------------------------- distribution at T > 0

V6 = 6
DIST_PROMPTS = {"short": [4], "long": [2, 5, 1, 3]}
DRAWS = 6000  # per prompt kind


@pytest.fixture(scope="module")
def spread_pair():
    target = tiny_llama(seed=5, vocab_size=V6, layers=4, initializer_range=0.5, max_position_embeddings=64)
    return target, random_head(target, torch.tensor([0, 2, 3, 5]), seed=1, scale=0.5)  # q = 0 on tokens 1 and 4


def joint_pvalues(target, draft, sampling, rule, tree=None, seed=0) -> dict[str, float]:
    prompts = [DIST_PROMPTS["short"], DIST_PROMPTS["long"]] * DRAWS
    result = generate(target, draft, prompts, num_draft_tokens=2, draft_rule=rule, sampling=sampling,
                      max_new_tokens=3, tree=tree, generator=torch.Generator().manual_seed(seed))  # fmt: skip
    flat = (torch.tensor(result.tokens) * torch.tensor([V6 * V6, V6, 1])).sum(1)
    return {
        kind: chi_square_pvalue(
            torch.bincount(flat[i::2], minlength=V6**3), joint3(target, DIST_PROMPTS[kind], sampling, V6)
        )
        for i, kind in enumerate(("short", "long"))
    }


@pytest.mark.parametrize(
    "rule,tree,sampling",
    [
        ("sample", None, SamplingParams(1.0)),
        ("greedy", None, SamplingParams(1.0)),
        ("sample", None, SamplingParams(0.8, top_k=4)),
        ("sample", "2,1", SamplingParams(1.0)),
        ("greedy", "dynamic:4", SamplingParams(1.0)),
    ],
    ids=["chain-sample", "chain-greedy", "chain-topk", "static-sample", "dynamic"],
)
def test_sampling_is_distributed_as_target_only(spread_pair, rule, tree, sampling):
    target, draft = spread_pair
    for kind, pvalue in joint_pvalues(target, draft, sampling, rule, tree).items():
        assert pvalue > 1e-4, kind


@pytest.mark.parametrize("rule", ["sample", "greedy"])
def test_a_target_state_that_forgets_its_rollback_is_caught(spread_pair, monkeypatch, rule):
    """Guard on the test above: a wrapper that drops the rollback leaves rejected drafts in the target's cache."""
    target, draft = spread_pair
    monkeypatch.setattr(eagle3_state.AuxTargetState, "rollback", lambda self, drop: None)
    pvalues = joint_pvalues(target, draft, SamplingParams(1.0), rule)
    assert min(pvalues.values()) < 1e-6, pvalues


# --------------------------------------------------------------------------------------------- CUDA static cache


def bf16_head_pair(device: str):
    """The compact-target test's models: a 6-layer wide target (aux layers [2, 3, 3]; 2 layers have no valid aux
    layers) and its random head in bf16; built on the CPU too, so a target the head rejects fails there first."""
    target = gpu_llama(7, layers=6, device=device)
    return target, Eagle3Draft.from_target(target, DRAFT_IDS, seed=0).to(torch.bfloat16).eval()


@pytest.mark.parametrize(
    "device,graphs",
    [
        ("cpu", False),
        pytest.param("cuda", True, marks=pytest.mark.gpu),
        pytest.param("cuda", False, marks=pytest.mark.gpu),
    ],
    ids=["cpu", "cuda-graphs", "cuda-eager"],
)
def test_a_bf16_head_on_the_bf16_compact_target_is_greedy_exact(device, graphs):
    """With CUDA graphs, the graphs bake the aux copies in (captured after the hooks: the target-only run before
    captures them without), and a second call replays them; without, the hooks live and die with each call. The
    head's drafting step runs as its own graph exactly when graphs are on."""
    target, draft = bf16_head_pair(device)
    assert draft.aux_layers(6) == [2, 3, 3] and draft.compute_dtype == torch.bfloat16
    fast = Llama.from_hf(target, dtype=torch.bfloat16)
    fast.use_graphs = draft.use_graphs = graphs
    want = generate(fast, None, LLAMA_PROMPTS, max_new_tokens=24).tokens  # target-only decoding, graphs without hooks
    for tree in (None, None, "2,2,1", "dynamic:6"):
        got = generate(fast, draft, LLAMA_PROMPTS, num_draft_tokens=3, max_new_tokens=24, tree=tree)
        assert_same_up_to_ties(target, LLAMA_PROMPTS, got.tokens, want, f"eagle3 tree={tree}")
    assert bool(fast.graphs) == graphs, "the decode steps ran as CUDA graphs exactly when they were on"
    assert (fast.eagle3_capture is not None) == graphs, "the aux capture outlives a call only for the graphs"
    assert bool(draft.head_cache.graphs) == graphs, "the head's drafting step ran as a CUDA graph when they were on"


# ------------------------------------------------------------------------------------------ loading and bench


def test_bench_skips_hf_assisted_for_a_head_and_says_why(pair, tmp_path):
    target, draft = pair
    draft.save_pretrained(tmp_path / "head")
    head, tokenizer = load_draft_model(str(tmp_path / "head"))  # either kind from one spec
    assert isinstance(head, Eagle3Draft) and tokenizer is None
    result = run_bench(target, head, SimpleNamespace(eos_token_id=None, pad_token_id=0), LLAMA_PROMPTS[:2],
                       num_draft_tokens=3, max_new_tokens=8, temperature=0.0, batch_size=1, seed=0, repeats=1,
                       tree="2,1")  # fmt: skip
    assert set(result["hf_assisted"]) == {"skipped"} and "no EAGLE-3 path" in result["hf_assisted"]["skipped"]
    assert result["speedup_vs_hf_assisted"] is None and result["settings"]["draft_kind"] == "eagle3"
    assert result["speculative"]["phases"]["draft_s"] > 0 and result["tree"]["speedup"] > 0
    assert "hf_assisted  skipped: transformers" in format_bench_table(result)


def test_offline_first_step_logits_are_the_engines_first_proposals(pair):
    """`first_step_logits` (the eval's expected_acceptance) at position t is what the engine's first draft step
    proposes after x_0..x_t: the reference built from scratch."""
    target, draft = pair
    seq = [5, 17, 3, 40, 22, 9, 30]
    with torch.no_grad():
        got = first_step_logits(draft, target, torch.tensor([seq]))[0]  # (T, V)
    for t in range(1, len(seq)):
        torch.testing.assert_close(got[t], reference_logits(target, draft, seq[: t + 1], []), rtol=1e-5, atol=1e-5)


def test_promoting_a_head_writes_the_engines_eagle3_methods(tmp_path):
    """The recommendation's kind reaches serving.yaml and every engine's method (shared/EAGLE3.md)."""
    from helpers.reports import make_report

    from eval.config import ServingConfig
    from eval.engines import recommended_setting
    from eval.promote import build_serving
    from eval.recommend import recommend

    report = make_report(tmp_path)
    for cand in report["candidates"]:
        cand["kind"] = "eagle3"
    report["recommendation"] = recommend(report, ServingConfig(min_acceptance=0.0))
    assert report["recommendation"]["kind"] == "eagle3" and report["recommendation"]["enabled"]
    setting = recommended_setting(report["recommendation"], "export/head", aux_layers=(2, 3, 3))
    serving = build_serving({}, report, tmp_path / "report.json", setting, "2026-12-01T00:00:00Z")
    K = report["recommendation"]["num_draft_tokens"]
    assert serving["speculative"]["kind"] == "eagle3"
    vllm, sglang, trtllm = (serving["engines"][e] for e in ("vllm", "sglang", "trtllm"))
    spec = vllm["speculative_config"]
    assert (spec["model"], spec["num_speculative_tokens"], spec["method"]) == ("export/head", K, "eagle3")
    assert sglang[:2] == ["--speculative-algorithm", "EAGLE3"]  # EAGLE would skip fc and serve a useless draft
    assert sglang[sglang.index("--speculative-num-steps") + 1] == K
    assert sglang[sglang.index("--speculative-eagle-topk") + 1] == 1
    assert sglang[sglang.index("--speculative-num-draft-tokens") + 1] == K + 1
    assert trtllm["speculative_config"]["decoding_type"] == "Eagle3"
