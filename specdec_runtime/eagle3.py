"""EAGLE-3 draft heads (Li et al. 2025): one decoder layer fed with the target's own hidden states, a reduced draft
vocabulary, and the on-disk layout vLLM and SGLang load as it is (shared/EAGLE3.md).

    draft = Eagle3Draft.from_pretrained("runs/x/candidates/eagle/best", device="cpu")
    logits, aux = target_aux_forward(target, input_ids, draft.aux_layers(target.config.num_hidden_layers))
    draft_logits, prenorm = draft(aux, embed(target, next_ids), position_ids, cache)   # (B, T, Vd), (B, T, H)
    q = to_target_probs(draft_logits.softmax(-1), draft.d2t, draft.target_vocab)      # (B, T, V), 0 off-vocab

How an engine drives it. Draft row t reads (the target's aux hidden states h_t of token x_t, the embedding of
x_{t+1}) at position t and predicts x_{t+2}: it lags the target by one token. Say a row holds x_0..x_n, x_n the newest
token (the prefill's first sample, or the last verify's correction / bonus), the target has scored x_0..x_{n-1}, and
the draft cache holds rows 0..m-1, all fed target states.

1. Catch up (after the prefill: m = 0; after a verify: m = the previous n): feed rows m..n-1 with
   `hidden` = h_m..h_{n-1} (B, T, 3H; `fc` projects it), `embeds` of x_{m+1}..x_n and positions m..n-1. The last
   row's logits propose draft token d_1. The target forward that produced h returns it next to its logits in one
   pass (`target_aux_forward`).
2. Draft: step k = 2..gamma feeds one row with `hidden` = the previous call's last `prenorm` (H wide: `fc` is
   skipped), the embedding of d_{k-1} and position n + k - 2.
3. Verify [x_n, d_1..d_gamma]: the target returns h_n..h_{n+gamma}. With a tokens accepted and the correction /
   bonus appended, `cache.crop(n)` drops every row fed the draft's own pre-norm states (even for accepted tokens),
   and step 1 of the next round feeds rows n..n+a from h_n..h_{n+a}.

The cache (`Eagle3Cache`) is one layer's keys and values; the attention of a call sees the cached keys and its own
rows under `attention_mask` (B, 1, T, S) bool, True = may attend; default causal over cache + rows. Training-time
test (`ttt_mask`) reuses the same forward: step j's rows attend the step-0 keys causally and the keys of steps
1..j at their own position only. Embeddings are never part of the draft: engines share the target's table, so the
caller passes `embeds` (B, T, H) = target.get_input_embeddings()(ids).

Files (one format for training checkpoints, best/ and exports): config.json (`draft_config`, a LlamaConfig with
architectures LlamaForCausalLMEagle3) and model.safetensors with unprefixed names (`weight_shapes`) plus d2t (int64,
offsets: target id = i + d2t[i]) and t2d (bool, the kept target ids). `Eagle3Draft.from_pretrained` also reads the
format the speculators package's trainer saves (and vLLM detects), with the variants that trainer turns on by default
(`from_speculators_config`): a head trained elsewhere is measured and compared as it was trained.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import Tensor, nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import (
    LlamaMLP,
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
    apply_rotary_pos_emb,
    rotate_half,
)

from specdec_runtime.errors import UserError

ARCHITECTURE = "LlamaForCausalLMEagle3"
WEIGHTS_FILE = "model.safetensors"
CONFIG_FILE = "config.json"
# Keys copied from the target's config into the draft's (besides the shapes set explicitly in `draft_config`).
COPIED_KEYS = ("hidden_act", "rms_norm_eps", "max_position_embeddings", "bos_token_id", "eos_token_id", "pad_token_id")
# Architecture variants of speculators' EAGLE-3 heads (`from_speculators_config`), off in ours: keys of our config.json
# that only a head read from speculators' format holds, with the value that means "as ours".
VARIANTS = {"norm_before_residual": False, "norm_before_fc": False, "norm_output": False, "sliding_window": None}


def default_aux_layers(num_layers: int) -> list[int]:
    """[2, L // 2, L - 3]: vLLM's and SGLang's default, as HF `output_hidden_states` indices (layer inputs)."""
    return [2, num_layers // 2, num_layers - 3]


def check_aux_layers(layers: list[int], num_layers: int) -> None:
    """Three layer-input indices in [1, L - 1], in ascending order: index 0 (the embeddings) has no residual in vLLM /
    SGLang, L (the final, normed output) is not a layer input, and the engines concatenate the captured states in
    layer order whatever order a config lists them in (fc's column blocks would be read in another order). The
    engines' own default is taken as it is (below 6 layers it is not ascending: [2, 2, 1] for 4)."""
    unordered = list(layers) != sorted(layers) and list(layers) != default_aux_layers(num_layers)
    if len(layers) != 3 or any(not 1 <= i <= num_layers - 1 for i in layers) or unordered:
        raise UserError(
            f"EAGLE-3 takes exactly 3 aux layers, HF output_hidden_states indices in [1, {num_layers - 1}] for a "
            f"{num_layers}-layer target, in ascending order (the engines' order); got {layers}"
        )


def aux_layer_keys(aux_layers: list[int]) -> dict:
    """The config.json keys naming the aux layers, written whatever the layers (default ones too: without them vLLM
    guesses per architecture, issue 23): vLLM reads layer-input indices; SGLang captures after layer i, so its
    `eagle_config` takes the same ids minus 1. TensorRT-LLM reads neither (`eval.engines` writes its snippet)."""
    aux = [int(i) for i in aux_layers]
    return {
        "eagle_aux_hidden_state_layer_ids": aux,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": [i - 1 for i in aux]},
    }


# ----------------------------------------------------------------------------------------------------------------
# Config and vocabulary maps


def draft_config(
    target_config, *, draft_vocab_size: int, aux_layers: list[int] | None = None, dtype: str = "float32"
) -> dict:
    """The draft's config.json as a dict: exactly the keys of shared/EAGLE3.md, rope copied from the target (both
    transformers 5's `rope_parameters` and the legacy `rope_theta` / `rope_scaling` keys older readers need)."""
    t = target_config
    L = t.num_hidden_layers
    aux = list(aux_layers) if aux_layers is not None else default_aux_layers(L)
    check_aux_layers(aux, L)
    head_dim = getattr(t, "head_dim", None) or t.hidden_size // t.num_attention_heads
    rope = dict(getattr(t, "rope_parameters", None) or {"rope_type": "default", "rope_theta": 10000.0})
    legacy_scaling = None if rope.get("rope_type", "default") == "default" else {k: v for k, v in rope.items()}
    config = {
        "architectures": [ARCHITECTURE],
        "model_type": "llama",
        "num_hidden_layers": 1,
        "hidden_size": t.hidden_size,
        "intermediate_size": t.intermediate_size,
        "num_attention_heads": t.num_attention_heads,
        "num_key_value_heads": t.num_key_value_heads,
        "head_dim": head_dim,
        "vocab_size": t.vocab_size,
        "draft_vocab_size": draft_vocab_size,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
        **{k: getattr(t, k) for k in COPIED_KEYS if getattr(t, k, None) is not None},
        "rope_parameters": rope,
        "rope_theta": rope.get("rope_theta", 10000.0),
        "rope_scaling": legacy_scaling,
        "torch_dtype": dtype,
        **aux_layer_keys(aux),
    }
    return config


def is_speculators_config(config: dict) -> bool:
    """True for the config.json of an EAGLE-3 head in the speculators package's format (what its trainer saves)."""
    return config.get("speculators_model_type") == "eagle3"


def from_speculators_config(config: dict) -> dict:
    """speculators' `Eagle3SpeculatorConfig` as saved (config.json) -> our config dict: `draft_config`'s keys plus
    the `VARIANTS` its trainer turns on by default (speculators 0.9.0 `speculators train`: the residual taken after
    hidden_norm, an RMSNorm over the concatenated aux states before fc, later steps fed the normed output, a sliding
    window of 2048 on the layer). What our head cannot compute is refused: more than one layer, per-layer fc norms,
    a Qwen3 layer (q/k norms), other than three aux layers."""
    from transformers import AutoConfig

    raw = dict(config["transformer_layer_config"])
    model_type = raw.pop("model_type", "llama")
    layer = AutoConfig.for_model(model_type, **raw)  # the defaults its diff-dict left out, as speculators reads it
    aux = config.get("eagle_aux_hidden_state_layer_ids")
    unsupported = {
        f"a {model_type} decoder layer": model_type != "llama",
        f"{layer.num_hidden_layers} decoder layers": layer.num_hidden_layers != 1,
        "fc_norm (a norm per aux layer)": bool(config.get("fc_norm")),
        f"{len(aux or [])} aux layers": aux is not None and len(aux) != 3,
        "a target hidden size of its own": config.get("target_hidden_size") not in (None, layer.hidden_size),
    }
    if refused := [what for what, bad in unsupported.items() if bad]:
        raise UserError(
            f"this speculators EAGLE-3 head has {', '.join(refused)}: specdistill's EAGLE-3 runtime computes one Llama "
            "layer fed with three aux layers (shared/EAGLE3.md); serve it with vLLM instead"
        )
    heads = layer.num_attention_heads
    rope = dict(getattr(layer, "rope_parameters", None) or {"rope_type": "default", "rope_theta": 10000.0})
    sliding = "sliding_attention" in (getattr(layer, "layer_types", None) or [])
    ours = {
        "architectures": [ARCHITECTURE],
        "model_type": "llama",
        "num_hidden_layers": 1,
        "hidden_size": layer.hidden_size,
        "intermediate_size": layer.intermediate_size,
        "num_attention_heads": heads,
        "num_key_value_heads": layer.num_key_value_heads,
        "head_dim": getattr(layer, "head_dim", None) or layer.hidden_size // heads,
        "vocab_size": layer.vocab_size,
        "draft_vocab_size": config["draft_vocab_size"],
        "tie_word_embeddings": False,
        "attention_bias": bool(getattr(layer, "attention_bias", False)),
        "mlp_bias": bool(getattr(layer, "mlp_bias", False)),
        **{k: getattr(layer, k) for k in COPIED_KEYS if getattr(layer, k, None) is not None},
        "rope_parameters": rope,
        "rope_theta": rope.get("rope_theta", 10000.0),
        "rope_scaling": None if rope.get("rope_type", "default") == "default" else rope,
        "torch_dtype": config.get("dtype") or config.get("torch_dtype") or "float32",
        "norm_before_residual": bool(config.get("norm_before_residual", False)),
        "norm_before_fc": bool(config.get("norm_before_fc", False)),
        "norm_output": bool(config.get("norm_output", False)),
        "sliding_window": getattr(layer, "sliding_window", None) if sliding else None,
    }
    return ours | (aux_layer_keys(aux) if aux is not None else {})


def from_speculators_weights(state: dict[str, Tensor], config: dict) -> dict[str, Tensor]:
    """speculators' model.safetensors -> our names: `layers.0.` is our `midlayer.`, its `input_norm` (norm_before_fc)
    our `fc.norm`; the target's tensors it keeps (embed_tokens; verifier_* are not saved) are dropped, since engines
    and our runtime use the target's own. A head trained over the full vocabulary has no d2t / t2d: identity maps."""
    renamed = {}
    for name, tensor in state.items():
        if name.startswith(("embed_tokens.", "verifier_")):
            continue
        if name == "fc.weight" and config["norm_before_fc"]:
            name = "fc.proj.weight"
        renamed[name.replace("layers.0.", "midlayer.").replace("input_norm.", "fc.norm.")] = tensor
    if "d2t" not in renamed and config["draft_vocab_size"] == config["vocab_size"]:
        renamed["d2t"] = torch.zeros(config["draft_vocab_size"], dtype=torch.long)
        renamed["t2d"] = torch.ones(config["vocab_size"], dtype=torch.bool)
    return renamed


def vocab_maps(draft_ids: Tensor, target_vocab: int) -> tuple[Tensor, Tensor]:
    """(Vd,) strictly increasing target ids -> d2t (Vd,) int64 offsets (target id = i + d2t[i]) and t2d (V,) bool."""
    ids = draft_ids.long().cpu()
    if ids.dim() != 1 or not len(ids) or (ids[1:] <= ids[:-1]).any() or ids[0] < 0 or ids[-1] >= target_vocab:
        raise ValueError(f"draft ids must be strictly increasing target ids in [0, {target_vocab})")
    t2d = torch.zeros(target_vocab, dtype=torch.bool)
    t2d[ids] = True
    return ids - torch.arange(len(ids)), t2d


def target_ids(d2t: Tensor) -> Tensor:
    """(Vd,) the target id of each draft-vocabulary entry."""
    return torch.arange(len(d2t), device=d2t.device) + d2t


def to_target_probs(draft_probs: Tensor, d2t: Tensor, target_vocab: int) -> Tensor:
    """(..., Vd) probabilities over the draft vocabulary -> (..., V) over target ids, exactly 0 elsewhere."""
    out = draft_probs.new_zeros(*draft_probs.shape[:-1], target_vocab)
    return out.index_copy_(-1, target_ids(d2t), draft_probs)


def to_target_logits(draft_logits: Tensor, d2t: Tensor, target_vocab: int) -> Tensor:
    """(..., Vd) draft logits -> (..., V) target-id logits, -inf off the draft vocabulary (what engines do)."""
    out = draft_logits.new_full((*draft_logits.shape[:-1], target_vocab), float("-inf"))
    return out.index_copy_(-1, target_ids(d2t), draft_logits)


# ----------------------------------------------------------------------------------------------------------------
# The target's side


def target_aux_forward(
    target, input_ids: Tensor, aux_layers: list[int], attention_mask: Tensor | None = None, **kwargs
) -> tuple[Tensor, Tensor]:
    """One target forward -> (logits (B, T, V), aux hidden states (B, T, 3H)): the inputs of the three aux layers
    concatenated in `aux_layers` order (HF `output_hidden_states` indices)."""
    out = target(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True, **kwargs)
    return out.logits, torch.cat([out.hidden_states[i] for i in aux_layers], dim=-1)


def embed(target, ids: Tensor) -> Tensor:
    """(B, T) token ids -> (B, T, H) embeddings from the target's own table (the draft has none)."""
    return target.get_input_embeddings()(ids)


# ----------------------------------------------------------------------------------------------------------------
# The draft


@dataclass
class Eagle3Cache:
    """Keys and values of the draft's one layer: (B, KV, S, D) each, or None before the first call."""

    k: Tensor | None = None
    v: Tensor | None = None

    @property
    def length(self) -> int:
        return 0 if self.k is None else self.k.shape[2]

    def append(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Add a call's (B, KV, T, D) keys and values; returns everything cached, (B, KV, S + T, D) each."""
        self.k = k if self.k is None else torch.cat([self.k, k], dim=2)
        self.v = v if self.v is None else torch.cat([self.v, v], dim=2)
        return self.k, self.v

    def crop(self, length: int) -> None:
        """Keep the first `length` positions (roll back the drafted rows)."""
        if self.k is not None:
            self.k, self.v = self.k[:, :, :length], self.v[:, :, :length]


def causal_mask(T: int, S: int, device: torch.device) -> Tensor:
    """(T, S) bool: the T new rows sit after S - T cached ones; row t sees keys 0 .. S - T + t."""
    return torch.ones(T, S, dtype=torch.bool, device=device).tril(S - T)


def ttt_mask(T: int, step: int, device: torch.device, segments: Tensor | None = None) -> Tensor:
    """(T, (step + 1) T) bool for training-time-test step `step` over keys [step 0 | step 1 | ... | step `step`]:
    causal over the step-0 keys, and the same position only among the later steps' keys (EAGLE-3, SpecForge).

    `segments` (B, T): which sequence each row of a packed batch belongs to; the step-0 keys are then also
    restricted to the row's own sequence -> (B, 1, T, (step + 1) T)."""
    eye = torch.eye(T, dtype=torch.bool, device=device)
    causal = causal_mask(T, T, device)
    if segments is None:
        return torch.cat([causal, *([eye] * step)], dim=1)
    B = segments.shape[0]
    own = causal & (segments[:, :, None] == segments[:, None, :])  # (B, T, T)
    return torch.cat([own, *([eye.expand(B, T, T)] * step)], dim=2)[:, None]


def folded_gqa_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor) -> Tensor:
    """`scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)` with the G = Hq / KV query heads of
    each key head folded into its query rows: q (B, Hq, T, D), k and v (B, KV, S, D), mask (T, S) or (B, 1, T, S)
    bool -> (B, Hq, T, D). With a mask, GQA leaves CUDA only the math kernel (flash takes no mask, the
    memory-efficient one no GQA in torch 2.13's documentation), whose fp32 (B, Hq, T, S) scores backward keeps:
    ~30 GB for an 8B target's head at batch 4 x 2048 and ttt_depth 5. Equal head counts and a plain mask are what
    the memory-efficient kernel takes, without copying the keys and values (docs/runtime.md)."""
    B, Hq, T, D = q.shape
    KV, S = k.shape[1], k.shape[2]
    G = Hq // KV
    q = q.reshape(B, KV, G * T, D)  # query head h reads key head h // G, as SDPA's enable_gqa does
    mask = mask.unsqueeze(-3).expand(*mask.shape[:-2], G, T, S).reshape(*mask.shape[:-2], G * T, S)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask).reshape(B, Hq, T, D)


# Query rows per SDPA call in `row_blocked_attention` (128: 43 ms for the three unrolled steps' forward and backward
# of a 520-token packed batch on a 2-core CPU, 64: 45-47, 256: 52, one call: 74-77; docs/benchmarks.md).
ROW_BLOCK = 128


def row_blocked_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, block: int = ROW_BLOCK) -> Tensor:
    """`scaled_dot_product_attention(q, k, v, attn_mask=mask)` one block of `block` query rows at a time, each
    against only the keys some row of the block may see: q (B, H, R, D), k and v (B, H, S, D), mask (R, S) or
    (B, 1, R, S) bool -> (B, H, R, D), the same values (a masked key adds nothing) and gradients. SDPA's CPU kernel
    computes every (row, key) score its mask leaves out, and the training-time-test unroll's mask (step-0 keys up
    to the row, then the row's own key of each later step) leaves out most of them: at step j a packed batch of T
    tokens scores T x (j + 1) T pairs where ~T^2 / 2 + j T are seen; blocks skip all but ~block x (j + 1) T of the
    rest. A block with no visible key keeps every key (its rows attend to nothing either way)."""
    R, S = q.shape[-2], k.shape[-2]
    if R <= block:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    outs = []
    for start in range(0, R, block):
        rows = mask[..., start : start + block, :]  # (b, S) or (B, 1, b, S)
        keys = rows.reshape(-1, S).any(0).nonzero().squeeze(1)  # (S',) the keys some row of the block sees
        if 0 < keys.numel() < S:
            kb, vb, rows = k.index_select(-2, keys), v.index_select(-2, keys), rows.index_select(-1, keys)
        else:
            kb, vb = k, v
        outs.append(F.scaled_dot_product_attention(q[..., start : start + block, :], kb, vb, attn_mask=rows))
    return torch.cat(outs, dim=-2)  # (B, H, R, D)


class Eagle3Rotary(LlamaRotaryEmbedding):
    """HF's Llama rotary embedding (cos / sin computed in fp32, returned in the input's dtype) whose frequencies stay
    fp32 through any cast of the head: `.to(torch.bfloat16)`, `.bfloat16()`, `.half()`, DeepSpeed 0.19.0-0.19.2's
    `module.bfloat16()` (0.19.3+ casts parameters only). bf16 would round them by up to 2^-9 relative, ~2e-3 rad per
    token of distance, and vLLM / SGLang serve the head with fp32 frequencies (issue 22); `Llama.from_hf` keeps the
    target's fp32 the same way."""

    def _apply(self, fn, recurse=True):
        fp32 = {name: self._buffers[name] for name in ("inv_freq", "original_inv_freq")}
        super()._apply(fn, recurse)
        for name, freqs in fp32.items():  # wherever `fn` moved the buffer, with the fp32 values
            self._buffers[name] = freqs.to(self._buffers[name].device)
        return self


class Eagle3Attention(nn.Module):
    """Llama attention whose q/k/v read the 2H-wide [embeds, hidden] input; o_proj writes H. With `sliding_window`
    (a speculators head's sliding-attention layer) a row sees no key `sliding_window` or more positions back."""

    def __init__(self, config: LlamaConfig, sliding_window: int | None = None):
        super().__init__()
        H, D = config.hidden_size, config.head_dim
        self.heads, self.kv_heads, self.head_dim = config.num_attention_heads, config.num_key_value_heads, D
        self.sliding_window = sliding_window
        self.q_proj = nn.Linear(2 * H, self.heads * D, bias=False)
        self.k_proj = nn.Linear(2 * H, self.kv_heads * D, bias=False)
        self.v_proj = nn.Linear(2 * H, self.kv_heads * D, bias=False)
        self.o_proj = nn.Linear(self.heads * D, H, bias=False)

    def forward(
        self,
        x: Tensor,
        rope: tuple[Tensor, Tensor],
        cache: Eagle3Cache,
        mask: Tensor | None,
        positions: Tensor,
        rows: Tensor | None = None,
    ) -> Tensor:
        """x (B, T, 2H), positions (B, T) -> (B, T, H); with `rows` (R,) indices into T: every row's key and value
        is cached, only those rows query (`mask`: theirs, (R, S) or (B, 1, R, S)) -> (B, R, H)."""
        B, T, _ = x.shape
        if rows is not None and mask is None:
            raise ValueError("query rows need their attention mask: the default causal one assumes the last rows")
        k = self.k_proj(x).view(B, T, self.kv_heads, self.head_dim).transpose(1, 2)  # (B, KV, T, D)
        v = self.v_proj(x).view(B, T, self.kv_heads, self.head_dim).transpose(1, 2)
        cos, sin = rope
        if rows is None:
            q = self.q_proj(x).view(B, T, self.heads, self.head_dim).transpose(1, 2)  # (B, Hq, T, D)
            q, k = apply_rotary_pos_emb(q, k, cos, sin)
        else:
            # apply_rotary_pos_emb's rotation, the queries with their rows' angles
            T, positions = len(rows), positions[:, rows]
            q = self.q_proj(x[:, rows]).view(B, T, self.heads, self.head_dim).transpose(1, 2)  # (B, Hq, R, D)
            q = q * cos[:, rows].unsqueeze(1) + rotate_half(q) * sin[:, rows].unsqueeze(1)
            k = k * cos.unsqueeze(1) + rotate_half(k) * sin.unsqueeze(1)
        k, v = cache.append(k, v)  # (B, KV, S, D)
        if mask is None:
            mask = causal_mask(T, k.shape[2], x.device)
        if self.sliding_window is not None:
            # A key's index is its position in every cache the runtime passes (a row's slot is its position).
            keys = torch.arange(k.shape[2], device=x.device)
            mask = mask & (positions[:, None, :, None] - keys < self.sliding_window)  # (B, 1, T, S)
        gqa = self.heads != self.kv_heads
        # Every call on CUDA (validation and drafting too: an 8B head's validation at batch 4 x 2048 would otherwise
        # hold fp32 (B, Hq, T, S) scores in the math kernel): the form the memory-efficient kernel takes
        # (`folded_gqa_attention`). Training on the CPU: the keys and values repeated to the query heads, so the
        # mask broadcasts over them; folding would repeat the mask G times, and SDPA keeps a float copy of it for
        # backward (a packed row of 1,600 tokens: ~115 MB less at the peak of three unrolled steps, and 4 % faster,
        # docs/benchmarks.md). On the CPU without autograd, SDPA's fused CPU kernel takes GQA with a mask. Training
        # on the CPU attends by blocks of query rows, each to the keys it may see (`row_blocked_attention`).
        if gqa and q.is_cuda:
            out = folded_gqa_attention(q, k, v, mask)
        elif q.requires_grad and q.device.type == "cpu":
            if gqa:
                G = self.heads // self.kv_heads
                k, v = k.repeat_interleave(G, dim=1), v.repeat_interleave(G, dim=1)  # (B, Hq, S, D)
            out = row_blocked_attention(q, k, v, mask)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
        return self.o_proj(out.transpose(1, 2).reshape(B, T, self.heads * self.head_dim))  # (B, T, H)


class Eagle3Layer(nn.Module):
    """The midlayer: attention over cat([input_layernorm(embeds), hidden_norm(hidden)]), residual = the raw hidden
    state (`norm_before_residual` false, the engines' layout; true: hidden_norm(hidden), speculators' default), then
    the Llama MLP block."""

    def __init__(self, config: LlamaConfig, *, norm_before_residual: bool = False, sliding_window: int | None = None):
        super().__init__()
        H, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm, self.hidden_norm = LlamaRMSNorm(H, eps), LlamaRMSNorm(H, eps)
        self.post_attention_layernorm = LlamaRMSNorm(H, eps)
        self.self_attn = Eagle3Attention(config, sliding_window)
        self.mlp = LlamaMLP(config)
        self.norm_before_residual = norm_before_residual

    def forward(
        self,
        hidden: Tensor,
        embeds: Tensor,
        rope,
        cache: Eagle3Cache,
        mask: Tensor | None,
        positions: Tensor,
        rows: Tensor | None = None,
    ) -> Tensor:
        """-> (B, T, H) pre-norm outputs, or (B, R, H) of `rows` only (`Eagle3Attention`)."""
        normed = self.hidden_norm(hidden)
        x = torch.cat([self.input_layernorm(embeds), normed], dim=-1)  # (B, T, 2H)
        residual = normed if self.norm_before_residual else hidden
        if rows is not None:
            residual = residual[:, rows]
        h = residual + self.self_attn(x, rope, cache, mask, positions, rows)
        return h + self.mlp(self.post_attention_layernorm(h))  # (B, T or R, H), pre-norm


class NormedFc(nn.Module):
    """fc after one RMSNorm over the concatenated aux states (a speculators head's `norm_before_fc`). One module, so
    that whoever projects target features through `draft.fc` (the engine's head cache does) applies the norm too."""

    def __init__(self, H: int, eps: float):
        super().__init__()
        self.norm, self.proj = LlamaRMSNorm(3 * H, eps), nn.Linear(3 * H, H, bias=False)

    @property
    def weight(self) -> Tensor:
        return self.proj.weight  # what readers of `fc.weight` ask for: its dtype, its size

    def forward(self, x: Tensor) -> Tensor:
        return self.proj(self.norm(x))


def _identity(x: Tensor) -> Tensor:
    return x


class Eagle3Draft(nn.Module):
    """fc (3H -> H), one `Eagle3Layer`, norm, lm_head (Vd, H), and the d2t / t2d vocabulary maps as buffers; the
    `VARIANTS` a speculators head may hold switch on where its config says so."""

    def __init__(self, config: dict):
        super().__init__()
        self.export_config = dict(config)
        legacy = ("rope_theta", "rope_scaling", "torch_dtype")  # rope_parameters says it all to transformers 5
        skip = (*legacy, *VARIANTS)
        self.config = llama = LlamaConfig(**{k: v for k, v in config.items() if k not in skip})
        variant = {k: config.get(k, default) for k, default in VARIANTS.items()}
        H, Vd = llama.hidden_size, config["draft_vocab_size"]
        eps = llama.rms_norm_eps
        self.fc = NormedFc(H, eps) if variant["norm_before_fc"] else nn.Linear(3 * H, H, bias=False)
        self.midlayer = Eagle3Layer(
            llama, norm_before_residual=variant["norm_before_residual"], sliding_window=variant["sliding_window"]
        )
        self.norm_output = variant["norm_output"]  # later steps read the normed output (speculators, Eagle 3.1)
        self.norm = LlamaRMSNorm(H, eps)
        self.lm_head = nn.Linear(H, Vd, bias=False)
        self.register_buffer("d2t", torch.zeros(Vd, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(llama.vocab_size, dtype=torch.bool))
        self.rotary = Eagle3Rotary(llama)  # inv_freq: a non-persistent fp32 buffer, not in the weights
        self.cpu_fast = False  # True: a `cpu.cpu_eagle3` copy, its linears laid out once for the CPU
        self.use_graphs = True  # False: eager CUDA drafting steps (to measure what the graph buys)
        self.head_cache = None  # eagle3_state.HeadCache: the engine's buffers and CUDA graphs, kept across calls

    @property
    def target_vocab(self) -> int:
        return self.config.vocab_size

    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype the head computes in: its fc's (a `cpu.cpu_eagle3` copy's packed weight keeps the dtype too)."""
        return self.fc.weight.dtype

    def aux_layers(self, num_target_layers: int) -> list[int]:
        """The target layers this draft reads: the config's ids, or the engines' default for a head saved before
        they were always written (issue 23)."""
        return self.export_config.get("eagle_aux_hidden_state_layer_ids") or default_aux_layers(num_target_layers)

    def forward(
        self,
        hidden: Tensor,
        embeds: Tensor,
        position_ids: Tensor,
        cache: Eagle3Cache | None = None,
        attention_mask: Tensor | None = None,
        last_only: bool = False,
        head: bool = True,
        rows: Tensor | None = None,
    ) -> tuple[Tensor, Tensor]:
        """hidden (B, T, 3H) target aux states or (B, T, H) own pre-norm outputs, embeds (B, T, H) of the next
        tokens, position_ids (B, T), attention_mask (B, 1, T, S) bool over cache + rows (None = causal)
        -> (draft logits (B, T, Vd), or (B, 1, Vd) of the last row with last_only; the states later steps read
        (B, T, H): the layer's pre-norm outputs, or with `norm_output` their normed ones). `head=False` returns
        lm_head's input (B, T, H) in place of the logits, for a loss that applies the head itself.

        `rows` (R,) indices into T (training, `distill.eagle3`): every row's key and value is cached, but only these
        rows go on through the layer: the outputs are (B, R, ...), `attention_mask` is theirs, (B, 1, R, S).

        `cache` is anything with `append(k, v) -> all keys, values` (`Eagle3Cache`, or the engine's slot cache)."""
        if hidden.shape[-1] != embeds.shape[-1]:
            hidden = self.fc(hidden)  # the target's 3H features; later steps' own outputs are H wide already
        rope = self.rotary(embeds, position_ids)  # cos, sin (B, T, D)
        cache = cache if cache is not None else Eagle3Cache()
        prenorm = self.midlayer(hidden, embeds, rope, cache, attention_mask, position_ids, rows)
        lm_head = self.lm_head if head else _identity
        if self.norm_output:
            normed = self.norm(prenorm)
            return lm_head(normed[:, -1:] if last_only else normed), normed
        return lm_head(self.norm(prenorm[:, -1:] if last_only else prenorm)), prenorm

    # ------------------------------------------------------------------------------------------------------------
    # Files

    def save_pretrained(self, folder: Path | str, state_dict: dict[str, Tensor] | None = None, **_) -> None:
        """config.json and model.safetensors (unprefixed names, d2t, t2d) into `folder` (the loop's writer calls
        this like an HF model's; a gathered FSDP `state_dict` replaces the module's own)."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        state = state_dict if state_dict is not None else self.state_dict()
        dtype = str(self.fc.weight.dtype).removeprefix("torch.")
        (folder / CONFIG_FILE).write_text(json.dumps({**self.export_config, "torch_dtype": dtype}, indent=2) + "\n")
        save_file({k: v.detach().contiguous().cpu() for k, v in state.items()}, folder / WEIGHTS_FILE)

    @classmethod
    def from_pretrained(cls, folder: Path | str, *, device: str | torch.device = "cpu", dtype=None) -> Eagle3Draft:
        """A head folder in our layout or in speculators' (`from_speculators_config`), in the dtype of its weights
        unless `dtype` is given."""
        folder = Path(folder)
        config = json.loads((folder / CONFIG_FILE).read_text())
        state = load_file(folder / WEIGHTS_FILE)
        if is_speculators_config(config):
            config = from_speculators_config(config)
            state = from_speculators_weights(state, config)
        model = cls(config)
        missing, unexpected = model.load_state_dict(state, strict=False)
        if missing or unexpected:
            raise UserError(
                f"{folder} is not an EAGLE-3 draft of this layout (missing {missing[:3]}, extra {unexpected[:3]}); "
                "pass a head exported by specdistill or by speculators"
            )
        model = model.to(device=device)
        saved = state["fc.weight" if "fc.weight" in state else "fc.proj.weight"].dtype  # the file's dtype
        return model.to(dtype if dtype is not None else saved).eval()

    @classmethod
    def from_target(
        cls,
        target,
        draft_ids: Tensor,
        aux_layers: list[int] | None = None,
        *,
        seed: int | None = None,
        init_std: float = 0.0,
        norm_from_target: bool = True,
        variants: dict | None = None,
    ) -> Eagle3Draft:
        """A new head for `target`: random fc and midlayer (torch's default for a Linear, or with `init_std` > 0
        normal(0, init_std), as HF models and speculators start theirs), norm copied from the target's final norm
        (or ones with `norm_from_target` false), lm_head from the target's head rows of `draft_ids` (strictly
        increasing target ids); fp32, on the target's device. `variants`: `VARIANTS` keys to switch on (written
        into its config.json only when on, so a head in the engines' layout keeps exactly shared/EAGLE3.md's keys)."""
        config = draft_config(target.config, draft_vocab_size=len(draft_ids), aux_layers=aux_layers)
        variants = variants or {}
        if unknown := set(variants) - set(VARIANTS):
            raise ValueError(f"unknown EAGLE-3 head variants {sorted(unknown)}; known: {sorted(VARIANTS)}")
        config |= {k: v for k, v in variants.items() if v != VARIANTS[k]}
        if seed is not None:
            torch.manual_seed(seed)
        model = cls(config).to(next(target.parameters()).device)
        d2t, t2d = vocab_maps(draft_ids, target.config.vocab_size)
        with torch.no_grad():
            if init_std > 0:
                for m in (*model.fc.modules(), *model.midlayer.modules()):
                    if isinstance(m, nn.Linear):
                        m.weight.normal_(0.0, init_std)
            model.d2t.copy_(d2t)
            model.t2d.copy_(t2d)
            model.lm_head.weight.copy_(target.get_output_embeddings().weight[target_ids(model.d2t)])
            if norm_from_target:
                model.norm.weight.copy_(target.base_model.norm.weight)
        return model


def first_step_logits(draft: Eagle3Draft, target, input_ids: Tensor) -> Tensor:
    """(B, T) token ids -> (B, T, V) target-id logits aligned as a standalone LM's: position t predicts token t + 1
    from the row (h_{t-1}, embedding of x_t), the head's first draft step; position 0 (no row) is uniform over the
    draft vocabulary. What `expected_acceptance` compares with the target's logits offline."""
    L = target.config.num_hidden_layers
    _, aux = target_aux_forward(target, input_ids, draft.aux_layers(L))
    dtype = draft.compute_dtype
    logits, _ = draft(aux[:, :-1].to(dtype), embed(target, input_ids[:, 1:]).to(dtype), _positions(input_ids))
    logits = torch.cat([torch.zeros_like(logits[:, :1]), logits], 1)  # (B, T, Vd)
    return to_target_logits(logits.float(), draft.d2t, draft.target_vocab)


def _positions(input_ids: Tensor) -> Tensor:
    """(B, T) -> (B, T - 1) rope positions 0..T-2 of the rows."""
    return torch.arange(input_ids.shape[1] - 1, device=input_ids.device).expand(input_ids.shape[0], -1)


def is_eagle3_folder(folder: Path | str) -> bool:
    """True when `folder/config.json` names the EAGLE-3 architecture, or is a speculators EAGLE-3 config."""
    path = Path(folder) / CONFIG_FILE
    if not path.is_file():
        return False
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except ValueError:  # truncated or not JSON: unidentifiable here; the loaders name the file (check_model_files)
        return False
    if not isinstance(config, dict):
        return False
    return ARCHITECTURE in (config.get("architectures") or []) or is_speculators_config(config)


def weight_shapes(config: dict) -> dict[str, tuple[tuple[int, ...], torch.dtype | None]]:
    """Every tensor of the export, its shape and (for d2t / t2d) its dtype; float weights take the file's dtype."""
    H, Vd, V = config["hidden_size"], config["draft_vocab_size"], config["vocab_size"]
    I = config["intermediate_size"]  # noqa: E741
    q, kv = config["num_attention_heads"] * config["head_dim"], config["num_key_value_heads"] * config["head_dim"]
    m = "midlayer."
    return {
        "fc.weight": ((H, 3 * H), None),
        f"{m}input_layernorm.weight": ((H,), None),
        f"{m}hidden_norm.weight": ((H,), None),
        f"{m}post_attention_layernorm.weight": ((H,), None),
        f"{m}self_attn.q_proj.weight": ((q, 2 * H), None),
        f"{m}self_attn.k_proj.weight": ((kv, 2 * H), None),
        f"{m}self_attn.v_proj.weight": ((kv, 2 * H), None),
        f"{m}self_attn.o_proj.weight": ((H, q), None),
        f"{m}mlp.gate_proj.weight": ((I, H), None),
        f"{m}mlp.up_proj.weight": ((I, H), None),
        f"{m}mlp.down_proj.weight": ((H, I), None),
        "norm.weight": ((H,), None),
        "lm_head.weight": ((Vd, H), None),
        "d2t": ((Vd,), torch.int64),
        "t2d": ((V,), torch.bool),
    }
