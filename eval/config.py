"""Config sections owned by eval/: the acceptance-rate sweep and promotion into the serving config."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from specdec_runtime.tree import parse_tree


@dataclass
class EvalConfig:
    prompts: str = "builtin:eval"
    """Eval prompts: builtin:eval, or a prompt file (prompt / messages / Spec-Bench turns), or a datasets folder."""
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
    batch_size: int = 1
    """Prompts decoded together (1 = the latency setting serving engines are tuned for)."""
    warmup: int = 1
    """Warm-up prompts run before timing each setting."""

    def validate(self) -> None:
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
        for name in ("max_new_tokens", "batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
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
    """Below this measured acceptance_rate the draft is not enabled, whatever its speedup."""

    def validate(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 <= self.min_acceptance <= 1:
            raise ValueError(f"min_acceptance must be in [0, 1], got {self.min_acceptance}")
