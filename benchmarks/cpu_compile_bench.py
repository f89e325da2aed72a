"""torch.compile of the CPU fast path's decode and verify steps (issue 14): eager against Inductor, measured.

The model is the one the runtime decodes with on the CPU (`backends.fast_model`: the compact Llama of `llama.py`
with its static cache and the fused, laid-out-once weights of `cpu.py`; fp32 target, `cpu.draft_dtype()` draft). A
context of `--context` tokens is prefilled eagerly into the static cache, then each step is timed at that fixed
position, so that every call of a step has the same shapes (on the fast path the mask spans exactly context + T slots)
and overwrites the same slots (the cache state, hence the logits, are the same every call). Steps:

- target decode step (1 token), target verify forwards of 4 and 8 tokens (gamma 3 and 7), and the decode step of
  the 4-layer truncated draft (`--draft-layers`).

Variants (`--variants`; eager first, it is the reference):

- `eager`: today's fast path, as the engine runs it on the CPU;
- `compiled`: `torch.compile(model, dynamic=False)`, default Inductor settings;
- `frozen`: the same with Inductor's `freezing = True` (parameters and buffers that are not mutated become graph
  constants, so Inductor can constant-fold them and pre-pack weights); needs no_grad, which the whole script runs
  under, and is set globally while the graph is traced (`first_call`: Dynamo reads it there);
- `frozen-cpp` (opt-in): freezing + `cpp_wrapper` (the graph's Python wrapper compiled to C++: less per-call host
  overhead, a longer compile);
- `plain-frozen` and `plain-compiled` (opt-in): the compact Llama *without* cpu.py's layouts (`Llama.from_hf`: plain
  nn.Linear weights, masks over all S cache slots as on CUDA), compiled with and without freezing, so that
  Inductor's own weight pre-packing replaces cpu.py's hand-made layouts.

Compile time is the first call of each (variant, step), measured on its own, with a fresh Inductor cache unless
`--warm-cache` (a cold compile, as on a machine's first run); then 2 untimed calls each, then `--calls` timed calls
per (variant, step), the variants interleaved round robin (their order rotated every round) so that drift on the
machine hits all of them alike; the medians are reported. Each compiled variant's logits are compared with eager's
at the same inputs (greedy argmax per position identical?, max |diff|), and its first call must have written its
keys into the model's own cache. A variant whose compile fails is recorded as failed with the error's first line (a
result too: `compiled` fails on the fast path, whose oneDNN-packed weights `mkldnn._linear_pointwise` Inductor
lowers only as frozen constants).

Ratios as in cpu_runtime_bench.py, but from these isolated forwards (no engine loop around them):
verify_cost_ratio(T) = verify forward over T tokens / decode step and cost ratio c = draft step / target decode
step, both within one variant; tokens/s = 1 / decode step (target-only decoding) and 1 / draft step.

    python benchmarks/cpu_compile_bench.py --json runs/cpu_compile_bench.json     # embedded SmolLM2, idle machine
    OMP_NUM_THREADS=1 python benchmarks/cpu_compile_bench.py --tiny --calls 3     # smoke: tiny random Llama

This does not put torch.compile into the runtime: it measures whether it would pay. In the engine's loop the CPU
fast path narrows the mask to the slots in use (`StaticState.window`), so its width changes every step; a compiled
runtime would need a fixed-width mask (all S slots, as the plain variants use) or a dynamic width, whose cost this
bench does not measure for the fused model.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable

import torch

from distill.students import evenly_spaced_layers, truncate_student
from specdec_runtime.backends import backend_name, fast_model
from specdec_runtime.llama import Llama, StaticState

VARIANTS = {
    "eager": ("fused", None),
    "compiled": ("fused", {}),
    "frozen": ("fused", {"freezing": True}),
    "frozen-cpp": ("fused", {"freezing": True, "cpp_wrapper": True}),
    "plain-compiled": ("plain", {}),
    "plain-frozen": ("plain", {"freezing": True}),
}
"""Variant -> (model, Inductor options of its torch.compile; None: no compile). `fused`: the runtime's CPU fast path
(`cpu.cpu_model`); `plain`: the compact Llama without cpu.py's layouts (`Llama.from_hf`, plain nn.Linear weights,
full-width masks over all S cache slots), for Inductor to lay out the weights itself (freezing's weight pre-packing)."""
DEFAULT_VARIANTS = ["eager", "compiled", "frozen", "plain-frozen"]
STEPS = {"decode": ("target", 1), "verify4": ("target", 4), "verify8": ("target", 8), "draft": ("draft", 1)}
"""Timed step -> (model, tokens per forward)."""


def tiny_hf_model(seed: int = 0):
    """A tiny random Llama built in code (the `random:tiny-llama` shapes with 8 layers, so a 4-layer draft is a real
    cut, and a tied head): the script's smoke test, no checkpoint."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from specdec_runtime.tiny import TINY_MODELS

    shape = TINY_MODELS["tiny-llama"] | {"num_hidden_layers": 8}
    config = LlamaConfig(vocab_size=512, tie_word_embeddings=True, **shape)
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).eval()


def context_tokens(target_spec: str, tokenizer, length: int, vocab_size: int) -> list[int]:
    """`length` tokens of context: builtin:test chats rendered back to back (random ids without a tokenizer)."""
    if tokenizer is None:
        return torch.randint(0, vocab_size, (length,), generator=torch.Generator().manual_seed(0)).tolist()
    from distill.prompts import load_prompts, render_chat

    ids: list[int] = []
    for record in load_prompts("builtin:test"):
        ids += render_chat(tokenizer, record.messages)
        if len(ids) >= length:
            return ids[:length]
    raise ValueError(f"builtin:test renders to only {len(ids)} tokens with {target_spec}'s tokenizer: lower --context")


def step_inputs(context: int, tokens: list[int], width: int) -> tuple[torch.Tensor, ...]:
    """tokens, positions, slots, mask of a forward of these tokens right after `context` cached tokens (batch 1), as
    `StaticState.extend` builds them: the mask spans `width` slots (context + T on the CPU fast path, all S else)."""
    T = len(tokens)
    positions = torch.arange(context, context + T)[None]  # (1, T)
    mask = (torch.arange(width)[None, :] <= positions[0][:, None])[None, None]  # (1, 1, T, W)
    return torch.tensor([tokens]), positions, positions.clone(), mask


def compile_variant(model: torch.nn.Module, options: dict | None) -> Callable:
    if options is None:
        return model
    return torch.compile(model, dynamic=False, options=dict(options) or None)


def first_call(fn: Callable, inputs: tuple, options: dict | None) -> torch.Tensor:
    """The call that compiles. Dynamo decides whether parameters and buffers become graph constants from the global
    `torch._inductor.config.freezing` while it traces (`torch.compile(options=...)` reaches only Inductor), so the
    variant's options are patched into the global config around this call."""
    with torch._inductor.config.patch(**(options or {})):
        return fn(*inputs)


def first_line(error: BaseException) -> str:
    """The error's first line, plus the op an Inductor lowering failed on (its first line can be a bare assert)."""
    lines = (str(error).strip() or type(error).__name__).splitlines()
    op = next((line.strip() for line in lines if line.strip().startswith("target:")), None)
    return f"{type(error).__name__}: {lines[0].strip()}" + (f" ({op})" if op else "")


def summary(times: list[float]) -> dict:
    q = statistics.quantiles(times, n=4) if len(times) >= 2 else [times[0]] * 3
    return {"median_ms": 1e3 * statistics.median(times), "p25_ms": 1e3 * q[0], "p75_ms": 1e3 * q[2], "n": len(times)}


def unique_graphs() -> int:
    return int(torch._dynamo.utils.counters["stats"]["unique_graphs"])


def build_models(args) -> tuple[dict, str, object]:
    """{kind: {"target": model, "draft": model}} for the model kinds the variants use; the target's name; tokenizer."""
    if args.tiny:
        hf_target, tokenizer, name = tiny_hf_model(), None, "tiny random Llama (8 layers, hidden 64)"
    else:
        from specdec_runtime.loading import load_model

        hf_target, tokenizer = load_model(args.target, device="cpu")
        name = args.target
    hf_draft = truncate_student(hf_target, evenly_spaced_layers(hf_target.config.num_hidden_layers, args.draft_layers))
    kinds = {VARIANTS[v][0] for v in args.variants}
    models = {"fused": {"target": fast_model(hf_target), "draft": fast_model(hf_draft, draft=True)}}
    if "plain" in kinds:
        models["plain"] = {
            "target": Llama.from_hf(hf_target, dtype=torch.float32).eval(),
            "draft": Llama.from_hf(hf_draft, dtype=models["fused"]["draft"].lm_head.dtype).eval(),
        }
    return models, name, tokenizer


def run(args) -> dict:
    models, target_name, tokenizer = build_models(args)
    fused = models["fused"]
    L = args.context
    ctx = context_tokens(args.target, tokenizer, L + 8, fused["target"].config.vocab_size)
    inputs: dict[tuple[str, str], tuple] = {}  # (kind, step) -> forward inputs
    for kind, pair in models.items():
        for model in pair.values():  # eager prefill of the context, as the engine does it
            state = StaticState(model, 1, L + 8)
            state.extend(torch.tensor([ctx[:L]]), torch.tensor([L]), last_only=True)
        S = pair["target"].cache_shape[1]
        for step, (_, T) in STEPS.items():
            inputs[(kind, step)] = step_inputs(L, ctx[L : L + T], L + T if kind == "fused" else S)
    print(
        f"{target_name}: {torch.get_num_threads()} threads, {torch.backends.cpu.get_cpu_capability()}, "
        f"torch {torch.__version__}; backend {backend_name(fused['target'])}, target "
        f"{fused['target'].lm_head.dtype}, {args.draft_layers}-layer draft {fused['draft'].lm_head.dtype}; "
        f"context {L} tokens",
        flush=True,
    )

    # (variant, step) -> callable; compile time and correctness from the first calls
    fns: dict[tuple[str, str], Callable] = {}
    results: dict[str, dict] = {}
    reference: dict[str, torch.Tensor] = {}
    for variant in args.variants:
        kind, options = VARIANTS[variant]
        results[variant] = {"model": kind, "options": options, "steps": {}}
        wrapped = {name: compile_variant(m, options) for name, m in models[kind].items()}
        for step, (which, _) in STEPS.items():
            fn, row = wrapped[which], results[variant]["steps"].setdefault(step, {})
            probe = models[kind][which].layers[-1].self_attn.k_cache[0, L : L + STEPS[step][1]]
            probe.zero_()  # the call must write its keys here: a compiled graph that copies the cache would not
            start = time.perf_counter()
            try:
                logits = first_call(fn, inputs[(kind, step)], options).float()
            except Exception as error:  # noqa: BLE001 - a failed compile is a result: record it, go on
                row.update(failed=True, error=first_line(error), first_call_s=time.perf_counter() - start)
                print(f"  {variant:<14} {step:<8} FAILED after {row['first_call_s']:.1f} s: {row['error']}", flush=True)
                continue
            row.update(failed=False, first_call_s=time.perf_counter() - start)
            row["cache_written"] = bool(probe.float().abs().sum(-1).min() > 0)
            if variant == "eager":
                reference[step] = logits
            elif step in reference:
                ref = reference[step]
                row["max_abs_diff"] = float((logits - ref).abs().max())
                row["argmax_identical"] = bool(torch.equal(logits.argmax(-1), ref.argmax(-1)))
            for _ in range(2):  # untimed warm-up: allocator, oneDNN primitive caches
                fn(*inputs[(kind, step)])
            fns[(variant, step)] = fn
            check = "" if row["cache_written"] else ", CACHE NOT WRITTEN"
            if "max_abs_diff" in row:
                same = "identical" if row["argmax_identical"] else "DIFFERS"
                check += f", max |diff| {row['max_abs_diff']:.2e}, argmax {same}"
            print(f"  {variant:<14} {step:<8} first call {row['first_call_s']:7.2f} s{check}", flush=True)

    times: dict[tuple[str, str], list[float]] = {key: [] for key in fns}
    order = [v for v in args.variants if any(k[0] == v for k in fns)]
    graphs_before, start = unique_graphs(), time.perf_counter()
    for i in range(args.calls):
        rotated = order[i % len(order) :] + order[: i % len(order)]
        for step in STEPS:
            for variant in rotated:
                fn = fns.get((variant, step))
                if fn is None:
                    continue
                x = inputs[(VARIANTS[variant][0], step)]
                t0 = time.perf_counter()
                fn(*x)
                times[(variant, step)].append(time.perf_counter() - t0)
    recompiles = unique_graphs() - graphs_before
    print(
        f"timed: {args.calls} calls per (variant, step), round robin, {time.perf_counter() - start:.1f} s; "
        f"graphs compiled while timing: {recompiles} (must be 0)",
        flush=True,
    )

    for (variant, step), ts in times.items():
        results[variant]["steps"][step].update(summary(ts))
    eager = results.get("eager", {}).get("steps", {})

    def ratio(a, b):
        return a / b if a is not None and b else None

    for res in results.values():
        ms = {s: r.get("median_ms") for s, r in res["steps"].items()}
        res["verify_cost_ratio_4"] = ratio(ms["verify4"], ms["decode"])
        res["verify_cost_ratio_8"] = ratio(ms["verify8"], ms["decode"])
        res["draft_cost_ratio"] = ratio(ms["draft"], ms["decode"])
        res["target_tokens_per_s"] = ratio(1e3, ms["decode"])
        res["draft_tokens_per_s"] = ratio(1e3, ms["draft"])
        res["speedup_vs_eager"] = {s: ratio(eager.get(s, {}).get("median_ms"), ms[s]) for s in STEPS}
        compiled = res["options"] is not None
        res["compile_s"] = sum(r["first_call_s"] for r in res["steps"].values()) if compiled else 0.0
        res["failed"] = any(r.get("failed") for r in res["steps"].values())
    return {
        "settings": vars(args),
        "target_name": target_name,
        "machine": {
            "threads": torch.get_num_threads(),
            "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "torch": torch.__version__,
            "processor": platform.processor() or platform.machine(),
        },
        "backend": backend_name(fused["target"]),
        "target_dtype": str(fused["target"].lm_head.dtype),
        "draft_dtype": str(fused["draft"].lm_head.dtype),
        "graphs_compiled_while_timing": recompiles,
        "variants": results,
    }


def _f(value, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def report(out: dict) -> str:
    head = (
        f"{'variant':<15}{'decode ms':>10}{'tok/s':>7}{'v4 ms':>8}{'v(4)':>6}{'v8 ms':>8}{'v(8)':>6}"
        f"{'draft ms':>9}{'c':>6}{'draft tok/s':>12}{'compile s':>10}  vs eager (decode/v4/v8/draft), check"
    )
    lines = [head]
    for variant, res in out["variants"].items():
        steps = res["steps"]
        ms = {s: steps[s].get("median_ms") for s in STEPS}
        failed = [f"{s}: {r['error']}" for s, r in steps.items() if r.get("failed")]
        speed = "/".join(_f(res["speedup_vs_eager"][s], ".2f") for s in STEPS) if variant != "eager" else "-"
        diffs = [r["max_abs_diff"] for r in steps.values() if "max_abs_diff" in r]
        same = all(r.get("argmax_identical", True) for r in steps.values())
        check = f"max |diff| {max(diffs):.1e}, argmax {'identical' if same else 'DIFFERS'}" if diffs else ""
        lines.append(
            f"{variant:<15}{_f(ms['decode'], '.2f'):>10}{_f(res['target_tokens_per_s'], '.1f'):>7}"
            f"{_f(ms['verify4'], '.2f'):>8}{_f(res['verify_cost_ratio_4'], '.2f'):>6}"
            f"{_f(ms['verify8'], '.2f'):>8}{_f(res['verify_cost_ratio_8'], '.2f'):>6}"
            f"{_f(ms['draft'], '.2f'):>9}{_f(res['draft_cost_ratio'], '.3f'):>6}"
            f"{_f(res['draft_tokens_per_s'], '.1f'):>12}{res['compile_s']:>10.1f}  {speed} {check}"
        )
        lines += [f"    FAILED {f}" for f in failed]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="embedded:smollm2-135m-instruct", help="model spec of the target")
    parser.add_argument("--tiny", action="store_true", help="a tiny random 8-layer Llama built in code (smoke test)")
    parser.add_argument("--draft-layers", type=int, default=4, help="layers of the truncated draft")
    parser.add_argument("--context", type=int, default=128, help="cached tokens before each timed step")
    parser.add_argument("--calls", type=int, default=50, help="timed calls per (variant, step)")
    parser.add_argument(
        "--variants", nargs="+", choices=list(VARIANTS), default=DEFAULT_VARIANTS, help="eager must come first"
    )
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    parser.add_argument("--json", default=None, help="write the results here")
    parser.add_argument(
        "--warm-cache", action="store_true", help="use the user's Inductor cache (default: a fresh one, cold compiles)"
    )
    args = parser.parse_args()
    if args.variants[0] != "eager":
        parser.error("--variants must start with eager (the reference for the logits check and the speedups)")
    if args.calls < 1:
        parser.error("--calls must be >= 1")
    if args.threads:
        torch.set_num_threads(args.threads)
    # one compiled graph per (variant, model, tokens per forward): more than dynamo's default limit of 8 per frame
    torch._dynamo.config.recompile_limit = 64
    torch._dynamo.config.accumulated_recompile_limit = max(torch._dynamo.config.accumulated_recompile_limit, 256)

    cache = None if args.warm_cache else tempfile.mkdtemp(prefix="cpu_compile_bench-inductor-")
    if cache:  # a cold Inductor cache: compile times as on a machine's first run, not replayed from an earlier one
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache
    start = time.perf_counter()
    try:
        with torch.no_grad():  # freezing applies only without grad; the runtime decodes under no_grad too
            out = run(args)
    finally:
        if cache:
            shutil.rmtree(cache, ignore_errors=True)
    out["wall_s"] = time.perf_counter() - start
    print(report(out))
    print(f"wall {out['wall_s']:.0f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
