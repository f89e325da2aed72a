"""GPU benchmark of the runtime's CUDA fast path (bf16 compact model, static KV cache, CUDA graphs).

A random-weight 1.1B Llama target (TinyLlama-1.1B shapes; the middle layers' residual updates are scaled by 0.02 so
that a cut-down draft agrees with it often) and a 2-layer draft cut from it (first and last layer, same embeddings
and head): tokens/s for target-only and speculative decoding, with and without CUDA graphs, our engine on the HF
models (generic path), and HF assisted generation; plus the measured cost ratios and efficiency = measured /
predicted speedup.

    PYTHONPATH=. python benchmarks/gpu_bench.py --json gpu_bench.json        # on a CUDA machine
"""

from __future__ import annotations

import argparse
import copy
import json
import time
import traceback

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from specdec_runtime.bench import format_bench_table, run_bench
from specdec_runtime.engine import SamplingParams, generate
from specdec_runtime.llama import Llama
from specdec_runtime.metrics import measure_cost_ratios, merge_stats, predicted_speedup


def build_pair(seed: int = 0, small: bool = False, middle_scale: float = 0.02):
    shape = dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
                 num_attention_heads=32, num_key_value_heads=4)
    if small:  # a CPU dry run of this script
        shape = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                     num_attention_heads=4, num_key_value_heads=2)
    config = LlamaConfig(**shape, max_position_embeddings=2048, initializer_range=0.02, tie_word_embeddings=False)
    torch.manual_seed(seed)
    with torch.device(DEVICE):
        target = LlamaForCausalLM(config).to(torch.bfloat16).eval()
    # Random layers disagree completely, so a cut-down draft would never be accepted. Shrinking what the middle layers
    # add to the residual stream (same shapes, same cost) makes the 2-layer draft agree often, like a trained one.
    with torch.no_grad():
        for layer in target.model.layers[1:-1]:
            layer.self_attn.o_proj.weight.mul_(middle_scale)
            layer.mlp.down_proj.weight.mul_(middle_scale)
    draft = copy.deepcopy(target)
    draft.model.layers = torch.nn.ModuleList([draft.model.layers[0], draft.model.layers[-1]])
    draft.config.num_hidden_layers = 2
    for i, layer in enumerate(draft.model.layers):
        layer.self_attn.layer_idx = i
    if getattr(draft.config, "layer_types", None):
        draft.config.layer_types = draft.config.layer_types[:2]
    return target, draft


DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


class Dummy:
    eos_token_id = None
    pad_token_id = 0


def timed_generate(target, draft, prompts, gamma, max_new_tokens, seed=0) -> dict:
    kwargs = dict(num_draft_tokens=gamma, draft_rule="greedy", sampling=SamplingParams(0.0),
                  max_new_tokens=max_new_tokens, stop_token_ids=())
    generate(target, draft, prompts[:1], generator=torch.Generator(DEVICE).manual_seed(seed), **kwargs)  # warm-up
    sync()
    parts = [generate(target, draft, [p], generator=torch.Generator(DEVICE).manual_seed(seed), **kwargs).stats
             for p in prompts]
    sync()
    return merge_stats(parts).aggregate()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--gamma", type=int, default=4)
    parser.add_argument("--json", default=None)
    parser.add_argument("--small", action="store_true", help="tiny shapes: a dry run of the script on a CPU")
    args = parser.parse_args()
    name = torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu"
    print(f"device: {name}, torch {torch.__version__}", flush=True)
    target, draft = build_pair(small=args.small)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(target.config.vocab_size, (int(n),), generator=gen).tolist()
               for n in torch.randint(32, 128, (args.num_prompts,), generator=gen)]
    results: dict = {"gamma": args.gamma, "num_prompts": args.num_prompts, "max_new_tokens": args.max_new_tokens}

    try:
        start = time.time()
        bench = run_bench(target, draft, Dummy(), prompts, num_draft_tokens=args.gamma,
                          max_new_tokens=args.max_new_tokens, temperature=0.0, batch_size=1, seed=0)
        print(format_bench_table(bench), flush=True)
        print(f"(run_bench took {time.time() - start:.1f} s)", flush=True)
        results["run_bench_graphs"] = bench
    except Exception:
        traceback.print_exc()

    for graphs in (True, False):
        try:
            fast_t, fast_d = Llama.from_hf(target, dtype=torch.bfloat16), Llama.from_hf(draft, dtype=torch.bfloat16)
            fast_t.use_graphs = fast_d.use_graphs = graphs
            t_only = timed_generate(fast_t, None, prompts, args.gamma, args.max_new_tokens)
            spec = timed_generate(fast_t, fast_d, prompts, args.gamma, args.max_new_tokens)
            c, v = measure_cost_ratios(fast_t, fast_d, num_draft_tokens=args.gamma)
            pred = predicted_speedup(spec["mean_accepted_length"], args.gamma, c, v)
            speedup = t_only["wall_s"] / spec["wall_s"]
            row = {"target_only_tokens_per_s": t_only["tokens_per_s"], "speculative_tokens_per_s": spec["tokens_per_s"],
                   "acceptance_rate": spec["acceptance_rate"], "mean_accepted_length": spec["mean_accepted_length"],
                   "cost_ratio": c, "verify_cost_ratio": v, "predicted_speedup": pred, "speedup": speedup,
                   "efficiency": speedup / pred}
            results[f"compact_graphs_{'on' if graphs else 'off'}"] = row
            print(f"compact model, CUDA graphs {'on' if graphs else 'off'}: " + json.dumps(row), flush=True)
            del fast_t, fast_d
        except Exception:
            traceback.print_exc()

    try:  # our engine on the HF models as given (DynamicCache, eager): the generic path
        t_only = timed_generate(target, None, prompts[:4], args.gamma, args.max_new_tokens)
        spec = timed_generate(target, draft, prompts[:4], args.gamma, args.max_new_tokens)
        results["hf_generic_path"] = {"target_only_tokens_per_s": t_only["tokens_per_s"],
                                      "speculative_tokens_per_s": spec["tokens_per_s"],
                                      "speedup": t_only["wall_s"] / spec["wall_s"]}
        print("HF models through our engine (generic path): " + json.dumps(results["hf_generic_path"]), flush=True)
    except Exception:
        traceback.print_exc()

    try:  # accounting check: the target as its own draft accepts everything
        fast_t, fast_s = Llama.from_hf(target, dtype=torch.bfloat16), Llama.from_hf(target, dtype=torch.bfloat16)
        spec = timed_generate(fast_t, fast_s, prompts[:2], args.gamma, 64)
        results["self_draft"] = {"acceptance_rate": spec["acceptance_rate"],
                                 "mean_accepted_length": spec["mean_accepted_length"]}
        print("target as its own draft: " + json.dumps(results["self_draft"]), flush=True)
    except Exception:
        traceback.print_exc()

    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
