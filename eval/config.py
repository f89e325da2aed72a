"""Config sections owned by eval/: the acceptance-rate sweep and promotion into the serving config."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from specdec_runtime.tree import parse_tree


@dataclass
class EvalConfig:
    prompts: str = "builtin:test"
    """Test prompts (the sweep and the confirmation): builtin:test, a prompt file (prompt / messages / Spec-Bench
    turns) or a datasets folder; a run refuses them when they overlap its training or validation prompts."""
    max_prompts: int = 32
    """Evaluate at most this many prompts (0 = all)."""
    num_draft_tokens: list[int] = field(default_factory=lambda: [1, 2, 3, 4, 5, 6, 7, 8])
    """Gamma values to sweep."""
    temperatures: list[float] = field(default_factory=lambda: [0.0, 1.0])
    """Sampling temperatures to sweep (0 = greedy decoding)."""
    draft_rules: list[Literal["greedy", "sample"]] = field(default_factory=lambda: ["greedy", "sample"])
    """Draft rules to sweep: greedy (argmax draft, vLLM default) and sample (exact rejection sampling)."""
    trees: list[str] = field(default_factory=list)
    """Token-tree shapes to sweep besides chains: '4,2,2,1' (branching per depth) or 'dynamic:NODES'."""
    max_new_tokens: int = 128
    """Tokens generated per prompt."""
    batch_sizes: list[int] = field(default_factory=lambda: [1])
    """Concurrency axis: prompts decoded together. The sweep runs at the smallest (1 = the latency setting serving
    engines are tuned for); the chosen setting is confirmed at every one, each paired with target-only decoding at
    the same concurrency."""
    repeats: int = 3
    """Timed repeats of every paired A/B (target-only and speculative alternate per prompt, ABBA order)."""
    warmup: int = 1
    """Untimed warm-up calls per arm before each setting, on the batch holding the longest prompt."""

    def __post_init__(self) -> None:
        if self.max_prompts < 0:
            raise ValueError(f"max_prompts must be >= 0 (0 = all), got {self.max_prompts}")
        if not self.num_draft_tokens or min(self.num_draft_tokens) < 1:
            raise ValueError(f"num_draft_tokens must be a non-empty list of values >= 1, got {self.num_draft_tokens}")
        if not self.temperatures or min(self.temperatures) < 0:
            raise ValueError(f"temperatures must be a non-empty list of values >= 0, got {self.temperatures}")
        if not self.draft_rules:
            raise ValueError("draft_rules must not be empty")
        for spec in self.trees:
            try:
                parse_tree(spec)
            except ValueError as e:
                raise ValueError(f"trees: {e}") from None
        for name in ("max_new_tokens", "repeats"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not self.batch_sizes or min(self.batch_sizes) < 1 or len(set(self.batch_sizes)) < len(self.batch_sizes):
            raise ValueError(f"batch_sizes must be a non-empty list of distinct values >= 1, got {self.batch_sizes}")
        if self.warmup < 0:
            raise ValueError(f"warmup must be >= 0, got {self.warmup}")


@dataclass
class ServingConfig:
    path: str = ""
    """Serving config file to write; empty = <output_dir>/serving.yaml."""
    temperature: float = 0.0
    """The sampling temperature the deployment serves at; the recommendation is made for it."""
    draft_rule: Literal["greedy", "sample"] = "greedy"
    """The draft rule the deployment uses (vLLM's default is greedy drafting)."""
    min_acceptance: float = 0.5
    """Below this acceptance_rate (on the confirmation split) the draft is not enabled, whatever its speedup."""
    min_speedup_margin: float = 0.05
    """Enable only when the confirmation split's speedup_ci lower bound exceeds 1 + this margin."""

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 <= self.min_acceptance <= 1:
            raise ValueError(f"min_acceptance must be in [0, 1], got {self.min_acceptance}")
        if self.min_speedup_margin < 0:
            raise ValueError(f"min_speedup_margin must be >= 0, got {self.min_speedup_margin}")
