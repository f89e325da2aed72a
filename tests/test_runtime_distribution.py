"""Speculative sampling is distributed exactly as target-only sampling: chi-square tests against analytic joints.

Rows of a batch are independent, so one generate call over thousands of rows gives thousands of draws. The toy model
reads the previous token back from its KV cache, so a rejected draft token left visible after a rollback, a wrong
bonus token or a wrong position id all change the joint distribution of the first three tokens.
"""

import itertools
from types import SimpleNamespace

import pytest
import torch
from conftest import tiny_llama as conftest_tiny_llama
from transformers import LlamaForCausalLM

import specdec_runtime.engine as engine
from specdec_runtime.engine import SamplingParams, generate
from specdec_runtime.llama import Llama
from specdec_runtime.sampling import warp_logits

# Tiny models: intra-op thread wake-ups cost more than the maths on a shared 2-core machine.
pytestmark = pytest.mark.usefixtures("one_thread")

V = 6
NONE = V  # "no previous token" row of the trigram table




class TrigramLM(torch.nn.Module):
    """Logits by (previous token, current token, position parity); the previous token is read from the KV cache."""

    def __init__(self, table: torch.Tensor):  # (V + 1, V, 2, V)
        super().__init__()
        self.table = table
        self.config = SimpleNamespace(vocab_size=V, max_position_embeddings=1024)
        self.device = torch.device("cpu")

    def forward(self, input_ids, position_ids, attention_mask, cache, use_cache=True, logits_to_keep=0):
        B, T = input_ids.shape
        ids, _ = cache.update(input_ids[:, None, :, None].float(), input_ids[:, None, :, None].float(), 0)
        ids = ids[:, 0, :, 0].long()  # (B, S + T): every column the cache holds, holes included
        S = ids.shape[1] - T
        cols = torch.arange(S + T)
        latest = torch.where(attention_mask.bool(), cols, -1).cummax(1).values  # last visible column <= c
        prev_col = torch.cat([torch.full((B, 1), -1), latest[:, :-1]], 1)[:, S:]  # (B, T) last visible before c
        prev = torch.where(prev_col >= 0, ids.gather(1, prev_col.clamp_min(0)), NONE)
        logits = self.table[prev, input_ids, position_ids % 2]  # (B, T, V)
        return SimpleNamespace(logits=logits[:, -logits_to_keep:] if logits_to_keep else logits)


def trigram_tables(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Target and draft tables that differ strongly; each bans tokens the other likes (-inf logits)."""
    gen = torch.Generator().manual_seed(seed)
    target = 2.0 * torch.randn(V + 1, V, 2, V, generator=gen)
    draft = 2.0 * torch.randn(V + 1, V, 2, V, generator=gen)
    target[..., 0] = float("-inf")  # p has no mass on token 0, q does
    draft[..., 1] = float("-inf")  # q has no mass on token 1, p does
    draft[..., 2] += 3.0  # q over-proposes token 2
    return target, draft


def exact_joint(table: torch.Tensor, prompt: list[int], sampling: SamplingParams) -> torch.Tensor:
    """P(y1, y2, y3) of target-only sampling after `prompt` -> (V, V, V)."""
    L = len(prompt)
    prev0 = prompt[-2] if L > 1 else NONE

    def p(prev, cur, pos):
        return warp_logits(table[prev, cur, pos % 2], sampling)

    joint = torch.zeros(V, V, V)
    for y1, y2 in itertools.product(range(V), repeat=2):
        joint[y1, y2] = p(prev0, prompt[-1], L - 1)[y1] * p(prompt[-1], y1, L)[y2] * p(y1, y2, L + 1)
    return joint


def chi_square_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson chi-square goodness of fit; cells expecting < 5 draws are pooled into one."""
    counts, expected = counts.flatten().double(), probs.flatten().double() * counts.sum()
    small = expected < 5
    if small.any():
        counts = torch.cat([counts[~small], counts[small].sum()[None]])
        expected = torch.cat([expected[~small], expected[small].sum()[None]])
    assert counts[expected == 0].sum() == 0, "a draw the target can never produce"
    keep = expected > 0
    stat = ((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum()
    dof = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), stat / 2))


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


def tiny_llama(seed: int) -> LlamaForCausalLM:
    # A 12-token vocabulary and spread-out logits (initializer_range 0.5), so p and q differ a lot.
    return conftest_tiny_llama(vocab_size=12, seed=seed, max_position_embeddings=64, initializer_range=0.5)


def llama_joint2(model: LlamaForCausalLM, prompt: list[int], sampling: SamplingParams) -> torch.Tensor:
    """P(y1, y2) of target-only sampling after `prompt` -> (V, V), from full forwards."""
    vocab = model.config.vocab_size
    with torch.no_grad():
        p1 = warp_logits(model(input_ids=torch.tensor([prompt])).logits[0, -1], sampling)
        seqs = torch.tensor([prompt + [y] for y in range(vocab)])
        p2 = warp_logits(model(input_ids=seqs).logits[:, -1], sampling)
    return p1[:, None] * p2


@pytest.mark.parametrize("backend", ["hf", "compact"])
def test_speculative_joint_on_tiny_llamas(backend):
    target, draft = tiny_llama(0), tiny_llama(1)
    prompts = {"short": [5], "long": [3, 9, 1, 7, 2]}
    sampling = SamplingParams(temperature=1.0, top_k=8)
    exact = {kind: llama_joint2(target, prompt, sampling) for kind, prompt in prompts.items()}
    if backend == "compact":
        target, draft = Llama.from_hf(target), Llama.from_hf(draft)
    draws = 4000
    result = generate(
        target,
        draft,
        [prompts["short"], prompts["long"]] * draws,
        num_draft_tokens=3,
        draft_rule="sample",
        sampling=sampling,
        max_new_tokens=2,
        generator=torch.Generator().manual_seed(1),
    )
    tokens = torch.tensor(result.tokens)
    flat = tokens[:, 0] * 12 + tokens[:, 1]
    assert 0.05 < result.stats.aggregate()["acceptance_rate"] < 0.95
    for i, kind in enumerate(("short", "long")):
        counts = torch.bincount(flat[i::2], minlength=144)
        assert chi_square_pvalue(counts, exact[kind]) > 1e-4, kind
