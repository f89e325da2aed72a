"""`random:tiny-llama`: a seeded random 4-layer Llama with a byte-level ChatML tokenizer, built in code.

It exists so that smoke runs, CI and tutorials exercise every stage end to end (real files, real tokenizer, real
chat template) without network access or a real checkpoint. Its text is noise; its mechanics are real.
"""

from __future__ import annotations

from pathlib import Path

import torch

from specdec_runtime import atomic

TINY_MODELS = {
    "tiny-llama": dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
    ),
}
SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def byte_level_tokenizer():
    """256 byte symbols + 3 ChatML specials: any text round-trips, the vocabulary is tiny."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    vocab.update({s: len(vocab) + i for i, s in enumerate(SPECIALS)})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(SPECIALS))
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token="<|endoftext|>",
    )
    fast.chat_template = CHATML
    return fast


def build_tiny_model(name: str, out: Path, seed: int = 0) -> Path:
    """Write the random model `name` to `out` (atomically, `atomic.staged_cache_dir`) and return `out`."""
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    from specdec_runtime.loading import save_model_files

    tokenizer = byte_level_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=True,
        **TINY_MODELS[name],
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    model.generation_config = GenerationConfig(eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id)
    with atomic.staged_cache_dir(out) as tmp:  # concurrent ranks build the same model: the first to finish wins
        save_model_files(model, tokenizer, tmp)  # on any rank: another node's first process fills its own cache
    return out
