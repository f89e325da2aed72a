"""Decoding backends: the model the engine decodes with, the name reports give it, and the batches it is timed on.

`fast_model` turns a loaded model into the one `engine.generate` runs:

- CUDA, Llama family: the compact model of `llama.py` in bf16 with a static KV cache and CUDA graphs for the decode
  and verify steps (`compact-static-cache+cuda-graphs`);
- CPU, Llama family: the compact model's fast CPU path (`cpu.cpu_model`: fused weights in the layouts timed fastest
  on this machine, `BackendOptions.cpu_layouts`; `compact-static-cache+cpu-fused`), its steps compiled by Inductor
  on request (`cpu.compile_steps`; `compact-static-cache+cpu-fused+inductor-frozen`);
- an EAGLE-3 head stays a head (the engine pairs it with the target's states), laid out for the CPU there;
- anything else: the HF model as given (`hf-eager`).

`BackendOptions` is the user's choice on the CPU (the config's `target.cpu_fast_path` / `target.cpu_compile`,
`TargetConfig.backend`); `eval`, `bench` and the data stage all choose through `fast_model` and record
`backend_name` in their JSON.

    target = fast_model(hf_target, BackendOptions(cpu_compile=True))
    draft = fast_model(hf_draft, BackendOptions(cpu_compile=True), draft=True)
    backend_name(target)   # 'compact-static-cache+cpu-fused+inductor-frozen'
"""

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Literal

import torch
from transformers import LlamaForCausalLM

from .cpu import CPU_BACKEND, CPU_COMPILED_BACKEND, compile_steps, compiled_layouts, cpu_eagle3, cpu_model, draft_dtype
from .cpu_tune import DEFAULT_ROWS, MODES, check_rows, decode_floor_s, layout_summary, machine_info
from .eagle3 import Eagle3Draft
from .llama import Llama
from .metrics import Phases


@dataclass(frozen=True)
class BackendOptions:
    """How to decode on the CPU (CUDA always takes the compact model with its graphs)."""

    cpu_fast_path: bool = True
    """Decode Llama-family models through the fast CPU path (`cpu.cpu_model`); False: the HF models, eager."""
    cpu_compile: bool = False
    """Also compile the fast path's decode and verify steps with Inductor (`cpu.compile_steps`, autotuned); the
    weights are then oneDNN-packed whatever `cpu_layouts` says (`cpu.compiled_layouts`): Inductor times the GEMM
    kernels of each graph itself."""
    cpu_layouts: Literal["auto", "tune", "rule"] = "auto"
    """How the fast path lays out its weights (`cpu_tune`): auto = the layouts timed fastest on this machine, from
    its cached plan (timed at the first load, a few seconds); tune = time them again; rule = the fixed rule."""
    cpu_layout_rows: tuple[int, ...] = DEFAULT_ROWS
    """GEMM row counts (batch x tokens per step) the layouts are planned for; others take the nearest one's."""

    def __post_init__(self) -> None:
        if self.cpu_compile and not self.cpu_fast_path:
            raise ValueError(
                "target.cpu_compile compiles the CPU fast path's steps, but target.cpu_fast_path is false: "
                "set target.cpu_fast_path=true or target.cpu_compile=false"
            )
        if self.cpu_layouts not in MODES:
            raise ValueError(f"cpu_layouts={self.cpu_layouts!r}: use one of {', '.join(MODES)}")
        object.__setattr__(self, "cpu_layout_rows", check_rows(self.cpu_layout_rows))  # frozen: sorted, unique


@dataclass
class TargetConfig:
    """The config's `target` section: the target model, how it is loaded, and its decoding backend (`backend`)."""

    model: str = "embedded:smollm2-135m-instruct"
    """Target model spec: an HF id, a local HF folder, a .gguf file, or embedded:smollm2-135m-instruct."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """Weights dtype; auto = float32 on CPU, bfloat16 on CUDA."""
    device: str = "auto"
    """Device to run the target on: auto (cuda if available, else cpu), cpu, cuda, cuda:1, ..."""
    trust_remote_code: bool = False
    """Run modelling code shipped with the checkpoint. Off by default: it executes arbitrary Python."""
    allow_pickle: bool = False
    """Allow pickle `.bin` weights (arbitrary code on load); safetensors only by default."""
    cpu_fast_path: bool = True
    """On the CPU, decode Llama-family models through the runtime's fast CPU path (compact model, static cache, fused
    pre-packed weights: specdec_runtime/cpu.py) in the data stage and eval; false decodes with the HF models."""
    cpu_compile: bool = False
    """On the CPU fast path, also compile the decode and verify steps of the target and of standalone drafts with
    Inductor (`cpu.compile_steps`): ~1.3x faster steps after ~30 s of compiling per graph and model the first time a
    process sees it, and up to one more copy of the weights per graph (docs/runtime.md); pays in long eval sweeps
    and serving processes. Needs cpu_fast_path."""
    cpu_layouts: Literal["auto", "tune", "rule"] = "auto"
    """On the CPU fast path, how the weights are laid out (specdec_runtime/cpu_tune.py): auto = per weight shape and
    row count the layout timed fastest on this machine (timed once, a few seconds, then cached per machine in the
    model cache), tune = time them again (after a hardware or torch change, on an idle machine), rule = the fixed
    rule of earlier releases (transposed weights up to 4 rows, oneDNN-packed above)."""

    def __post_init__(self) -> None:
        BackendOptions(self.cpu_fast_path, self.cpu_compile, self.cpu_layouts)  # raises on a bad combination

    @property
    def backend(self) -> BackendOptions:
        """The decoding backend these keys choose (`fast_model`)."""
        return BackendOptions(self.cpu_fast_path, self.cpu_compile, self.cpu_layouts)


def fast_model(
    model: torch.nn.Module, backend: BackendOptions = BackendOptions(), *, draft: bool = False
) -> torch.nn.Module:
    """The model the engine decodes `model` with (module docstring).

    On the CPU fast path a target keeps fp32 numerics and a draft (`draft=True`) takes `cpu.draft_dtype()`, both
    laid out as `backend.cpu_layouts` says for `backend.cpu_layout_rows`; the steps are compiled when
    `backend.cpu_compile` (CUDA has its graphs instead). An EAGLE-3 head stays an
    `Eagle3Draft`: on the CPU fast path a copy with its linears laid out once (`cpu.cpu_eagle3`, eager), elsewhere
    as it is. Any other model is returned as is.
    """
    if isinstance(model, Eagle3Draft):
        on_cpu = model.fc.weight.device.type == "cpu"
        fast = on_cpu and backend.cpu_fast_path and not model.cpu_fast
        return cpu_eagle3(model, draft_dtype(), backend.cpu_layouts, backend.cpu_layout_rows) if fast else model
    if not isinstance(model, LlamaForCausalLM) or Llama.unsupported(model) is not None:
        return model  # e.g. another activation or a length-dependent rope: the generic HF path decodes it
    if model.device.type == "cuda":
        return Llama.from_hf(model, dtype=torch.bfloat16)
    if model.device.type == "cpu" and backend.cpu_fast_path:
        dtype = draft_dtype() if draft else torch.float32
        if backend.cpu_compile:  # Inductor's autotuner chooses the GEMM kernels of packed weights itself
            return compile_steps(cpu_model(model, dtype, compiled_layouts(dtype), backend.cpu_layout_rows))
        return cpu_model(model, dtype, backend.cpu_layouts, backend.cpu_layout_rows)
    return model


def backend_name(model: torch.nn.Module) -> str:
    """Which decoding backend a model runs (`settings.backend` in the bench and eval JSON): the compact
    static-cache model (CUDA graphs on CUDA, fused CPU layouts on the CPU fast path) or HF eager."""
    if isinstance(model, Llama):
        if model.cpu_fast:
            return CPU_COMPILED_BACKEND if model.compiled_step is not None else CPU_BACKEND
        return "compact-static-cache+cuda-graphs" if model.device.type == "cuda" and model.use_graphs else "compact"
    return "hf-eager"


def plan_rows(backend: BackendOptions, batch_size: int, widths: Iterable[int]) -> BackendOptions:
    """`backend` with its planned GEMM rows extended to the steps a run makes: each width (tokens per forward: 1,
    gamma + 1, a tree's nodes + 1) at one row and at the full batch; the row counts a shrinking batch passes
    through in between take the nearest planned one's layout."""
    extra = {b * w for w in widths for b in (1, batch_size)}
    return replace(backend, cpu_layout_rows=tuple(sorted({*backend.cpu_layout_rows, *extra})))


def machine_block(target: torch.nn.Module, draft, target_only: Phases) -> dict:
    """`machine` of the bench JSON and the eval report: what the numbers were measured on (`cpu_tune.machine_info`:
    CPU, ISA flags, cores, threads, torch, probed bandwidth) and, for a target on the CPU, how close its decode step
    (the target's forward: `verify_s` per forward of the target-only arm's pooled phases) comes to the
    weight-streaming floor (`cpu_tune.decode_floor_s`; at batch size B the B rows of a step share one read of the
    weights); the fast path's layouts per shape and row count, and how they were chosen."""
    on_cpu = target.device.type == "cpu"
    info = machine_info(probe=on_cpu)  # the probe measures host memory: no floor for a target on a GPU
    step = target_only.verify_s / target_only.verify_forwards if target_only.verify_forwards else None
    floor = decode_floor_s(target, info["bandwidth_gb_s"]) if on_cpu and info["bandwidth_gb_s"] else None
    return info | {
        "decode_step_s": step,
        "decode_floor_s": floor,
        "decode_step_over_floor": step / floor if step and floor else None,
        "layouts": {"target": layout_summary(target), "draft": layout_summary(draft)},
        "layout_tuning": {"target": getattr(target, "cpu_tuning", None), "draft": getattr(draft, "cpu_tuning", None)},
    }


def full_units(items: Sequence, batch_size: int) -> list[list]:
    """Consecutive batches of exactly batch_size items (the remainder is left out) -> units."""
    if batch_size > len(items):
        raise ValueError(f"batch size {batch_size} needs at least {batch_size} prompts (got {len(items)})")
    return [list(items[i : i + batch_size]) for i in range(0, len(items) - batch_size + 1, batch_size)]


def longest_unit(units: list[list[list[int]]]) -> int:
    """Index of the unit holding the longest prompt: its warm-up allocates the largest cache any timed call needs."""
    return max(range(len(units)), key=lambda i: max(len(p) for p in units[i]))
