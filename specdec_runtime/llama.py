"""Compact Llama-family decoder with a static per-row KV cache: the runtime's fast path (gpt-fast style).

`Llama.from_hf(hf_model)` takes the weights of an HF `LlamaForCausalLM` (RoPE incl. linear / llama3 scaling, GQA,
RMSNorm, SwiGLU, tied embeddings). Each row writes its keys and values at its own positions, so rolling back rejected
draft tokens is just lowering the row's length: stale slots past it are overwritten before any query can see them.
On CUDA the fixed-shape decode and verify steps replay as CUDA graphs; prefill runs eagerly. A batch runs in the
first rows of the cache (finished rows leave it), and a graph per power-of-two row count serves every batch up to it.
"""

from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class LlamaArgs:
    """Shape of a Llama-family decoder, read from an HF LlamaConfig."""

    vocab_size: int
    """Rows of the embedding and of the output head."""
    dim: int
    """Hidden size."""
    n_layers: int
    """Decoder blocks."""
    n_heads: int
    """Query heads."""
    n_kv_heads: int
    """Key/value heads (GQA when fewer than n_heads)."""
    head_dim: int
    """Channels per head."""
    intermediate_size: int
    """SwiGLU hidden size."""
    norm_eps: float
    """RMSNorm epsilon."""
    attention_bias: bool
    """Bias on the q/k/v/o projections."""
    mlp_bias: bool
    """Bias on the gate/up/down projections."""


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # fp32 statistics, cast back before the weight: bit-for-bit the HF order of operations
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def grouped_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Grouped-query attention against the cache as it lies: q (B, T, H, D), keys and values (B, Hkv, W, D) (views
    of the cache), mask (B, 1, T, W) bool -> (B, T, H * D).

    Query head h reads kv head h // G (HF's repeat_kv order), so a group's G query heads fold into the query length,
    (B, Hkv, G * T, D), instead of the keys and values being repeated G times: that repeat copied the whole cache
    in every layer and step (issue 22)."""
    B, T, H, D = q.shape
    Hkv, W = keys.shape[1], keys.shape[2]
    G = H // Hkv
    qg = q.reshape(B, T, Hkv, G, D).permute(0, 2, 3, 1, 4).reshape(B, Hkv, G * T, D)
    mg = mask[:, :, None].expand(B, 1, G, T, W).reshape(B, 1, G * T, W)  # each head of a group: its T query rows
    y = F.scaled_dot_product_attention(qg, keys, values, attn_mask=mg)  # (B, Hkv, G * T, D)
    return y.view(B, Hkv, G, T, D).permute(0, 3, 1, 2, 4).reshape(B, T, H * D)


class Attention(nn.Module):
    def __init__(self, args: LlamaArgs):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = args.n_heads, args.n_kv_heads, args.head_dim
        self.q_proj = nn.Linear(args.dim, args.n_heads * args.head_dim, bias=args.attention_bias)
        self.k_proj = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=args.attention_bias)
        self.v_proj = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=args.attention_bias)
        self.o_proj = nn.Linear(args.n_heads * args.head_dim, args.dim, bias=args.attention_bias)
        self.k_cache: torch.Tensor | None = None  # (rows, S, Hkv, D): a batch of B <= rows uses the first B
        self.v_cache: torch.Tensor | None = None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, slots: torch.Tensor, mask: torch.Tensor):
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.n_heads, self.head_dim)
        k = self.k_proj(x).view(B, T, self.n_kv_heads, self.head_dim)
        v = self.v_proj(x).view(B, T, self.n_kv_heads, self.head_dim)
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin  # cos, sin: (B, T, 1, D)
        rows = torch.arange(B, device=x.device)[:, None]
        self.k_cache[rows, slots] = k  # per-row slots (B, T)
        self.v_cache[rows, slots] = v
        keys, values = self.k_cache[:B].transpose(1, 2), self.v_cache[:B].transpose(1, 2)  # (B, Hkv, S, D) views
        return self.o_proj(grouped_attention(q, keys, values, mask))


class MLP(nn.Module):
    def __init__(self, args: LlamaArgs):
        super().__init__()
        self.gate_proj = nn.Linear(args.dim, args.intermediate_size, bias=args.mlp_bias)
        self.up_proj = nn.Linear(args.dim, args.intermediate_size, bias=args.mlp_bias)
        self.down_proj = nn.Linear(args.intermediate_size, args.dim, bias=args.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, args: LlamaArgs):
        super().__init__()
        self.input_layernorm = RMSNorm(args.dim, args.norm_eps)
        self.self_attn = Attention(args)
        self.post_attention_layernorm = RMSNorm(args.dim, args.norm_eps)
        self.mlp = MLP(args)

    def forward(self, x, cos, sin, slots, mask):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, slots, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


COMPILED_MIN_SLOTS = 1024
"""Cache slots of a model with compiled CPU steps, at least (`setup_cache`): room for the prompts and answers of
typical eval and data runs, so that a process allocates (and compiles for) one cache; 47 MB per row for SmolLM2."""


def graph_rows(batch: int, cache_rows: int) -> int:
    """Rows of the CUDA graph that serves a batch of `batch` rows: the next power of two, at most the cache's rows."""
    return min(1 << (batch - 1).bit_length(), cache_rows)


def graph_keys(widths: Iterable[int], max_rows: int, cache_rows: int) -> set[tuple[int, int]]:
    """(width, rows) of every graph `Llama.step` can replay for batches of 1..max_rows rows at these widths."""
    return {(T, graph_rows(b, cache_rows)) for T in widths for b in range(1, max_rows + 1)}


class Llama(nn.Module):
    """Llama decoder whose forward takes explicit rope positions, cache write slots and a (B, 1, T, S) mask."""

    def __init__(self, args: LlamaArgs, inv_freq: torch.Tensor, attention_scaling: float, config):
        super().__init__()
        self.args = args
        self.config = config  # the HF config it came from: vocab_size, max_position_embeddings, eos ids
        self.embed_tokens = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList(Block(args) for _ in range(args.n_layers))
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.lm_head = nn.Linear(args.dim, args.vocab_size, bias=False)
        self.register_buffer("inv_freq", inv_freq.float(), persistent=False)  # (D/2,)
        self.attention_scaling = attention_scaling
        self.cache_shape: tuple[int, int] | None = None  # (rows, S) of the allocated static cache
        self.use_graphs = True  # False: eager CUDA decode/verify steps (to measure what the graphs buy)
        self.cpu_fast = False  # True: rebuilt by cpu.cpu_model; its masks span only the slots in use (`window`)
        self.compiled_step = None  # cpu.compile_steps: the Inductor-compiled forward that runs `step` on the CPU
        self.graphs: dict[int, dict[int, tuple]] = {}  # T -> rows -> (graph, inputs, logits), valid for cache_shape
        self.graph_pool = None
        self.eagle3_capture = None  # eagle3_state.capture_for: (aux layers, AuxCapture) its CUDA graphs copy into

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    @staticmethod
    def unsupported(hf_model: nn.Module) -> str | None:
        """Why the compact model cannot take this HF model (None: it can); `backends.fast_model` then keeps the
        generic HF path."""
        cfg = hf_model.config
        if cfg.model_type != "llama" or getattr(cfg, "hidden_act", None) != "silu":
            return f"it covers Llama (silu) checkpoints, got model_type={cfg.model_type!r}"
        rope_type = hf_model.model.rotary_emb.rope_type
        if rope_type not in ("default", "linear", "llama3"):
            return f"rope_type {rope_type!r} changes with sequence length"
        return None

    @classmethod
    def from_hf(cls, hf_model: nn.Module, dtype: torch.dtype | None = None) -> "Llama":
        """Copy the weights of an HF LlamaForCausalLM (same device; `dtype` defaults to the model's)."""
        cfg = hf_model.config
        reason = cls.unsupported(hf_model)
        if reason is not None:  # callers check `unsupported` first (backends.fast_model): a bug if reached
            raise ValueError(f"the compact model cannot take this model: {reason}; use the generic HF path")
        rotary = hf_model.model.rotary_emb
        args = LlamaArgs(
            vocab_size=cfg.vocab_size,
            dim=cfg.hidden_size,
            n_layers=cfg.num_hidden_layers,
            n_heads=cfg.num_attention_heads,
            n_kv_heads=cfg.num_key_value_heads,
            head_dim=cfg.head_dim,
            intermediate_size=cfg.intermediate_size,
            norm_eps=cfg.rms_norm_eps,
            attention_bias=cfg.attention_bias,
            mlp_bias=cfg.mlp_bias,
        )
        with torch.device("meta"):
            model = cls(args, rotary.inv_freq, rotary.attention_scaling, cfg)
        state = {name.removeprefix("model."): w for name, w in hf_model.state_dict().items()}
        if cfg.tie_word_embeddings:
            state["lm_head.weight"] = state["embed_tokens.weight"]
        model.load_state_dict(state, assign=True)
        if cfg.tie_word_embeddings:
            model.lm_head.weight = model.embed_tokens.weight
        # Inference only: `assign=True` made Parameters that require grad, and a forward outside no_grad (a CUDA
        # graph's warm-up and capture) would then record autograd graphs that keep every activation alive.
        model = model.to(dtype=dtype or hf_model.dtype).eval().requires_grad_(False)
        # fp32 frequencies whatever the weights' dtype (`.to` above would have cast the buffer), as HF does
        model.register_buffer("inv_freq", rotary.inv_freq.float().to(model.device), persistent=False)
        return model

    def setup_cache(self, batch_size: int, max_len: int) -> int:
        """Allocate (or keep, when large enough) the static cache; returns its length S, trash slot included."""
        if self.cache_shape is not None and self.cache_shape[0] >= batch_size and self.cache_shape[1] > max_len:
            return self.cache_shape[1]
        S = -(-(max_len + 1) // 16) * 16  # +1 trash slot; rounded so later calls with similar lengths reuse it
        if self.compiled_step is not None:
            # Compiled steps are specialised to the cache tensors they write (Dynamo pins them by identity), so a
            # new cache recompiles every step: allocate few, generous ones (the attention window stays narrow).
            generous = max(COMPILED_MIN_SLOTS, -(-(max_len + 1) // 256) * 256)
            S = max(S, min(generous, -(-(self.config.max_position_embeddings + 1) // 16) * 16))
        shape = (batch_size, S, self.args.n_kv_heads, self.args.head_dim)
        dtype = self.lm_head.weight.dtype
        for layer in self.layers:
            layer.self_attn.k_cache = torch.zeros(shape, dtype=dtype, device=self.device)
            layer.self_attn.v_cache = torch.zeros(shape, dtype=dtype, device=self.device)
        # Graphs captured for the old cache are dropped with their memory pool: a pool handle must not outlive
        # every graph that used it (the caching allocator asserts on a capture into such a pool).
        self.cache_shape, self.graphs, self.graph_pool = (batch_size, S), {}, None
        return S

    def forward(self, tokens, input_pos, slots, mask, last_only: bool = False) -> torch.Tensor:
        """tokens, input_pos (rope positions), slots (cache writes): (B, T); mask: (B, 1, T, S) -> logits (B, T, V).

        Positions and slots are separate so a token tree can give siblings one position but their own slots.
        """
        x = self.embed_tokens(tokens)  # (B, T, D)
        freqs = input_pos[..., None].float() * self.inv_freq  # (B, T, D/2)
        emb = torch.cat([freqs, freqs], -1)[:, :, None]  # (B, T, 1, D)
        cos = (emb.cos() * self.attention_scaling).to(x.dtype)
        sin = (emb.sin() * self.attention_scaling).to(x.dtype)
        for layer in self.layers:
            x = layer(x, cos, sin, slots, mask)
        if last_only:
            x = x[:, -1:]
        return self.lm_head(self.norm(x))

    def step(self, tokens, input_pos, slots, mask) -> torch.Tensor:
        """Forward for a fixed-shape decode/verify step, replayed as a CUDA graph on CUDA (compiled by Inductor on
        the CPU after `cpu.compile_steps`)."""
        if self.compiled_step is not None and not self._hooked():
            return self._compiled(tokens, input_pos, slots, mask)
        if self.device.type != "cuda" or not self.use_graphs:
            return self(tokens, input_pos, slots, mask)
        (B, T), S = tokens.shape, self.cache_shape[1]
        # One graph per power-of-two row count (as serving engines bucket batch sizes): a shrinking batch replays
        # the smallest graph that fits instead of capturing a new one per size; the rows past B are padding.
        rows = graph_rows(B, self.cache_shape[0])
        by_rows = self.graphs.setdefault(T, {})
        if rows not in by_rows:
            by_rows[rows] = self._capture(rows, T)
        graph, (tokens_in, pos_in, slots_in, mask_in), logits = by_rows[rows]
        tokens_in[:B], pos_in[:B], slots_in[:B], mask_in[:B] = tokens, input_pos, slots, mask
        slots_in[B:], mask_in[B:] = S - 1, True  # padding rows write only the trash slot; their logits are dropped
        graph.replay()
        return logits[:B]

    def _hooked(self) -> bool:
        """Forward pre-hooks on a decoder layer (an EAGLE-3 head's aux-state capture, `eagle3_state.AuxCapture`): the
        compiled graphs were traced without them, so such a target runs its CPU steps eager."""
        return any(layer._forward_pre_hooks for layer in self.layers)

    def _compiled(self, tokens, input_pos, slots, mask) -> torch.Tensor:
        """`step` through the compiled forward: the rows padded to `graph_rows` as for the CUDA graphs (one graph
        per power-of-two row count and width T), the mask's width left dynamic (the CPU window grows every step:
        one graph serves all widths)."""
        (B, T), S = tokens.shape, self.cache_shape[1]
        rows = graph_rows(B, self.cache_shape[0])
        pad = rows - B  # padding rows write only the trash slot; their logits are dropped
        # fresh (row-major) inputs whatever they were sliced from: Dynamo guards on strides, even of size-1 dims
        tokens = torch.cat([tokens, tokens.new_zeros(pad, T)])
        input_pos = torch.cat([input_pos, input_pos.new_zeros(pad, T)])
        slots = torch.cat([slots, slots.new_full((pad, T), S - 1)])
        mask = torch.cat([mask, mask.new_ones(pad, 1, T, mask.shape[-1])])
        torch._dynamo.maybe_mark_dynamic(mask, 3)
        # Freezing (weights as graph constants, so Inductor keeps the packed layouts) is read from the global config
        # while Dynamo traces, and only on a first call of a shape; patched around every call so any retrace sees it.
        with torch._inductor.config.patch(freezing=True), torch.no_grad():  # freezing applies without grad only
            logits = self.compiled_step(tokens, input_pos, slots, mask)
        self.graphs.setdefault(T, {})[rows] = None  # compiled: `capture_graphs` need not call this key again
        return logits[:B]

    def capture_graphs(self, widths: Iterable[int], max_rows: int) -> None:
        """Capture now every graph `step` can replay for these widths (tokens per forward) at 1..max_rows rows
        (`graph_keys`), so that none is captured inside a timed run; call it after the cache is set up (a warm-up
        generate call). On the CPU with compiled steps, compiles them instead (a call that writes only the trash
        slot). A no-op elsewhere off CUDA or without graphs."""
        if self.compiled_step is not None and self.cache_shape is not None:
            (R, S), dev = self.cache_shape, self.device
            for T, rows in sorted(graph_keys(widths, max_rows, R)):
                if rows not in self.graphs.get(T, {}):
                    trash = torch.full((rows, T), S - 1, dtype=torch.long, device=dev)
                    # a 2-slot window: a window as wide as the cache would specialise the graph to that width
                    mask = torch.ones(rows, 1, T, 2, dtype=torch.bool, device=dev)
                    self._compiled(torch.zeros_like(trash), torch.zeros_like(trash), trash, mask)
            return
        if self.device.type != "cuda" or not self.use_graphs or self.cache_shape is None:
            return
        for T, rows in sorted(graph_keys(widths, max_rows, self.cache_shape[0])):
            by_rows = self.graphs.setdefault(T, {})
            if rows not in by_rows:
                by_rows[rows] = self._capture(rows, T)

    @torch.no_grad()  # a graph captured with autograd on records a backward graph, its saved tensors in the pool
    def _capture(self, rows: int, T: int) -> tuple:
        S, dev = self.cache_shape[1], self.device
        # Warm-up and capture write only into the trash slot, so the live cache is untouched until the real replay.
        inputs = (
            torch.zeros(rows, T, dtype=torch.long, device=dev),
            torch.zeros(rows, T, dtype=torch.long, device=dev),
            torch.full((rows, T), S - 1, dtype=torch.long, device=dev),
            torch.ones(rows, 1, T, S, dtype=torch.bool, device=dev),
        )
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                self(*inputs)
        torch.cuda.current_stream().wait_stream(side)
        self.graph_pool = self.graph_pool or torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.graph_pool):
            logits = self(*inputs)
        return graph, inputs, logits


class StaticState:
    """Per-row static cache: row b's token at position i lives in slot i; holes write to the last (trash) slot."""

    def __init__(self, model: Llama, batch_size: int, max_len: int):
        self.model = model
        self.S = model.setup_cache(batch_size, max_len)
        self.lengths = torch.zeros(batch_size, dtype=torch.long, device=model.device)  # (B,) real tokens = next pos
        self.segment = 0  # uncommitted tree slots right after each row's real tokens

    def window(self, need: torch.Tensor) -> int:
        """Cache slots a forward's mask spans: all S (fixed shapes for the CUDA graphs), or on the CPU fast path only
        the first max(need) slots, need (B,) = the slots each row uses; attention then reads no unused slot."""
        if not self.model.cpu_fast:
            return self.S
        # compiled steps: at least 2, so that Dynamo never specialises a graph to a 1-slot window (its 0/1 rule)
        return max(int(need.max()), 2) if self.model.compiled_step is not None else int(need.max())

    def extend(
        self, tokens: torch.Tensor, counts: torch.Tensor, last_only: bool = False, new_rows: int | None = None
    ) -> torch.Tensor:
        T = tokens.shape[1]
        valid = torch.arange(T, device=tokens.device) >= (T - counts)[:, None]  # (B, T), holes on the left
        positions = (self.lengths[:, None] + valid.long().cumsum(1) - 1).clamp_min(0)  # (B, T)
        slots = torch.where(valid, positions, self.S - 1)
        W = self.window(self.lengths + counts)
        cols = torch.arange(W, device=tokens.device)
        # A real token sees slots up to its own position (all written by now); a hole sees only the trash slot, or
        # in a narrower window (no trash slot in it) the slots up to its harmless position: finite, and discarded.
        hole_sees = cols == self.S - 1 if W == self.S else cols <= positions[..., None]
        mask = torch.where(valid[..., None], cols <= positions[..., None], hole_sees)[:, None]
        self.lengths = self.lengths + counts
        if last_only and T > 2:  # prefill: eager, variable length
            return self.model(tokens, positions, slots, mask, last_only=True).float()
        logits = self.model.step(tokens, positions, slots, mask)  # on CUDA: the graph's buffer, reused next replay
        # a CUDA graph's logits buffer is overwritten by the next replay; eager CPU logits are fresh: no copy
        return (logits[:, -1:] if last_only else logits).to(torch.float32, copy=not self.model.cpu_fast)

    def draft_step(self, x: torch.Tensor) -> torch.Tensor:
        """The chain's drafting step: feed each row its drafted token x (B,) -> next draft logits (B, V)."""
        return self.extend(x[:, None], torch.ones_like(x), last_only=True, new_rows=1)[:, -1]

    def rollback(self, drop: torch.Tensor) -> None:
        self.lengths = self.lengths - drop

    def select(self, keep: list[int]) -> None:
        """Move the kept rows to the front of the cache, in place (the CUDA graphs hold the cache's addresses)."""
        moved = [i for i, src in enumerate(keep) if i != src]  # keeping a prefix moves nothing
        if moved:
            dst = torch.tensor(moved, device=self.lengths.device)
            src = torch.tensor([keep[i] for i in moved], device=self.lengths.device)
            for layer in self.model.layers:
                for cache in (layer.self_attn.k_cache, layer.self_attn.v_cache):
                    cache[dst] = cache[src]  # the right side is gathered first: overlapping moves are safe
        self.lengths = self.lengths[torch.tensor(keep, device=self.lengths.device)]

    def tree_forward(self, tokens: torch.Tensor, positions: torch.Tensor, seen: torch.Tensor) -> torch.Tensor:
        """Tree nodes take the slots after the segment (their own slots, siblings share a rope position)."""
        B, T = tokens.shape
        width = self.segment + T
        slots = self.lengths[:, None] + self.segment + torch.arange(T, device=tokens.device)  # (B, T)
        W = self.window(self.lengths + width)
        rel = torch.arange(W, device=tokens.device) - self.lengths[:, None]  # (B, W) segment column of a slot
        in_segment = (rel >= 0) & (rel < width)
        seen_slot = seen.gather(2, rel.clamp(0, width - 1)[:, None, :].expand(B, T, W))  # (B, T, W)
        mask = (rel < 0)[:, None] | (in_segment[:, None] & seen_slot)  # real tokens, then flagged segment slots
        self.segment = width
        logits = self.model.step(tokens, positions, slots, mask[:, None])
        return logits.to(torch.float32, copy=not self.model.cpu_fast)

    def tree_commit(self, cols: torch.Tensor, counts: torch.Tensor) -> None:
        K = cols.shape[1]
        keep = torch.arange(K, device=cols.device) < counts[:, None]  # (B, K)
        src = self.lengths[:, None] + cols.clamp_min(0)
        dst = torch.where(keep, self.lengths[:, None] + torch.arange(K, device=cols.device), self.S - 1)
        rows = torch.arange(cols.shape[0], device=cols.device)[:, None]
        for layer in self.model.layers:
            for cache in (layer.self_attn.k_cache, layer.self_attn.v_cache):
                cache[rows, dst] = cache[rows, src]  # the right side is gathered first: overlapping moves are safe
        self.lengths = self.lengths + counts
        self.segment = 0
