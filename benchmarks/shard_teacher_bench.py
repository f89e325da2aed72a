"""Teacher sharding (train.shard_teacher): what a sharded teacher saves and costs, measured in one launch.

Each process first runs the teacher as a full copy, then the same weights sharded over all processes with the
training loop's own `shard_teacher` (FSDP2, inference only), on the same batch, through the loop's `teacher_forward`.
Reported per process: the teacher bytes it holds (exact: its local shards), the peak device memory of one teacher
forward (CUDA max allocated; not measured on CPU), the forward time (median of --repeats after --warmup) and the
largest |logit difference| between the two (the sharded teacher must compute the full model).

    torchrun --nproc_per_node 2 benchmarks/shard_teacher_bench.py                     # CPU, gloo, embedded SmolLM2
    torchrun --nproc_per_node 8 benchmarks/shard_teacher_bench.py --teacher meta-llama/Llama-3.1-8B-Instruct \\
        --dtype bfloat16 --batch-size 8 --seq-len 2048                               # 8 GPUs

On the 2-core CPU machine use OMP_NUM_THREADS=1 (two processes with two threads each oversubscribe the cores).
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time

import torch
from accelerate import PartialState
from accelerate.utils import gather_object

from distill.objectives import teacher_forward
from specdec_runtime.loading import load_model
from train.distributed import shard_teacher


def param_bytes(model) -> int:
    """Bytes of the weights this process holds (a sharded parameter counts its local shard only)."""
    total = 0
    for p in model.parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        total += local.numel() * local.element_size()
    return total


def measure(model, batch: dict, device: torch.device, *, warmup: int, repeats: int) -> tuple[torch.Tensor, dict]:
    """(logits on CPU, {bytes, peak_forward_mib, forward_ms}) of `repeats` timed teacher forwards."""
    cuda = device.type == "cuda"
    for _ in range(warmup):
        teacher_forward(model, batch)
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(repeats):
        torch.distributed.barrier()  # every process starts together: a sharded forward waits for the slowest
        start = time.perf_counter()
        logits = teacher_forward(model, batch)
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    stats = {
        "teacher_mib": param_bytes(model) / 2**20,
        "peak_forward_mib": torch.cuda.max_memory_allocated() / 2**20 if cuda else None,
        "forward_ms": 1000 * statistics.median(times),
    }
    return logits.float().cpu(), stats


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--teacher", default="embedded:smollm2-135m-instruct")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", default=None, help="also write the results here (rank 0)")
    args = ap.parse_args()

    state = PartialState(cpu=not torch.cuda.is_available())
    rank, world, device = state.process_index, state.num_processes, state.device
    if world < 2:
        raise SystemExit("launch with torchrun --nproc_per_node N (N >= 2): sharding needs several processes")
    with state.main_process_first():  # the first load may convert the GGUF into the shared cache
        teacher, _ = load_model(args.teacher, dtype=args.dtype, device="cpu")
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, teacher.config.vocab_size, (args.batch_size, args.seq_len), generator=g)
    batch = {"input_ids": ids.to(device), "attention_mask": torch.ones_like(ids).to(device)}

    full = copy.deepcopy(teacher).to(device).eval()
    full_logits, full_stats = measure(full, batch, device, warmup=args.warmup, repeats=args.repeats)
    del full
    if device.type == "cuda":
        torch.cuda.empty_cache()
    summary = shard_teacher(teacher.eval(), device, world)
    sharded_logits, sharded_stats = measure(teacher, batch, device, warmup=args.warmup, repeats=args.repeats)
    max_diff = (sharded_logits - full_logits).abs().max().item()

    rows = gather_object([{"rank": rank, "full": full_stats, "sharded": sharded_stats, "diff": max_diff}])
    if state.is_main_process:
        print(summary)
        print(
            f"teacher {args.teacher} ({args.dtype}), batch {args.batch_size} x {args.seq_len}, {world} processes, "
            f"device {device.type}"
        )
        print(
            "| rank | teacher MiB full / sharded | ratio | forward ms full / sharded | ratio | peak fwd MiB full / "
            "sharded | max abs logit diff |"
        )
        print("| --- | --- | --- | --- | --- | --- | --- |")
        for r in rows:
            f, s = r["full"], r["sharded"]
            peak = (
                f"{f['peak_forward_mib']:.0f} / {s['peak_forward_mib']:.0f}"
                if f["peak_forward_mib"] is not None
                else "n/a (CPU)"
            )
            print(
                f"| {r['rank']} | {f['teacher_mib']:.1f} / {s['teacher_mib']:.1f} | "
                f"{s['teacher_mib'] / f['teacher_mib']:.3f} | {f['forward_ms']:.1f} / {s['forward_ms']:.1f} | "
                f"{s['forward_ms'] / f['forward_ms']:.2f} | {peak} | {r['diff']:.2e} |"
            )
        if args.json:
            with open(args.json, "w") as fh:
                json.dump({"args": vars(args), "world": world, "device": device.type, "rows": rows}, fh, indent=1)


if __name__ == "__main__":
    main()
