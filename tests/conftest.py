"""Shared fixtures: tiny random models built in code, an isolated model cache, quiet libraries."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")


@pytest.fixture
def isolated_cache(tmp_path, monkeypatch):
    """A fresh SPECDISTILL_CACHE so conversions and random models are built by the test itself."""
    monkeypatch.setenv("SPECDISTILL_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def tiny_llama(vocab_size: int = 64, layers: int = 2, seed: int = 0, **overrides):
    """A random LlamaForCausalLM small enough to run hundreds of forwards per second on a CPU."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    shape = dict(vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    return LlamaForCausalLM(LlamaConfig(**{**shape, **overrides})).eval()


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op thread for a module of tiny models: thread wake-ups cost more than the maths there."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
