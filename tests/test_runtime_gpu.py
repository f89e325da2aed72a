"""The CUDA fast path: bf16 compact model, static per-row cache and CUDA graphs, through the same engine.

Run: python -m pytest tests/test_runtime_gpu.py -q -m gpu   (on a CUDA machine; skipped elsewhere)
"""

from types import SimpleNamespace

import pytest
import torch
from helpers.models import GPU_PROMPTS, assert_same_up_to_ties, bench_arm_tokens, gpu_llama, gpu_perturbed
from helpers.stats import CUDA_SAMPLING, JOINT_PROMPTS, llama_joint2, llama_joint_pvalues

from specdec_runtime.bench import run_bench
from specdec_runtime.engine import generate
from specdec_runtime.llama import Llama

pytestmark = pytest.mark.gpu


def test_bf16_graphs_greedy_identity():
    hf_target = gpu_llama(0)
    target = Llama.from_hf(hf_target, dtype=torch.bfloat16)
    draft = Llama.from_hf(gpu_perturbed(hf_target, 0.05), dtype=torch.bfloat16)
    reference = generate(target, None, GPU_PROMPTS, max_new_tokens=48).tokens
    assert target.graphs, "decode steps should replay as CUDA graphs"
    rates = []
    for gamma in (1, 2, 4, 8):
        result = generate(target, draft, GPU_PROMPTS, num_draft_tokens=gamma, max_new_tokens=48)
        rates.append(result.stats.aggregate()["acceptance_rate"])
        assert_same_up_to_ties(hf_target, GPU_PROMPTS, result.tokens, reference, f"gamma={gamma}")
    assert all(0 < r < 1 for r in rates), rates
    assert 9 in target.graphs and 1 in draft.graphs  # verify of gamma 8 + 1 tokens, single-token draft step


def test_bf16_graphs_greedy_identity_with_eos_mid_draft():
    hf_target = gpu_llama(0)
    target = Llama.from_hf(hf_target, dtype=torch.bfloat16)
    draft = Llama.from_hf(hf_target, dtype=torch.bfloat16)  # accepts everything: the stop lands inside a draft block
    free = generate(target, None, GPU_PROMPTS, max_new_tokens=32).tokens
    eos = free[0][5]
    reference = generate(target, None, GPU_PROMPTS, max_new_tokens=32, stop_token_ids=[eos]).tokens
    result = generate(target, draft, GPU_PROMPTS, num_draft_tokens=4, max_new_tokens=32, stop_token_ids=[eos])
    assert_same_up_to_ties(hf_target, GPU_PROMPTS, result.tokens, reference, "eos")
    assert reference[0][-1] == eos and all(len(t) <= 32 and eos not in t[:-1] for t in result.tokens)


def test_bf16_graphs_distribution():
    # init 0.1: p and q overlap ~60%, and bf16 moves probabilities by ~0.5%, far below what 20k draws resolve
    hf_target, hf_draft = gpu_llama(0, vocab_size=12, init=0.1), gpu_llama(1, vocab_size=12, init=0.1)
    target = Llama.from_hf(hf_target, dtype=torch.bfloat16)
    draft = Llama.from_hf(hf_draft, dtype=torch.bfloat16)
    sampling = CUDA_SAMPLING  # no nucleus: bf16 would move tokens across its boundary
    exact = {kind: llama_joint2(hf_target, prompt, sampling) for kind, prompt in JOINT_PROMPTS.items()}
    generator = torch.Generator(device="cuda").manual_seed(0)
    kwargs = dict(draws=20_000, generator=generator, num_draft_tokens=3, draft_rule="sample")
    _, pvalues = llama_joint_pvalues(target, draft, exact, sampling, **kwargs)
    for kind, pvalue in pvalues.items():
        assert pvalue > 1e-4, kind


def test_bench_uses_the_compact_model_on_cuda():
    hf_target = gpu_llama(0)
    result = run_bench(
        hf_target,
        gpu_perturbed(hf_target, 0.05),
        SimpleNamespace(eos_token_id=None, pad_token_id=0),
        GPU_PROMPTS,
        num_draft_tokens=4,
        max_new_tokens=16,
        temperature=0.0,
        batch_size=2,
        seed=0,
    )
    assert result["settings"]["compact_model"]
    tokens = bench_arm_tokens(len(GPU_PROMPTS), batch_size=2, max_new_tokens=16)  # 2 batches of 2, 3 repeats
    assert result["speculative"]["new_tokens"] == result["target_only"]["new_tokens"] == tokens
    assert 0 < result["acceptance_rate"] < 1 and result["speedup"] > 0 and result["efficiency"] > 0
