"""GPU benchmark of the runtime's CUDA fast path (bf16 compact model, static KV cache, CUDA graphs), measured as
issue 12 asks: every speedup is per token (decode seconds per token, prefill excluded), from target-only and
speculative runs alternating per prompt (ABBA, `--repeats` times), with its 95 % bootstrap interval over prompts;
the costs (c, v, predicted_speedup, efficiency, overhead_fraction) come from each run's own in-run phases; HF
assisted generation drafts exactly gamma tokens per step (`specdec_runtime.bench.fair_assistant`) and the width it
really verified is reported.

A random-weight 1.1B Llama target (TinyLlama-1.1B shapes; the middle layers' residual updates are scaled by 0.02 so
that a cut-down draft agrees with it often) and a 2-layer draft cut from it (first and last layer, same embeddings
and head). No EOS id, so every call emits exactly --max-new-tokens tokens. Sections (`--sections`):

    bench     `specdec_runtime.bench.run_bench` (= `specdistill bench`): target-only vs speculative (compact model,
              static cache, CUDA graphs) vs fair HF assisted generation at the same gamma
    graphs    the compact model with CUDA graphs on and off, paired target-only vs speculative each
    generic   our engine on the HF models as given (DynamicCache, eager): the generic path
    self      the target as its own draft: acceptance ~1 (bf16 ties aside) and efficiency <= ~1.05; clearly above 1
              is a measurement bug

    PYTHONPATH=. python benchmarks/gpu_bench.py --json gpu_bench.json                  # 1 GPU, about 6 minutes
    PYTHONPATH=. python benchmarks/gpu_bench.py --sections bench self --json a.json    # a part of it
    PYTHONPATH=. python benchmarks/gpu_bench.py --small --num-prompts 3 --max-new-tokens 8 --repeats 2  # CPU dry run

One GPU only: it measures batch-1 latency, which more GPUs do not change.
"""

from __future__ import annotations

import argparse
import copy
import json
import time
import traceback

import torch
import transformers
from transformers import LlamaConfig, LlamaForCausalLM

from specdec_runtime.ab import paired_metrics, paired_runs, pooled
from specdec_runtime.backends import full_units, longest_unit
from specdec_runtime.bench import format_bench_table, run_bench
from specdec_runtime.engine import SamplingParams, generate
from specdec_runtime.llama import Llama
from specdec_runtime.metrics import GenerationStats

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SECTIONS = ("bench", "graphs", "generic", "self")


def build_pair(seed: int = 0, small: bool = False, middle_scale: float = 0.02):
    shape = dict(
        vocab_size=32000,
        hidden_size=2048,
        intermediate_size=5632,
        num_hidden_layers=22,
        num_attention_heads=32,
        num_key_value_heads=4,
    )
    if small:  # a CPU dry run of this script
        shape = dict(
            vocab_size=512,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
        )
    config = LlamaConfig(
        **shape, max_position_embeddings=2048, initializer_range=0.02, tie_word_embeddings=False, eos_token_id=None
    )  # no stop token: every call emits exactly max_new_tokens
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


class NoStopTokenizer:
    """What `run_bench` reads of a tokenizer: no EOS (random weights have no end of text), pad id 0."""

    eos_token_id = None
    pad_token_id = 0


def arm_summary(stats: GenerationStats) -> dict:
    agg = stats.aggregate()
    return {k: agg[k] for k in ("tokens_per_s", "wall_s", "new_tokens")} | {"phases": stats.phases.to_dict()}


def paired_ab(target, draft, prompts: list[list[int]], *, gamma: int, max_new_tokens: int, repeats: int) -> dict:
    """Target-only vs speculative decoding (greedy) through our engine on the models as given, one prompt per unit:
    a warm-up of each arm on the longest prompt, then ABBA pairs `repeats` times -> tokens/s and phases per arm plus
    `ab.paired_metrics` (speedup, speedup_ci, in-run costs, efficiency), as `run_bench` computes them."""
    units = full_units(prompts, 1)
    kwargs = dict(
        num_draft_tokens=gamma,
        draft_rule="greedy",
        sampling=SamplingParams(0.0),
        max_new_tokens=max_new_tokens,
        stop_token_ids=(),
    )

    def run(unit: int, arm: str, repeat: int) -> GenerationStats:
        gen = torch.Generator(target.device).manual_seed(unit + 7919 * repeat)
        return generate(target, draft if arm == "speculative" else None, units[unit], generator=gen, **kwargs).stats

    for arm in ("speculative", "target_only"):  # speculative first: it sizes the target's static cache
        run(longest_unit(units), arm, 0)
    runs = paired_runs(run, units=len(units), arms=("target_only", "speculative"), repeats=repeats)
    arms = {arm: arm_summary(pooled(arm_runs)) for arm, arm_runs in runs.items()}
    return arms | paired_metrics(runs["target_only"], runs["speculative"], gamma)


def _f(x, spec: str = ".3f") -> str:
    return "-" if x is None else format(x, spec)


def summary_line(name: str, row: dict) -> str:
    ci = row["speedup_ci"]
    return (
        f"{name}: target-only {_f(row['target_only']['tokens_per_s'], '.1f')} tok/s, speculative "
        f"{_f(row['speculative']['tokens_per_s'], '.1f')} tok/s, alpha {_f(row['acceptance_rate'])}, tau "
        f"{_f(row['mean_accepted_length'])}, c {_f(row['cost_ratio'])}, v {_f(row['verify_cost_ratio'])}, predicted "
        f"{_f(row['predicted_speedup'])}, speedup {_f(row['speedup'])} "
        f"[{_f(ci[0] if ci else None)}, {_f(ci[1] if ci else None)}], efficiency {_f(row['efficiency'])}, "
        f"overhead_fraction {_f(row['overhead_fraction'])}"
    )


def section(results: dict, key: str, fn) -> None:
    """Run one measurement; a failure is printed and the other sections still run."""
    try:
        start = time.perf_counter()
        results[key] = fn()
        print(f"({key} took {time.perf_counter() - start:.1f} s)", flush=True)
    except Exception:
        traceback.print_exc()
        results[key] = {"error": traceback.format_exc(limit=3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--gamma", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3, help="timed ABBA repeats of every paired A/B")
    parser.add_argument("--sections", nargs="+", choices=SECTIONS, default=list(SECTIONS))
    parser.add_argument("--json", default=None)
    parser.add_argument("--small", action="store_true", help="tiny shapes: a dry run of the script on a CPU")
    args = parser.parse_args()
    name = torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu"
    print(f"device: {name}, torch {torch.__version__}, transformers {transformers.__version__}", flush=True)
    target, draft = build_pair(small=args.small)
    gen = torch.Generator().manual_seed(1)
    prompts = [
        torch.randint(target.config.vocab_size, (int(n),), generator=gen).tolist()
        for n in torch.randint(32, 128, (args.num_prompts,), generator=gen)
    ]
    results: dict = {
        "device": name,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "settings": vars(args),
    }
    ab = dict(gamma=args.gamma, max_new_tokens=args.max_new_tokens, repeats=args.repeats)

    if "bench" in args.sections:

        def bench() -> dict:
            result = run_bench(
                target,
                draft,
                NoStopTokenizer(),
                prompts,
                num_draft_tokens=args.gamma,
                max_new_tokens=args.max_new_tokens,
                temperature=0.0,
                batch_size=1,
                seed=0,
                repeats=args.repeats,
            )
            print(format_bench_table(result), flush=True)
            return result

        section(results, "run_bench", bench)

    if "graphs" in args.sections:
        for graphs in (True, False):

            def compact(graphs: bool = graphs) -> dict:
                fast_t, fast_d = Llama.from_hf(target, dtype=torch.bfloat16), Llama.from_hf(draft, dtype=torch.bfloat16)
                fast_t.use_graphs = fast_d.use_graphs = graphs
                row = paired_ab(fast_t, fast_d, prompts, **ab)
                print(summary_line(f"compact model, CUDA graphs {'on' if graphs else 'off'}", row), flush=True)
                return row

            section(results, f"compact_graphs_{'on' if graphs else 'off'}", compact)

    if "generic" in args.sections:

        def generic() -> dict:
            row = paired_ab(target, draft, prompts[:4], **ab)
            print(summary_line("our engine on the HF models (generic path)", row), flush=True)
            return row

        section(results, "hf_generic_path", generic)

    if "self" in args.sections:

        def self_draft() -> dict:
            fast_t, fast_s = Llama.from_hf(target, dtype=torch.bfloat16), Llama.from_hf(target, dtype=torch.bfloat16)
            row = paired_ab(fast_t, fast_s, prompts, **ab)
            print(summary_line("target as its own draft (compact model)", row), flush=True)
            return row

        section(results, "self_draft", self_draft)

    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
