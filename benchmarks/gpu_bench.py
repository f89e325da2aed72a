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
    eagle3    an EAGLE-3 head (`Eagle3Draft.from_target`, the engines' default aux layers in layer order, a quarter of
              the vocabulary, bf16) on the compact target with CUDA graphs: random, so it is rarely accepted; the
              section measures what the head path costs and checks it, not what a trained head gains

Every paired section warms both arms up, then captures every CUDA graph a timed call can replay
(`specdec_runtime.ab.capture_graphs`, as `run_bench` does), and checks (`check_results`; the run exits 1 and says
which failed, the JSON lists them under `checks`): greedy rows identical to target-only ones (or parting at a near-tie
of the target, where bf16 verify and decode forwards may round apart), no graph captured inside a timed call, a
finite speedup inside its interval, the self draft's acceptance >= 0.9 and, on CUDA, its efficiency <= 1.05 (timing
bounds are not enforced on a CPU, whose dry run shares its cores). Peak memory per section is in the JSON.

    PYTHONPATH=. python benchmarks/gpu_bench.py --json gpu_bench.json                  # 1 GPU, about 6 minutes
    PYTHONPATH=. python benchmarks/gpu_bench.py --sections bench self --json a.json    # a part of it
    PYTHONPATH=. python benchmarks/gpu_bench.py --small --num-prompts 3 --max-new-tokens 8 --repeats 2  # CPU dry run

One GPU only: it measures batch-1 latency, which more GPUs do not change. `benchmarks/gpu_smoke.sh` runs it with
fewer prompts and tokens as one step of the one-GPU check.
"""

from __future__ import annotations

import argparse
import copy
import itertools
import json
import math
import sys
import time
import traceback

import torch
import transformers
from transformers import LlamaConfig, LlamaForCausalLM

from specdec_runtime.ab import PeakMemory, capture_graphs, paired_metrics, paired_runs, pooled
from specdec_runtime.backends import full_units, longest_unit
from specdec_runtime.bench import format_bench_table, run_bench
from specdec_runtime.eagle3 import Eagle3Draft, default_aux_layers
from specdec_runtime.engine import SamplingParams, generate
from specdec_runtime.llama import Llama
from specdec_runtime.metrics import GenerationStats

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SECTIONS = ("bench", "graphs", "generic", "self", "eagle3")
TIE = 0.05
"""Rows may part where the target's top two logits are within TIE x its largest |logit| (bf16 verify and decode
forwards round differently; the bound of the tests' `assert_same_up_to_ties`)."""
SELF_MIN_ACCEPTANCE = 0.9
"""The target as its own draft accepts everything but bf16 near-ties."""
SELF_MAX_EFFICIENCY = 1.05
"""Measured over predicted speedup of the self draft: clearly above 1 is a measurement bug (docs/benchmarks.md)."""


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


def eagle3_head(target: LlamaForCausalLM) -> Eagle3Draft:
    """A random EAGLE-3 head for `target` in bf16: the engines' default aux layers in layer order (the default of the
    dry run's 4 layers, [2, 2, 1], is not; `from_target` checks them) and every fourth token id as the draft
    vocabulary (Llama 3 heads keep 32k of 128k)."""
    aux_layers = sorted(default_aux_layers(target.config.num_hidden_layers))
    draft_ids = torch.arange(0, target.config.vocab_size, 4)
    return Eagle3Draft.from_target(target, draft_ids, aux_layers, seed=0).to(torch.bfloat16).eval()


class NoStopTokenizer:
    """What `run_bench` reads of a tokenizer: no EOS (random weights have no end of text), pad id 0."""

    eos_token_id = None
    pad_token_id = 0


def arm_summary(stats: GenerationStats) -> dict:
    agg = stats.aggregate()
    return {k: agg[k] for k in ("tokens_per_s", "wall_s", "new_tokens")} | {"phases": stats.phases.to_dict()}


# ------------------------------------------------------------------------------------------ what a run must show


def graph_entries(*models) -> list:
    """Every CUDA graph the compact models among `models` hold (`Llama.graphs`: width -> rows -> entry), and an
    EAGLE-3 head's drafting-step graphs (`HeadCache.graphs`: rows -> entry)."""
    entries = [e for m in models if isinstance(m, Llama) for by_rows in m.graphs.values() for e in by_rows.values()]
    heads = [m.head_cache for m in models if isinstance(m, Eagle3Draft) and m.head_cache is not None]
    return entries + [e for cache in heads for e in cache.graphs.values()]


def captured(before: list, after: list) -> bool:
    """A graph was captured (or dropped) between two `graph_entries`; `before` keeps its entries alive, so an id
    cannot be reused by a new one."""
    return {id(e) for e in before} != {id(e) for e in after}


def parting(hf_target, prompt: list[int], got: list[int], want: list[int]) -> str | None:
    """None when a greedy row equals the target-only one or parts at a near-tie of the target (`TIE`), else why."""
    split = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), None)
    if split is None:
        return None if got == want else f"{len(got)} tokens against {len(want)}"
    with torch.no_grad():
        ids = torch.tensor([prompt + want[:split]], device=hf_target.device)
        logits = hf_target(input_ids=ids).logits[0, -1].float()  # (V,)
    gap, largest = float(logits.topk(2).values.diff().abs()), float(logits.abs().max())
    return None if gap < TIE * largest else f"parted at token {split}, top-two gap {gap:.3g} of {largest:.3g}"


def row_failures(key: str, row: dict, on_cuda: bool) -> list[str]:
    """The invariants one section's row breaks, one line each."""
    if "error" in row:
        return [f"{key}: raised {row['error'].strip().splitlines()[-1]}"]
    out = []
    speedup, ci = row["speedup"], row["speedup_ci"]
    finite = speedup is not None and ci is not None and all(math.isfinite(x) for x in (speedup, *ci))
    if not (finite and speedup > 0 and ci[0] <= speedup <= ci[1]):
        out.append(f"{key}: speedup {speedup} outside its interval {ci} (or not finite and positive)")
    alpha = row["acceptance_rate"]
    if alpha is None or not 0 <= alpha <= 1:
        out.append(f"{key}: acceptance_rate {alpha}")
    out += [f"{key}: greedy row {line}" for line in row.get("greedy_partings", [])]
    out += [f"{key}: a CUDA graph was captured inside timed call {c}" for c in row.get("captures_in_timed_calls", [])]
    if key == "self_draft":
        if alpha is not None and alpha < SELF_MIN_ACCEPTANCE:
            out.append(f"{key}: the target as its own draft accepted {alpha:.3f} < {SELF_MIN_ACCEPTANCE}")
        eff = row["efficiency"]
        if on_cuda and (eff is None or eff > SELF_MAX_EFFICIENCY):
            out.append(f"{key}: efficiency {eff} above {SELF_MAX_EFFICIENCY}: a measurement bug")
    if key == "eagle3" and on_cuda and not row["target_graphs_copy_aux"]:
        out.append(f"{key}: the target's CUDA graphs were not captured with the aux-state copies")
    if key == "eagle3" and on_cuda and not row["head_graphs"]:
        out.append(f"{key}: the head's drafting step did not run as a CUDA graph")
    return out


def check_results(results: dict, on_cuda: bool) -> list[str]:
    """Every section's failures (`row_failures`); empty when all invariants hold."""
    return [line for key in results["sections"] for line in row_failures(key, results[key], on_cuda)]


# -------------------------------------------------------------------------------------------------- measurements


def paired_ab(
    target, draft, prompts: list[list[int]], *, hf_target, gamma: int, max_new_tokens: int, repeats: int
) -> dict:
    """Target-only vs speculative decoding (greedy) through our engine on the models given, one prompt per unit: a
    warm-up of each arm on the longest prompt, every CUDA graph a timed call replays captured, then ABBA pairs
    `repeats` times -> tokens/s and phases per arm plus `ab.paired_metrics` (speedup, speedup_ci, in-run costs,
    efficiency), as `run_bench` computes them; `greedy_partings` (speculative rows that part from target-only ones
    off a near-tie of `hf_target`) and `captures_in_timed_calls` are what `row_failures` checks."""
    units = full_units(prompts, 1)
    kwargs = dict(
        num_draft_tokens=gamma,
        draft_rule="greedy",
        sampling=SamplingParams(0.0),
        max_new_tokens=max_new_tokens,
        stop_token_ids=(),
    )
    rows: dict[tuple[str, int, int], list[int]] = {}
    captures: list[str] = []

    def run(unit: int, arm: str, repeat: int) -> GenerationStats:
        gen = torch.Generator(target.device).manual_seed(unit + 7919 * repeat)
        result = generate(target, draft if arm == "speculative" else None, units[unit], generator=gen, **kwargs)
        rows[arm, unit, repeat] = result.tokens[0]
        return result.stats

    def timed(unit: int, arm: str, repeat: int) -> GenerationStats:
        before = graph_entries(target, draft)
        stats = run(unit, arm, repeat)
        if captured(before, graph_entries(target, draft)):
            captures.append(f"(unit {unit}, {arm}, repeat {repeat})")
        return stats

    for arm in ("speculative", "target_only"):  # speculative first: it sizes the target's static cache
        run(longest_unit(units), arm, 0)
    capture_graphs(target, draft, batch_size=1, gamma=gamma)  # after the warm-up, which set up the static caches
    runs = paired_runs(timed, units=len(units), arms=("target_only", "speculative"), repeats=repeats)
    partings = []
    for unit, repeat in itertools.product(range(len(units)), range(repeats)):
        base, spec = rows["target_only", unit, repeat], rows["speculative", unit, repeat]
        why = parting(hf_target, units[unit][0], spec, base)
        partings += [f"(unit {unit}, repeat {repeat}): {why}"] if why else []
    arms = {arm: arm_summary(pooled(arm_runs)) for arm, arm_runs in runs.items()}
    checked = {"greedy_partings": partings, "captures_in_timed_calls": captures}
    return arms | paired_metrics(runs["target_only"], runs["speculative"], gamma) | checked


def _f(x, spec: str = ".3f") -> str:
    return "-" if x is None else format(x, spec)


def summary_line(name: str, row: dict) -> str:
    if "error" in row:
        return f"{name}: ERROR {row['error'].strip().splitlines()[-1]}"
    ci = row["speedup_ci"]
    tokens_per_s = (row[arm]["tokens_per_s"] for arm in ("target_only", "speculative"))
    return (
        f"{name}: target-only {_f(next(tokens_per_s), '.1f')} tok/s, speculative {_f(next(tokens_per_s), '.1f')} "
        f"tok/s, alpha {_f(row['acceptance_rate'])}, tau {_f(row['mean_accepted_length'])}, c {_f(row['cost_ratio'])}"
        f", v {_f(row['verify_cost_ratio'])}, predicted {_f(row['predicted_speedup'])}, speedup {_f(row['speedup'])} "
        f"[{_f(ci[0] if ci else None)}, {_f(ci[1] if ci else None)}], efficiency {_f(row['efficiency'])}, "
        f"overhead_fraction {_f(row['overhead_fraction'])}, peak memory {_f(row['peak_memory_bytes'] / 2**20, '.0f')}"
        " MiB"
    )


def section(results: dict, key: str, fn) -> None:
    """Run one measurement with its peak memory; a failure is printed and recorded, and the other sections run."""
    results["sections"].append(key)
    try:
        start = time.perf_counter()
        with PeakMemory(DEVICE) as peak:
            row = fn()
        results[key] = row | {"peak_memory_bytes": peak.bytes}
        print(summary_line(key, results[key]), f"({time.perf_counter() - start:.1f} s)", flush=True)
    except Exception:
        traceback.print_exc()
        results[key] = {"error": traceback.format_exc(limit=3)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--gamma", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3, help="timed ABBA repeats of every paired A/B")
    parser.add_argument("--sections", nargs="+", choices=SECTIONS, default=list(SECTIONS))
    parser.add_argument("--json", default=None)
    parser.add_argument("--small", action="store_true", help="tiny shapes: a dry run of the script on a CPU")
    args = parser.parse_args(argv)
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
        "sections": [],
    }
    ab = dict(hf_target=target, gamma=args.gamma, max_new_tokens=args.max_new_tokens, repeats=args.repeats)

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
                return paired_ab(fast_t, fast_d, prompts, **ab)

            section(results, f"compact_graphs_{'on' if graphs else 'off'}", compact)

    if "generic" in args.sections:

        def generic() -> dict:
            return paired_ab(target, draft, prompts[:4], **ab)

        section(results, "hf_generic_path", generic)

    if "self" in args.sections:

        def self_draft() -> dict:
            fast_t, fast_s = Llama.from_hf(target, dtype=torch.bfloat16), Llama.from_hf(target, dtype=torch.bfloat16)
            return paired_ab(fast_t, fast_s, prompts, **ab)

        section(results, "self_draft", self_draft)

    if "eagle3" in args.sections:

        def eagle3() -> dict:
            fast_t, head = Llama.from_hf(target, dtype=torch.bfloat16), eagle3_head(target)
            row = paired_ab(fast_t, head, prompts, **ab)
            # the hooks' copies live in the graphs only when the aux capture was set up before them (eagle3_state)
            row["target_graphs_copy_aux"] = fast_t.eagle3_capture is not None and bool(fast_t.graphs)
            row["head_graphs"] = sorted(head.head_cache.graphs) if head.head_cache is not None else []  # row counts
            return row

        section(results, "eagle3", eagle3)

    failures = check_results(results, on_cuda=DEVICE == "cuda")
    results["checks"] = {"failed": failures, "timing_bounds_enforced": DEVICE == "cuda"}
    results["summary"] = [summary_line(key, results[key]) for key in results["sections"]]
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    for line in failures:
        print(f"CHECK FAILED {line}", file=sys.stderr, flush=True)
    print(f"checks: {'FAILED ' + str(len(failures)) if failures else 'all passed'}", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
