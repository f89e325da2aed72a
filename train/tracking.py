"""Experiment tracking: W&B on the main process, a no-op logger everywhere else.

    tracker = make_tracker(cfg.tracking, run_dir, dump_config(cfg), accelerator.is_main_process, name="quick-fkl")
    tracker.log({"train/loss": 1.9}, step=10)
    tracker.log_table("eval/settings", ["candidate", "speedup"], [["trunc4-fkl", 1.8]])
    tracker.log_artifact(run_dir / "best", name="quick-fkl-best", type="model")
    tracker.finish()

`mode: auto` goes online only when an API key is configured (WANDB_API_KEY, `wandb login`'s netrc or settings),
otherwise offline: the run is kept under `<run_dir>/wandb/` and can be uploaded later with `wandb sync`.
Secrets never reach W&B: config keys that name a key, token, secret or password are dropped before logging.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

from train.config import TrackingConfig

SECRET_WORDS = ("key", "token", "secret", "password")


def is_secret_key(name: str) -> bool:
    """True for `api_key`, `hf_token`, `wandbKey`, `db-password`...; False for `max_new_tokens` or `keep_last`.

    Matched per word (split on `_`, `-`, `.` and camelCase) and by word ending, so count fields such as
    `max_new_tokens` survive while `apikey` or `hf_token` are dropped.
    """
    words = re.split(r"[_\-.\s]+|(?<=[a-z0-9])(?=[A-Z])", name)
    return any(word.lower().endswith(secret) for word in words for secret in SECRET_WORDS)


def strip_secrets(config: Any) -> Any:
    """A copy of a nested dict/list config without the keys `is_secret_key` flags."""
    if isinstance(config, dict):
        return {k: strip_secrets(v) for k, v in config.items() if not is_secret_key(str(k))}
    if isinstance(config, list | tuple):
        return [strip_secrets(v) for v in config]
    return config


class NoOpTracker:
    """Stands in for W&B on non-main ranks and with `tracking.backend: none`."""

    def log(self, metrics: dict[str, float], step: int) -> None:
        pass

    def log_table(self, name: str, columns: list[str], rows: list[list]) -> None:
        pass

    def log_artifact(self, path: Path, name: str, type: str) -> None:
        pass

    def finish(self) -> None:
        pass


class WandbTracker:
    """A thin wrapper over one `wandb.Run`."""

    def __init__(self, run) -> None:
        self.run = run

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.run.log(metrics, step=step)

    def log_table(self, name: str, columns: list[str], rows: list[list]) -> None:
        """One `wandb.Table` under `name`, at the run's current step (a table is a summary, not a curve)."""
        import wandb

        self.run.log({name: wandb.Table(columns=columns, data=rows)})

    def log_artifact(self, path: Path, name: str, type: str) -> None:
        import wandb

        artifact = wandb.Artifact(re.sub(r"[^\w.-]", "-", name), type=type)
        if Path(path).is_dir():
            artifact.add_dir(str(path))
        else:
            artifact.add_file(str(path))
        self.run.log_artifact(artifact)

    def finish(self) -> None:
        self.run.finish()


def resolve_mode(mode: str) -> str:
    """auto -> online when W&B credentials are configured, offline otherwise (never prompts)."""
    if mode != "auto":
        return mode
    if os.environ.get("WANDB_MODE"):  # the user's explicit environment wins over our guess
        return os.environ["WANDB_MODE"]
    if os.environ.get("WANDB_API_KEY"):
        return "online"
    import wandb

    # The public way to ask "is a key configured?" without a prompt or a network round trip.
    return "online" if wandb.login(prompt=False, verify=False) else "offline"


def make_tracker(
    cfg: TrackingConfig, run_dir: Path, run_config: dict, is_main: bool, *, name: str | None = None
) -> NoOpTracker | WandbTracker:
    """W&B run in `run_dir` (main process, backend wandb) or a no-op; `name` is used when `cfg.run_name` is None."""
    if not is_main or cfg.backend == "none":
        return NoOpTracker()
    import wandb

    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    run = wandb.init(
        dir=str(run_dir),
        project=cfg.project,
        entity=cfg.entity,
        name=cfg.run_name or name,
        config=strip_secrets(run_config),
        mode=resolve_mode(cfg.mode),
        reinit="create_new",  # candidates train one after another in one process, one run each
    )
    return WandbTracker(run)
