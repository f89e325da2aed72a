"""Config sections owned by train/: the optimisation loop and experiment tracking."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Literal

if TYPE_CHECKING:  # annotations only: the CLI imports this module for its schema and stays fast
    from distill.config import DataConfig, DistillConfig
    from distill.students import DraftConfig
    from specdec_runtime.backends import TargetConfig


@dataclass
class TrainConfig:
    max_steps: int = 100
    """Optimizer steps to run; 0 = run `epochs` epochs instead."""
    epochs: int = 0
    """Epochs over the distillation data when max_steps is 0."""
    batch_size: int = 8
    """Sequences per process per micro-batch."""
    grad_accum: int = 1
    """Micro-batches per optimizer step (global batch = batch_size * grad_accum * processes)."""
    max_seq_len: int = 512
    """Prompt + response tokens per sequence; longer sequences are truncated from the response end."""
    max_micro_batch_tokens: int = 0
    """Peak memory bound: a micro-batch holding more real (unpadded) tokens than this runs as several forward and
    backward passes over consecutive runs of its rows, each within the bound (a longer sequence alone). The step's
    loss and gradients are the same; only one run's activations are alive at a time. 0 = the micro-batch in one
    pass."""
    lr: float = 5e-4
    """Peak AdamW learning rate."""
    min_lr_ratio: float = 0.1
    """Cosine schedule floor as a fraction of lr."""
    warmup_steps: int = 10
    """Linear warm-up steps."""
    weight_decay: float = 0.0
    """AdamW weight decay (with optimizer=muon: of the parameters AdamW trains)."""
    optimizer: Literal["adamw", "muon"] = "adamw"
    """adamw; or muon: torch.optim.Muon on the 2-D weight matrices (lr scaled to match AdamW's update size, so `lr`
    means the same) and AdamW on norms, biases, embeddings and the output head (train/optimizers.py). Not under
    DeepSpeed or FSDP, whose flat or sharded parameters are no matrices to orthogonalise."""
    muon_weight_decay: float = 0.1
    """Weight decay of the matrices Muon trains (torch's and speculators' default)."""
    max_grad_norm: float = 1.0
    """Gradient clipping norm (0 = off)."""
    mixed_precision: Literal["auto", "no", "bf16"] = "auto"
    """auto = bf16 autocast on CUDA, fp32 on CPU."""
    eval_every: int = 50
    """Validate every N steps (and at the end)."""
    save_every: int = 50
    """Checkpoint every N steps (and at the end)."""
    keep_last: int = 2
    """Checkpoints kept besides the best one (best = highest validation expected_acceptance)."""
    resume: bool = True
    """Continue from the newest good checkpoint in the candidate folder when there is one."""
    log_every: int = 10
    """Log training metrics every N steps."""
    shard_teacher: Literal["auto", "always", "never"] = "auto"
    """Shard the teacher's weights over the processes (FSDP2, inference only) instead of a full copy on each:
    auto = when accelerate runs FSDP; always = also under DDP or on CPU (a large teacher, a small DDP student);
    never = a full copy on every process. One process never shards."""
    timeout_minutes: float = 60.0
    """Process-group timeout of a multi-process launch, for every stage (data, distill, eval): how long a collective
    waits for the slowest rank (rank 0 downloading or converting the target, the last data shards) before the run
    fails. torch's own default is 10 minutes under NCCL. Across nodes it is also how long a dead node can hold the
    others under NCCL (docs/distributed.md#multi-node)."""

    def __post_init__(self) -> None:
        if self.max_steps < 0 or self.epochs < 0 or (self.max_steps == 0 and self.epochs == 0):
            raise ValueError("set max_steps >= 1, or max_steps=0 with epochs >= 1")
        for name in ("batch_size", "grad_accum", "max_seq_len", "eval_every", "save_every", "keep_last", "log_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.lr <= 0:
            raise ValueError(f"lr must be > 0, got {self.lr}")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        if min(self.warmup_steps, self.weight_decay, self.muon_weight_decay, self.max_grad_norm) < 0:
            raise ValueError("warmup_steps, weight_decay, muon_weight_decay and max_grad_norm must be >= 0")
        if self.max_micro_batch_tokens < 0:
            raise ValueError(f"max_micro_batch_tokens must be >= 0 (0 = no bound), got {self.max_micro_batch_tokens}")
        if self.timeout_minutes <= 0:
            raise ValueError(f"timeout_minutes must be > 0, got {self.timeout_minutes}")


@dataclass
class TrackingConfig:
    SHORTHAND: ClassVar[str] = "backend"  # `tracking: none` in YAML (or tracking=none) means `tracking.backend: none`

    backend: Literal["wandb", "none"] = "wandb"
    """wandb, or none to log to the console only."""
    project: str = "specdistill"
    """W&B project."""
    entity: str | None = None
    """W&B entity (team or user); None = your default."""
    mode: Literal["auto", "online", "offline"] = "auto"
    """auto = online when an API key is configured, offline otherwise (runs sync later with `wandb sync`)."""
    run_name: str | None = None
    """W&B run name; None = <output_dir name>-<candidate>."""


@dataclass
class CandidateRun:
    """One candidate as the pipeline resolved it (its overrides applied): what the recipe trains and where."""

    name: str
    """Candidate name: its folder and its label in the log."""
    out_dir: Path
    """<output_dir>/candidates/<name>/: checkpoints/, best/, metrics.jsonl, config.yaml, DONE."""
    run_name: str
    """The W&B run name."""
    seed: int
    """Global seed; each process adds its rank."""
    target: TargetConfig
    """The target section (model, dtype, device, trust_remote_code, allow_pickle, the decoding backend)."""
    draft: DraftConfig
    data: DataConfig
    distill: DistillConfig
    train: TrainConfig
    tracking: TrackingConfig
    resolved: dict[str, Any]
    """The whole resolved config as a dict, logged to W&B."""
    resolved_yaml: str
    """The same as YAML: config.yaml of the run and of every checkpoint."""
    fingerprint: str
    """Hash of the settings that decide what is trained: the DONE marker's content."""
    config_drift: Callable[[dict], list[str]]
    """The dotted keys where a checkpoint's saved config (a dict) differs from this run's and forbids a resume."""
