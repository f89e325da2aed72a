"""Metric accounting against closed forms, the offline acceptance estimate, speedup models, cost ratios, bench."""

import math
import warnings
from types import SimpleNamespace

import pytest
import torch
from helpers.models import GPU_PROMPTS, bench_arm_tokens, tiny_llama

from specdec_runtime.bench import format_bench_table, run_bench
from specdec_runtime.engine import SamplingParams, generate
from specdec_runtime.metrics import (
    analytic_speedup,
    expected_acceptance,
    merge_stats,
    predicted_speedup,
)

# Tiny models: intra-op thread wake-ups cost more than the maths on a shared 2-core machine.
pytestmark = pytest.mark.usefixtures("one_thread")

V, SUPPORT, LAMBDA = 12, 5, 0.6
WEIGHTS = torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05])


class BigramLM(torch.nn.Module):
    """Logits by current token from a (V, V) table; no state, so the cache is left empty."""

    def __init__(self, table: torch.Tensor):
        super().__init__()
        self.table = table
        self.config = SimpleNamespace(vocab_size=V, max_position_embeddings=4096)
        self.device = torch.device("cpu")

    def forward(self, input_ids, position_ids, attention_mask, cache, use_cache=True, logits_to_keep=0):
        logits = self.table[input_ids]
        return SimpleNamespace(logits=logits[:, -logits_to_keep:] if logits_to_keep else logits)


def constant_overlap_pair(seed: int = 0) -> tuple[BigramLM, BigramLM]:
    """p and q change with the context, but sum_v min(p_v, q_v) = LAMBDA and p(argmax q) = max(WEIGHTS) everywhere.

    p: WEIGHTS on a random 5-token subset per context; q = LAMBDA * p + (1 - LAMBDA) * uniform(off the subset).
    """
    gen = torch.Generator().manual_seed(seed)
    p, q = torch.zeros(V, V), torch.zeros(V, V)
    for c in range(V):
        order = torch.randperm(V, generator=gen)
        p[c, order[:SUPPORT]] = WEIGHTS[torch.randperm(SUPPORT, generator=gen)]
        q[c] = LAMBDA * p[c]
        q[c, order[SUPPORT:]] = (1 - LAMBDA) / (V - SUPPORT)
    return BigramLM(p.log()), BigramLM(q.log())


def truncated_geometric(a: float, gamma: int) -> tuple[float, float]:
    """Mean and variance of the accepted count per step with i.i.d. acceptance a and gamma drafts."""
    probs = [a**k * (1 - a) for k in range(gamma)] + [a**gamma]
    mean = sum(k * pk for k, pk in enumerate(probs))
    return mean, sum((k - mean) ** 2 * pk for k, pk in enumerate(probs))


@pytest.mark.parametrize("rule,alpha", [("sample", LAMBDA), ("greedy", float(WEIGHTS.max()))])
@pytest.mark.parametrize("gamma", [1, 3])
def test_constant_acceptance_matches_closed_forms(rule, alpha, gamma):
    target, draft = constant_overlap_pair()
    prompts = [[c % V] for c in range(1200)]
    result = generate(
        target,
        draft,
        prompts,
        num_draft_tokens=gamma,
        draft_rule=rule,
        sampling=SamplingParams(temperature=1.0),
        max_new_tokens=24,
        generator=torch.Generator().manual_seed(0),
    )
    agg = result.stats.aggregate()
    steps = sum(r.verify_steps for r in result.stats.requests)
    mean_n, var_n = truncated_geometric(alpha, gamma)
    tau = (1 - alpha ** (gamma + 1)) / (1 - alpha)
    assert mean_n + 1 == pytest.approx(tau)
    assert abs(agg["mean_accepted_length"] - tau) < 5 * math.sqrt(var_n / steps)
    judged = sum(sum(r.position_reached) for r in result.stats.requests)
    assert abs(agg["acceptance_rate"] - alpha) < 5 * math.sqrt(alpha * (1 - alpha) / judged)
    for i, rate in enumerate(agg["per_position_acceptance"]):
        reached = sum(r.position_reached[i] for r in result.stats.requests)
        assert abs(rate - alpha) < 5 * math.sqrt(alpha * (1 - alpha) / reached)

    # The offline estimate on the generated sequences gives the same alpha, exactly (the overlap is constant).
    seqs = torch.tensor([p + t for p, t in zip(prompts, result.tokens)])
    mask = torch.ones(seqs.shape, dtype=torch.bool)
    offline = expected_acceptance(target.table[seqs], draft.table[seqs], mask, SamplingParams(1.0), rule)
    assert float(offline) == pytest.approx(alpha, abs=1e-5)


def test_expected_acceptance_hand_computed():
    p = torch.tensor([[0.5, 0.3, 0.2], [0.1, 0.1, 0.8]]).log()
    q = torch.tensor([[0.2, 0.2, 0.6], [0.1, 0.1, 0.8]]).log()
    ones, first = torch.ones(2, dtype=torch.bool), torch.tensor([True, False])
    t1 = SamplingParams(temperature=1.0)
    assert float(expected_acceptance(p, q, ones, t1, "sample")) == pytest.approx((0.2 + 0.2 + 0.2 + 1.0) / 2)
    assert float(expected_acceptance(p, q, first, t1, "sample")) == pytest.approx(0.6)
    assert float(expected_acceptance(p, q, ones, t1, "greedy")) == pytest.approx((0.2 + 0.8) / 2)
    assert float(expected_acceptance(p, q, ones, SamplingParams(), "sample")) == pytest.approx(0.5)  # argmax match
    # top_k=1 turns both into one-hots: the same as greedy decoding.
    assert float(expected_acceptance(p, q, ones, SamplingParams(1.0, top_k=1), "sample")) == pytest.approx(0.5)
    assert float(expected_acceptance(p, p, ones, t1, "sample")) == pytest.approx(1.0)
    assert float(expected_acceptance(p, q, torch.zeros(2, dtype=torch.bool), t1)) == 0.0  # empty mask guarded


def test_speedup_models():
    assert analytic_speedup(0.0, 4, 0.1) == pytest.approx(1 / 1.4)
    assert analytic_speedup(1.0, 4, 0.0) == pytest.approx(5.0)
    assert analytic_speedup(0.8, 4, 0.05) == pytest.approx((1 - 0.8**5) / (0.2 * 1.2))
    assert analytic_speedup(0.999999, 3, 0.1) == pytest.approx(analytic_speedup(1.0, 3, 0.1), rel=1e-4)
    assert predicted_speedup(3.0, 4, 0.05, 1.0) == pytest.approx(2.5)
    # With v = 1 and tau from the i.i.d. model, the two agree.
    tau = (1 - 0.7**4) / 0.3
    assert predicted_speedup(tau, 3, 0.2, 1.0) == pytest.approx(analytic_speedup(0.7, 3, 0.2))


def test_stats_aggregate_and_merge():
    target, draft = tiny_llama(seed=0), tiny_llama(seed=1)
    prompts = [[1, 2, 3], [4], [5, 6]]
    parts = [generate(target, draft, [p], num_draft_tokens=2, max_new_tokens=6) for p in prompts]
    whole = generate(target, draft, prompts, num_draft_tokens=2, max_new_tokens=6)
    merged_stats = merge_stats([part.stats for part in parts])
    merged = merged_stats.aggregate()
    assert merged_stats.phases.verify_forwards == sum(part.stats.phases.verify_forwards for part in parts)
    assert merged["decode_s"] == pytest.approx(sum(part.stats.phases.decode_s for part in parts))
    agg = whole.stats.aggregate()
    for key in ("acceptance_rate", "mean_accepted_length", "per_position_acceptance", "new_tokens"):
        assert merged[key] == agg[key], key
    assert agg["new_tokens"] == 18 and agg["wall_s"] > 0 and agg["tokens_per_s"] > 0
    assert 0 < agg["ttft_s"] <= agg["wall_s"] and agg["tpot_s"] > 0
    assert agg["target_forwards"] == max(r.verify_steps for r in whole.stats.requests) + 1  # + prefill
    assert agg["draft_forwards"] == 2 * (agg["target_forwards"] - 1) + 1
    target_only = generate(target, None, prompts, max_new_tokens=6).stats.aggregate()
    assert target_only["mean_accepted_length"] == 1.0 and target_only["acceptance_rate"] is None
    assert target_only["draft_forwards"] == 0 and target_only["per_position_acceptance"] == []
    assert set(whole.stats.requests[0].summary()) == set(agg)


def test_run_bench_smoke():
    """The CPU twin of test_runtime_gpu's bench test: the same prompts and batches, the same token count."""
    target = tiny_llama(seed=0)
    tokenizer = SimpleNamespace(eos_token_id=None, pad_token_id=0)
    prompts = GPU_PROMPTS  # 5 prompts in batches of 2: the fifth is left out
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warnings a user would trip on
        result = run_bench(
            target,
            target,
            tokenizer,
            prompts,
            num_draft_tokens=3,
            max_new_tokens=8,
            temperature=0.0,
            batch_size=2,
            seed=0,
        )
    for mode in ("target_only", "speculative", "hf_assisted"):
        assert result[mode]["new_tokens"] == bench_arm_tokens(len(prompts), batch_size=2, max_new_tokens=8)
        assert result[mode]["wall_s"] > 0 and result[mode]["tokens_per_s"] > 0
    assert result["acceptance_rate"] == 1.0 and result["mean_accepted_length"] == 4.0  # the draft is the target
    for key in ("cost_ratio", "verify_cost_ratio", "analytic_speedup", "predicted_speedup", "speedup", "efficiency"):
        assert 0 < result[key] < 100, key
    assert result["speedup_vs_hf_assisted"] > 0
    table = format_bench_table(result)
    assert "speculative" in table and "speedup_vs_hf_assisted" in table
