"""Checkpoint I/O for the distillation loop: atomic step folders, keep-last-K, the best model, exact resume.

Layout, with <cand> = <output_dir>/candidates/<name>:

    <cand>/checkpoints/step-000123/
        model.safetensors, config.json      the student (save_pretrained); a LoRA student keeps its adapters
                                            unmerged (adapter_model.safetensors + adapter_config.json) so they train on
        tokenizer files
        optimizer.pt, scheduler.pt          torch state dicts (the optimizer's full state, keyed by parameter name)
        optimizer-zero-rankNNN.pt           instead of optimizer.pt under DeepSpeed: ZeRO's partition of each rank,
                                            written by that rank (nothing is gathered on one device or host)
        rng.json                            python, numpy, torch and CUDA RNG states, one entry per rank (plain
                                            JSON: reading it runs no code, unlike a pickle)
        trainer_state.json                  step, data position, best metric, metrics history
        config.yaml                         the resolved config the run was started with
        COMPLETE                            written last: a folder without it is half-written and never resumed
    <cand>/best/                            merged HF model + tokenizer + metrics.json (highest expected_acceptance)
    <cand>/lora_base/                       LoRA on a truncated student: its frozen base (HF model), written once,
                                            so the adapter-only step checkpoints can be evaluated and exported
    <cand>/DONE                             the finished run's config fingerprint

Every folder is written under a temporary name and renamed into place (`specdec_runtime.atomic`), so a killed run
leaves either the old state or the new one. Only the main process calls the writers.
"""

from __future__ import annotations

import json
import random
import shutil
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from peft import PeftModel, set_peft_model_state_dict
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file

from specdec_runtime import atomic
from specdec_runtime.errors import UserError

MARKER = "COMPLETE"
PREFIX = "step-"
MODEL_FILE = "model.safetensors"
# The optimizer state of a DeepSpeed run as read back by one rank: {ZERO_KEY: its partition, ZERO_RANKS: how many}.
ZERO_KEY, ZERO_RANKS = "zero_partition", "zero_ranks"
ADAPTER_FILE = "adapter_model.safetensors"
NO_FIT_FIX = (
    "the checkpoint was written for another draft: set train.resume=false to start over, or use another output_dir"
)


class CorruptCheckpointError(UserError):
    """A checkpoint folder cannot be resumed from; the message says which file and why."""


@dataclass
class TrainerState:
    """Loop position and bookkeeping, saved as trainer_state.json."""

    step: int = 0
    """Optimizer steps done."""
    epoch: int = 0
    """Epoch of the next global batch."""
    batch: int = 0
    """Index of the next global batch within its epoch."""
    best_metric: float | None = None
    """Highest validation expected_acceptance so far."""
    best_step: int | None = None
    """Step of `best_metric` (the weights in best/)."""
    last_eval_step: int | None = None
    """Step of the last validation, so a resumed finished run does not validate twice."""
    world_size: int = 1
    """Processes that wrote the checkpoint (the RNG states are per rank)."""
    global_batch: int = 0
    """Sequences per optimizer step when the checkpoint was written (the unit of `batch`)."""
    history: list[dict[str, Any]] = field(default_factory=list)
    """Every validation row logged so far."""


@dataclass
class Checkpoint:
    """A loaded checkpoint, read completely so a corrupt file is found before anything is restored."""

    path: Path
    """The step folder."""
    state: TrainerState
    """trainer_state.json."""
    model: dict[str, torch.Tensor]
    """Student weights (adapter weights only for a LoRA student)."""
    optimizer: dict
    """Optimizer state dict."""
    scheduler: dict
    """LR scheduler state dict."""
    rng: list[dict]
    """RNG states, indexed by rank."""
    config_yaml: str
    """The resolved config the checkpoint was trained with."""


def step_dir(root: Path, step: int) -> Path:
    return root / f"{PREFIX}{step:06d}"


def _step_of(path: Path) -> int:
    return int(path.name.removeprefix(PREFIX))


def _step_dirs(root: Path) -> list[Path]:
    """Step folders under `root`, newest first."""
    dirs = [p for p in root.glob(f"{PREFIX}*") if p.is_dir() and p.name.removeprefix(PREFIX).isdigit()]
    return sorted(dirs, key=_step_of, reverse=True)


# ----------------------------------------------------------------------------------------------------------------
# Model weights


def write_model(folder: Path, model, state_dict: dict | None, tokenizer) -> None:
    """save_pretrained of the (unwrapped) student; `state_dict` is the gathered full state under FSDP, else None."""
    model.save_pretrained(folder, state_dict=state_dict)
    if isinstance(model, PeftModel):  # peft writes only the adapters; keep the architecture next to them
        model.get_base_model().config.save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def apply_model_state(model, state: dict[str, torch.Tensor]) -> None:
    """Load checkpoint weights into the plain (not yet prepared) student, refusing missing or unknown keys."""
    if isinstance(model, PeftModel):
        result = set_peft_model_state_dict(model, state)
        if result.unexpected_keys:
            raise CorruptCheckpointError(
                f"adapter weights do not fit the student: {result.unexpected_keys[:3]}; {NO_FIT_FIX}"
            )
        return
    missing, unexpected = model.load_state_dict(state, strict=False)
    # save_pretrained stores a tied head once; its twin shares the loaded tensor's storage.
    own = model.state_dict()
    loaded = {own[name].data_ptr() for name in state if name in own}
    untied = [name for name in missing if own[name].data_ptr() not in loaded]
    if untied or unexpected:
        raise CorruptCheckpointError(
            f"weights do not fit the student: missing {untied[:3]}, extra {unexpected[:3]}; {NO_FIT_FIX}"
        )


# ----------------------------------------------------------------------------------------------------------------
# RNG


def rng_state() -> dict:
    """This process's RNG states: python, numpy, torch CPU and its own CUDA device (not every visible one: a resume
    may see fewer devices per process)."""
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def rng_to_json(state: dict) -> dict:
    """One process's RNG states as JSON values (ints and floats only)."""
    version, internal, gauss = state["python"]
    name, keys, pos, has_gauss, cached = state["numpy"]
    out = {
        "python": [version, list(internal), gauss],
        "numpy": [name, np.asarray(keys).tolist(), int(pos), int(has_gauss), float(cached)],
        "torch": state["torch"].tolist(),
    }
    return out | ({"cuda": state["cuda"].tolist()} if state.get("cuda") is not None else {})


def rng_from_json(data: dict) -> dict:
    """`rng_to_json`'s output -> the states `set_rng_state` takes; a malformed entry raises (TypeError/ValueError)."""
    version, internal, gauss = data["python"]
    name, keys, pos, has_gauss, cached = data["numpy"]
    state = {
        "python": (int(version), tuple(int(i) for i in internal), None if gauss is None else float(gauss)),
        "numpy": (str(name), np.asarray(keys, dtype=np.uint32), int(pos), int(has_gauss), float(cached)),
        "torch": torch.tensor(data["torch"], dtype=torch.uint8),
    }
    return state | ({"cuda": torch.tensor(data["cuda"], dtype=torch.uint8)} if "cuda" in data else {})


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def resume_position(ckpt: Checkpoint, rank: int, world: int, global_batch: int, *, log=print) -> TrainerState:
    """The checkpoint's loop state for this run, with this process's RNG streams restored (when the process count
    is the checkpoint's) and the data position carried over to another global batch."""
    state = ckpt.state
    if state.world_size == world:
        set_rng_state(ckpt.rng[rank])
    else:
        log(
            f"warning: {ckpt.path} holds the RNG streams of {state.world_size} processes, this run has {world}: "
            "the streams restart from the seed"
        )
    if state.global_batch != global_batch:  # another process count: carry the position over
        state.batch = state.batch * state.global_batch // global_batch
        log(f"warning: the global batch changed from {state.global_batch} to {global_batch} sequences")
    state.world_size, state.global_batch = world, global_batch
    return state


def cut_metrics(path: Path, step: int) -> None:
    """Drop the rows of metrics.jsonl logged after `step` (a resumed run logs them again)."""
    if path.is_file():
        rows = [line for line in path.read_text().splitlines() if line and json.loads(line)["step"] <= step]
        atomic.write_text(path, "".join(row + "\n" for row in rows))


# ----------------------------------------------------------------------------------------------------------------
# Step checkpoints


ZERO_GLOB = "optimizer-zero-rank*.pt"


def zero_file(rank: int) -> str:
    return f"optimizer-zero-rank{rank:03d}.pt"


def staging_dir(root: Path, step: int) -> Path:
    """The temporary folder step `step` is written into before it is renamed (`atomic.fresh_tmp_dir`'s name for it);
    every rank can name it."""
    return root / f".tmp-{step_dir(root, step).name}"


def begin_staging(root: Path, step: int) -> Path:
    """An empty staging folder for step `step` (main process only), for the ranks to write their shards into."""
    return atomic.fresh_tmp_dir(root, step_dir(root, step).name)


def save_checkpoint(
    root: Path,
    state: TrainerState,
    *,
    write_model_fn: Callable[[Path], None],
    optimizer: dict | None,
    scheduler: dict,
    rng: list[dict],
    config_yaml: str,
) -> Path:
    """Write `root/step-<state.step>/` atomically (temp folder, COMPLETE last, rename) and return it.

    `optimizer` None: a DeepSpeed run, whose ranks have already written their ZeRO partitions into the staging
    folder (`begin_staging`, then `zero_file(rank)` in it); the rest is added to that folder.
    """
    final = step_dir(root, state.step)
    if optimizer is None:
        tmp = staging_dir(root, state.step)
        if not any(tmp.glob(ZERO_GLOB)):
            raise RuntimeError(f"{tmp} holds no ZeRO partition: every rank must write its own before this call")
    else:
        tmp = atomic.fresh_tmp_dir(root, final.name)
        torch.save(optimizer, tmp / "optimizer.pt")
    write_model_fn(tmp)
    torch.save(scheduler, tmp / "scheduler.pt")
    (tmp / "rng.json").write_text(json.dumps([rng_to_json(r) for r in rng]))
    (tmp / "trainer_state.json").write_text(json.dumps(asdict(state), indent=1))
    (tmp / "config.yaml").write_text(config_yaml)
    (tmp / MARKER).write_text("")
    atomic.replace_dir(tmp, final)
    return final


def newest_complete(root: Path) -> Path | None:
    """The newest step folder with its COMPLETE marker (not checked further)."""
    return next((p for p in _step_dirs(root) if (p / MARKER).is_file()), None)


def prune_checkpoints(root: Path, keep_last: int) -> None:
    """Keep the newest `keep_last` complete step folders; drop older ones and half-written leftovers."""
    for aside in root.glob(".old-*"):  # a step folder a crash left renamed aside goes back first
        atomic.recover_dir(root / aside.name.removeprefix(".old-").rsplit("-", 1)[0])
    complete = [p for p in _step_dirs(root) if (p / MARKER).is_file()]
    keep = set(complete[:keep_last])
    stale = [p for p in _step_dirs(root) if p not in keep]
    stale += [p for p in root.iterdir() if p.is_dir() and p.name.startswith((".tmp-", ".old-"))]
    for path in stale:
        shutil.rmtree(path)


def zero_partition_globals() -> list[type]:
    """The non-tensor classes DeepSpeed (0.19) pickles into a ZeRO-2 optimizer partition: data records (an Enum, a
    dataclass, the loss scaler's attributes), which the weights-only unpickler may rebuild without running code. A
    DeepSpeed that adds another is refused by name (the checkpoint is skipped with the class in the message)."""
    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [ZeroStageEnum, fragment_address, LossScaler]


def read_checkpoint(path: Path, *, adapter: bool, rank: int = 0) -> Checkpoint:
    """Load every file of a step folder (of a DeepSpeed run: `rank`'s own ZeRO partition); raise
    CorruptCheckpointError naming the first unreadable one."""
    if not (path / MARKER).is_file():
        raise CorruptCheckpointError(f"no {MARKER} marker (half-written)")
    name = ""
    try:
        name = "trainer_state.json"
        state = TrainerState(**json.loads((path / name).read_text()))
        name = ADAPTER_FILE if adapter else MODEL_FILE
        model = load_file(path / name)
        zero_ranks = len(list(path.glob(ZERO_GLOB)))
        if zero_ranks:
            # A ZeRO partition holds three DeepSpeed records besides tensors (its stage enum, fragment addresses, the
            # loss scaler): allow-listed for torch's weights-only unpickler, so reading a copied run directory runs no
            # code. A rank the checkpoint has no partition for (more processes now) reads none; the resume then
            # refuses with the process counts.
            name = zero_file(rank)
            with torch.serialization.safe_globals(zero_partition_globals()):
                mine = torch.load(path / name, weights_only=True, mmap=True) if rank < zero_ranks else None
            optimizer = {ZERO_KEY: mine, ZERO_RANKS: zero_ranks}
        else:
            name = "optimizer.pt"
            optimizer = torch.load(path / name, weights_only=True, mmap=True)
        name = "scheduler.pt"
        scheduler = torch.load(path / name, weights_only=True)
        name = "rng.json"
        if (path / "rng.pt").is_file() and not (path / name).is_file():
            raise ValueError("the RNG states are a pickle (rng.pt, an older format), and unpickling runs code")
        rng = [rng_from_json(r) for r in json.loads((path / name).read_text())]
        name = "config.yaml"
        config_yaml = (path / name).read_text()
    except Exception as e:  # any unreadable file (truncated, missing, garbage) makes the folder unusable
        raise CorruptCheckpointError(f"{name}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from e
    return Checkpoint(path, state, model, optimizer, scheduler, rng, config_yaml)


def latest_checkpoint(
    root: Path, *, adapter: bool, rank: int = 0, log: Callable[[str], None] = print
) -> Checkpoint | None:
    """The newest readable complete checkpoint; each skipped newer folder is reported with its reason."""
    skipped = []
    for path in _step_dirs(root):
        try:
            ckpt = read_checkpoint(path, adapter=adapter, rank=rank)
        except CorruptCheckpointError as e:
            log(f"warning: skipping checkpoint {path}: {e}")
            skipped.append(path)
            continue
        if skipped:
            log(f"warning: resuming from the older checkpoint {path} instead of {skipped[0]}")
        return ckpt
    if skipped:
        log(f"warning: no usable checkpoint in {root}; starting from scratch")
    return None


# ----------------------------------------------------------------------------------------------------------------
# best/ and DONE


def save_folder(folder: Path, write_model_fn: Callable[[Path], None]) -> None:
    """Write an HF-format folder atomically (temp folder, then rename)."""
    with atomic.staged_dir(folder) as tmp:
        write_model_fn(tmp)


def save_best(best: Path, write_model_fn: Callable[[Path], None], metrics: dict[str, Any]) -> None:
    """Replace `best/` with a new HF-format folder and its metrics.json, atomically."""

    def write(folder: Path) -> None:
        write_model_fn(folder)
        (folder / "metrics.json").write_text(json.dumps(metrics, indent=1))

    save_folder(best, write)


def write_done(cand: Path, fingerprint: str) -> None:
    atomic.write_text(cand / "DONE", fingerprint)


def best_is_complete(best: Path) -> bool:
    """Whether `best` is what DONE vouches for: an HF folder with a readable config.json and metrics.json and
    weights whose every safetensors file is whole (its header read, its length covering every tensor)."""
    try:
        json.loads((best / "config.json").read_text())
        json.loads((best / "metrics.json").read_text())
        weights = sorted(best.glob("*.safetensors"))
        for path in weights:
            with safe_open(path, "pt") as f:  # raises on a truncated file (incomplete metadata or data)
                f.keys()
        return bool(weights)
    except (OSError, ValueError, SafetensorError):
        return False


def is_done(cand: Path, fingerprint: str) -> bool:
    """True when `cand` holds a finished run of the config with this fingerprint: DONE says so and best/ is whole
    (a best/ that lost its weights is trained to the end again: the recipe resumes and validates anew)."""
    done = cand / "DONE"
    return done.is_file() and done.read_text() == fingerprint and best_is_complete(cand / "best")
