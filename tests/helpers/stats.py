"""Analytic joints of toy models and goodness-of-fit statistics for the exactness tests."""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import torch
from transformers import LlamaForCausalLM

from specdec_runtime.engine import generate
from specdec_runtime.sampling import SamplingParams, warp_logits

V = 6  # vocabulary of the trigram toy models


NONE = V  # "no previous token" row of a trigram table


def exact_joint(table: torch.Tensor, prompt: list[int], sampling: SamplingParams) -> torch.Tensor:
    """P(y1, y2, y3) of target-only sampling from a trigram table (V + 1, V, 2, V) after `prompt` -> (V, V, V)."""
    L = len(prompt)
    prev0 = prompt[-2] if L > 1 else NONE

    def p(prev, cur, pos):
        return warp_logits(table[prev, cur, pos % 2], sampling)

    joint = torch.zeros(V, V, V)
    for y1, y2 in itertools.product(range(V), repeat=2):
        joint[y1, y2] = p(prev0, prompt[-1], L - 1)[y1] * p(prompt[-1], y1, L)[y2] * p(y1, y2, L + 1)
    return joint


def llama_joint2(model: LlamaForCausalLM, prompt: list[int], sampling: SamplingParams) -> torch.Tensor:
    """P(y1, y2) of target-only sampling after `prompt` -> (V, V) on the CPU, from full forwards on model.device."""
    vocab, device = model.config.vocab_size, model.device
    with torch.no_grad():
        p1 = warp_logits(model(input_ids=torch.tensor([prompt], device=device)).logits[0, -1], sampling)
        seqs = torch.tensor([prompt + [y] for y in range(vocab)], device=device)
        p2 = warp_logits(model(input_ids=seqs).logits[:, -1], sampling)
    return (p1[:, None] * p2).cpu()


class TrigramLM(torch.nn.Module):
    """Logits by (previous token, current token, position parity); the previous token is the last cache column the
    query may attend to before its own: its parent inside a tree, so a rejected token left visible after a rollback
    changes the output. Accepts 2D padding masks (chains) and 4D additive masks (trees)."""

    def __init__(self, table: torch.Tensor):  # (V + 1, V, 2, V): row V is "no previous token"
        super().__init__()
        self.table = table
        self.config = SimpleNamespace(vocab_size=table.shape[-1], max_position_embeddings=1024)
        self.device, self.dtype = torch.device("cpu"), torch.float32

    def forward(self, input_ids, position_ids, attention_mask, cache, use_cache=True, logits_to_keep=0):
        B, T = input_ids.shape
        ids, _ = cache.update(input_ids[:, None, :, None].float(), input_ids[:, None, :, None].float(), 0)
        ids = ids[:, 0, :, 0].long()  # (B, S + T): every column the cache holds, holes included
        S = ids.shape[1] - T
        cols, own = torch.arange(S + T), S + torch.arange(T)
        if attention_mask.dim() == 4:  # additive tree mask (B, 1, T, S + T): 0 = attend
            visible = attention_mask[:, 0] == 0
        else:  # (B, S + T) real columns, causal
            visible = attention_mask.bool()[:, None, :] & (cols <= own[:, None])
        prev_col = torch.where(visible & (cols < own[:, None]), cols, -1).amax(-1)  # (B, T)
        prev = torch.where(prev_col >= 0, ids.gather(1, prev_col.clamp_min(0)), self.table.shape[0] - 1)
        logits = self.table[prev, input_ids, position_ids % 2]  # (B, T, V)
        return SimpleNamespace(logits=logits[:, -logits_to_keep:] if logits_to_keep else logits)


# Whole sequences with a stop token: 6 = 2 (gamma + 1) for gamma 2, or 2 (depth + 1) for depth-2 trees, so bonus
# tokens and rollbacks both feed forward and rows leave the batch at different steps.
SEQ_V, SEQ_STOP, SEQ_LEN = 4, 3, 6


SEQ_PROMPTS = {"short": [1], "long": [2, 0, 1]}


def sequence_tables(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(V + 1, V, 2, V) target and draft tables that agree often (all-accepted steps take a bonus token) but not
    always (rejections roll back), with a rare stop token so most sequences run to full length."""
    gen = torch.Generator().manual_seed(seed)
    target = 1.5 * torch.randn(SEQ_V + 1, SEQ_V, 2, SEQ_V, generator=gen)
    target[..., SEQ_STOP] -= 1.5
    draft = target + torch.randn(target.shape, generator=gen)
    return target, draft


def sequence_probs(table: torch.Tensor, prompt: list[int], sampling: SamplingParams) -> dict[tuple, float]:
    """P(sequence) of target-only sampling for every sequence a run can emit: SEQ_LEN tokens, or fewer ending in the
    stop token."""
    none, probs = table.shape[0] - 1, {}
    for length in range(1, SEQ_LEN + 1):
        for seq in itertools.product(range(SEQ_V), repeat=length):
            if SEQ_STOP in seq[:-1] or (length < SEQ_LEN and seq[-1] != SEQ_STOP):
                continue
            ctx, prob = list(prompt) + list(seq), 1.0
            for i in range(len(prompt), len(ctx)):
                prev = ctx[i - 2] if i >= 2 else none
                prob *= float(warp_logits(table[prev, ctx[i - 1], (i - 1) % 2], sampling)[ctx[i]])
            probs[seq] = prob
    return probs


def sequence_pvalues(rows: list[list[int]], table: torch.Tensor, sampling: SamplingParams) -> dict[str, float]:
    """Chi-square p-value per prompt kind of emitted sequences (rows of interleaved short, long SEQ_PROMPTS) against
    their exact distribution."""
    pvalues = {}
    for i, kind in enumerate(("short", "long")):
        probs = sequence_probs(table, SEQ_PROMPTS[kind], sampling)
        cells = {seq: c for c, seq in enumerate(probs)}
        counts = torch.zeros(len(cells) + 1)  # the last cell: sequences the target can never emit
        for tokens in rows[i::2]:
            counts[cells.get(tuple(tokens), len(cells))] += 1
        pvalues[kind] = chi_square_pvalue(counts, torch.tensor([*probs.values(), 0.0]))
    return pvalues


JOINT_PROMPTS = {"short": [5], "long": [3, 9, 1, 7, 2]}
CUDA_SAMPLING = SamplingParams(temperature=1.0, top_p=1.0)
"""The CUDA distribution tests' sampling against an fp32 reference: no nucleus, since bf16 moves probabilities by
~0.5 % and a token near the reference's nucleus boundary would fall in or out of it, which 20k draws see (issue 22;
the nucleus is tested exactly on the CPU)."""


def llama_joint_pvalues(
    target, draft, exact: dict[str, torch.Tensor], sampling: SamplingParams, *, draws: int, generator, **kwargs
) -> tuple[object, dict[str, float]]:
    """(result, chi-square p-value per prompt kind) of the first two tokens of `draws` interleaved short and long
    JOINT_PROMPTS against `exact` (kind -> (V, V) joint, from llama_joint2 on the target); `kwargs` go to generate
    (draft_rule, num_draft_tokens or tree)."""
    result = generate(
        target,
        draft,
        [JOINT_PROMPTS["short"], JOINT_PROMPTS["long"]] * draws,
        sampling=sampling,
        max_new_tokens=2,
        generator=generator,
        **kwargs,
    )
    tokens = torch.tensor(result.tokens)  # (2 * draws, 2)
    pvalues = {}
    for i, kind in enumerate(("short", "long")):
        vocab = exact[kind].shape[-1]
        flat = tokens[i::2, 0] * vocab + tokens[i::2, 1]
        pvalues[kind] = chi_square_pvalue(torch.bincount(flat, minlength=vocab * vocab), exact[kind])
    return result, pvalues


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


def g_test_pvalue(samples: torch.Tensor, probs: torch.Tensor) -> float:
    """G-test of categorical samples (n,) against probs (C,); 0 when an impossible outcome shows up."""
    counts = torch.bincount(samples, minlength=probs.numel()).double()
    if counts[probs == 0].sum() > 0:
        return 0.0
    observed, expected = counts[probs > 0], samples.numel() * probs[probs > 0]
    g = 2 * torch.where(observed > 0, observed * (observed / expected).log(), 0.0).sum()
    dof = torch.tensor((probs > 0).sum().item() - 1.0, dtype=torch.float64)
    return float(torch.special.gammaincc(dof / 2, g / 2))


def joint3(target, prompt: list[int], sampling: SamplingParams, vocab: int) -> torch.Tensor:
    """P(y1, y2, y3) of target-only sampling after `prompt` -> (V, V, V), from full forwards (V = `vocab`)."""
    with torch.no_grad():
        p1 = warp_logits(target(input_ids=torch.tensor([prompt])).logits[0, -1], sampling)
        two = torch.tensor([prompt + [a] for a in range(vocab)])
        p2 = warp_logits(target(input_ids=two).logits[:, -1], sampling)  # (V, V)
        three = torch.tensor([prompt + [a, b] for a in range(vocab) for b in range(vocab)])
        p3 = warp_logits(target(input_ids=three).logits[:, -1], sampling).view(vocab, vocab, vocab)
    return p1[:, None, None] * p2[:, :, None] * p3
