"""Tiny random models built in code (CPU and CUDA), HF greedy references, per-row trees and the bench's token count."""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from specdec_runtime.tree import Tree, sibling_rank


def tiny_llama(seed: int = 0, vocab_size: int = 64, layers: int = 2, **overrides) -> LlamaForCausalLM:
    """A random LlamaForCausalLM small enough to run hundreds of forwards per second on a CPU."""
    torch.manual_seed(seed)
    shape = dict(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
    )
    return LlamaForCausalLM(LlamaConfig(**{**shape, **overrides})).eval()


def spread_llama(seed: int) -> LlamaForCausalLM:
    """A 12-token vocabulary and spread-out logits (initializer_range 0.5), so two seeds' p and q differ a lot."""
    return tiny_llama(seed, vocab_size=12, max_position_embeddings=64, initializer_range=0.5)


def perturbed(model: LlamaForCausalLM, scale: float, seed: int) -> LlamaForCausalLM:
    """A draft that agrees with the target often but not always."""
    draft = tiny_llama(0)
    draft.load_state_dict(model.state_dict())
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for w in draft.parameters():
            w.add_(scale * torch.randn(w.shape, generator=gen))
    return draft


LLAMA_PROMPTS = [[5, 17, 3, 40, 22, 9], [11], [60, 2, 33], [7, 7, 7, 7, 7, 7, 7, 7, 1]]


def hf_greedy(model, prompts, max_new: int, eos: int | None = None) -> list[list[int]]:
    """Target-only greedy decoding by HF generate, one prompt at a time (no padding)."""
    rows = []
    for prompt in prompts:
        out = model.generate(
            torch.tensor([prompt]), do_sample=False, max_new_tokens=max_new, eos_token_id=eos, pad_token_id=0
        )
        rows.append(out[0, len(prompt) :].tolist())
    return rows


GPU_PROMPTS = [*LLAMA_PROMPTS, [8, 30]]


def bench_arm_tokens(num_prompts: int, batch_size: int, max_new_tokens: int, repeats: int = 3) -> int:
    """New tokens one arm of `run_bench` emits without a stop token: only full batches run (the remainder is left
    out), each prompt emits max_new_tokens, and the arm's calls are pooled over the paired repeats."""
    return num_prompts // batch_size * batch_size * max_new_tokens * repeats


def gpu_llama(
    seed: int, vocab_size: int = 64, init: float = 0.2, layers: int = 2, device: str = "cuda"
) -> LlamaForCausalLM:
    """A wider tiny Llama for the GPU tests (on `device`: the CPU builds the same weights, for checks of its shapes);
    a large `init` spreads the logits out: fewer bf16 near-ties. An EAGLE-3 head needs `layers` >= 4 (aux layers
    in [1, L - 1], the default [2, L // 2, L - 3])."""
    return tiny_llama(
        seed,
        vocab_size,
        layers,
        hidden_size=64,
        intermediate_size=128,
        max_position_embeddings=512,
        initializer_range=init,
    ).to(device)


def gpu_perturbed(model: LlamaForCausalLM, scale: float) -> LlamaForCausalLM:
    """A GPU draft near `model`: each weight moved by `scale` times its own spread."""
    draft = gpu_llama(99)
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
            logits = hf_fp32(input_ids=torch.tensor([prompt + want[:split]], device=hf_fp32.device)).logits[0, -1]
        top = logits.topk(2).values
        assert float(top[0] - top[1]) < 0.05 * float(logits.abs().max()), f"{label}: parted at {split}, not a tie"


def per_row_tree(parents: list[list[int]]) -> Tree:
    """Tree with per-row parents; depth by walking up in Python."""
    depth = []
    for row in parents:
        depth.append([])
        for p in row:
            depth[-1].append(1 if p < 0 else depth[-1][p] + 1)
    parents_t, depth_t = torch.tensor(parents), torch.tensor(depth)
    ranks = sibling_rank(parents_t)
    return Tree(parents_t, depth_t, ranks, int(depth_t.max()), int(ranks.max()) + 1)


def eagle3_setup(prompt_topk: bool, shapes=((4, 11), (3, 7))):
    """A 6-layer target, a head over its whole vocabulary (no position masked for its teacher argmax), and one row
    per (prompt length, length) in `shapes` with a full top-k cache (K = V, so the cached targets are the online
    ones; from position 0 with `prompt_topk`) and their aux hidden states."""
    from distill.data import TOPK_START
    from specdec_runtime.eagle3 import Eagle3Draft, target_aux_forward

    target = tiny_llama(seed=1, layers=6)
    head = Eagle3Draft.from_target(target, torch.arange(64), seed=0)
    aux_layers = head.aux_layers(6)
    g = torch.Generator().manual_seed(4)
    rows = []
    for P, n in shapes:
        ids = torch.randint(0, 64, (n,), generator=g).tolist()
        with torch.no_grad():
            logits, aux = target_aux_forward(target, torch.tensor([ids]), aux_layers)
        start = 1 if prompt_topk else P
        values, top = torch.log_softmax(logits[0, start - 1 : -1].float(), -1).topk(64, -1)  # (R, V) each
        row = {"input_ids": ids, "prompt_len": P, "topk_ids": top.tolist(), "topk_logprobs": values.half().tolist()}
        row |= {"aux_hidden": aux[0].half().tolist()} | ({TOPK_START: start} if prompt_topk else {})
        rows.append(row)
    return target, head, aux_layers, rows
