"""CPU fast path: the compact Llama (static per-row cache, `llama.py`) with weight layouts that suit CPU GEMMs.

At batch 1 a small decoder is memory-bound on a CPU as on a GPU: each forward streams every weight once, so a verify
over gamma + 1 tokens should cost about one decode step. `F.linear` on a row-major (N, K) weight does not get there on
small row counts (its GEMM repacks the weight per call: measured 2-3x the one-row time for 4-8 rows), so `cpu_model`
rebuilds the compact model with:

- q/k/v fused into one weight and gate/up into one per layer, each laid out once: transposed (K, N) for 1-4 rows
  (MKL's small-M GEMM streams it once) and pre-packed for oneDNN for more rows
  (`torch.ops.mkldnn._reorder_linear_weight`, the layout Inductor's CPU freezing uses, run by `_linear_pointwise`);
- the output head pre-packed the same way: no per-call packing of the largest matrix;
- grouped-query attention over a (B, Hkv, G * T, D) view of the queries against the cache as it lies (no repeat of
  the keys and values), over only the cache slots some row uses (`StaticState` passes a mask that narrow on CPU).

The target's numerics stay fp32 (only the layouts change); `draft_dtype` may store a draft's decoder and head weights
in bf16 (measured per machine: worth it only where the CPU has native bf16 GEMMs). The model stays a `Llama`, so the
engine drives it through the same `StaticState` as on CUDA; `cpu_model(hf)` is what `backends.fast_model` returns on
CPU.

    from specdec_runtime.cpu import cpu_model
    target = cpu_model(hf_target)                       # fp32, identical greedy output to HF
    draft = cpu_model(hf_draft, dtype=torch.bfloat16)   # a draft may trade numerics for speed
"""

import copy

import torch
import torch.nn.functional as F
from torch import nn

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


GEMV_ROWS = 4
"""Up to this many rows an fp32 GEMM runs on the transposed (K, N) weight (MKL's small-M path: fastest for 1 row);
more rows run on the oneDNN-packed copy (measured here, SmolLM2's 30 layers of weights streamed from DRAM, 2 idle
threads, (K, N) vs packed: 1 row 21.3 vs 25.2 ms, 4 rows 29.1 vs 31.2, 8 rows 41.2 vs 33.2, 32 rows 58.0 vs 55.3)."""


def _packed(weight: torch.Tensor) -> torch.Tensor:
    """(N, K) weight -> oneDNN's blocked layout; the batch-size hint only picks the blocking, and one packing served
    1..32 rows alike here."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), 32)


class FusedLinear(nn.Module):
    """Several linears on one input as one GEMM -> (..., N1 + N2 + ...), with the weight laid out once for the CPU.

    fp32 keeps two layouts (`GEMV_ROWS`): the transposed (K, N) weight for 1-4 rows and the oneDNN-packed one for
    more; other dtypes (a bf16 draft) keep only the packed one, which oneDNN runs natively (bf16 `torch.mm` would
    reorder the weight per call). `gemv=False` (the output head: 113 MB for SmolLM2) keeps only the packed layout.
    Where oneDNN has no bf16 path (AVX2 alone, `draft_dtype` is then fp32 and no preset asks for bf16) a bf16 weight
    keeps the transposed layout only and runs on `torch.mm`: slow, but the same numerics.
    """

    def __init__(self, linears: list[nn.Linear], dtype: torch.dtype, gemv: bool = True):
        super().__init__()
        weight = torch.cat([lin.weight.detach() for lin in linears], 0).to(dtype)  # (N, K)
        self.out_features, self.dtype = weight.shape[0], dtype
        packable = dtype == torch.float32 or torch.ops.mkldnn._is_mkldnn_bf16_supported()
        self.register_buffer("packed", _packed(weight) if packable else None, persistent=False)
        w_t = weight.t().contiguous() if not packable or (gemv and dtype == torch.float32) else None  # (K, N)
        self.register_buffer("w_t", w_t, persistent=False)
        biases = [lin.bias for lin in linears]
        bias = None
        if any(b is not None for b in biases):
            parts = [b.detach() if b is not None else torch.zeros(lin.out_features) for b, lin in zip(biases, linears)]
            bias = torch.cat(parts).to(dtype)
        self.register_buffer("bias", bias, persistent=False)

    @property
    def weight(self) -> torch.Tensor:  # Llama.setup_cache reads the compute dtype from lm_head.weight
        return self.packed if self.packed is not None else self.w_t

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1]).to(self.dtype)  # (M, K)
        if self.w_t is not None and (x2.shape[0] <= GEMV_ROWS or self.packed is None):
            y = torch.mm(x2, self.w_t) if self.bias is None else torch.addmm(self.bias, x2, self.w_t)
        else:
            y = torch.ops.mkldnn._linear_pointwise(x2, self.packed, self.bias, "none", [], "")
        return y.view(*x.shape[:-1], self.out_features)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """HF's rotary embedding, element for element: x * cos + rotate_half(x) * sin."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


class CpuAttention(nn.Module):
    """Attention with one fused qkv GEMM and grouped queries; the cache keeps `llama.Attention`'s layout and names."""

    def __init__(self, attn: nn.Module, args: LlamaArgs, dtype: torch.dtype):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = args.n_heads, args.n_kv_heads, args.head_dim
        self.qkv = FusedLinear([attn.q_proj, attn.k_proj, attn.v_proj], dtype)
        self.o_proj = FusedLinear([attn.o_proj], dtype)
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

    def __init__(self, mlp: nn.Module, dtype: torch.dtype):
        super().__init__()
        self.gate_up = FusedLinear([mlp.gate_proj, mlp.up_proj], dtype)
        self.down_proj = FusedLinear([mlp.down_proj], dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


def draft_dtype() -> torch.dtype:
    """A draft's weight dtype on this CPU: bfloat16 where oneDNN runs bf16 GEMMs natively (AVX-512 and up), else
    float32 (on AVX2 alone bf16 would be converted per call)."""
    return torch.bfloat16 if torch.ops.mkldnn._is_mkldnn_bf16_supported() else torch.float32


def cpu_model(hf_model: nn.Module, dtype: torch.dtype = torch.float32) -> Llama:
    """The compact Llama of an HF LlamaForCausalLM on the CPU, with the fast CPU layouts (module docstring).

    dtype: the decoder and head weights' storage and compute dtype (float32 for a target; a draft may use bfloat16).
    Embeddings, norms and rope stay in the HF model's dtype; activations enter each GEMM in `dtype`.
    """
    if hf_model.device.type != "cpu":
        raise ValueError(f"cpu_model builds the CPU fast path; the model is on {hf_model.device}: move it to the CPU")
    model = Llama.from_hf(hf_model, dtype=torch.float32)
    for layer in model.layers:
        layer.self_attn = CpuAttention(layer.self_attn, model.args, dtype)
        layer.mlp = CpuMLP(layer.mlp, dtype)
    model.lm_head = FusedLinear([model.lm_head], dtype, gemv=False)
    model.cpu_fast = True
    return model.eval()


def cpu_eagle3(head: nn.Module, dtype: torch.dtype) -> nn.Module:
    """A copy of an EAGLE-3 head (`eagle3.Eagle3Draft`) for the CPU fast path: each of its linears (fc, q/k/v/o,
    gate/up/down, the draft-vocabulary lm_head) laid out once as a `FusedLinear` in `dtype`, so no GEMM repacks its
    weight per draft step; norms, rope and the vocabulary maps stay as they are. The engine's state reads its dtype
    from `fc.weight`, so the head's caches and pre-norm states follow `dtype` (a draft's numerics may change; exact
    verification makes the output the target's either way). The head given is left untouched."""
    cache, head.head_cache = head.head_cache, None  # the engine's buffers (and the target's embedding) stay behind
    try:
        fast = copy.deepcopy(head)
    finally:
        head.head_cache = cache
    for module in list(fast.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, nn.Linear):
                setattr(module, name, FusedLinear([child], dtype))
    fast.cpu_fast = True
    return fast.eval().requires_grad_(False)  # the norms stay Parameters: inference only, as `Llama.from_hf`


def compile_steps(model: Llama) -> Llama:
    """Compile a `cpu_model`'s decode and verify steps (`Llama.step`) with Inductor and weight freezing, in place.

    Freezing makes the weights graph constants, so Inductor keeps the packed oneDNN layouts and fuses what lies
    between the GEMMs (rope, norms, SwiGLU, the cache writes); default Inductor cannot lower the packed
    `mkldnn._linear_pointwise` at all. One graph per (tokens per step, power-of-two row count) with the window width
    dynamic (`Llama._compiled`); graphs are tied to the cache tensors, so the caches are allocated generously
    (`llama.COMPILED_MIN_SLOTS`). Prefill stays eager. Measured in the loop (docs/benchmarks.md): decode steps 1.38x
    faster, but ~30 s of compiling and up to one more copy of the weights per graph: worth it for long eval sweeps
    and serving processes, not for a few prompts. Output is the eager fast path's up to the fp32 rounding of fused
    kernels (max |logit diff| ~4e-5 on SmolLM2), so greedy tokens can differ on near-exact ties only.
    Needs no_grad or inference_mode at call time (the engine decodes under no_grad)."""
    if not (isinstance(model, Llama) and model.cpu_fast):
        raise ValueError("compile_steps compiles the CPU fast path's model: build it with cpu_model(hf_model) first")
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
    torch._dynamo.config.accumulated_recompile_limit = max(
        torch._dynamo.config.accumulated_recompile_limit, 2 * RECOMPILE_LIMIT
    )
    model.compiled_step = torch.compile(model.forward, dynamic=False)
    model.cache_shape, model.graphs = None, {}  # the next cache is allocated the compiled way (`setup_cache`)
    return model
