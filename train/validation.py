"""Validation of a student on the validation split of the teacher data: the metrics `best/` is chosen by, over all
processes. One loop for every student; what differs (how rows become a batch, a batch's sums, the summed row's
metrics) is plugged in as functions, the standalone student's by default, an EAGLE-3 head's from distill/eagle3.py.

    metrics = validate(student, teacher, validation_ds, accelerator, cfg.distill, cfg.train, pad_id)
    metrics["eval/expected_acceptance"]   # mean over response tokens of sum_v min(p_v, q_v)
    metrics = validate(..., collate=collate_eagle3, batch_sums=head.validation_sums, metrics=head.validation_metrics)
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import torch
from accelerate import Accelerator
from torch import Tensor

from distill.batches import IGNORE, collate, fetch_rows, split_by_tokens
from distill.config import DistillConfig
from distill.objectives import batch_inputs, teacher_targets, validation_sums
from train import distributed
from train.config import TrainConfig


def standalone_sums(student, teacher, batch: dict[str, Tensor], distill_cfg: DistillConfig) -> Tensor:
    """A standalone student's sums over one batch: `distill.objectives.validation_sums` of its logits."""
    logits = student(**batch_inputs(batch), use_cache=False).logits
    labels = batch["labels"]
    row, _ = validation_sums(
        logits,
        teacher_targets(teacher, batch),
        labels,
        labels != IGNORE,
        distill_cfg.objective,
        kd_temperature=distill_cfg.kd_temperature,
        beta=distill_cfg.beta,
        chunk_size=distill_cfg.chunk_size,
    )
    return row


def standalone_metrics(sums: list[float], distill_cfg: DistillConfig) -> dict[str, float]:
    """Validation loss, expected_acceptance (sum_v min(p, q) at temperature 1), greedy top-1 match and each objective
    term, per response token, from `standalone_sums` added up."""
    count = max(sums[3], 1.0)
    metrics = {
        "eval/loss": sums[0] / count,
        "eval/expected_acceptance": sums[1] / count,
        "eval/greedy_match": sums[2] / count,
        "eval/tokens": sums[3],
    }
    # validation_sums' terms come in the objective's order (`distill_loss` sums one per name of the objective)
    return metrics | {f"eval/{name}": value / count for name, value in zip(distill_cfg.objective, sums[4:])}


@torch.no_grad()
def validate(
    student,
    teacher,
    validation_ds,
    accelerator: Accelerator,
    distill_cfg: DistillConfig,
    train_cfg: TrainConfig,
    pad_id: int,
    *,
    collate: Callable[..., dict[str, Tensor]] = collate,
    batch_sums: Callable[..., Tensor] = standalone_sums,
    metrics: Callable[[list[float], DistillConfig], dict[str, float]] = standalone_metrics,
) -> dict[str, float]:
    """The validation metrics over `validation_ds`, from sums all-reduced over processes (each process takes every
    world-th row). `teacher` None: the data's offline top-k cache is the teacher.

    collate(rows, max_seq_len=, pad_id=, topk=) -> batch; batch_sums(student, teacher, batch, distill_cfg) -> one
    batch's fp32 sums, added over batches and processes; metrics(sums, distill_cfg) -> {name: value}. By default the
    standalone student's (`standalone_sums`, `standalone_metrics`)."""
    rank, world = accelerator.process_index, accelerator.num_processes
    mine = list(range(rank, len(validation_ds), world))
    # Every process runs the same number of forwards (DDP syncs buffers, FSDP gathers weights in each one), so
    # the short ranks pad with a copy of row 0 that has no response tokens.
    mine += [None] * (math.ceil(len(validation_ds) / world) - len(mine))
    # Response tokens only, whatever distill.loss_on_prompt: best/ and the reported acceptance then measure what a
    # draft serves, comparably between runs with and without it.
    to_batch = functools.partial(collate, max_seq_len=train_cfg.max_seq_len, pad_id=pad_id, topk=teacher is None)
    student.eval()
    sums: Tensor | None = None
    for start in range(0, len(mine), train_cfg.batch_size):
        chunk = mine[start : start + train_cfg.batch_size]
        rows = fetch_rows(validation_ds, [i if i is not None else 0 for i in chunk])
        rows = [row if i is not None else _no_response(row) for i, row in zip(chunk, rows)]
        batch = {k: v.to(accelerator.device) for k, v in to_batch(rows).items()}
        # in passes of at most train.max_micro_batch_tokens, as in training: the sums add over rows
        bound = train_cfg.max_micro_batch_tokens
        for run in split_by_tokens(batch, bound, distributed.passes(accelerator, batch, bound)):
            row = batch_sums(student, teacher, run, distill_cfg)
            sums = row if sums is None else sums + row
    student.train()
    return metrics(accelerator.reduce(sums, "sum").tolist(), distill_cfg)


def _no_response(row: dict) -> dict:
    return row | {"prompt_len": len(row["input_ids"]), "topk_ids": [], "topk_logprobs": []}
