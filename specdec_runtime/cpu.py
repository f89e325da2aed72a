"""CPU fast path: the compact Llama (static per-row cache, `llama.py`) with weight layouts that suit CPU GEMMs.

At batch 1 a small decoder is memory-bound on a CPU as on a GPU: each forward streams every weight once, so a verify
over gamma + 1 tokens should cost about one decode step. `F.linear` on a row-major (N, K) weight does not get there on
small row counts everywhere (its GEMM repacked the weight per call on one machine: 2-3x the one-row time for 4-8
rows), so `cpu_model` rebuilds the compact model with:

- q/k/v fused into one weight and gate/up into one per layer, each laid out once per row count in the layout that
  ran fastest on this machine (`cpu_tune`: transposed (K, N) on `torch.mm`, pre-packed for oneDNN as Inductor's CPU
  freezing does, row-major on `F.linear`, or bf16 packed for a draft), timed once at load and cached per machine;
  `layouts="rule"` keeps the fixed rule measured on one machine (1-4 rows (K, N), more rows packed, the head packed);
- the output head planned the same way: no per-call packing of the largest matrix;
- grouped-query attention over a (B, Hkv, G * T, D) view of the queries against the cache as it lies (no repeat of
  the keys and values), over only the cache slots some row uses (`StaticState` passes a mask that narrow on CPU).

The target's numerics stay fp32 (only the layouts change); a draft given `dtype=torch.bfloat16` may also take bf16
weights where oneDNN runs them natively, per shape and row count as timed (`draft_dtype`). The model stays a
`Llama`, so the engine drives it through the same `StaticState` as on CUDA; `cpu_model(hf)` is what
`backends.fast_model` returns on CPU.

    from specdec_runtime.cpu import cpu_model
    target = cpu_model(hf_target)                       # fp32, identical greedy output to HF
    draft = cpu_model(hf_draft, dtype=torch.bfloat16)   # a draft may trade numerics for speed
    cpu_model(hf_target, layouts="rule")                # the fixed rule, nothing timed
    cpu_model(hf_target, rows=range(1, 17))             # plan the GEMM rows your batch x (gamma + 1) reaches
"""

import copy
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from .cpu_tune import DEFAULT_ROWS, FusedLinear, Planner, Timer, bf16_native, check_layouts, fused_linears
from .llama import Llama, LlamaArgs, grouped_attention

__all__ = [
    "CPU_BACKEND",
    "CPU_COMPILED_BACKEND",
    "CpuAttention",
    "CpuMLP",
    "FusedLinear",
    "compile_steps",
    "cpu_eagle3",
    "cpu_model",
    "draft_dtype",
]

CPU_BACKEND = "compact-static-cache+cpu-fused"
"""`settings.backend` of a run on the CPU fast path."""
CPU_COMPILED_BACKEND = CPU_BACKEND + "+inductor-frozen"
"""`settings.backend` of a run on the CPU fast path with its steps compiled (`compile_steps`)."""

RECOMPILE_LIMIT = 128
"""Dynamo's graphs per code object: target and draft share `Llama.forward`, with a graph per (model, tokens per
step, power-of-two row count); Dynamo's default of 8 would fall back to eager silently after the eighth."""


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """HF's rotary embedding, element for element: x * cos + rotate_half(x) * sin."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


class CpuAttention(nn.Module):
    """Attention with one fused qkv GEMM and grouped queries; the cache keeps `llama.Attention`'s layout and names."""

    def __init__(self, args: LlamaArgs, qkv: FusedLinear, o_proj: FusedLinear):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = args.n_heads, args.n_kv_heads, args.head_dim
        self.qkv, self.o_proj = qkv, o_proj
        self.k_cache: torch.Tensor | None = None  # (rows, S, Hkv, D), as in llama.Attention
        self.v_cache: torch.Tensor | None = None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, slots: torch.Tensor, mask: torch.Tensor):
        """mask (B, 1, T, W): the first W cache slots (W <= S) are the ones any query of this forward may see."""
        B, T, _ = x.shape
        H, Hkv, D, W = self.n_heads, self.n_kv_heads, self.head_dim, mask.shape[-1]
        qkv = self.qkv(x).view(B, T, H + 2 * Hkv, D)
        qk = rope(qkv[:, :, : H + Hkv], cos, sin)  # q and k rotated in one go
        q, k, v = qk[:, :, :H], qk[:, :, H:], qkv[:, :, H + Hkv :]
        rows = torch.arange(B, device=x.device)[:, None]
        self.k_cache[rows, slots] = k.to(self.k_cache.dtype)  # per-row slots (B, T)
        self.v_cache[rows, slots] = v.to(self.v_cache.dtype)
        keys = self.k_cache[:B, :W].transpose(1, 2)  # (B, Hkv, W, D): a view, no copy
        values = self.v_cache[:B, :W].transpose(1, 2)
        return self.o_proj(grouped_attention(q.to(keys.dtype), keys, values, mask))


class CpuMLP(nn.Module):
    """SwiGLU with one fused gate/up GEMM."""

    def __init__(self, gate_up: FusedLinear, down_proj: FusedLinear):
        super().__init__()
        self.gate_up, self.down_proj = gate_up, down_proj

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


def draft_dtype() -> torch.dtype:
    """A draft's weight dtype on this CPU: bfloat16 where oneDNN runs bf16 GEMMs natively (AVX-512 BF16 and up: the
    planner then times bf16 next to the fp32 layouts), else float32 (on AVX2 alone bf16 would be converted per
    call)."""
    return torch.bfloat16 if bf16_native() else torch.float32


def cpu_model(
    hf_model: nn.Module,
    dtype: torch.dtype = torch.float32,
    layouts: str = "auto",
    rows: Sequence[int] = DEFAULT_ROWS,
    *,
    timer: Timer | None = None,
) -> Llama:
    """The compact Llama of an HF LlamaForCausalLM on the CPU, with the fast CPU layouts (module docstring).

    dtype: float32 keeps fp32 weights and numerics (a target); bfloat16 lets a draft take bf16 weights where they run
    faster (`cpu_tune.candidates`). Embeddings, norms and rope stay fp32; each GEMM's output is in `dtype`.
    layouts: "auto" (the machine's cached plan, timing what it lacks), "tune" (time again), "rule" (the fixed
    rule), or one layout forced on every linear (`cpu_tune.LAYOUTS`). rows: the GEMM row counts to plan (batch x
    tokens per step: 1 .. gamma + 1, tree widths, batches); others take the nearest planned one's layout.
    timer: how one timed pass is measured (tests inject fake costs). `model.cpu_tuning` says what was timed and how
    long it took.
    """
    if hf_model.device.type != "cpu":
        raise ValueError(f"cpu_model builds the CPU fast path; the model is on {hf_model.device}: move it to the CPU")
    check_layouts(layouts, dtype)
    planner = Planner(layouts, rows, timer)  # checks the rows before the weights are copied
    model = Llama.from_hf(hf_model, dtype=torch.float32)
    attns, mlps = [layer.self_attn for layer in model.layers], [layer.mlp for layer in model.layers]
    groups = {
        "qkv": [[a.q_proj, a.k_proj, a.v_proj] for a in attns],
        "o_proj": [[a.o_proj] for a in attns],
        "gate_up": [[m.gate_proj, m.up_proj] for m in mlps],
        "down_proj": [[m.down_proj] for m in mlps],
        "lm_head": [[model.lm_head]],
    }
    fused = fused_linears(groups, dtype, planner, heads=("lm_head",))
    for i, layer in enumerate(model.layers):
        layer.self_attn = CpuAttention(model.args, fused["qkv"][i], fused["o_proj"][i])
        layer.mlp = CpuMLP(fused["gate_up"][i], fused["down_proj"][i])
    model.lm_head = fused["lm_head"][0]
    model.cpu_fast, model.cpu_tuning = True, planner.info()
    return model.eval()


def cpu_eagle3(
    head: nn.Module,
    dtype: torch.dtype,
    layouts: str = "auto",
    rows: Sequence[int] = DEFAULT_ROWS,
    *,
    timer: Timer | None = None,
) -> nn.Module:
    """A copy of an EAGLE-3 head (`eagle3.Eagle3Draft`) for the CPU fast path: each of its linears (fc, q/k/v/o,
    gate/up/down, the draft-vocabulary lm_head) laid out once as a `FusedLinear`, planned as `cpu_model` plans
    (`dtype`, `layouts`, `rows`, `timer`; each linear its own shape, named by its module path); norms, rope and the
    vocabulary maps stay as they are. The engine's state reads its dtype from `fc.weight`, so the head's caches and
    pre-norm states follow `dtype` (a draft's numerics may change; exact verification makes the output the target's
    either way). The head given is left untouched."""
    check_layouts(layouts, dtype)
    planner = Planner(layouts, rows, timer)
    cache, head.head_cache = head.head_cache, None  # the engine's buffers (and the target's embedding) stay behind
    try:
        fast = copy.deepcopy(head)
    finally:
        head.head_cache = cache
    linears = {
        f"{path}.{name}".lstrip("."): (module, name, child)
        for path, module in fast.named_modules()
        for name, child in module.named_children()
        if isinstance(child, nn.Linear)
    }
    fused = fused_linears({path: [[child]] for path, (_, _, child) in linears.items()}, dtype, planner)
    for path, (module, name, _) in linears.items():
        setattr(module, name, fused[path][0])
    fast.cpu_fast, fast.cpu_tuning = True, planner.info()
    return fast.eval().requires_grad_(False)  # the norms stay Parameters: inference only, as `Llama.from_hf`


def compiled_layouts(dtype: torch.dtype) -> str:
    """The layout a model whose steps `compile_steps` compiles is built with: oneDNN-packed (bf16 for a bf16 draft
    where oneDNN has native bf16), the one whose GEMMs Inductor lowers and autotunes; the other layouts compiled
    poorly (SmolLM2, 2-core AVX2, default Inductor: 104 ms a decode step with the timed plan's mix of `split`,
    `kn` and `packed` vs 56 ms all `packed`)."""
    return "packed_bf16" if dtype == torch.bfloat16 and bf16_native() else "packed"


def compile_steps(model: Llama, autotune: bool = True) -> Llama:
    """Compile a `cpu_model`'s decode and verify steps (`Llama.step`) with Inductor and weight freezing, in place.

    Freezing makes the weights graph constants, so Inductor keeps the packed oneDNN layouts and fuses what lies
    between the GEMMs (rope, norms, SwiGLU, the cache writes); default Inductor cannot lower the packed
    `mkldnn._linear_pointwise` at all. `autotune` (Inductor's max_autotune) times, per GEMM shape and row count of
    each graph, Inductor's own C++ GEMM template against oneDNN's packed GEMM on this machine and keeps the faster:
    the template streams fp32 weights at 17-20 GB/s for 1-4 rows where MKL and oneDNN reach 4-12 GB/s (2-core AVX2
    EPYC), so the model should be built with every linear `packed` (`compiled_layouts`), which it recognises.

    One graph per (tokens per step, power-of-two row count) with the window width dynamic (`Llama._compiled`);
    graphs are tied to the cache tensors, so the caches are allocated generously (`llama.COMPILED_MIN_SLOTS`).
    Prefill stays eager. Measured in the loop (docs/benchmarks.md, 2-core AVX2 EPYC): decode steps 2.0x faster than
    the eager fast path (35 vs 70 ms for SmolLM2, 1.45x the read-bandwidth floor), but minutes of compiling and
    autotuning (386 s for the target's and a 4-layer draft's graphs of gamma 1 and 3 at batch 1) and up to one more
    copy of the weights per graph: worth it for long eval sweeps and serving processes, not for a few prompts.
    Output is the eager fast path's up to the fp32 rounding of fused kernels (max |logit diff| ~4e-5 on SmolLM2),
    so greedy tokens can differ on near-exact ties only.
    Needs no_grad or inference_mode at call time (the engine decodes under no_grad)."""
    if not (isinstance(model, Llama) and model.cpu_fast):
        raise ValueError("compile_steps compiles the CPU fast path's model: build it with cpu_model(hf_model) first")
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
    torch._dynamo.config.accumulated_recompile_limit = max(
        torch._dynamo.config.accumulated_recompile_limit, 2 * RECOMPILE_LIMIT
    )
    # the autotuner's per-GEMM report goes to stderr unless told not to: a user sees progress bars, not kernel tables
    quiet = {"autotune_num_choices_displayed": 0, "max_autotune_report_choices_stats": False}
    options = {"max_autotune": True, **quiet} if autotune else None
    model.compiled_step = torch.compile(model.forward, dynamic=False, options=options)
    model.cache_shape, model.graphs = None, {}  # the next cache is allocated the compiled way (`setup_cache`)
    return model
