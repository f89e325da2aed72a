"""The CUDA fast path: bf16 compact model, static per-row cache and CUDA graphs, through the same engine.

Run: python -m pytest tests/test_runtime_gpu.py -q -m gpu   (on a CUDA machine; skipped elsewhere)
"""

from types import SimpleNamespace

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from specdec_runtime.bench import run_bench
from specdec_runtime.engine import SamplingParams, generate
from specdec_runtime.llama import Llama
from specdec_runtime.sampling import warp_logits

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

PROMPTS = [[5, 17, 3, 40, 22, 9], [11], [60, 2, 33], [7, 7, 7, 7, 7, 7, 7, 7, 1], [8, 30]]


def tiny_llama(seed: int, vocab_size: int = 64, init: float = 0.2) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        initializer_range=init,  # spread-out logits: fewer bf16 near-ties
    )
    return LlamaForCausalLM(config).eval().cuda()


def perturbed(model: LlamaForCausalLM, scale: float) -> LlamaForCausalLM:
    draft = tiny_llama(99)
    draft.load_state_dict(model.state_dict())
    with torch.no_grad():
        for w in draft.parameters():
            w.add_(scale * w.std() * torch.randn_like(w))
    return draft


def assert_same_up_to_ties(hf_fp32: LlamaForCausalLM, prompts, got_rows, want_rows, label: str) -> None:
    """Rows equal, or parting at a step where the fp32 target's top two logits are within bf16 noise.

    bf16 verify (gamma + 1 tokens) and decode (1 token) forwards round differently, so an exact tie can break either
    way; everywhere else the tokens must match.
    """
    for prompt, got, want in zip(prompts, got_rows, want_rows):
        split = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), None)
        if split is None:
            assert got == want, label
            continue
        with torch.no_grad():
            logits = hf_fp32(input_ids=torch.tensor([prompt + want[:split]], device="cuda")).logits[0, -1]
        top = logits.topk(2).values
        assert float(top[0] - top[1]) < 0.05 * float(logits.abs().max()), f"{label}: parted at {split}, not a tie"


def test_bf16_graphs_greedy_identity():
    hf_target = tiny_llama(0)
    target = Llama.from_hf(hf_target, dtype=torch.bfloat16)
    draft = Llama.from_hf(perturbed(hf_target, 0.05), dtype=torch.bfloat16)
    reference = generate(target, None, PROMPTS, max_new_tokens=48).tokens
    assert target.graphs, "decode steps should replay as CUDA graphs"
    rates = []
    for gamma in (1, 2, 4, 8):
        result = generate(target, draft, PROMPTS, num_draft_tokens=gamma, max_new_tokens=48)
        rates.append(result.stats.aggregate()["acceptance_rate"])
        assert_same_up_to_ties(hf_target, PROMPTS, result.tokens, reference, f"gamma={gamma}")
    assert all(0 < r < 1 for r in rates), rates
    assert 9 in target.graphs and 1 in draft.graphs  # verify of gamma 8 + 1 tokens, single-token draft step


def test_bf16_graphs_greedy_identity_with_eos_mid_draft():
    hf_target = tiny_llama(0)
    target = Llama.from_hf(hf_target, dtype=torch.bfloat16)
    draft = Llama.from_hf(hf_target, dtype=torch.bfloat16)  # accepts everything: the stop lands inside a draft block
    free = generate(target, None, PROMPTS, max_new_tokens=32).tokens
    eos = free[0][5]
    reference = generate(target, None, PROMPTS, max_new_tokens=32, stop_token_ids=[eos]).tokens
    result = generate(target, draft, PROMPTS, num_draft_tokens=4, max_new_tokens=32, stop_token_ids=[eos])
    assert_same_up_to_ties(hf_target, PROMPTS, result.tokens, reference, "eos")
    assert reference[0][-1] == eos and all(len(t) <= 32 and eos not in t[:-1] for t in result.tokens)


def test_bf16_graphs_distribution():
    # init 0.1: p and q overlap ~60%, and bf16 moves probabilities by ~0.5%, far below what 20k draws resolve
    hf_target, hf_draft = tiny_llama(0, vocab_size=12, init=0.1), tiny_llama(1, vocab_size=12, init=0.1)
    target = Llama.from_hf(hf_target, dtype=torch.bfloat16)
    draft = Llama.from_hf(hf_draft, dtype=torch.bfloat16)
    sampling = SamplingParams(temperature=1.0, top_p=0.95)
    prompts = {"short": [5], "long": [3, 9, 1, 7, 2]}
    draws = 20_000
    result = generate(
        target,
        draft,
        [prompts["short"], prompts["long"]] * draws,
        num_draft_tokens=3,
        draft_rule="sample",
        sampling=sampling,
        max_new_tokens=2,
        generator=torch.Generator(device="cuda").manual_seed(0),
    )
    tokens = torch.tensor(result.tokens)
    flat = tokens[:, 0] * 12 + tokens[:, 1]
    for i, kind in enumerate(("short", "long")):
        counts = torch.bincount(flat[i::2], minlength=144).double()
        assert chi_square_pvalue(counts, exact_joint2(hf_target, prompts[kind], sampling)) > 1e-4, kind


def exact_joint2(model: LlamaForCausalLM, prompt: list[int], sampling: SamplingParams) -> torch.Tensor:
    """P(y1, y2) of target-only sampling after `prompt`, flattened (V * V,), from fp32 full forwards."""
    vocab = model.config.vocab_size
    with torch.no_grad():
        p1 = warp_logits(model(input_ids=torch.tensor([prompt], device="cuda")).logits[0, -1], sampling)
        seqs = torch.tensor([prompt + [y] for y in range(vocab)], device="cuda")
        p2 = warp_logits(model(input_ids=seqs).logits[:, -1], sampling)
    return (p1[:, None] * p2).flatten().cpu()


def chi_square_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs.double() * counts.sum()
    small = expected < 5
    counts = torch.cat([counts[~small], counts[small].sum()[None]])
    expected = torch.cat([expected[~small], expected[small].sum()[None]])
    assert counts[expected == 0].sum() == 0, "a draw the target can never produce"
    keep = expected > 0
    stat = ((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum()
    return float(torch.special.gammaincc(torch.tensor((int(keep.sum()) - 1) / 2, dtype=torch.float64), stat / 2))


def test_bench_uses_the_compact_model_on_cuda():
    hf_target = tiny_llama(0)
    result = run_bench(
        hf_target,
        perturbed(hf_target, 0.05),
        SimpleNamespace(eos_token_id=None, pad_token_id=0),
        PROMPTS,
        num_draft_tokens=4,
        max_new_tokens=16,
        temperature=0.0,
        batch_size=2,
        seed=0,
    )
    assert result["settings"]["compact_model"]
    assert result["speculative"]["new_tokens"] == result["target_only"]["new_tokens"] == 16 * len(PROMPTS)
    assert 0 < result["acceptance_rate"] < 1 and result["speedup"] > 0 and result["efficiency"] > 0
