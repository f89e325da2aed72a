"""Weight layouts of the CPU fast path, chosen by timing them on the machine at hand (issue 28), and what that
machine can stream at best.

Which GEMM is fastest for a few rows depends on the CPU: on a 2-core AVX-512 Xeon the transposed (K, N) weight with
`torch.mm` won up to 4 rows and oneDNN's packed weight above; on an AVX-512 + BF16 machine that fixed rule made a
2-token verify cost 1.4x a decode step instead of ~1.1x. So each weight shape of a model (fused qkv, o_proj, gate_up,
down_proj, lm_head; an EAGLE-3 head's linears) gets, per row count the runtime runs (`DEFAULT_ROWS`, or the
caller's), the fastest of these layouts (`LAYOUTS`), as cuDNN's benchmark mode and FFTW's planner do:

- `kn`: the transposed (K, N) fp32 weight, `torch.mm` / `addmm` (MKL's small-M GEMM streams it once);
- `packed`: the fp32 weight pre-packed for oneDNN (`mkldnn._reorder_linear_weight`, the layout Inductor's CPU
  freezing uses), run by `mkldnn._linear_pointwise`;
- `nk`: the row-major (N, K) fp32 weight, `F.linear` (what HF runs);
- `split`: the (K, N) fp32 weight cut along N into one slab per torch thread, (T, K, N / T), run as one `torch.bmm`:
  MKL's small-M GEMM streams a weight on ~one core's bandwidth whatever the threads (2-core AVX2 EPYC: 1 row
  through SmolLM2's weights 10-12 GB/s on 1 or 2 threads, a plain read 23 GB/s on 2), while a batched GEMM gives
  each thread its own slab (16 GB/s, 1 row 33 vs 53 ms); offered only with more than one thread;
- `packed_bf16` (a draft only, where oneDNN has native bf16 GEMMs): the bf16 weight pre-packed the same way;
  `kn_bf16`: a bf16 weight on `torch.mm` where it has not (only for a caller who asks for bf16 there).

A decode step streams every layer's weights from DRAM, so a shape is timed the way it runs: the rows go through all
the layers' weights of that shape in sequence (`TUNE_MAX_BYTES` at most), the candidates interleaved, `TUNE_REPS`
times, and the median wins. The plan is cached per machine (`plan_path`: CPU model and ISA flags, cores, torch
threads, torch version) in the model cache, keyed per (shape, layer count, dtype), so later loads time nothing.
`layouts="rule"` keeps the old fixed rule (`rule_layout`), `"tune"` times again, `"auto"` (default) times only what
the cache lacks; a single layout name forces it on every linear (tests, debugging).

The limit: `probe_bandwidth` reads a 256 MB tensor for ~1 s (GB/s, cached with the plan) and
`decode_floor_s` divides the bytes of weights one decode step reads by it: no decode step can beat that floor, and
`decode step / floor` says how far the fast path is from it. `machine_info` gathers what the bench and eval record.

    plan = Planner("auto", DEFAULT_ROWS)
    choices = plan.choose(WeightSet("gate_up", weights, biases, torch.float32))   # {rows: layout}
    plan.save()
    machine_info()  # {"cpu": ..., "flags": [...], "cores": 2, "torch_threads": 2, "torch": ..., "bandwidth_gb_s": ...}
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cache, partial
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from . import atomic

log = logging.getLogger(__name__)

LAYOUTS = ("kn", "packed", "nk", "split", "packed_bf16", "kn_bf16")
"""Every weight layout a `FusedLinear` can keep (module docstring)."""
LAYOUT_DTYPE = {
    "kn": torch.float32,
    "packed": torch.float32,
    "nk": torch.float32,
    "split": torch.float32,
    "packed_bf16": torch.bfloat16,
    "kn_bf16": torch.bfloat16,
}
"""The dtype each layout stores its weight in and computes in."""
MODES = ("auto", "tune", "rule")
"""`layouts` settings besides a single forced layout: the cached plan else timing, timing afresh, the fixed rule."""
DEFAULT_ROWS = (*range(1, 10), 16, 32)
"""Row counts planned when the caller names none: decode and verify steps up to gamma 8 at batch 1, and two batch
widths; any other row count takes the nearest planned one's layout (`row_table`)."""
TUNE_REPS = 3
"""Timed passes per (shape, rows, layout); the median counts. SmolLM2's 5 shapes x 11 row counts x 3 fp32 layouts
stream its weights up to ~100 times in all (fewer: `CONTENDER`)."""
CONTENDER = 1.5
"""A layout whose first pass took more than this times the fastest first pass is not timed again (its one sample
stands): the repetitions go to the close calls, where noise could flip the choice."""
RULE_MARGIN = 0.10
"""A timed layout replaces the fixed rule's only when it is more than this much faster (`keep_rule`)."""
TUNE_MAX_BYTES = 512 * 2**20
"""At most this many bytes of one shape's weights per layout are timed (its first layers): SmolLM2's largest set
(gate_up, 212 MB) is timed whole, and a larger model's weights stream from DRAM one weight at a time anyway."""
PLAN_VERSION = 4
"""Part of the machine key: a change to the candidates or to how they are timed invalidates cached plans."""
GEMV_ROWS = 4
"""The fixed rule (`rule_layout`): up to this many rows an fp32 GEMM ran on the transposed (K, N) weight, more rows
on the oneDNN-packed copy (measured on a 2-core AVX-512 Xeon, SmolLM2's 30 layers streamed from DRAM, 2 idle
threads, (K, N) vs packed: 1 row 21.3 vs 25.2 ms, 4 rows 29.1 vs 31.2, 8 rows 41.2 vs 33.2, 32 rows 58.0 vs 55.3)."""
ISA_FLAGS = frozenset(
    "fma f16c avx avx2 avx_vnni avx512f avx512bw avx512vl avx512_vnni avx512_bf16 avx512_fp16 "
    "asimd sve sve2 bf16 i8mm".split()  # x86, then arm64
)
"""The /proc/cpuinfo flags that decide which GEMM kernels exist (plus every `amx_*`), kept in the machine key."""
Timer = Callable[[str, str, int, Callable[[], object]], float]
"""(shape key, layout, rows, run) -> seconds of one `run()`: `clock` times it, a test's fake returns set costs."""


# ------------------------------------------------------------------------------------------------------ kernels


@cache
def bf16_native() -> bool:
    """oneDNN runs bf16 GEMMs natively here (AVX-512 BF16 / AMX); elsewhere it would convert per call."""
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def allowed(dtype: torch.dtype) -> tuple[str, ...]:
    """The layouts weights allowed `dtype` may take: a target (float32) keeps fp32 numerics; a draft allowed
    bfloat16 may also take bf16 weights."""
    if dtype == torch.float32:
        return ("kn", "packed", "nk", "split")
    if dtype == torch.bfloat16:
        return ("kn", "packed", "nk", "split", "packed_bf16" if bf16_native() else "kn_bf16")
    raise ValueError(f"the CPU fast path keeps weights in float32 or bfloat16, got {dtype}: pass one of those")


def candidates(dtype: torch.dtype) -> tuple[str, ...]:
    """The layouts timed for weights allowed `dtype`: `allowed`, less `split` with one torch thread (one slab: the
    `kn` GEMM again)."""
    return tuple(name for name in allowed(dtype) if name != "split" or torch.get_num_threads() > 1)


def rule_layout(dtype: torch.dtype, rows: int, gemv: bool = True) -> str:
    """The fixed rule before issue 28 (`GEMV_ROWS`): fp32 (K, N) up to 4 rows else packed (`gemv=False`, the
    output head: packed only); a bf16 draft packed where oneDNN has bf16, else bf16 on `torch.mm`."""
    if dtype == torch.float32:
        return "kn" if gemv and rows <= GEMV_ROWS else "packed"
    return "packed_bf16" if bf16_native() else "kn_bf16"


def lay_out(weight: torch.Tensor, layout: str) -> torch.Tensor:
    """(N, K) weight -> the tensor `layout` runs on (module docstring)."""
    w = weight.detach().to(LAYOUT_DTYPE[layout]).contiguous()
    match layout:
        case "kn" | "kn_bf16":
            return w.t().contiguous()  # (K, N)
        case "packed" | "packed_bf16":
            # the batch-size hint only picks the blocking; one packing served 1..32 rows alike
            return torch.ops.mkldnn._reorder_linear_weight(w, 32)
        case "nk":
            return w
        case "split":
            return split_kn(w, torch.get_num_threads())
    raise ValueError(f"unknown layout {layout!r}: one of {', '.join(LAYOUTS)}")


def split_kn(weight: torch.Tensor, slabs: int) -> torch.Tensor:
    """(N, K) -> (slabs, K, ceil(N / slabs)): slab s holds output columns s * n .. (s + 1) * n - 1, the last one
    padded with zero columns (cut off again by `run_layout`)."""
    N, K = weight.shape
    n = -(-N // slabs)
    padded = torch.cat([weight, weight.new_zeros(slabs * n - N, K)]) if slabs * n > N else weight
    return padded.view(slabs, n, K).transpose(1, 2).contiguous()  # (T, K, n)


def run_layout(
    layout: str, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, out_features: int | None = None
) -> torch.Tensor:
    """x (M, K) in the layout's dtype, w laid out by `lay_out` -> (M, N) in the layout's dtype (`split` pads N to
    a multiple of its slabs: `out_features` cuts the padding off; None keeps every column)."""
    bias = None if bias is None else bias.to(x.dtype)
    match layout:
        case "kn" | "kn_bf16":
            return torch.mm(x, w) if bias is None else torch.addmm(bias, x, w)
        case "packed" | "packed_bf16":
            return torch.ops.mkldnn._linear_pointwise(x, w, bias, "none", [], "")
        case "nk":
            return F.linear(x, w, bias)
        case "split":
            slabs, _, n = w.shape
            y = torch.bmm(x.expand(slabs, *x.shape), w)  # (T, M, n): one slab per thread
            y = y.transpose(0, 1).reshape(x.shape[0], slabs * n)[:, :out_features]  # (M, N)
            return y if bias is None else y.add_(bias)
    raise ValueError(f"unknown layout {layout!r}: one of {', '.join(LAYOUTS)}")


def row_table(plan: dict[int, str]) -> tuple[str, ...]:
    """The layout for 1..max(plan) rows: a planned row count's own, else the nearest planned one's (a tie takes the
    larger); more rows than planned (a prefill) take the largest's."""
    planned = sorted(plan)
    return tuple(plan[min(planned, key=lambda p: (abs(p - m), -p))] for m in range(1, planned[-1] + 1))


class FusedLinear(nn.Module):
    """Several linears on one input as one GEMM -> (..., N1 + N2 + ...), the weight laid out per row count as `plan`
    says ({rows: layout}, unplanned row counts as the nearest planned one: `row_table`).

    Only the layouts the plan uses are kept (the others are None), so a shape whose every row count chose one
    layout holds one copy of its weight. Whatever layout runs, activations enter it in its dtype and leave in
    `dtype` (a bf16 draft's fp32 layouts are cast back), so the caches downstream keep one dtype.
    """

    def __init__(
        self, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype, plan: dict[int, str], name: str
    ):
        super().__init__()
        self.name, self.dtype, self.plan = name, dtype, dict(sorted(plan.items()))
        self.out_features, self.in_features = weight.shape  # (N, K)
        self.by_rows = row_table(self.plan)
        for layout in LAYOUTS:
            kept = lay_out(weight, layout) if layout in self.plan.values() else None
            self.register_buffer(f"w_{layout}", kept, persistent=False)
        self.register_buffer("bias", None if bias is None else bias.detach().float(), persistent=False)

    @property
    def weight(self) -> torch.Tensor:
        """A stand-in with the compute dtype and device only: `Llama.setup_cache` and `Eagle3Draft.compute_dtype`
        read the dtype their caches take from `.weight`."""
        kept = next(self.buffers())  # the unused layouts are None, which buffers() skips
        return torch.empty(0, dtype=self.dtype, device=kept.device)

    def layout(self, rows: int) -> str:
        """The layout a GEMM of `rows` rows runs on."""
        return self.by_rows[min(rows, len(self.by_rows)) - 1]

    def bytes_read(self, rows: int = 1) -> int:
        """Bytes of weight (and bias) a GEMM of `rows` rows streams: N x K in its layout's dtype."""
        itemsize = LAYOUT_DTYPE[self.layout(rows)].itemsize
        bias = 0 if self.bias is None else self.bias.numel() * itemsize
        return self.out_features * self.in_features * itemsize + bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1])  # (M, K)
        layout = self.layout(x2.shape[0])
        y = run_layout(layout, x2.to(LAYOUT_DTYPE[layout]), getattr(self, f"w_{layout}"), self.bias, self.out_features)
        return y.to(self.dtype).view(*x.shape[:-1], self.out_features)


def fuse(linears: Sequence[nn.Linear]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Linears on one input -> their weights stacked (N1 + N2 + ..., K) in fp32, and the biases (zeros where one
    has none; None when none has)."""
    weight = torch.cat([lin.weight.detach().float() for lin in linears], 0)
    if all(lin.bias is None for lin in linears):
        return weight, None
    parts = [lin.bias.detach().float() if lin.bias is not None else torch.zeros(lin.out_features) for lin in linears]
    return weight, torch.cat(parts)


# ------------------------------------------------------------------------------------------------------- timing


@dataclass
class WeightSet:
    """Every weight of one shape a forward streams (one per layer), and the layouts allowed for it."""

    name: str
    """The shape's name in the model: qkv, o_proj, gate_up, down_proj, lm_head, or an EAGLE-3 head's module path."""
    weights: list[torch.Tensor]
    """(N, K) each, fp32, in the order a forward reads them."""
    biases: list[torch.Tensor | None]
    """(N,) each, or None."""
    dtype: torch.dtype
    """float32 (fp32 layouts only) or bfloat16 (a draft: the bf16 layout too), `candidates`."""
    gemv: bool = True
    """False for the model's output head, which the fixed rule kept packed only (`rule_layout`)."""

    @property
    def key(self) -> str:
        """The timing problem, as the cached plan names it: shape, how many weights stream, dtype, bias."""
        (n, k), bias = self.weights[0].shape, ":bias" if self.biases[0] is not None else ""
        return f"{n}x{k}x{len(self.weights)}:{str(self.dtype).removeprefix('torch.')}{bias}"


def clock(shape: str, layout: str, rows: int, run: Callable[[], object]) -> float:
    """The `Timer` of a real load: wall seconds of one `run()`."""
    start = time.perf_counter()
    run()
    return time.perf_counter() - start


def cheapest(samples: dict[str, list[float]]) -> str:
    """The layout whose median time is the least (the first listed on a tie)."""
    return min(samples, key=lambda layout: statistics.median(samples[layout]))


def _stream(layout: str, x: torch.Tensor, weights: list[torch.Tensor], biases: list) -> None:
    for w, b in zip(weights, biases):  # each layer's weight once, as a forward reads them
        run_layout(layout, x, w, b, None if b is None else b.shape[0])


def tune(ws: WeightSet, rows: Sequence[int], timer: Timer = clock, reps: int = TUNE_REPS) -> dict[int, str]:
    """Time every candidate layout of `ws` at each row count -> {rows: the fastest layout}.

    The rows stream through the set's weights in sequence (at most `TUNE_MAX_BYTES`: a weight that stays in cache
    would time a different problem); the candidates take turns within each repetition, so drift hits them alike."""
    names = candidates(ws.dtype)
    if len(names) == 1:
        return dict.fromkeys(rows, names[0])
    per_weight = ws.weights[0].numel() * 4
    count = max(1, min(len(ws.weights), TUNE_MAX_BYTES // per_weight))
    laid = {name: [lay_out(w, name) for w in ws.weights[:count]] for name in names}
    gen = torch.Generator().manual_seed(0)
    choices = {}
    for r in rows:
        x = torch.randn(r, ws.weights[0].shape[1], generator=gen)
        runs = {name: partial(_stream, name, x.to(LAYOUT_DTYPE[name]), laid[name], ws.biases[:count]) for name in names}
        for name in [n for n in names if n.startswith("packed")]:  # oneDNN builds its primitive on a first call
            run_layout(name, x.to(LAYOUT_DTYPE[name]), laid[name][0], ws.biases[0])
        samples = {name: [timer(ws.key, name, r, run)] for name, run in runs.items()}
        first = min(s[0] for s in samples.values())
        contenders = [name for name in names if samples[name][0] <= CONTENDER * first]  # clear losers stop here
        for _ in range(reps - 1):
            for name in contenders:
                samples[name].append(timer(ws.key, name, r, runs[name]))
        choices[r] = keep_rule(samples, rule_layout(ws.dtype, r, ws.gemv))
    return choices


def keep_rule(samples: dict[str, list[float]], rule: str) -> str:
    """The cheapest layout, unless the fixed rule's layout is within `RULE_MARGIN` of it: timed alone, close layouts
    swap places from run to run, and in the loop (the shapes interleaved, the weights streamed from DRAM) a near tie
    measured 0.89x at 8 rows; the rule's layout, measured in the loop, keeps close calls."""
    best = cheapest(samples)
    if rule in samples and statistics.median(samples[rule]) <= (1 + RULE_MARGIN) * statistics.median(samples[best]):
        return rule
    return best


# ------------------------------------------------------------------------------------------- the machine, cached


def parse_cpuinfo(text: str) -> tuple[str, list[str]]:
    """/proc/cpuinfo -> (the first processor's model name, its flags that decide GEMM kernels: `ISA_FLAGS`, amx_*)."""
    name, flags = "", set()
    for line in text.splitlines():
        key, _, value = (part.strip() for part in line.partition(":"))
        if key == "model name" and not name:
            name = value
        elif key in ("flags", "Features") and not flags:
            flags = set(value.split())
    return name, sorted(f for f in flags if f in ISA_FLAGS or f.startswith("amx"))


@cache
def cpu_identity() -> tuple[str, tuple[str, ...], int]:
    """(CPU model name, its GEMM-relevant ISA flags, the cores this process may run on)."""
    try:
        name, flags = parse_cpuinfo(Path("/proc/cpuinfo").read_text(errors="replace"))
    except OSError:  # not Linux
        name, flags = "", []
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return name or platform.processor() or platform.machine(), tuple(flags), cores


def machine_key() -> dict:
    """What a cached plan is valid for: the CPU, its ISA flags, cores, torch's threads and version (threads decide
    which GEMM wins as much as the CPU does)."""
    cpu, flags, cores = cpu_identity()
    return {
        "cpu": cpu,
        "flags": list(flags),
        "cores": cores,
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "plan_version": PLAN_VERSION,
    }


def plan_path(key: dict) -> Path:
    """The machine's plan file: in $SPECDISTILL_CPU_PLANS when set (the tests point it at a temporary folder), else
    in the model cache ($SPECDISTILL_CACHE, else ~/.cache/specdistill) under cpu-plans/."""
    from .loading import cache_dir  # loading pulls in transformers; the kernels above need only torch

    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    folder = os.environ.get("SPECDISTILL_CPU_PLANS")
    return (Path(folder) if folder else cache_dir() / "cpu-plans") / f"{digest}.json"


def read_plan(key: dict) -> dict:
    """The machine's cached plan file ({"machine", "bandwidth_gb_s", "shapes"}), empty when there is none (or it
    belongs to another machine, or cannot be read: a cache is rebuilt, never trusted blindly)."""
    empty = {"machine": key, "bandwidth_gb_s": None, "shapes": {}}
    try:
        stored = json.loads(plan_path(key).read_text())
    except (OSError, ValueError):
        return empty
    if not isinstance(stored, dict) or stored.get("machine") != key or not isinstance(stored.get("shapes"), dict):
        return empty
    return empty | stored


def write_plan(key: dict, shapes: dict | None = None, bandwidth_gb_s: float | None = None) -> Path:
    """Merge shape entries and/or the bandwidth into the machine's plan file (re-read first: another process may
    have added its own shapes since), written atomically."""
    plan = read_plan(key)
    plan["shapes"].update(shapes or {})
    if bandwidth_gb_s is not None:
        plan["bandwidth_gb_s"] = bandwidth_gb_s
    return atomic.write_text(plan_path(key), json.dumps(plan, indent=1, sort_keys=True))


def probe_bandwidth(seconds: float = 1.0, megabytes: int = 256) -> float:
    """GB/s of reading a `megabytes` tensor (a sum over it), the median over ~`seconds` of passes.

    A read, not a copy: a decode step only reads its weights, and a copy's traffic (read, write and the write's
    allocating read) measured less than a read on the same machine (2-core AVX2 EPYC: copy 18.6-19.9 GB/s counting
    read + write, sum 23.3 GB/s), which would put the floor too high and flatter every step measured against it."""
    src = torch.ones(megabytes * 2**20 // 4)  # written: untouched pages would all read the one shared zero page
    src.sum()  # first touch and thread start-up, outside the timing
    times, deadline = [], time.perf_counter() + seconds
    while time.perf_counter() < deadline or len(times) < 3:
        start = time.perf_counter()
        src.sum()
        times.append(time.perf_counter() - start)
    return src.nbytes / statistics.median(times) / 1e9


def bandwidth_gb_s(probe: bool = True) -> float | None:
    """This machine's probed bandwidth, from its plan file, else probed now (~1 s) and cached; None when not cached
    and `probe` is False."""
    key = machine_key()
    cached = read_plan(key)["bandwidth_gb_s"]
    if cached is not None or not probe:
        return cached
    measured = probe_bandwidth()
    write_plan(key, bandwidth_gb_s=measured)
    return measured


def machine_info(probe: bool = True) -> dict:
    """The machine numbers were measured on, JSON-able: CPU model, its GEMM-relevant ISA flags, cores, torch
    threads and version, and the probed bandwidth (`bandwidth_gb_s`: cached, else probed when `probe`)."""
    key = machine_key()
    return {k: key[k] for k in ("cpu", "flags", "cores", "torch_threads", "torch")} | {
        "bandwidth_gb_s": bandwidth_gb_s(probe)
    }


def weight_bytes_per_step(model: nn.Module) -> int:
    """Bytes of weights one decode step (1 row) reads: each `FusedLinear` in the layout it runs one row on, each
    plain linear's weight (an HF model's); embeddings read one row and norms are tiny: left out."""
    total = 0
    for module in model.modules():
        if isinstance(module, FusedLinear):
            total += module.bytes_read(1)
        elif isinstance(module, nn.Linear):
            total += module.weight.nbytes + (0 if module.bias is None else module.bias.nbytes)
    return total


def decode_floor_s(model: nn.Module, bandwidth_gb_s: float) -> float:
    """The weight-streaming floor of one decode step: the bytes of weights it reads / the probed bandwidth. A
    step at batch 1 is memory-bound, so `decode step / floor` says how far the kernels are from the machine's limit
    (the KV cache and the activations, small at short contexts, come on top)."""
    return weight_bytes_per_step(model) / (bandwidth_gb_s * 1e9)


def layout_summary(model) -> dict[str, dict[int, str]]:
    """{shape name: {rows: layout}} of a model on the CPU fast path (one entry per shape: every layer's weight of
    a shape shares its plan); {} for any other model or draft."""
    if not isinstance(model, nn.Module):
        return {}
    return {m.name: m.plan for m in model.modules() if isinstance(m, FusedLinear)}


# -------------------------------------------------------------------------------------------------- the planner


def check_layouts(layouts: str, dtype: torch.dtype) -> None:
    """A `layouts` setting the fast path takes for weights allowed `dtype`, else one error naming the choices."""
    names = allowed(dtype)
    if layouts in MODES or layouts in names:
        return
    also = f"; {layouts} is not a layout for {dtype} weights" if layouts in LAYOUTS else ""
    raise ValueError(
        f"layouts={layouts!r}: use 'auto' (the cached plan, else timing), 'tune' (time again), 'rule' (the fixed "
        f"rule) or one layout to force: {', '.join(names)}{also}"
    )


def check_rows(rows: Sequence[int]) -> tuple[int, ...]:
    """Row counts to plan, sorted and unique, else one error naming the fix."""
    if not rows or not all(isinstance(r, int) and r >= 1 for r in rows):
        raise ValueError(f"layout rows must be positive integers (GEMM rows = batch x tokens per step), got {rows}")
    return tuple(sorted(set(rows)))


class Planner:
    """The layouts of one model load: per weight set and row count, the fixed rule, a forced layout, or the fastest
    (the machine's cached plan, timing only what it lacks). `save` writes what was timed."""

    def __init__(self, layouts: str, rows: Sequence[int], timer: Timer | None = None):
        self.mode, self.rows, self.timer = layouts, check_rows(rows), timer or clock
        self.key = machine_key()
        cached = read_plan(self.key)["shapes"] if layouts == "auto" else {}
        self.cached = {key: {int(r): layout for r, layout in entry["rows"].items()} for key, entry in cached.items()}
        self.timed: dict[str, dict] = {}  # shape key -> {"rows": {...}, "tune_s": ...}: written by `save`
        self.tune_s = 0.0

    def choose(self, ws: WeightSet) -> dict[int, str]:
        """{rows: layout} for every planned row count of this weight set."""
        check_layouts(self.mode, ws.dtype)
        if self.mode == "rule":
            return {r: rule_layout(ws.dtype, r, ws.gemv) for r in self.rows}
        if self.mode in LAYOUTS:
            return dict.fromkeys(self.rows, self.mode)
        names = candidates(ws.dtype)
        known = {r: layout for r, layout in self.cached.get(ws.key, {}).items() if layout in names}
        missing = [r for r in self.rows if r not in known]
        if missing:
            start = time.perf_counter()
            known |= tune(ws, missing, self.timer)
            seconds = time.perf_counter() - start
            self.tune_s += seconds
            self.cached[ws.key] = known
            self.timed[ws.key] = {"rows": known, "tune_s": self.timed.get(ws.key, {}).get("tune_s", 0) + seconds}
        return {r: known[r] for r in self.rows}

    def save(self) -> Path | None:
        """Write the timed entries into the machine's plan file (None: nothing was timed)."""
        if not self.timed:
            return None
        path = write_plan(self.key, self.timed)
        log.info("CPU fast path: timed %d weight shapes in %.1f s, cached in %s", len(self.timed), self.tune_s, path)
        return path

    def info(self) -> dict:
        """How this load chose: `layouts`, the shapes timed now, their seconds."""
        return {"layouts": self.mode, "timed_shapes": sorted(self.timed), "tune_s": round(self.tune_s, 3)}


def fused_linears(
    groups: dict[str, list[list[nn.Linear]]],
    dtype: torch.dtype,
    planner: Planner,
    heads: Sequence[str] = (),
) -> dict[str, list[FusedLinear]]:
    """{shape name: per layer, the linears fused into one GEMM} -> {shape name: per layer, its `FusedLinear`}, each
    shape planned as one weight set (`heads`: output heads, `WeightSet.gemv`). Shape by shape, so the fused fp32
    copies and the timed layouts of one shape at a time are alive. The planner's timings are saved at the end."""
    out = {}
    for name, layers in groups.items():
        pairs = [fuse(linears) for linears in layers]
        ws = WeightSet(name, [w for w, _ in pairs], [b for _, b in pairs], dtype, gemv=name not in heads)
        plan = planner.choose(ws)
        out[name] = [FusedLinear(w, b, dtype, plan, name) for w, b in pairs]
    planner.save()
    return out
