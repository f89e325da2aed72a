"""Config sections owned by distill/: where prompts come from, how the teacher answers them, and the objective."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Literal

OBJECTIVES = ("forward_kl", "reverse_kl", "jsd", "tv", "ce")


@dataclass
class EndpointConfig:
    """An OpenAI-compatible server that writes the teacher's responses (`data.generator: endpoint`)."""

    url: str = ""
    """Base URL of the server's OpenAI API, ending in /v1, e.g. http://localhost:8000/v1 (not in the data's
    fingerprint: the same server may move)."""
    model: str = ""
    """The model name the server serves (its /v1/models id, vLLM's --served-model-name); in the data's fingerprint."""
    api_key_env: str = ""
    """Name of the environment variable holding the server's API key (sent as a bearer token), e.g. OPENAI_API_KEY;
    never the key itself. Empty: no key."""
    max_concurrency: int = 256
    """Requests in flight at once, over all processes: enough to keep the server's batches full."""
    timeout_s: float = 600.0
    """Seconds one request may take (queueing on a busy server included) before it is retried."""
    retries: int = 3
    """Retries of a request after a timeout, a lost connection or a 5xx/429 answer, with exponential backoff."""

    def __post_init__(self) -> None:
        if self.url and not re.match(r"https?://[^/\s]+", self.url):
            raise ValueError(
                f"url must start with http:// or https://, e.g. http://localhost:8000/v1, got {self.url!r}"
            )
        if self.api_key_env and not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", self.api_key_env):
            raise ValueError(
                "api_key_env names an environment variable (e.g. OPENAI_API_KEY) that holds the key, never the key "
                "itself; export the key in a variable and give its name"
            )
        if self.max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {self.max_concurrency}")
        if self.timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {self.timeout_s}")
        if self.retries < 0:
            raise ValueError(f"retries must be >= 0, got {self.retries}")


@dataclass
class DataConfig:
    prompts: str | list[str] = "builtin:train"
    """Training prompts: builtin:train, builtin:long-input (long-input tasks, training only), a JSONL/JSON/CSV/parquet
    file, a datasets folder, an HF dataset id, self_instruct (the teacher writes self_instruct_count prompts), or a
    list of these concatenated in order, e.g. [builtin:train, builtin:long-input, self_instruct]; max_prompts applies
    to the concatenation."""
    validation_prompts: str = "builtin:validation"
    """Validation prompts: scored during distillation to pick the checkpoint (best/); never trained on, and
    disjoint from the test prompts (eval.prompts)."""
    max_prompts: int = 0
    """Use at most this many training prompts (0 = all)."""
    max_validation_prompts: int = 32
    """Use at most this many validation prompts (0 = all)."""
    self_instruct_count: int = 200
    """With self_instruct in prompts (alone or in a list): how many unique prompts the teacher writes."""
    num_samples: int = 1
    """Teacher responses sampled per prompt."""
    max_prompt_tokens: int = 384
    """Prompts longer than this (after the chat template) are refused with the prompt id."""
    max_new_tokens: int = 128
    """Teacher response length limit in tokens."""
    temperature: float = 0.7
    """Teacher sampling temperature for data generation (0 = greedy)."""
    top_k: int = 0
    """Teacher top-k for data generation (0 = off)."""
    top_p: float = 0.95
    """Teacher top-p for data generation (1.0 = off)."""
    batch_size: int = 16
    """Sequences (prompt x sample) per teacher generation batch."""
    shard_size: int = 64
    """Prompts per written shard; a killed generation resumes at the first missing shard."""
    teacher_cache: bool = False
    """Also store the teacher's top-k log-probs per response token (per prompt token too when a candidate trains from
    the cache with distill.loss_on_prompt), so distillation runs without the teacher."""
    teacher_cache_top_k: int = 32
    """k of the offline teacher cache."""
    generator: Literal["runtime", "endpoint"] = "runtime"
    """Who writes the teacher's responses: runtime (our engine, with the target loaded here) or endpoint (any
    OpenAI-compatible server: vLLM, SGLang, TGI, llama.cpp, transformers serve; see data.endpoint). The scoring pass
    (teacher_cache, EAGLE-3 hidden states) is always our target's forward."""
    endpoint: EndpointConfig = field(default_factory=EndpointConfig)
    """The server of data.generator=endpoint."""

    def __post_init__(self) -> None:
        if isinstance(self.prompts, list):
            _check_sources(self.prompts)
        for name in ("max_prompts", "max_validation_prompts"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0 (0 = all), got {getattr(self, name)}")
        for name in (
            "num_samples",
            "max_prompt_tokens",
            "max_new_tokens",
            "batch_size",
            "shard_size",
            "teacher_cache_top_k",
            "self_instruct_count",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.generator == "endpoint":
            missing = [name for name in ("url", "model") if not getattr(self.endpoint, name)]
            if missing:
                raise ValueError(
                    f"generator=endpoint needs endpoint.{missing[0]}, e.g. data.endpoint.url=http://localhost:8000/v1 "
                    "data.endpoint.model=<the served model name>"
                )


def _check_sources(sources: list) -> None:
    """data.prompts as a list: at least one source, each a non-empty string, none twice."""
    if not sources:
        raise ValueError("prompts is an empty list; give one source or a list of sources, e.g. [builtin:train]")
    for i, source in enumerate(sources):
        if not isinstance(source, str) or not source.strip():
            raise ValueError(f"prompts[{i}] must be a prompt source (a non-empty string), got {source!r}")
        if source in sources[:i]:
            raise ValueError(f"prompts lists {source!r} twice (prompts[{sources.index(source)}] and prompts[{i}])")


@dataclass
class DistillConfig:
    objective: dict[str, float] | str = field(default_factory=lambda: {"forward_kl": 1.0})
    """Loss terms and weights, e.g. {forward_kl: 1.0} or {tv: 0.5, ce: 0.5}; terms: forward_kl, reverse_kl, jsd,
    tv, ce. A bare name on the command line (distill.objective=tv) means weight 1."""
    kd_temperature: float = 1.0
    """Softens teacher and student logits inside the KD terms; unrelated to sampling temperature."""
    beta: float = 0.5
    """JSD interpolation weight (generalized JSD of Agarwal et al. 2024, GKD)."""
    lmbda: float = 0.0
    """Probability that a batch's responses are generated on-policy by the student and scored by the teacher
    (GKD's lambda, Agarwal et al. 2024; DistillSpec, Zhou et al. 2024)."""
    teacher: Literal["online", "cache"] = "online"
    """online: the teacher scores every batch in memory; cache: read top-k log-probs written by `data`."""
    chunk_size: int = 128
    """Positions per chunk when computing the loss, so (B, T, V) fp32 probabilities are never held twice."""
    chunked_head: bool = True
    """Apply the student's output head inside the loss, chunk_size positions at a time and to the trained positions
    only, so its full (B, T, V) logits and their gradient never exist (EAGLE-3 heads too: once per unrolled step;
    the full-logits path is kept automatically where the head cannot be reproduced, and under FSDP). Each chunk
    accumulates the head's (V, D) gradient once: on GPUs with a large vocabulary use a chunk_size of 1024 or more,
    or false when memory allows and the step is faster without it."""
    loss_on_prompt: bool = True
    """Train on every position that predicts a token of the sequence, prompt tokens included (validation still
    measures response tokens only); false: response tokens only. With teacher=cache the data stage then stores the
    top-k for prompt positions too, so the cache grows with the prompt length. Measured at equal optimizer steps,
    paired on builtin:test over 2 seeds (docs/benchmarks.md, issue 27): +0.025 acceptance for the quickstart's
    EAGLE-3 head, +0.013 for a 4-layer truncation, each interval above 0; the step costs more (1.3x the head's
    training minutes, 1.5x the truncation's there: the prompt rows go through the output head and the loss too)."""

    def __post_init__(self) -> None:
        if isinstance(self.objective, str):  # a bare name from the command line means weight 1
            self.objective = {self.objective: 1.0}
        unknown = [k for k in self.objective if k not in OBJECTIVES]
        if unknown:
            raise ValueError(f"unknown objective {unknown[0]!r}; valid objectives: {', '.join(OBJECTIVES)}")
        weights = self.objective.values()
        if not self.objective or any(not math.isfinite(w) or w < 0 for w in weights) or sum(weights) <= 0:
            raise ValueError(f"objective weights must be finite and >= 0 with a positive sum, got {self.objective}")
        if self.kd_temperature <= 0:
            raise ValueError(f"kd_temperature must be > 0, got {self.kd_temperature}")
        if not 0 <= self.beta <= 1:
            raise ValueError(f"beta must be in [0, 1], got {self.beta}")
        if not 0 <= self.lmbda <= 1:
            raise ValueError(f"lmbda must be in [0, 1] (a probability), got {self.lmbda}")
        if self.lmbda > 0 and self.teacher == "cache":
            raise ValueError("lmbda > 0 (on-policy data) needs the teacher online: set distill.teacher=online")
        if self.chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1, got {self.chunk_size}")
