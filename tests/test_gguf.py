"""GGUF specs through `load_model`: a tiny random Llama written with the `gguf` package (tests/gguf_writer.py) must
load with the reference logits and tokenizer, convert once into the safetensors cache, and an architecture
transformers cannot load must fail with `ModelLoadError` and leave no cache entry behind."""

from __future__ import annotations

import hashlib

import pytest
import torch
from gguf_writer import write_tiny_llama_gguf
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

from specdec_runtime.loading import ModelLoadError, load_model

TEXT = "hello world, the cat sat on the mat ünïcode\n"


def reference_model(reference: dict) -> LlamaForCausalLM:
    model = LlamaForCausalLM(LlamaConfig(**reference["config"])).eval()
    model.load_state_dict(reference["state_dict"])
    return model


def count_gguf_reads(monkeypatch) -> list[str]:
    """Record every transformers `from_pretrained` that reads a GGUF file (the conversion), by class name."""
    calls = []
    for cls in (AutoTokenizer, AutoModelForCausalLM):

        def counting(*args, _original=cls.from_pretrained, _name=cls.__name__, **kwargs):
            if kwargs.get("gguf_file"):
                calls.append(_name)
            return _original(*args, **kwargs)

        monkeypatch.setattr(cls, "from_pretrained", counting)
    return calls


@torch.no_grad()
def test_gguf_matches_reference_logits_and_tokenizer(tmp_path, isolated_cache):
    reference = write_tiny_llama_gguf(tmp_path / "tiny.gguf", seed=1)
    model, tokenizer = load_model(str(tmp_path / "tiny.gguf"), dtype="float32", device="cpu")

    ids = tokenizer(TEXT, add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(ids) == TEXT
    assert tokenizer.encode(" the", add_special_tokens=False) == [tokenizer.convert_tokens_to_ids("Ġthe")]  # merges
    assert tokenizer.encode("<|im_end|>", add_special_tokens=False) == [tokenizer.eos_token_id]
    assert (tokenizer.bos_token, tokenizer.eos_token) == ("<|im_start|>", "<|im_end|>")
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"

    assert model.config.vocab_size == reference["config"]["vocab_size"] == len(tokenizer)
    input_ids = torch.tensor([ids, ids[::-1]])  # (B, T)
    torch.testing.assert_close(model(input_ids).logits, reference_model(reference)(input_ids).logits, atol=1e-4, rtol=0)


@torch.no_grad()
def test_gguf_is_converted_once_into_the_cache(tmp_path, isolated_cache, monkeypatch):
    path = tmp_path / "tiny.gguf"
    write_tiny_llama_gguf(path)
    gguf_reads = count_gguf_reads(monkeypatch)

    first, _ = load_model(str(path), dtype="float32", device="cpu")
    assert sorted(gguf_reads) == ["AutoModelForCausalLM", "AutoTokenizer"]
    entry = isolated_cache / "gguf" / hashlib.sha256(path.read_bytes()).hexdigest()[:16]
    assert [p.name for p in (isolated_cache / "gguf").iterdir()] == [entry.name]  # no leftover temp folder
    assert (entry / "model.safetensors").is_file() and (entry / "config.json").is_file()

    second, tokenizer = load_model(str(path), dtype="float32", device="cpu")
    assert len(gguf_reads) == 2, "the second load converted the GGUF again instead of using the cache"
    assert second.name_or_path == str(entry)
    input_ids = torch.tensor([tokenizer(TEXT)["input_ids"]])  # (1, T)
    torch.testing.assert_close(second(input_ids).logits, first(input_ids).logits, atol=0, rtol=0)


def test_unsupported_gguf_architecture_fails_cleanly(tmp_path, isolated_cache):
    path = tmp_path / "toy.gguf"
    write_tiny_llama_gguf(path, arch="toyformer")
    with pytest.raises(ModelLoadError, match=r"transformers cannot load .*toyformer"):
        load_model(str(path), dtype="float32", device="cpu")
    assert list((isolated_cache / "gguf").glob("*")) == []  # no entry and no temp folder (a missing dir globs empty)


def test_truncated_gguf_raises_model_load_error(tmp_path, isolated_cache):
    path = tmp_path / "t.gguf"
    write_tiny_llama_gguf(path)
    path.write_bytes(path.read_bytes()[:2000])
    with pytest.raises(ModelLoadError, match="truncated"):
        load_model(str(path), device="cpu")
    assert not any((isolated_cache / "gguf").glob("*")) if (isolated_cache / "gguf").exists() else True
