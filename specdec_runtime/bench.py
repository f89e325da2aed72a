"""Benchmark one target/draft pair on one prompt set: target-only vs speculative (ours) vs HF assisted generation.

All three run in this process on the same prompts with the same stop token; warm-up runs are excluded from timings.
On CUDA, Llama-family models run through the compact model (bf16 static cache + CUDA graphs) for both of our modes,
while HF assisted generation uses the HF models as given. HF assisted generation only supports batch size 1, so it
runs prompt by prompt whatever `batch_size` is. With `tree`, a token-tree run of the same pair joins them (our engine,
same prompts), reported next to the chain as `tree`. The lead's CLI wires this to `specdistill bench`.
"""

import time

import torch
from transformers import GenerationConfig

from .engine import generate
from .llama import Llama
from .metrics import analytic_speedup, measure_cost_ratios, merge_stats, predicted_speedup
from .sampling import DraftRule, SamplingParams
from .tree import parse_tree, tree_size


def fast_model(model: torch.nn.Module) -> torch.nn.Module:
    """The compact bf16 model for a Llama checkpoint on CUDA; any other model is returned as is."""
    if model.device.type == "cuda" and model.config.model_type == "llama":
        return Llama.from_hf(model, dtype=torch.bfloat16)
    return model


def _run_ours(target, draft, prompts, batch_size, **kwargs) -> dict:
    parts = [generate(target, draft, prompts[i : i + batch_size], **kwargs) for i in range(0, len(prompts), batch_size)]
    return merge_stats([part.stats for part in parts]).aggregate()


def _run_hf_assisted(target, draft, prompts, config: GenerationConfig) -> dict:
    new_tokens, wall_s = 0, 0.0
    for prompt in prompts:
        ids = torch.tensor([prompt], device=target.device)
        if target.device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        out = target.generate(ids, attention_mask=torch.ones_like(ids), assistant_model=draft, generation_config=config)
        if target.device.type == "cuda":
            torch.cuda.synchronize()
        wall_s += time.perf_counter() - start
        new_tokens += out.shape[1] - ids.shape[1]
    return {"tokens_per_s": new_tokens / wall_s, "wall_s": wall_s, "new_tokens": new_tokens}


def run_bench(
    target: torch.nn.Module,
    draft: torch.nn.Module,
    tokenizer,
    prompts: list[list[int]],
    *,
    num_draft_tokens: int,
    max_new_tokens: int,
    temperature: float,
    batch_size: int,
    seed: int,
    warmup: int = 1,
    draft_rule: DraftRule = "greedy",
    tree: str | None = None,
) -> dict:
    """Bench JSON of DESIGN.md (`bench --json`); the tokenizer is read for its eos/pad token ids only.

    tree: a token-tree spec ('4,2,2,1', 'dynamic:NODES'); adds a `tree` block (tokens_per_s, wall_s, new_tokens,
    acceptance_rate, mean_accepted_length, nodes_per_step, verify_cost_ratio at the tree's node count, speedup over
    target-only and speedup_vs_chain over the chain of num_draft_tokens, both wall-time ratios on the same prompts).
    """
    eos = tokenizer.eos_token_id
    fast_target, fast_draft = fast_model(target), fast_model(draft)
    ours = {
        "num_draft_tokens": num_draft_tokens,
        "draft_rule": draft_rule,
        "sampling": SamplingParams(temperature=temperature),
        "max_new_tokens": max_new_tokens,
        "stop_token_ids": () if eos is None else (eos,),
    }
    hf_config = GenerationConfig(
        max_new_tokens=max_new_tokens,
        do_sample=temperature > 0,
        temperature=temperature if temperature > 0 else None,
        top_k=0,
        top_p=1.0,
        eos_token_id=eos,
        pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos,
        num_assistant_tokens=num_draft_tokens,
        num_assistant_tokens_schedule="constant",
        assistant_confidence_threshold=0.0,  # always draft all num_assistant_tokens
    )

    def seeded() -> torch.Generator:
        return torch.Generator(device=target.device).manual_seed(seed)

    for _ in range(warmup):  # compile kernels, capture CUDA graphs, fill allocator caches
        _run_ours(fast_target, None, prompts[:batch_size], batch_size, generator=seeded(), **ours)
        _run_ours(fast_target, fast_draft, prompts[:batch_size], batch_size, generator=seeded(), **ours)
        _run_hf_assisted(target, draft, prompts[:1], hf_config)
        if tree is not None:
            _run_ours(fast_target, fast_draft, prompts[:batch_size], batch_size, generator=seeded(), tree=tree, **ours)
    target_only = _run_ours(fast_target, None, prompts, batch_size, generator=seeded(), **ours)
    speculative = _run_ours(fast_target, fast_draft, prompts, batch_size, generator=seeded(), **ours)
    tree_run = None
    if tree is not None:
        tree_run = _run_ours(fast_target, fast_draft, prompts, batch_size, generator=seeded(), tree=tree, **ours)
    torch.manual_seed(seed)  # HF sampling draws from the global generator
    hf_assisted = _run_hf_assisted(target, draft, prompts, hf_config)

    context_len = max(1, round(sum(len(p) for p in prompts) / len(prompts)))
    c, v = measure_cost_ratios(
        fast_target, fast_draft, num_draft_tokens=num_draft_tokens, batch_size=batch_size, context_len=context_len
    )
    alpha, tau = speculative["acceptance_rate"], speculative["mean_accepted_length"]
    speedup = target_only["wall_s"] / speculative["wall_s"]
    predicted = predicted_speedup(tau, num_draft_tokens, c, v)
    keep = ("tokens_per_s", "wall_s", "new_tokens")
    result = {
        "target_only": {k: target_only[k] for k in keep},
        "speculative": {k: speculative[k] for k in keep},
        "hf_assisted": hf_assisted,
        "acceptance_rate": alpha,
        "mean_accepted_length": tau,
        "per_position_acceptance": speculative["per_position_acceptance"],
        "cost_ratio": c,
        "verify_cost_ratio": v,
        "analytic_speedup": analytic_speedup(alpha, num_draft_tokens, c),
        "predicted_speedup": predicted,
        "speedup": speedup,
        "efficiency": speedup / predicted,
        "speedup_vs_hf_assisted": hf_assisted["wall_s"] / speculative["wall_s"],
        "settings": {
            "num_draft_tokens": num_draft_tokens,
            "draft_rule": draft_rule,
            "temperature": temperature,
            "max_new_tokens": max_new_tokens,
            "batch_size": batch_size,
            "num_prompts": len(prompts),
            "seed": seed,
            "compact_model": fast_target is not target,
            "tree": tree,
        },
    }
    if tree_run is not None:
        _, nodes = tree_size(parse_tree(tree))
        _, tree_v = measure_cost_ratios(
            fast_target, fast_draft, num_draft_tokens=nodes, batch_size=batch_size, context_len=context_len
        )
        result["tree"] = {
            "tree": tree,
            **{k: tree_run[k] for k in keep},
            **{k: tree_run[k] for k in ("acceptance_rate", "mean_accepted_length", "nodes_per_step")},
            "verify_cost_ratio": tree_v,
            "speedup": target_only["wall_s"] / tree_run["wall_s"],
            "speedup_vs_chain": speculative["wall_s"] / tree_run["wall_s"],
        }
    return result


def format_bench_table(result: dict) -> str:
    """Human-readable summary of a `run_bench` result."""
    lines = [f"{'mode':<13}{'tokens/s':>11}{'wall_s':>10}{'new_tokens':>12}"]
    for mode in ("target_only", "speculative", "hf_assisted"):
        row = result[mode]
        lines.append(f"{mode:<13}{row['tokens_per_s']:>11.1f}{row['wall_s']:>10.3f}{row['new_tokens']:>12d}")
    names = (
        "acceptance_rate",
        "mean_accepted_length",
        "cost_ratio",
        "verify_cost_ratio",
        "analytic_speedup",
        "predicted_speedup",
        "speedup",
        "efficiency",
        "speedup_vs_hf_assisted",
    )
    width = max(len(name) for name in names)
    lines += [f"{name:<{width}}  {result[name]:.3f}" for name in names]
    if "tree" in result:
        row = result["tree"]
        tree_names = ("mean_accepted_length", "nodes_per_step", "verify_cost_ratio", "speedup", "speedup_vs_chain")
        lines.append(f"tree {row['tree']}: {row['tokens_per_s']:.1f} tokens/s, {row['wall_s']:.3f} s")
        lines += [f"  {name:<{width}}{row[name]:.3f}" for name in tree_names]
    return "\n".join(lines)
