"""Training batches from the teacher data: the recipe's row order, micro-batches, padded batches, on-policy rows.

    train_ds = load_training_split(data.train, ["input_ids", "prompt_len"], split="train", max_seq_len=512)
    order = epoch_order(len(train_ds), seed, epoch)             # the same permutation on every process
    rows = fetch_rows(train_ds, micro_batch_indices(order, step, micro, rank=rank, world=world,
                                                    batch_size=4, grad_accum=2))
    batch = collate(rows, max_seq_len=512, pad_id=pad_id, topk=False)   # input_ids, attention_mask, labels
    batch = collate(rows, max_seq_len=512, pad_id=pad_id, topk=False, loss_on_prompt=True)   # prompt labels too
    runs = split_by_tokens(batch, max_tokens=1024)   # backward passes of <= 1024 real tokens each

The datasets themselves are written by distill/data.py; the loop that consumes these batches is train/loop.py.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from pathlib import Path

import datasets
import numpy as np
import pyarrow as pa
import torch

from distill.config import DataConfig
from distill.data import TOPK_START, load_teacher_data
from specdec_runtime.errors import UserError

IGNORE = -100  # label of a position not trained on: padding, the last token, a prompt token with loss_on_prompt off


def load_training_split(
    path: Path, columns: list[str], *, split: str, max_seq_len: int, log: Callable[[str], object] = print
) -> datasets.Dataset:
    """The finished `split` dataset (training or validation) at `path` with `columns` only (and, with the top-k
    columns, `TOPK_START` where the cache has it: where its rows start); refused when it lacks a column (the top-k
    cache) or holds nothing to learn from within `max_seq_len` tokens."""
    ds = load_teacher_data(path)
    if len(ds) == 0:
        raise UserError(f"{path} holds no sequences; generate the {split} data again")
    if missing := [c for c in columns if c not in ds.column_names]:
        raise UserError(
            f"{path} has no {missing} columns; distill.teacher=cache needs data generated with data.teacher_cache=true"
        )
    if "topk_ids" in columns and TOPK_START in ds.column_names:
        columns = [*columns, TOPK_START]
    full = int((np.asarray(ds.select_columns(["prompt_len"])[:]["prompt_len"]) >= max_seq_len).sum())
    if full == len(ds):
        raise UserError(
            f"every prompt in {path} fills train.max_seq_len={max_seq_len}: no response token is left to learn "
            "from; raise train.max_seq_len"
        )
    if full:
        log(
            f"warning: {full} of {len(ds)} sequences in {path} keep no response token within "
            f"train.max_seq_len={max_seq_len}"
        )
    return ds.select_columns(columns)


@functools.lru_cache(maxsize=2)
def epoch_order(n: int, seed: int, epoch: int) -> list[int]:
    """The row order of `epoch`: a permutation drawn from an explicit generator, identical on every process."""
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed * 100_003 + epoch)).tolist()


def micro_batch_indices(
    order: list[int], batch: int, micro: int, *, rank: int, world: int, batch_size: int, grad_accum: int
) -> list[int]:
    """Rows of one process's micro-batch: the global batch `batch` is split micro-batch-major, then by rank, so
    any (processes, grad_accum, batch_size) with the same product covers the same rows in one optimizer step."""
    start = (batch * grad_accum * world + micro * world + rank) * batch_size
    return order[start : start + batch_size]


def fetch_rows(ds: datasets.Dataset, indices: list[int]) -> list[dict]:
    """The rows at `indices`: ids as lists and numbers as Python ints, the per-position columns (top-k, aux hidden
    states) as (T, width) numpy arrays (int64 / float32, as datasets' numpy format gives them). Read from the Arrow
    table: a per-position column is one flat buffer reshaped and split per row. 1.3 ms for an EAGLE-3 micro-batch
    of the quickstart, where `with_format("numpy")` took 24 (15 to copy the dataset object, the rest one array per
    position), 5 % of a training step; Python lists of the aux states took 0.29 s of a 1.3 s step
    (docs/benchmarks.md)."""
    if not indices:
        return []
    with ds.formatted_as("arrow"):  # in place and restored after, no copy of the dataset object
        table = ds[indices]  # pyarrow.Table of those rows, in that order
    columns = [_column(table.column(name)) for name in table.column_names]
    return [dict(zip(table.column_names, values)) for values in zip(*columns)]


def _column(column) -> list:
    """One Arrow column -> its value per row: a list of equal-length lists of numbers (what the data stage writes:
    list<fixed_size_list<number>[K]>) as (T, K) arrays, the rest as Python objects."""
    array = column.combine_chunks()
    kind = array.type
    if not (
        pa.types.is_list(kind) and (pa.types.is_list(kind.value_type) or pa.types.is_fixed_size_list(kind.value_type))
    ):
        return array.to_pylist()
    inner = array.flatten()  # (sum of T,) lists, one per position
    if pa.types.is_fixed_size_list(inner.type):
        width = inner.type.list_size
    else:  # lists whose length the schema does not fix (a dataset not written by the data stage)
        widths = np.unique(inner.value_lengths().to_numpy(zero_copy_only=False))
        width = int(widths[0]) if len(widths) == 1 else 0
    if width == 0:  # ragged (or empty) positions: no (T, K) array to make
        return array.to_pylist()
    flat = inner.flatten().to_numpy(zero_copy_only=False).reshape(-1, width)  # (sum of T, K)
    if np.issubdtype(flat.dtype, np.integer):  # the dtypes datasets' numpy format gives
        flat = flat.astype(np.int64, copy=False)
    elif np.issubdtype(flat.dtype, np.floating):
        flat = flat.astype(np.float32, copy=False)
    return np.split(flat, np.cumsum(array.value_lengths().to_numpy())[:-1])


def collate(
    rows: list[dict], *, max_seq_len: int, pad_id: int, topk: bool, loss_on_prompt: bool = False
) -> dict[str, torch.Tensor]:
    """Right-padded batch of (prompt + response) rows, truncated to `max_seq_len` from the response end.

    labels[b, t] is the token that position t predicts when it is a response token (with `loss_on_prompt`: any
    token, prompt ones included; padding never), IGNORE elsewhere, so the loss mask is `labels != IGNORE`. With
    `topk`, the cached top-k row that predicted token i sits at position i - 1, aligned with labels: row i - start of
    the row's arrays, start being its `TOPK_START` (1 in a cache with prompt rows) or else its prompt_len.
    """
    ids = [row["input_ids"][:max_seq_len] for row in rows]
    B, T = len(rows), max(len(x) for x in ids)
    input_ids = torch.full((B, T), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((B, T), dtype=torch.long)
    labels = torch.full((B, T), IGNORE, dtype=torch.long)
    if topk:
        K = next((len(row["topk_ids"][0]) for row in rows if len(row["topk_ids"])), 1)
        # Harmless filler where nothing is trained: K distinct ids holding K/(K+1) of the mass.
        topk_ids = torch.arange(K).expand(B, T, K).clone()  # (B, T, K)
        topk_logprobs = torch.full((B, T, K), -math.log(K + 1))  # (B, T, K)
    for b, (row, x) in enumerate(zip(rows, ids)):
        n, P = len(x), row["prompt_len"]
        input_ids[b, :n] = torch.tensor(x)
        attention_mask[b, :n] = 1
        first = 1 if loss_on_prompt else max(P, 1)  # first trained token; token 0 is predicted by no position
        if first < n:
            labels[b, first - 1 : n - 1] = input_ids[b, first:n]
            if topk:
                start = row.get(TOPK_START, P)  # the token the row's first cached top-k predicted
                if first < start:
                    raise ValueError(
                        f"the cached top-k starts at token {start}, after token {first}: loss_on_prompt needs a "
                        "cache with prompt rows"
                    )
                topk_ids[b, first - 1 : n - 1] = torch.tensor(row["topk_ids"][first - start : n - start])
                topk_logprobs[b, first - 1 : n - 1] = torch.tensor(row["topk_logprobs"][first - start : n - start])
    batch = {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}
    if topk:
        batch |= {"topk_ids": topk_ids, "topk_logprobs": topk_logprobs}
    return batch


def token_runs(lengths: list[int], max_tokens: int, passes: int = 0) -> list[tuple[int, int]]:
    """Consecutive runs [a, b) of rows holding at most `max_tokens` of `lengths` each (a row longer than that alone;
    max_tokens 0: one run), then, while fewer than `passes` (at most the rows), the run with the most tokens among
    those of two rows or more split in two where its tokens reach half."""
    runs, start, tokens = [], 0, 0
    for b, n in enumerate(lengths):
        if max_tokens > 0 and b > start and tokens + n > max_tokens:
            runs.append((start, b))
            start, tokens = b, 0
        tokens += n
    runs.append((start, len(lengths)))
    while len(runs) < min(passes, len(lengths)):
        a, b = max((r for r in runs if r[1] - r[0] > 1), key=lambda r: sum(lengths[r[0] : r[1]]))
        half, cut = sum(lengths[a:b]) / 2, a + 1
        while cut < b - 1 and sum(lengths[a : cut + 1]) <= half:
            cut += 1
        i = runs.index((a, b))
        runs[i : i + 1] = [(a, cut), (cut, b)]
    return runs


def split_by_tokens(batch: dict[str, torch.Tensor], max_tokens: int, passes: int = 0) -> list[dict[str, torch.Tensor]]:
    """A collated micro-batch as `token_runs` of its rows, every run cut to its own longest row
    (`train.max_micro_batch_tokens`; 0 = the batch whole). Rows are independent (padding and packing keep sequences
    apart) and the loss is summed over rows, so the runs' backward passes add up to the batch's gradient while only
    one run's activations are alive. `passes`: at least that many runs, so that every process of a step runs as many
    forwards as the one with the most (DDP's buffer broadcast and FSDP's gathers are collectives in each)."""
    lengths = batch["attention_mask"].sum(1).tolist()
    runs = token_runs(lengths, max_tokens, passes)
    if len(runs) == 1:
        return [batch]
    # every tensor of a collated batch is (B, T, ...), right-padded
    return [{k: v[a:b, : max(lengths[a:b])] for k, v in batch.items()} for a, b in runs]


@torch.no_grad()
def on_policy_rows(
    model,
    rows: list[dict],
    *,
    stop_ids: list[int],
    pad_id: int,
    data: DataConfig,
    max_seq_len: int,
    synced: bool = False,
) -> list[dict]:
    """The student's own answers to the rows' prompts, sampled like the teacher data (GKD, Agarwal et al. 2024;
    DistillSpec, Zhou et al. 2024). Rows whose prompt leaves no room under `max_seq_len` stay as they are.

    `synced`: the student's weights are sharded (FSDP, ZeRO-3), so every forward is a collective and a process
    whose answers end early keeps stepping until all are done; all processes then take the same max_new_tokens."""
    prompts = [row["input_ids"][: row["prompt_len"]] for row in rows]
    P = max(len(p) for p in prompts)
    max_new = min(data.max_new_tokens, max_seq_len - P)
    device = next(model.parameters()).device
    if synced:
        budget = torch.tensor(max_new, device=device)
        torch.distributed.all_reduce(budget, op=torch.distributed.ReduceOp.MIN)
        max_new = int(budget)
    if max_new < 1:
        return rows
    input_ids = torch.tensor([[pad_id] * (P - len(p)) + p for p in prompts], device=device)  # (B, P) left-padded
    attention_mask = torch.tensor([[0] * (P - len(p)) + [1] * len(p) for p in prompts], device=device)
    sampling = (
        dict(do_sample=True, temperature=data.temperature, top_k=data.top_k, top_p=data.top_p)
        if data.temperature > 0
        else dict(do_sample=False)
    )
    was_training = model.training
    model.eval()
    out = model.generate(
        input_ids=input_ids,
        attention_mask=attention_mask,
        max_new_tokens=max_new,
        eos_token_id=stop_ids,  # the tokenizer's EOS and the generation config's end-of-turn ids, as teacher data
        pad_token_id=pad_id,
        synced_gpus=synced,
        **sampling,
    )  # (B, P + new)
    model.train(was_training)
    answers = []
    for prompt, new in zip(prompts, out[:, P:].tolist()):
        end = next((i for i, t in enumerate(new) if t in stop_ids), None)
        response = new if end is None else new[: end + 1]
        answers.append({"input_ids": prompt + response, "prompt_len": len(prompt)})
    return answers
