"""The decode loop itself: phases timed inside it (an injected clock makes them exact), the first token from the
target's prefill, finished rows leaving the batch, and HF caches that hold exactly each row's accepted tokens.

The clock is fake: each forward of a real tiny Llama advances it by a known cost (fixed + per token), and the
accept/reject rule by a known overhead, so every phase, cost ratio and speedup has one exact expected value.
"""

import pytest
import torch
from helpers.models import LLAMA_PROMPTS, hf_greedy, perturbed, tiny_llama

import specdec_runtime.engine as engine
import specdec_runtime.tree_step as tree_step
from specdec_runtime.engine import SamplingParams, generate
from specdec_runtime.llama import Llama
from specdec_runtime.metrics import cost_ratios

# Tiny models: intra-op thread wake-ups cost more than the maths on a shared 2-core machine.
pytestmark = pytest.mark.usefixtures("one_thread")

# Dyadic costs: every sum of them is exact in floating point, so phases compare with ==.
TARGET_COST, DRAFT_COST, OVERHEAD = (1.0, 0.25), (0.125, 0.0625), 0.5  # (fixed, per token), per accept/reject


class FakeClock:
    """Time moves only when a charged forward or rule runs."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def charge(model: torch.nn.Module, clock: FakeClock, cost: tuple[float, float]) -> list[tuple[int, int]]:
    """Make each forward of `model` advance the clock by fixed + per_token * T -> the (B, T) of every forward."""
    calls, forward = [], model.forward

    def charged(*args, **kwargs):
        B, T = (kwargs["input_ids"] if "input_ids" in kwargs else args[0]).shape  # HF keywords, compact positional
        calls.append((B, T))
        clock.now += cost[0] + cost[1] * T
        return forward(*args, **kwargs)

    model.forward = charged
    return calls


def charge_overhead(monkeypatch, clock: FakeClock, module=engine, rule: str = "verify") -> None:
    """Each accept/reject (the real rule) costs OVERHEAD: time in the loop outside every forward."""
    verify = getattr(module, rule)

    def charged(*args, **kwargs):
        clock.now += OVERHEAD
        return verify(*args, **kwargs)

    monkeypatch.setattr(module, rule, charged)


def cost(calls: list[tuple[int, int]], fixed_per_token: tuple[float, float]) -> float:
    return sum(fixed_per_token[0] + fixed_per_token[1] * T for _, T in calls)


@pytest.fixture(scope="module")
def llamas():
    target = tiny_llama(0)
    return {"target": target, "near": perturbed(target, 0.004, seed=2)}


def fresh(model: torch.nn.Module) -> torch.nn.Module:
    """A copy whose forward can be charged without touching the module-scoped fixture."""
    copy = tiny_llama(0)
    copy.load_state_dict(model.state_dict())
    return copy


# ------------------------------------------------------------------------------------------------------ phases


@pytest.mark.parametrize("tree", [None, "2,2"], ids=["chain", "tree"])
def test_phases_are_the_forwards_timed_inside_the_loop(llamas, monkeypatch, tree):
    clock = FakeClock()
    target, draft = fresh(llamas["target"]), fresh(llamas["near"])
    target_calls, draft_calls = charge(target, clock, TARGET_COST), charge(draft, clock, DRAFT_COST)
    if tree is None:
        charge_overhead(monkeypatch, clock)
    else:  # the tree's own rule (greedy: the longest path matching the target's argmax)
        charge_overhead(monkeypatch, clock, tree_step, "verify_tree_greedy")
    stop = hf_greedy(llamas["target"], LLAMA_PROMPTS, 24)[0][6]  # rows finish at different steps
    result = generate(
        target,
        draft,
        LLAMA_PROMPTS,
        num_draft_tokens=3,
        tree=tree,
        max_new_tokens=24,
        stop_token_ids=[stop],
        clock=clock,
    )
    phases, gamma = result.stats.phases, 3 if tree is None else 2
    steps = max(r.verify_steps for r in result.stats.requests)
    assert phases.prefill_s == cost(target_calls[:1], TARGET_COST) + cost(draft_calls[:1], DRAFT_COST)
    assert phases.verify_s == cost(target_calls[1:], TARGET_COST)
    assert phases.draft_s == cost(draft_calls[1:], DRAFT_COST)
    assert phases.other_s == OVERHEAD * steps
    assert phases.verify_forwards == len(target_calls) - 1 == steps
    assert phases.draft_forwards == len(draft_calls) - 1 == gamma * steps  # the pending tokens, then per draft/level
    assert phases.decode_s == clock.now - phases.prefill_s  # nothing outside prefill and the loop costs time
    longest = max(result.stats.requests, key=lambda r: r.verify_steps)
    for req in result.stats.requests:
        assert req.ttft_s == phases.prefill_s  # the first token needs both prefills and nothing else
        assert req.wall_s == req.ttft_s + req.decode_s
    assert longest.decode_s == phases.decode_s and longest.wall_s == result.stats.wall_s == clock.now


def test_target_only_phases(llamas, monkeypatch):
    clock = FakeClock()
    target = fresh(llamas["target"])
    calls = charge(target, clock, TARGET_COST)
    charge_overhead(monkeypatch, clock)
    result = generate(target, None, [[5, 17, 3, 40, 22]], max_new_tokens=9, clock=clock)
    phases = result.stats.phases
    assert calls == [(1, 5)] + [(1, 1)] * 8  # prefill emits token 1, then one decode forward per token
    assert (phases.prefill_s, phases.verify_s, phases.draft_s, phases.other_s) == (2.25, 8 * 1.25, 0.0, 8 * OVERHEAD)
    assert (phases.verify_forwards, phases.draft_forwards) == (8, 0)
    assert result.stats.requests[0].decode_s == phases.decode_s == 8 * (1.25 + OVERHEAD)


@pytest.mark.parametrize("overhead", [False, True])
def test_cost_ratios_and_efficiency_from_in_run_phases(llamas, monkeypatch, overhead):
    """A self-draft accepts everything: 12 decode tokens in 3 steps of 4, against 12 target-only steps."""
    prompt, max_new, gamma = [[5, 17, 3, 40, 22]], 13, 3
    runs = {}
    for name in ("target_only", "speculative"):
        clock = FakeClock()
        target = fresh(llamas["target"])
        charge(target, clock, TARGET_COST)
        draft = None
        if name == "speculative":
            draft = fresh(llamas["target"])
            charge(draft, clock, DRAFT_COST)
        if overhead:
            charge_overhead(monkeypatch, clock)
        runs[name] = generate(target, draft, prompt, num_draft_tokens=gamma, max_new_tokens=max_new, clock=clock)
        monkeypatch.undo()
    base, spec = runs["target_only"].stats, runs["speculative"].stats
    assert runs["target_only"].tokens == runs["speculative"].tokens
    tau = spec.aggregate()["mean_accepted_length"]
    assert tau == 4.0 and spec.phases.verify_forwards == 3 and base.phases.verify_forwards == 12

    step = 1.25 + OVERHEAD * overhead  # the target-only decode step: one 1-token forward and the rule around it
    draft_step = [0.1875] * 3 + [0.25, 0.1875, 0.1875] * 2  # draft widths 1,1,1 then 2,1,1: the refeed after a bonus
    draft_forward, verify_forward = sum(draft_step) / 9, 1.0 + 0.25 * 4
    got = cost_ratios(spec.phases, base.phases, gamma, tau)
    assert got["cost_ratio"] == pytest.approx(draft_forward / step, rel=1e-12)
    assert got["verify_cost_ratio"] == pytest.approx(verify_forward / step, rel=1e-12)
    predicted = tau * step / (sum(draft_step) / 3 + verify_forward)  # tokens x step time / (draft + verify) per step
    assert got["predicted_speedup"] == pytest.approx(predicted, rel=1e-12)
    assert got["overhead_fraction"] == pytest.approx(spec.phases.other_s / spec.phases.decode_s, rel=1e-12)

    # Per-token speed from the per-request decode time: efficiency is exactly the share of the loop in forwards.
    per_token = [r.decode_s / (r.new_tokens - 1) for r in (base.requests[0], spec.requests[0])]
    efficiency = per_token[0] / per_token[1] / got["predicted_speedup"]
    assert efficiency == pytest.approx(1 - got["overhead_fraction"], rel=1e-12)
    if overhead:  # 0.5 of the 2.6 s a speculative step takes is outside the forwards
        assert efficiency == pytest.approx(7.8125 / 9.3125, rel=1e-12)
    else:
        assert efficiency == pytest.approx(1.0, rel=1e-12)


def test_cost_ratios_without_decode_steps():
    from specdec_runtime.metrics import Phases

    assert set(cost_ratios(Phases(prefill_s=1.0), Phases(verify_s=1.0, verify_forwards=1), 3, 1.0).values()) == {None}


# --------------------------------------------------------------------------------------------- the first token


def test_first_token_comes_from_the_target_prefill(llamas):
    """TTFT of a speculative run = target-only TTFT + the draft's prefill, nothing else (no draft or verify step)."""
    ttft, forwards = {}, {}
    for name in ("target_only", "speculative"):
        clock = FakeClock()
        target = fresh(llamas["target"])
        target_calls = charge(target, clock, TARGET_COST)
        draft = fresh(llamas["near"]) if name == "speculative" else None
        draft_calls = charge(draft, clock, DRAFT_COST) if draft is not None else []
        result = generate(target, draft, LLAMA_PROMPTS, num_draft_tokens=4, max_new_tokens=12, clock=clock)
        assert result.tokens == hf_greedy(llamas["target"], LLAMA_PROMPTS, 12)
        ttft[name] = {r.ttft_s for r in result.stats.requests}
        forwards[name] = (target_calls[0], draft_calls[:1])
    assert ttft["target_only"] == {1.0 + 0.25 * 9} and ttft["speculative"] == {1.0 + 0.25 * 9 + 0.125 + 0.0625 * 9}
    assert forwards["speculative"] == ((4, 9), [(4, 9)])  # both prefills see every prompt token, once


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_one_new_token_is_the_prefill_alone(llamas, temperature):
    target, draft = llamas["target"], llamas["near"]
    kwargs = dict(max_new_tokens=1, sampling=SamplingParams(temperature))
    alone = generate(target, None, LLAMA_PROMPTS, generator=torch.Generator().manual_seed(3), **kwargs)
    spec = generate(target, draft, LLAMA_PROMPTS, generator=torch.Generator().manual_seed(3), **kwargs)
    assert spec.tokens == alone.tokens  # the same draw from the same generator: the target's prefill
    assert spec.stats.phases.verify_forwards == spec.stats.phases.draft_forwards == 0
    assert spec.stats.target_forwards == spec.stats.draft_forwards == 1


# ------------------------------------------------------------------------------------------- shrinking batches


def record_forwards(model: torch.nn.Module) -> list[tuple[int, int, torch.Tensor | None]]:
    """Record (B, T, the cache columns' real mask (B, S) or None for the compact model) of every forward."""
    calls, forward = [], model.forward

    def recorded(*args, **kwargs):
        ids = kwargs["input_ids"] if "input_ids" in kwargs else args[0]
        B, T = ids.shape
        mask = kwargs.get("attention_mask")
        if mask is not None and mask.dim() == 4:  # a tree's additive mask: the root's row sees every real column
            mask = mask[:, 0, 0] == 0
        calls.append((B, T, None if mask is None else mask[:, : mask.shape[-1] - T].bool()))
        return forward(*args, **kwargs)

    model.forward = recorded
    return calls


def assert_compact(cache: torch.Tensor) -> None:
    """Each row's real columns right-aligned (holes only on the left) and no column a hole in every row."""
    S, real = cache.shape[1], cache.sum(1)
    assert torch.equal(cache, torch.arange(S) >= (S - real)[:, None]), cache.int()
    assert S == 0 or int(real.max()) == S


@pytest.mark.parametrize("backend", ["hf", "compact"])
@pytest.mark.parametrize("tree", [None, "3,2,1"], ids=["chain", "tree"])
def test_finished_rows_leave_the_batch(llamas, backend, tree):
    target, draft = fresh(llamas["target"]), fresh(llamas["near"])
    stop = hf_greedy(target, LLAMA_PROMPTS, 24)[0][6]
    reference = hf_greedy(target, LLAMA_PROMPTS, 24, eos=stop)
    if backend == "compact":
        target, draft = Llama.from_hf(target), Llama.from_hf(draft)
    target_calls, draft_calls = record_forwards(target), record_forwards(draft)
    result = generate(
        target, draft, LLAMA_PROMPTS, num_draft_tokens=4, tree=tree, max_new_tokens=24, stop_token_ids=[stop]
    )
    assert result.tokens == reference
    steps = [r.verify_steps for r in result.stats.requests]
    assert len(set(steps)) > 1  # rows really finish at different steps
    decoding = [sum(s > k for s in steps) for k in range(max(steps))]  # rows still decoding at step k
    assert [B for B, _, _ in target_calls] == [len(LLAMA_PROMPTS)] + decoding
    per_step = 4 if tree is None else 3  # draft forwards per step
    assert [B for B, _, _ in draft_calls] == [len(LLAMA_PROMPTS)] + [b for b in decoding for _ in range(per_step)]


@pytest.mark.parametrize("tree", [None, "2,2"], ids=["chain", "tree"])
@pytest.mark.parametrize("gamma,prompts", [(8, [[5, 17, 3], [11]]), (4, LLAMA_PROMPTS)], ids=["2rows-g8", "ragged"])
def test_hf_cache_holds_exactly_the_accepted_tokens(llamas, tree, gamma, prompts):
    """Issue 12's probe: 2 rows at gamma 8 held 436 cache columns for 372 tokens. Rejected columns must not pile up:
    before every verify forward each row's cached tokens are right-aligned and the cache is as wide as the longest."""
    target, draft = fresh(llamas["target"]), perturbed(llamas["target"], 0.01, seed=5)
    calls = record_forwards(target)
    max_new = 60
    result = generate(target, draft, prompts, num_draft_tokens=gamma, tree=tree, max_new_tokens=max_new)
    agg = result.stats.aggregate()
    assert 0 < agg["acceptance_rate"] < 1  # rejections in some rows while others accept
    bound = max(len(p) for p in prompts) + max_new + gamma + 1
    for _, _, cache in calls[1:]:
        assert_compact(cache)
        assert cache.shape[1] <= bound
    assert calls[1][2].sum(1).tolist() == [len(p) for p in prompts]  # the first verify: each prompt, nothing else
