"""Speculative sampling is distributed exactly as target-only sampling: chi-square tests against analytic joints.

Rows of a batch are independent, so one generate call over thousands of rows gives thousands of draws. The toy model
reads the previous token back from its KV cache, so a rejected draft token left visible after a rollback, a wrong
bonus token or a wrong position id all change the joint distribution of the emitted tokens: of the first three, and
of whole sequences of 2 (gamma + 1) tokens with a stop token (rows finish at different steps and leave the batch).
"""

import pytest
import torch
from helpers.models import spread_llama
from helpers.stats import (
    JOINT_PROMPTS,
    SEQ_LEN,
    SEQ_PROMPTS,
    SEQ_STOP,
    TrigramLM,
    V,
    chi_square_pvalue,
    exact_joint,
    llama_joint2,
    llama_joint_pvalues,
    sequence_pvalues,
    sequence_tables,
)

import specdec_runtime.engine as engine
import specdec_runtime.kv as kv
from specdec_runtime.engine import SamplingParams, generate
from specdec_runtime.llama import Llama

# Tiny models: intra-op thread wake-ups cost more than the maths on a shared 2-core machine.
pytestmark = pytest.mark.usefixtures("one_thread")


def trigram_tables(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Target and draft tables that differ strongly; each bans tokens the other likes (-inf logits)."""
    gen = torch.Generator().manual_seed(seed)
    target = 2.0 * torch.randn(V + 1, V, 2, V, generator=gen)
    draft = 2.0 * torch.randn(V + 1, V, 2, V, generator=gen)
    target[..., 0] = float("-inf")  # p has no mass on token 0, q does
    draft[..., 1] = float("-inf")  # q has no mass on token 1, p does
    draft[..., 2] += 3.0  # q over-proposes token 2
    return target, draft


PROMPTS = {"short": [3], "long": [4, 1, 5, 2]}
DRAWS = 12_000  # per prompt


def sample_joint(target, draft, sampling, rule, gamma, seed=0, max_new=3) -> dict[str, torch.Tensor]:
    """Counts of the first three emitted tokens per prompt kind, from one ragged batch of interleaved prompts."""
    prompts = [PROMPTS["short"], PROMPTS["long"]] * DRAWS
    result = generate(
        target,
        draft,
        prompts,
        num_draft_tokens=gamma,
        draft_rule=rule,
        sampling=sampling,
        max_new_tokens=max_new,
        generator=torch.Generator().manual_seed(seed),
    )
    tokens = torch.tensor(result.tokens)  # (2 * DRAWS, 3)
    flat = (tokens * torch.tensor([V * V, V, 1])).sum(1)
    return {
        kind: torch.bincount(flat[i::2], minlength=V**3).reshape(V, V, V) for i, kind in enumerate(("short", "long"))
    }


SAMPLINGS = {
    "t1": SamplingParams(temperature=1.0),
    "t0.7-topk3": SamplingParams(temperature=0.7, top_k=3),
    "t1.3-topp0.8": SamplingParams(temperature=1.3, top_p=0.8),
}


@pytest.fixture(scope="module")
def toys():
    target, draft = trigram_tables(0)
    return TrigramLM(target), TrigramLM(draft), target


def test_target_only_sampling_matches_the_analytic_joint(toys):
    target, _, table = toys
    sampling = SAMPLINGS["t1"]
    for kind, counts in sample_joint(target, None, sampling, "sample", 1).items():
        assert chi_square_pvalue(counts, exact_joint(table, PROMPTS[kind], sampling)) > 1e-4


@pytest.mark.parametrize(
    "sampling_name,rule,gamma",
    [
        ("t1", "sample", 2),
        ("t1", "sample", 3),
        ("t0.7-topk3", "sample", 2),
        ("t1.3-topp0.8", "sample", 3),
        ("t1", "greedy", 2),
        ("t1.3-topp0.8", "greedy", 3),
    ],
)
def test_speculative_joint_equals_target_only(toys, sampling_name, rule, gamma):
    target, draft, table = toys
    sampling = SAMPLINGS[sampling_name]
    for kind, counts in sample_joint(target, draft, sampling, rule, gamma).items():
        assert chi_square_pvalue(counts, exact_joint(table, PROMPTS[kind], sampling)) > 1e-4, kind


def test_a_broken_acceptance_rule_is_caught(toys, monkeypatch):
    """Guard on the test itself: resampling from p instead of norm(max(0, p - q)) must fail the chi-square test."""
    target, draft, table = toys

    verify = engine.verify

    def residual_from_p(p, q, x, generator, greedy=False):
        n, _ = verify(p, q, x, generator, greedy)
        p_n = p.gather(1, n[:, None, None].expand(-1, 1, p.shape[-1]))[:, 0]
        return n, engine.sample(p_n, generator)

    monkeypatch.setattr(engine, "verify", residual_from_p)
    sampling = SAMPLINGS["t1"]
    pvalues = [
        chi_square_pvalue(counts, exact_joint(table, PROMPTS[kind], sampling))
        for kind, counts in sample_joint(target, draft, sampling, "sample", 2).items()
    ]
    assert min(pvalues) < 1e-6


@pytest.mark.parametrize("backend", ["hf", "compact"])
def test_speculative_joint_on_tiny_llamas(backend):
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
        num_draft_tokens=3,
        draft_rule="sample",
    )
    assert 0.05 < result.stats.aggregate()["acceptance_rate"] < 0.95
    for kind, pvalue in pvalues.items():
        assert pvalue > 1e-4, kind


# ------------------------------------------------------------------------ whole sequences, with their broken twins

SEQ_GAMMA = 2
assert SEQ_LEN == 2 * (
    SEQ_GAMMA + 1
)  # two full steps after the first token: bonus tokens and rollbacks both feed forward
SEQ_DRAWS = 12_000  # per prompt kind


def sequence_pvalues_of(target, draft, table, sampling, rule, seed=0) -> dict[str, float]:
    """Chi-square p-value of the emitted sequences per prompt kind against their exact distribution."""
    result = generate(
        target,
        draft,
        [SEQ_PROMPTS["short"], SEQ_PROMPTS["long"]] * SEQ_DRAWS,
        num_draft_tokens=SEQ_GAMMA,
        draft_rule=rule,
        sampling=sampling,
        max_new_tokens=SEQ_LEN,
        stop_token_ids=[SEQ_STOP],
        generator=torch.Generator().manual_seed(seed),
    )
    return sequence_pvalues(result.tokens, table, sampling)


@pytest.fixture(scope="module")
def seq_toys():
    target, draft = sequence_tables(0)
    return TrigramLM(target), TrigramLM(draft), target


@pytest.mark.parametrize(
    "sampling,rule",
    [(SamplingParams(1.0), "sample"), (SamplingParams(0.8, top_p=0.9), "sample"), (SamplingParams(1.0), "greedy")],
    ids=["t1-sample", "topp-sample", "t1-greedy"],
)
def test_whole_sequences_are_distributed_as_target_only(seq_toys, sampling, rule):
    target, draft, table = seq_toys
    for kind, pvalue in sequence_pvalues_of(target, draft, table, sampling, rule).items():
        assert pvalue > 1e-4, kind


def test_whole_sequences_of_target_only_decoding(seq_toys):
    target, _, table = seq_toys
    for kind, pvalue in sequence_pvalues_of(target, None, table, SamplingParams(1.0), "sample").items():
        assert pvalue > 1e-4, kind


def test_a_bonus_token_from_the_wrong_index_is_caught(seq_toys, monkeypatch):
    """Guard on the test itself: the bonus token drawn from p at the last draft position instead of after it."""
    target, draft, table = seq_toys
    verify = engine.verify

    def bonus_one_early(p, q, x, generator, greedy=False):  # p: (B, G+1, V); row G is the bonus position
        G = x.shape[1]
        return verify(torch.cat([p[:, :G], p[:, G - 1 : G]], 1) if G else p, q, x, generator, greedy)

    monkeypatch.setattr(engine, "verify", bonus_one_early)
    pvalues = sequence_pvalues_of(target, draft, table, SamplingParams(1.0), "sample")
    assert min(pvalues.values()) < 1e-6, pvalues


def test_a_stale_cache_entry_after_rollback_is_caught(seq_toys, monkeypatch):
    """Guard on the test itself: a rollback that leaves the first rejected draft token visible in the cache."""
    target, draft, table = seq_toys
    drop_last_real = kv.drop_last_real
    monkeypatch.setattr(kv, "drop_last_real", lambda mask, drop: drop_last_real(mask, (drop - 1).clamp_min(0)))
    pvalues = sequence_pvalues_of(target, draft, table, SamplingParams(1.0), "sample")
    assert min(pvalues.values()) < 1e-6, pvalues
