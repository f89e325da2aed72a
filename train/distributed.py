"""The multi-process pieces of the distillation recipe: process group and precision settings, FSDP teacher sharding,
FSDP-aware gradient norms and best/ saves, and DeepSpeed (ZeRO-1/2).

    N GPUs (FSDP):     accelerate launch --config_file configs/accelerate/fsdp.yaml --num_processes N \
                           -m specdistill distill configs/llama-3.1-8b.yaml
                       (the teacher is then sharded too: train.shard_teacher, see `shard_teacher`)
    N GPUs (ZeRO-2):   accelerate launch --config_file configs/accelerate/deepspeed_zero2.yaml --num_processes N \
                           -m specdistill distill configs/llama-3.1-8b.yaml       (see `configure_deepspeed`)

The recipe (train/loop.py) calls each of these once, at a named point; with one process or plain DDP they return
at once or are not called.
"""

from __future__ import annotations

import copy
import os
import warnings
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType, InitProcessGroupKwargs, gather_object
from peft import PeftModel, get_peft_model
from torch import Tensor, nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)

from distill.batches import token_runs
from distill.students import merge_student
from specdec_runtime.errors import UserError
from specdec_runtime.loading import resolve_dtype
from train.checkpoint import ZERO_KEY, ZERO_RANKS, begin_staging, staging_dir, zero_file
from train.config import TrainConfig

# ----------------------------------------------------------------------------------------------------------------
# Process group and precision


def process_group_kwargs(timeout_minutes: float, *, gloo: bool = False) -> list[InitProcessGroupKwargs]:
    """The Accelerator's kwargs_handlers: train.timeout_minutes as the process-group timeout (NCCL's default of 10
    minutes kills a run whose rank 0 converts the target while the others wait), and gloo named where DeepSpeed runs
    without CUDA. They apply when the recipe creates the process group; the CLI creates it first
    (`specdistill.pipeline.dist_state`), with the same timeout."""
    timeout = timedelta(minutes=timeout_minutes)
    return [
        InitProcessGroupKwargs(backend="gloo", timeout=timeout) if gloo else InitProcessGroupKwargs(timeout=timeout)
    ]


def reset_accelerator_state() -> None:
    """Drop this process's AcceleratorState before a recipe creates its Accelerator; the process group
    (PartialState) stays. accelerate keeps one AcceleratorState per process and refuses an Accelerator with other
    settings (a second candidate with another mixed_precision). A private accelerate call, checked with accelerate
    1.15; GradientState takes the new accumulation.

    accelerate also writes the state's type into PartialState, and a new AcceleratorState reads it back: FSDP there
    skips the branch that sets up the FSDP plugin (`state.fsdp_plugin` missing, a crash in `prepare`). The launch's
    own type, the one that branch turns into FSDP, is put back."""
    from accelerate import PartialState
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=False)
    if PartialState._shared_state.get("distributed_type") == DistributedType.FSDP:
        PartialState._shared_state["distributed_type"] = DistributedType.MULTI_GPU


def fsdp_plugin(mixed_precision: str):
    """The FSDP plugin of an `accelerate launch` with an FSDP config file (None without one), from the launcher's
    settings as accelerate would build it, except that in bf16 FSDP2 reduces gradients in fp32.

    accelerate's own policy casts params, gradient reduction and outputs alike to bf16, so gradients accumulated over
    train.grad_accum micro-batches and averaged over ranks are summed in bf16, where DDP keeps fp32 gradients.
    accelerate keeps a policy that is already set (`set_mixed_precision` without override)."""
    if os.environ.get("ACCELERATE_USE_FSDP", "false").lower() != "true":
        return None
    from accelerate.utils import FullyShardedDataParallelPlugin

    plugin = FullyShardedDataParallelPlugin()
    if mixed_precision == "bf16" and plugin.fsdp_version == 2 and plugin.mixed_precision_policy is None:
        from torch.distributed.fsdp import MixedPrecisionPolicy

        bf16 = torch.bfloat16
        plugin.mixed_precision_policy = MixedPrecisionPolicy(
            param_dtype=bf16, reduce_dtype=torch.float32, output_dtype=bf16
        )
    return plugin


def training_dtype(setting: str, device: torch.device) -> str:
    """target.dtype resolved for the device the model runs on, wherever it is loaded: `auto` is bf16 for a teacher
    loaded on the CPU to be sharded onto GPUs, as for one loaded on a GPU (and a bf16 file loaded in bf16 stays
    memory-mapped, one page-cache copy for all ranks; an fp32 upcast is a private copy per rank)."""
    return str(resolve_dtype(setting, str(device))).removeprefix("torch.")


def global_norm(norm: Tensor | float) -> float:
    """A gradient norm as one float, the same on every process. Under FSDP2 it is a DTensor, whose float() can be
    this rank's partial norm (a `_NormPartial` placement): the logged grad_norm would be wrong, and the non-finite
    check could stop one rank while the others wait in the next collective."""
    from torch.distributed.tensor import DTensor

    return float(norm.full_tensor() if isinstance(norm, DTensor) else norm)


def prepare(accelerator: Accelerator, student: nn.Module, optimizer, train_cfg: TrainConfig) -> tuple:
    """accelerator.prepare(student, optimizer), then `check_grad_accum` (DeepSpeed's config may replace it here).

    FSDP2's CPU-RAM-efficient loading (fsdp.yaml) moves the student to the meta device and broadcasts rank 0's state
    dict into the shards, and it handles parameters only: a persistent buffer (an EAGLE-3 head's d2t / t2d) fails
    with "'Tensor' object has no attribute 'device_mesh'". Every process builds the same full student (seeded), so
    such a student is sharded from its own copy instead."""
    plugin = accelerator.state.fsdp_plugin if accelerator.distributed_type == DistributedType.FSDP else None
    params = {name for name, _ in student.named_parameters(remove_duplicate=False)}
    if plugin is not None and set(student.state_dict()) - params:
        plugin.cpu_ram_efficient_loading = False
    prepared = accelerator.prepare(student, optimizer)
    check_grad_accum(accelerator, train_cfg)
    return prepared


def passes(accelerator: Accelerator, batch: dict[str, Tensor], max_tokens: int) -> int:
    """With a token bound (train.max_micro_batch_tokens) on several processes: the most passes (`token_runs`) any
    process's batch needs, which every process then runs (`split_by_tokens(passes=)`), since each forward may hold a
    collective (DDP's buffer broadcast, FSDP's gathers). 0 otherwise."""
    if not max_tokens or accelerator.num_processes == 1:
        return 0
    mine = len(token_runs(batch["attention_mask"].sum(1).tolist(), max_tokens))
    return int(accelerator.gather(torch.tensor([mine], device=accelerator.device)).max())


def backward(accelerator: Accelerator, model: nn.Module, loss: Tensor, *, sync: bool = True) -> None:
    """accelerator.backward(loss), or with sync=False a backward that only adds to the local gradients, for the
    passes of a micro-batch before its last (`train.max_micro_batch_tokens`): the micro-batch's last pass then syncs
    (or, under `accumulate`, leaves it to the window's last micro-batch) as one pass would. Under DeepSpeed
    accelerate's backward steps the engine when the window syncs, and its `no_sync` does nothing from ZeRO-2 on, so
    the pass goes to the engine with the accumulation boundary unset; elsewhere `no_sync` (DDP, FSDP1, FSDP2)."""
    if sync:
        accelerator.backward(loss)
    elif accelerator.distributed_type == DistributedType.DEEPSPEED:
        accelerator.deepspeed_engine_wrapped.backward(loss, sync_gradients=False)
    else:
        with accelerator.no_sync(model):
            accelerator.backward(loss)


# ----------------------------------------------------------------------------------------------------------------
# Teacher placement


def should_shard_teacher(setting: str, distributed_type: DistributedType, *, world: int, cache: bool) -> bool:
    """train.shard_teacher resolved: auto shards exactly when accelerate shards the student (FSDP). There is nothing
    to shard with one process or without a teacher in memory (offline cache)."""
    if cache or world < 2:
        return False
    return setting == "always" or (setting == "auto" and distributed_type == DistributedType.FSDP)


def shard_teacher(teacher, device: torch.device, world: int) -> str:
    """Shard the teacher's weights over all `world` processes with FSDP2, in place, for inference only.

    Each decoder layer (the model's `_no_split_modules` classes) becomes one FSDP unit, and so do untied input
    embeddings and output head; the rest (final norm; a tied embedding/head) is the root unit, gathered for the whole
    forward. A forward gathers the other units one at a time and frees each after (reshard_after_forward), so a
    process holds 1/world of the teacher plus the root unit and one gathered unit, and the logits are those of the
    full model. The parameters move to `device` shard by shard: load the teacher on the CPU first and the device
    never holds a full copy. Every process must run the same number of teacher forwards (each one is a collective).
    Returns a one-line summary for the log.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, fully_shard

    if isinstance(teacher, FSDPModule):
        raise ValueError("the teacher passed to distill() is already sharded; pass the unsharded model")
    total = sum(p.numel() for p in teacher.parameters())
    teacher.requires_grad_(False)
    mesh = init_device_mesh(device.type, (world,))
    for module in shard_units(teacher):
        fully_shard(module, mesh=mesh, reshard_after_forward=True)
    fully_shard(teacher, mesh=mesh, reshard_after_forward=True)
    local = sum(p.to_local().numel() for p in teacher.parameters())
    return f"teacher sharded over {world} processes (FSDP2): {local:,} of {total:,} parameters on this one"


def shard_units(teacher: nn.Module) -> list[nn.Module]:
    """The teacher's FSDP2 units besides the root, children before parents (post-order): `fully_shard` on a parent
    claims the parameters of every submodule not yet sharded, so a nested unit must be sharded first. Units: the
    `_no_split_modules` classes, and untied input embeddings and output head (a tied pair shares one tensor, which
    can live in one unit only: the root)."""
    unit_names = set(getattr(teacher, "_no_split_modules", None) or [])
    embeddings, head = teacher.get_input_embeddings(), teacher.get_output_embeddings()
    untied = embeddings is not None and head is not None and head.weight is not embeddings.weight
    extra = {id(embeddings), id(head)} if untied else set()
    return [m for m in _post_order(teacher) if m is not teacher and (type(m).__name__ in unit_names or id(m) in extra)]


def _post_order(module: nn.Module, seen: set[int] | None = None) -> Iterator[nn.Module]:
    seen = set() if seen is None else seen
    if id(module) in seen:
        return
    seen.add(id(module))
    for child in module.children():
        yield from _post_order(child, seen)
    yield module


# ----------------------------------------------------------------------------------------------------------------
# best/ under FSDP


def best_model(student, full_state: dict | None) -> tuple[nn.Module, dict | None]:
    """(model, state dict) for best/ on the main process, after every process took part in gathering `full_state`
    (None without FSDP). A LoRA student is merged into a copy, and under FSDP that copy is built on the CPU from the
    gathered weights: merging the sharded module itself would run collectives on one rank (a hang)."""
    if not isinstance(student, PeftModel):
        return student, full_state
    if full_state is None:
        return merge_student(student), None
    return merged_from_state(student, full_state), None


def merged_from_state(student: PeftModel, full_state: dict[str, Tensor]) -> nn.Module:
    """A plain CPU model with `student`'s LoRA adapters merged, built from its full state dict: the structure on the
    meta device, the gathered tensors assigned into it, the buffers a state dict lacks (non-persistent, e.g. rotary
    frequencies; FSDP2 never shards buffers) copied from `student`."""
    base = student.get_base_model()
    name = student.active_adapter
    with torch.device("meta"), warnings.catch_warnings():
        # peft probes a property transformers 5 deprecated; nothing for users to fix
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing", category=FutureWarning)
        fresh = get_peft_model(type(base)(copy.deepcopy(base.config)), copy.deepcopy(student.peft_config[name]))
    _, unexpected = fresh.load_state_dict(full_state, strict=False, assign=True)
    live = dict(student.named_buffers())
    for key, buffer in list(fresh.named_buffers()):
        if buffer.is_meta and key in live:
            owner, _, leaf = key.rpartition(".")
            fresh.get_submodule(owner)._buffers[leaf] = live[key].detach().to("cpu", copy=True)
    merged = fresh.merge_and_unload()
    merged.tie_weights()
    left = [key for key, t in [*merged.named_parameters(), *merged.named_buffers()] if t.is_meta]
    if left or unexpected:
        raise RuntimeError(f"the gathered state does not fill the merged student: missing {left[:3]}, extra "
                           f"{unexpected[:3]}")  # fmt: skip
    return merged.eval()


# ----------------------------------------------------------------------------------------------------------------
# Resume agreement


def check_same_checkpoint(path: Path | None, root: Path) -> None:
    """Every rank read its checkpoint files itself (under DeepSpeed its own partition): all must resume the same
    step, or none. A collective: every process calls it."""
    picked = set(gather_object([str(path) if path else "none"]))
    if len(picked) > 1:
        raise UserError(
            f"the processes found different checkpoints to resume from ({', '.join(sorted(picked))}): a file "
            f"only some ranks read is unreadable; delete the newest step folder in {root} and run again"
        )


# ----------------------------------------------------------------------------------------------------------------
# DeepSpeed (ZeRO-1/2 through `accelerate launch --config_file configs/accelerate/deepspeed_zero2.yaml`)


def deepspeed_requested() -> bool:
    """`accelerate launch` with a DeepSpeed config file exports this; the Accelerator then runs DeepSpeed."""
    return os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true"


def check_deepspeed_device(target_device: str) -> None:
    """DeepSpeed never runs with cpu=True: it takes the GPUs whatever target.device says (refused here), and without
    CUDA its CPU accelerator, where gloo must be named (`process_group_kwargs`)."""
    if target_device == "cpu" and torch.cuda.is_available():
        raise UserError(
            "DeepSpeed takes this machine's GPUs whatever target.device says: drop target.device=cpu, or launch "
            "without the DeepSpeed config file"
        )


def check_grad_accum(accelerator: Accelerator, train_cfg: TrainConfig) -> None:
    """train.grad_accum is the accumulation the loss is scaled for; accelerate lets a launcher config (the
    ACCELERATE_GRADIENT_ACCUMULATION_STEPS variable, or DeepSpeed's gradient_accumulation_steps) replace it."""
    if accelerator.gradient_accumulation_steps != train_cfg.grad_accum:
        raise UserError(
            f"the launcher config sets gradient_accumulation_steps={accelerator.gradient_accumulation_steps} but "
            f"train.grad_accum={train_cfg.grad_accum}: remove gradient_accumulation_steps from the accelerate / "
            "DeepSpeed config file (train.grad_accum sets it)"
        )


def configure_deepspeed(plugin, train_cfg: TrainConfig) -> None:
    """Fill the DeepSpeed config from train.* before `prepare`.

    The loop passes no DataLoader to `prepare`, so the micro-batch size is set here. DeepSpeed clips inside its own
    step (accelerator.clip_grad_norm_ only reports the norm), so train.max_grad_norm becomes its gradient_clipping.
    The accumulation steps come from the Accelerator. ZeRO-3 is refused: it shards the student's weights, which
    the checkpoint and on-policy code here do not gather; FSDP does that (configs/accelerate/fsdp.yaml).
    """
    if plugin.zero_stage == 3:
        raise UserError(
            "DeepSpeed ZeRO-3 is not supported by `specdistill distill`: use zero_stage 1 or 2 "
            "(configs/accelerate/deepspeed_zero2.yaml), or configs/accelerate/fsdp.yaml to shard the student"
        )
    plugin.deepspeed_config["train_micro_batch_size_per_gpu"] = train_cfg.batch_size
    plugin.deepspeed_config["gradient_clipping"] = train_cfg.max_grad_norm


# ----------------------------------------------------------------------------------------------------------------
# Optimizer state I/O: one full file, or one ZeRO partition per rank


def optimizer_state(student, optimizer, *, deepspeed: bool, root: Path, step: int, is_main: bool) -> dict | None:
    """The optimizer state for the main process to checkpoint (a collective: every process calls it).

    DDP / FSDP / 1 process: the full state keyed by parameter name, gathered on the main process's CPU: the same
    file whatever the process count. DeepSpeed: each rank writes ZeRO's own partition (its fp32 master weights and
    Adam moments) into the step's staging folder itself, and None is returned.
    """
    if not deepspeed:
        return get_optimizer_state_dict(
            student, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
        )
    if is_main:
        begin_staging(root, step)
    torch.distributed.barrier()
    rank = torch.distributed.get_rank()
    torch.save(_to_cpu(student.optimizer.state_dict()), staging_dir(root, step) / zero_file(rank))
    torch.distributed.barrier()
    return None


def _to_cpu(tree: Any) -> Any:
    """`tree` (dicts, lists, tuples of tensors and other values) with every tensor copied to the CPU."""
    if isinstance(tree, Tensor):
        return tree.cpu()
    if isinstance(tree, dict):  # a shallow copy keeps the mapping's type (OrderedDict, defaultdict)
        out = copy.copy(tree)
        for key, value in tree.items():
            out[key] = _to_cpu(value)
        return out
    if isinstance(tree, tuple) and hasattr(tree, "_fields"):  # a namedtuple
        return type(tree)(*(_to_cpu(v) for v in tree))
    if isinstance(tree, list | tuple):
        return type(tree)(_to_cpu(v) for v in tree)
    return tree


def load_optimizer_state(student, optimizer, saved: dict, *, deepspeed: bool, world: int, path: Path) -> None:
    """Restore what `optimizer_state` saved into the prepared student's optimizer."""
    if deepspeed != (ZERO_KEY in saved):
        written, now = ("DeepSpeed", "without") if ZERO_KEY in saved else ("without DeepSpeed", "under DeepSpeed")
        raise UserError(
            f"checkpoint {path} holds an optimizer state written {written}, and this run is {now} it: resume with "
            "the launcher config it was written with, or set train.resume=false to start over"
        )
    if not deepspeed:
        set_optimizer_state_dict(student, optimizer, saved, options=StateDictOptions(full_state_dict=True))
        return
    if saved[ZERO_RANKS] != world:
        raise UserError(
            f"checkpoint {path} holds DeepSpeed ZeRO optimizer partitions of {saved[ZERO_RANKS]} processes and this "
            f"run has {world}: resume with {saved[ZERO_RANKS]} processes, or set train.resume=false to start over"
        )
    # DeepSpeed reads the entry of its own rank only (a rigid ZeRO-1/2 checkpoint). From the fp32 masters in the
    # checkpoint, not the (possibly bf16) weights: the resume is exact.
    rank = torch.distributed.get_rank()
    partitions = [saved[ZERO_KEY] if r == rank else None for r in range(world)]
    student.optimizer.load_state_dict(partitions, load_optimizer_states=True, load_from_fp32_weights=True)
