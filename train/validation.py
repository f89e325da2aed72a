"""Validation of a student on the held-out teacher data: the metrics `best/` is chosen by, over all processes.

metrics = evaluate(student, teacher, eval_ds, accelerator, cfg.distill, cfg.train, pad_id)
metrics["eval/expected_acceptance"]   # mean over response tokens of sum_v min(p_v, q_v)
"""

from __future__ import annotations

import math

import torch
from accelerate import Accelerator
from torch import Tensor

from distill.config import DistillConfig
from distill.data import IGNORE, collate, fetch_rows
from distill.objectives import batch_inputs, teacher_targets, validation_sums
from train.config import TrainConfig


@torch.no_grad()
def evaluate(
    student, teacher, eval_ds, accelerator: Accelerator, dc: DistillConfig, tc: TrainConfig, pad_id: int
) -> dict[str, float]:
    """Validation loss, expected_acceptance (sum_v min(p, q) at temperature 1) and greedy top-1 match over the
    held-out data, all-reduced over processes (each process takes every world-th row). `teacher` None: the
    data's offline top-k cache is the teacher."""
    rank, world = accelerator.process_index, accelerator.num_processes
    mine = list(range(rank, len(eval_ds), world))
    # Every process runs the same number of forwards (DDP syncs buffers, FSDP gathers weights in each one), so
    # the short ranks pad with a copy of row 0 that has no response tokens.
    mine += [None] * (math.ceil(len(eval_ds) / world) - len(mine))
    student.eval()
    sums: Tensor | None = None
    for start in range(0, len(mine), tc.batch_size):
        chunk = mine[start : start + tc.batch_size]
        rows = fetch_rows(eval_ds, [i if i is not None else 0 for i in chunk])
        rows = [row if i is not None else _no_response(row) for i, row in zip(chunk, rows)]
        batch = collate(rows, max_seq_len=tc.max_seq_len, pad_id=pad_id, topk=teacher is None)
        batch = {k: v.to(accelerator.device) for k, v in batch.items()}
        logits = student(**batch_inputs(batch), use_cache=False).logits
        labels = batch["labels"]
        row, terms = validation_sums(
            logits,
            teacher_targets(teacher, batch),
            labels,
            labels != IGNORE,
            dc.objective,
            kd_temperature=dc.kd_temperature,
            beta=dc.beta,
            chunk_size=dc.chunk_size,
        )
        sums = row if sums is None else sums + row
    student.train()
    sums = accelerator.reduce(sums, "sum").tolist()
    count = max(sums[3], 1.0)
    metrics = {
        "eval/loss": sums[0] / count,
        "eval/expected_acceptance": sums[1] / count,
        "eval/greedy_match": sums[2] / count,
        "eval/tokens": sums[3],
    }
    return metrics | {f"eval/{name}": value / count for name, value in zip(terms, sums[4:])}


def _no_response(row: dict) -> dict:
    return row | {"prompt_len": len(row["input_ids"]), "topk_ids": [], "topk_logprobs": []}
