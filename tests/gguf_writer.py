"""Write tiny random GGUF files with the `gguf` package, so GGUF loading is tested without a real checkpoint.

The file holds what llama.cpp's convert_hf_to_gguf.py writes for a Llama: `llama.*` hyperparameters, F32 tensors
under GGUF names with the q/k rows permuted into llama.cpp's rotary layout, and a byte-level BPE (`gpt2`) tokenizer:
the 256 byte symbols, a few merges, the ChatML specials and a chat template.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import torch
from transformers.convert_slow_tokenizer import bytes_to_unicode

from specdec_runtime.tiny import CHATML, SPECIALS

TINY_GGUF_LLAMA = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    rms_norm_eps=1e-5,
    rope_theta=50000.0,
)
# Each word becomes one token through a chain of left-to-right merges; a leading space is a word boundary.
MERGED_WORDS = (" the", " cat", " sat", " on", " mat", "hello", " world", "ing")

# HF name inside model.layers.N -> GGUF name inside blk.N (llama.cpp's gguf-py tensor map for llama)
LAYER_TENSORS = {
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
}


def byte_bpe_vocab() -> tuple[list[str], list[str], list[int]]:
    """(tokens, merges, token types): byte symbols (id == byte value), merged words, then ChatML specials."""
    spell = bytes_to_unicode()  # byte -> printable symbol, as GPT-2 spells a space "Ġ"
    tokens = [spell[b] for b in range(256)]
    merges = []
    for word in MERGED_WORDS:
        symbols = [spell[b] for b in word.encode("utf-8")]
        for i in range(1, len(symbols)):
            left, right = "".join(symbols[:i]), symbols[i]
            if left + right not in tokens:
                merges.append(f"{left} {right}")
                tokens.append(left + right)
    types = [gguf.TokenType.NORMAL] * len(tokens) + [gguf.TokenType.CONTROL] * len(SPECIALS)
    return tokens + list(SPECIALS), merges, [int(t) for t in types]


def random_llama_state_dict(config: dict, seed: int) -> dict[str, torch.Tensor]:
    """An HF-layout LlamaForCausalLM state dict; weights large enough that a misplaced tensor moves the logits."""
    g = torch.Generator().manual_seed(seed)
    V, D, F = config["vocab_size"], config["hidden_size"], config["intermediate_size"]
    head_dim = D // config["num_attention_heads"]
    q_rows, kv_rows = config["num_attention_heads"] * head_dim, config["num_key_value_heads"] * head_dim

    def matrix(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=g) / shape[-1] ** 0.5

    def norm() -> torch.Tensor:  # not all ones, so swapping the two norms of a layer changes the output
        return 1 + 0.1 * torch.randn(D, generator=g)

    layer_shapes = {
        "self_attn.q_proj.weight": (q_rows, D),
        "self_attn.k_proj.weight": (kv_rows, D),
        "self_attn.v_proj.weight": (kv_rows, D),
        "self_attn.o_proj.weight": (D, q_rows),
        "mlp.gate_proj.weight": (F, D),
        "mlp.up_proj.weight": (F, D),
        "mlp.down_proj.weight": (D, F),
    }
    state = {"model.embed_tokens.weight": torch.randn(V, D, generator=g)}
    for n in range(config["num_hidden_layers"]):
        state |= {f"model.layers.{n}.{name}": matrix(*shape) for name, shape in layer_shapes.items()}
        state[f"model.layers.{n}.input_layernorm.weight"] = norm()
        state[f"model.layers.{n}.post_attention_layernorm.weight"] = norm()
    state["model.norm.weight"] = norm()
    state["lm_head.weight"] = matrix(V, D)
    return state


def permute_for_ggml_rope(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """HF rotates dim i with i + head_dim/2, ggml rotates adjacent pairs: llama.cpp interleaves each head's rows."""
    # (H * head_dim, D) -> (H, 2, head_dim/2, D) -> (H, head_dim/2, 2, D) -> (H * head_dim, D)
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_tensors(state: dict[str, torch.Tensor], config: dict) -> dict[str, torch.Tensor]:
    """HF state dict -> GGUF-named tensors in the layout llama.cpp writes."""
    out = {"token_embd.weight": state["model.embed_tokens.weight"]}
    for n in range(config["num_hidden_layers"]):
        for hf, gg in LAYER_TENSORS.items():
            out[f"blk.{n}.{gg}"] = state[f"model.layers.{n}.{hf}"]
        out[f"blk.{n}.attn_q.weight"] = permute_for_ggml_rope(
            out[f"blk.{n}.attn_q.weight"], config["num_attention_heads"]
        )
        out[f"blk.{n}.attn_k.weight"] = permute_for_ggml_rope(
            out[f"blk.{n}.attn_k.weight"], config["num_key_value_heads"]
        )
    out["output_norm.weight"] = state["model.norm.weight"]
    out["output.weight"] = state["lm_head.weight"]  # present, so the loader sets tie_word_embeddings=False
    return out


def write_tiny_llama_gguf(path: str | Path, seed: int = 0, arch: str = "llama") -> dict:
    """Write a tiny random Llama as an F32 GGUF at `path`; return {"config": LlamaConfig kwargs, "state_dict": HF}.

    `arch` is the `general.architecture` written, and the prefix of the hyperparameter keys. Any name other than
    "llama" (e.g. a made-up one) gives a file whose tensors are fine but whose architecture transformers cannot load.
    """
    tokens, merges, types = byte_bpe_vocab()
    ids = {t: i for i, t in enumerate(tokens)}
    config = dict(
        TINY_GGUF_LLAMA,
        vocab_size=len(tokens),
        tie_word_embeddings=False,
        bos_token_id=ids["<|im_start|>"],
        eos_token_id=ids["<|im_end|>"],
        pad_token_id=ids["<|endoftext|>"],
    )
    state = random_llama_state_dict(config, seed)

    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name("tiny-random-llama")
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_rope_dimension_count(config["hidden_size"] // config["num_attention_heads"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_rope_freq_base(config["rope_theta"])
    writer.add_vocab_size(config["vocab_size"])

    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(config["bos_token_id"])
    writer.add_eos_token_id(config["eos_token_id"])
    writer.add_pad_token_id(config["pad_token_id"])
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHATML)

    for name, tensor in gguf_tensors(state, config).items():
        writer.add_tensor(name, tensor.contiguous().numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return {"config": config, "state_dict": state}
