"""Teacher-generated distillation data (sequence-level KD), written in resumable shards, and the offline top-k cache.

The teacher answers every training prompt `num_samples` times; the answers are the distillation data (Kim & Rush
2016, sequence-level KD). Held-out prompts get the same treatment in a second dataset, for validation.

    data = generate_teacher_data(teacher, tokenizer, cfg.data, Path(cfg.output_dir) / "data", teacher_id=spec)
    train = load_teacher_data(data.train)   # columns: id, category, input_ids, prompt_len[, topk_ids, topk_logprobs]

From the command line (CPU, 1 GPU, N processes: each writes its own shards, rank 0 merges):

    specdistill data configs/quickstart.yaml
    torchrun --nproc_per_node 2 -m specdistill data configs/quickstart.yaml

On disk, `<out_dir>/teacher-<fingerprint>/` (and `teacher-eval-<fingerprint>/`) is a `save_to_disk` folder finished
by a `.complete` marker. The rows, every (prompt, sample) pair in order, are generated batch_size at a time, batch j
with its own seeded generator, so the tokens depend neither on the process count nor on the shards. A shard is a run
of whole batches (about shard_size prompts, fewer when that would leave a process without one), written to
`shards/.tmp-shard-<first batch>` and renamed to `shards/shard-<first batch>`, so a killed run resumes at the first
missing shard with nothing lost or repeated, and writes the same tokens an uninterrupted one would.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import math
import shutil
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import datasets
import numpy as np
import pyarrow.compute as pc
import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from distill.config import DataConfig
from distill.prompts import (
    SELF_INSTRUCT,
    PromptRecord,
    concat_sources,
    load_prompts,
    load_sources,
    overlap_count,
    render_chat,
    save_prompts,
    self_instruct_prompts,
    without_prompts,
)
from specdec_runtime.atomic import staged_dir, write_text
from specdec_runtime.bench import fast_model
from specdec_runtime.engine import SamplingParams, generate
from specdec_runtime.loading import stop_token_ids

FORMAT_VERSION = 2  # bump when the columns or the sampling scheme change, so old caches are not reused
COMPLETE = ".complete"
# Prompt writing needs diversity whatever temperature the answers are sampled at.
SELF_INSTRUCT_SAMPLING = SamplingParams(temperature=1.0, top_p=0.95)


@dataclass
class TeacherData:
    """Where the finished datasets are."""

    train: Path
    """Teacher answers to the training prompts (a finished `save_to_disk` folder)."""
    eval: Path
    """Teacher answers to the held-out prompts, same format, for validation."""


AUX_HIDDEN = "aux_hidden"  # offline cache for EAGLE-3 heads: (tokens, n_aux * H) fp16, every prompt + response position


def features(top_k: int | None, aux_width: int | None = None) -> datasets.Features:
    """Column types of the data; the top-k columns only when the offline teacher cache is on (top_k = K), the aux
    hidden states (n_aux * H wide) only when it also stores them for EAGLE-3 candidates."""
    cols = {
        "id": datasets.Value("string"),  # "<prompt id>#<sample>"
        "category": datasets.Value("string"),
        "input_ids": datasets.List(datasets.Value("int32")),  # prompt + response (stop token included if emitted)
        "prompt_len": datasets.Value("int32"),  # the response (and the loss mask) starts here
    }
    if top_k is not None:  # one row of K per response token
        cols["topk_ids"] = datasets.List(datasets.List(datasets.Value("int32"), length=top_k))
        cols["topk_logprobs"] = datasets.List(datasets.List(datasets.Value("float16"), length=top_k))
    if aux_width is not None:  # one row per token of prompt + response: every position is an EAGLE-3 key
        cols[AUX_HIDDEN] = datasets.List(datasets.List(datasets.Value("float16"), length=aux_width))
    return datasets.Features(cols)


# ----------------------------------------------------------------------------------------------------------------
# Entry point


def generate_teacher_data(
    teacher,
    tokenizer,
    cfg: DataConfig,
    out_dir: Path,
    *,
    teacher_id: str,
    seed: int = 0,
    rank: int = 0,
    world_size: int = 1,
    barrier: Callable[[], None] | None = None,
    aux_layers: list[int] | None = None,
    cpu_fast_path: bool = True,
    cpu_compile: bool = False,
) -> TeacherData:
    """Generate (or find cached) teacher answers to the training and held-out prompts.

    The answers are decoded by `specdec_runtime.bench.fast_model(teacher, cpu_fast_path)` (on the CPU the runtime's
    fast CPU path, `target.cpu_fast_path`, its steps compiled with `cpu_compile`, `target.cpu_compile`); the top-k
    cache and hidden states come from the HF teacher itself.

    `aux_layers` (HF output_hidden_states indices): with the offline cache on, also store the teacher's hidden
    states there, fp16, at every position (`AUX_HIDDEN`), for EAGLE-3 candidates that train from the cache.

    Validation prompts are never trained on: training prompts that also appear in `cfg.validation_prompts` (all of
    it, not only the first max_validation_prompts) are dropped, and the count is printed.

    `teacher_id` identifies the teacher weights (spec + resolved folder) in the fingerprint. With world_size > 1,
    the i-th shard is written by rank i % world_size and rank 0 merges; `barrier` (e.g. `accelerator.wait_for_everyone`)
    must be passed when the ranks run concurrently, so rank 0 merges only once every shard is written.
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, world_size={world_size}), got {rank}")
    vocab = teacher.config.vocab_size
    if cfg.teacher_cache and cfg.teacher_cache_top_k > vocab:
        raise ValueError(
            f"data.teacher_cache_top_k={cfg.teacher_cache_top_k} exceeds the teacher's vocabulary ({vocab}); lower it"
        )
    out_dir = Path(out_dir)
    stop_ids = list(stop_token_ids(teacher, tokenizer))
    job = dict(cfg=cfg, out_dir=out_dir, teacher_id=teacher_id, seed=seed, stop_ids=stop_ids, rank=rank)
    decoder = fast_model(teacher, cpu_fast_path, cpu_compile=cpu_compile)  # the model the engine decodes with
    write_self_instruct = functools.partial(_self_instruct_records, decoder, tokenizer, barrier=barrier, **job)
    train_records = concat_sources(load_sources(cfg.prompts, self_instruct=write_self_instruct))
    eval_records = load_prompts(cfg.validation_prompts)
    train_records = drop_held_out(train_records, eval_records, log=print if rank == 0 else None)
    splits = {
        "teacher": (cfg.prompts, train_records[: cfg.max_prompts or None]),
        "teacher-eval": (cfg.validation_prompts, eval_records[: cfg.max_validation_prompts or None]),
    }
    prompt_ids = {}
    for split, (source, records) in splits.items():  # every check before any generation
        if not records:
            raise ValueError(f"no prompts to answer from {source!r}; pass a prompt set with at least one prompt")
        prompt_ids[split] = render_prompts(tokenizer, records, cfg.max_prompt_tokens)
        check_context(teacher, records, prompt_ids[split], cfg.max_new_tokens)
    with _datasets_bars_off():
        paths = {
            split: _generate_split(
                split,
                records,
                prompt_ids[split],
                teacher,
                decoder,
                world_size=world_size,
                barrier=barrier,
                aux_layers=aux_layers if cfg.teacher_cache else None,
                **job,
            )
            for split, (_, records) in splits.items()
        }
    return TeacherData(train=paths["teacher"], eval=paths["teacher-eval"])


def load_teacher_data(path: Path) -> datasets.Dataset:
    """The finished dataset at `path`; refuses a folder whose generation has not completed."""
    path = Path(path)
    if not (path / COMPLETE).is_file():
        raise ValueError(
            f"{path} is not a finished teacher dataset (no {COMPLETE} marker): its generation was "
            "interrupted or is still running; rerun `specdistill data` to finish it"
        )
    return datasets.load_from_disk(str(path))


def load_training_split(
    path: Path, columns: list[str], *, split: str, max_seq_len: int, log: Callable[[str], object] = print
) -> datasets.Dataset:
    """The finished `split` dataset (train or eval) at `path` with `columns` only; refused when it lacks a column
    (the top-k cache) or holds nothing to learn from within `max_seq_len` tokens."""
    ds = load_teacher_data(path)
    if len(ds) == 0:
        raise ValueError(f"{path} holds no sequences; generate the {split} data again")
    if missing := [c for c in columns if c not in ds.column_names]:
        raise ValueError(
            f"{path} has no {missing} columns; distill.teacher=cache needs data generated with data.teacher_cache=true"
        )
    full = int((np.asarray(ds.select_columns(["prompt_len"])[:]["prompt_len"]) >= max_seq_len).sum())
    if full == len(ds):
        raise ValueError(
            f"every prompt in {path} fills train.max_seq_len={max_seq_len}: no response token is left to learn "
            "from; raise train.max_seq_len"
        )
    if full:
        log(
            f"warning: {full} of {len(ds)} sequences in {path} keep no response token within "
            f"train.max_seq_len={max_seq_len}"
        )
    return ds.select_columns(columns)


def cache_stats(path: Path) -> dict:
    """Size of the offline teacher cache: {"tokens", "bytes_per_token", "top_k"} (raw payload of both columns)."""
    table = load_teacher_data(path).data
    if "topk_ids" not in table.column_names:
        raise ValueError(f"{path} has no offline teacher cache; generate it with data.teacher_cache=true")
    return _cache_payload(table)


def _cache_payload(table) -> dict:
    tokens = pc.sum(pc.list_value_length(table.column("topk_ids"))).as_py() or 0
    payload = 0
    for name in ("topk_ids", "topk_logprobs"):
        values = pc.list_flatten(pc.list_flatten(table.column(name)))
        payload += len(values) * values.type.byte_width
    top_k = table.schema.field("topk_ids").type.value_type.list_size
    return {"tokens": tokens, "bytes_per_token": payload / max(tokens, 1), "top_k": top_k}


# ----------------------------------------------------------------------------------------------------------------
# Leaf functions


def check_context(teacher, records: list[PromptRecord], prompt_ids: list[list[int]], max_new_tokens: int) -> None:
    """Refuse, before any generation, a prompt whose answer could run past the teacher's context window."""
    context = getattr(teacher.config, "max_position_embeddings", None)
    if not context:
        return
    longest = max(range(len(records)), key=lambda i: len(prompt_ids[i]))
    if len(prompt_ids[longest]) + max_new_tokens > context:
        raise ValueError(
            f"prompt {records[longest].id!r} has {len(prompt_ids[longest])} tokens: with data.max_new_tokens="
            f"{max_new_tokens} it exceeds the teacher's context of {context} tokens; lower data.max_new_tokens or "
            "data.max_prompt_tokens (longer prompts are refused)"
        )


def training_prompts(cfg: DataConfig) -> list[PromptRecord] | None:
    """The prompts the `data` stage answers for training: data.prompts (a list's sources concatenated) without the
    data.validation_prompts, the first data.max_prompts of them; None for self_instruct (the teacher writes those at
    data time)."""
    if cfg.prompts == SELF_INSTRUCT:
        return None
    return [r for _, records in training_prompts_by_source(cfg) for r in records]


def training_prompts_by_source(cfg: DataConfig) -> list[tuple[str, list[PromptRecord]]]:
    """`training_prompts` as (source, records) per source of data.prompts. A self_instruct source is written at data
    time and counts as empty here, so the other sources keep at least the prompts the data stage answers."""
    parts = load_sources(cfg.prompts)
    kept = drop_held_out(concat_sources(parts), load_prompts(cfg.validation_prompts), log=None)
    ids = {r.id for r in kept[: cfg.max_prompts or None]}
    return [(source, [r for r in records if r.id in ids]) for source, records in parts]


def validation_prompts(cfg: DataConfig) -> list[PromptRecord]:
    """The prompts the `data` stage answers for validation (checkpoint selection, best/): the first
    data.max_validation_prompts of data.validation_prompts."""
    return load_prompts(cfg.validation_prompts)[: cfg.max_validation_prompts or None]


def check_test_prompts(cfg: DataConfig, test: Sequence[PromptRecord], source: str) -> None:
    """Refuse test prompts (eval.prompts=`source`) that the drafts were trained or selected on: compared with the
    training and validation prompts the data stage answers, by `prompt_key` as `drop_held_out` does, with the count
    per source of a data.prompts list. Prompts of a self_instruct source are written at data time and not checked."""
    parts = training_prompts_by_source(cfg)
    keys = ["data.prompts"] if isinstance(cfg.prompts, str) else [f"data.prompts[{i}]" for i in range(len(parts))]
    roles = {f"training prompts ({key}={source})": records for key, (source, records) in zip(keys, parts)}
    roles[f"validation prompts (data.validation_prompts={cfg.validation_prompts})"] = validation_prompts(cfg)
    shared = {role: n for role, records in roles.items() if (n := overlap_count(test, records))}
    if shared:
        overlaps = " and ".join(f"{n} with the {role}" for role, n in shared.items())
        raise ValueError(
            f"{len(test)} test prompts (eval.prompts={source}) share {overlaps}; test prompts must be unseen by "
            "training and checkpoint selection: point eval.prompts at a disjoint set (e.g. builtin:test)"
        )


def drop_held_out(
    records: list[PromptRecord], held_out: Sequence[PromptRecord], *, log: Callable[[str], object] | None = print
) -> list[PromptRecord]:
    """The training `records` without the prompts that also appear in `held_out` (order kept)."""
    kept = without_prompts(records, held_out)
    if len(kept) < len(records) and log is not None:
        log(
            f"data: dropped {len(records) - len(kept)} of {len(records)} training prompts that are also validation "
            "prompts (data.validation_prompts): validation prompts are never trained on"
        )
    if records and not kept:
        raise ValueError(
            "every training prompt is also a validation prompt; point data.prompts and data.validation_prompts at "
            "disjoint sets (e.g. builtin:train and builtin:validation)"
        )
    return kept


def topk_from_logits(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits (B, T, V) -> the k largest temperature-1 log-probs (B, T, K) as float16 and their ids (B, T, K) int32."""
    logprobs = F.log_softmax(logits, dim=-1, dtype=torch.float32)  # (B, T, V), fp32 so the normaliser is exact
    values, ids = logprobs.topk(k, dim=-1)  # (B, T, K)
    return values.half(), ids.int()


def shards_for_rank(num_shards: int, rank: int, world_size: int) -> list[int]:
    """Shard indices this rank writes: round-robin, so ranks share the work evenly."""
    return list(range(rank, num_shards, world_size))


def shard_name(first_batch: int) -> str:
    return f"shard-{first_batch:05d}"


def shard_spans(num_rows: int, cfg: DataConfig, world_size: int) -> list[tuple[int, slice]]:
    """(first batch, row span) of every shard: runs of whole batches of about data.shard_size prompts, fewer when
    that would leave a process without a shard (300 prompts in shards of 256 would be 2 shards for 8 GPUs, and 6
    GPUs waiting for 2 in a barrier)."""
    num_batches = math.ceil(num_rows / cfg.batch_size)
    wanted = math.ceil(cfg.shard_size * cfg.num_samples / cfg.batch_size)
    per_shard = max(1, min(wanted, num_batches // world_size))
    bs = cfg.batch_size
    return [(b, slice(b * bs, min(num_rows, (b + per_shard) * bs))) for b in range(0, num_batches, per_shard)]


def render_prompts(tokenizer, records: list[PromptRecord], max_prompt_tokens: int) -> list[list[int]]:
    """Chat-templated prompt ids; refuses (naming the prompt) any longer than max_prompt_tokens."""
    out = []
    for record in records:
        ids = render_chat(tokenizer, record.messages)
        if len(ids) > max_prompt_tokens:
            raise ValueError(
                f"prompt {record.id!r} has {len(ids)} tokens after the chat template, more than "
                f"data.max_prompt_tokens={max_prompt_tokens}; shorten or drop it, or raise the limit"
            )
        out.append(ids)
    return out


def fingerprint(
    split: str,
    records: list[PromptRecord],
    prompt_ids: list[list[int]],
    cfg: DataConfig,
    teacher_id: str,
    teacher_dtype: str,
    seed: int,
    stop_ids: list[int],
    aux_layers: list[int] | None = None,
) -> str:
    """sha256[:12] over everything that decides the written tokens (and cached aux layers), and nothing else.

    batch_size is in it because each batch samples from its own generator: regrouping the rows changes which random
    numbers each row sees. shard_size is not: shards are runs of whole batches.
    """
    settings = {
        name: getattr(cfg, name)
        for name in ("num_samples", "max_new_tokens", "temperature", "top_k", "top_p", "batch_size")
    }
    key = {
        "format": FORMAT_VERSION,
        "split": split,
        "teacher": teacher_id,
        "dtype": teacher_dtype,
        "seed": seed,
        "stop_ids": stop_ids,
        "settings": settings,
        "teacher_cache": cfg.teacher_cache_top_k if cfg.teacher_cache else 0,
        "prompts": [[r.id, r.category, r.messages, ids] for r, ids in zip(records, prompt_ids)],
    }
    if aux_layers:  # only then: data generated before EAGLE-3 keeps its fingerprint
        key["aux_layers"] = aux_layers
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:12]


def batch_seed(seed: int, split: str, first: int, batch: int) -> int:
    """The seed of batch `batch` of the shard starting at batch `first`, one per (split, first + batch): the tokens
    never depend on the shard layout, the process count, or which run wrote them."""
    digest = hashlib.sha256(f"{seed}/{split}/{first + batch}".encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 1  # manual_seed takes a non-negative int64


# ----------------------------------------------------------------------------------------------------------------
# One split: shards -> merged dataset


def _generate_split(
    split: str,
    records: list[PromptRecord],
    prompt_ids: list[list[int]],
    teacher,
    decoder,
    *,
    cfg: DataConfig,
    out_dir: Path,
    teacher_id: str,
    seed: int,
    stop_ids: list[int],
    rank: int,
    world_size: int,
    barrier: Callable[[], None] | None,
    aux_layers: list[int] | None,
) -> Path:
    dtype = str(next(teacher.parameters()).dtype)
    key = fingerprint(split, records, prompt_ids, cfg, teacher_id, dtype, seed, stop_ids, aux_layers)
    root = out_dir / f"{split}-{key}"
    aux_width = len(aux_layers) * teacher.config.hidden_size if aux_layers else None
    if (root / COMPLETE).is_file():
        if rank == 0:
            print(f"{split}: cached, {_summary(json.loads((root / COMPLETE).read_text()), root)}")
        return root

    rows = [(r, ids, s) for r, ids in zip(records, prompt_ids) for s in range(cfg.num_samples)]
    shards = shard_spans(len(rows), cfg, world_size)
    mine = [shards[i] for i in shards_for_rank(len(shards), rank, world_size)]
    todo = [(b, span) for b, span in mine if not _shard_done(root / "shards" / shard_name(b), span)]
    with tqdm(total=sum(span.stop - span.start for _, span in todo), desc=split, unit="seq", disable=rank != 0) as bar:
        for b, span in todo:
            columns = _generate_shard(
                teacher,
                decoder,
                rows[span],
                cfg,
                stop_ids,
                functools.partial(batch_seed, seed, split, b),
                bar.update,
                aux_layers,
            )
            _write_atomic(
                datasets.Dataset.from_dict(columns, features=features(_cache_k(cfg), aux_width)),
                root / "shards" / shard_name(b),
            )
    if barrier is not None:
        barrier()
    if rank == 0:
        names = [shard_name(b) for b, _ in shards]
        summary = _merge(root, names, num_prompts=len(records), num_samples=cfg.num_samples, aux_layers=aux_layers)
        print(f"{split}: {_summary(summary, root)}")
    if barrier is not None:
        barrier()  # the other ranks return only once the merged dataset exists
    return root


def _shard_done(path: Path, span: slice) -> bool:
    """The shard is written with this layout (another process count lays out other shards, whose leftovers are
    redone or, unnamed now, dropped with shards/)."""
    return path.is_dir() and datasets.load_from_disk(str(path)).num_rows == span.stop - span.start


def _generate_shard(
    teacher,
    decoder,
    rows: list[tuple[PromptRecord, list[int], int]],
    cfg: DataConfig,
    stop_ids: list[int],
    seed_of: Callable[[int], int],
    progress: Callable[[int], object],
    aux_layers: list[int] | None = None,
) -> dict:
    """Columns of one shard: its (prompt, prompt ids, sample) rows, generated batch_size sequences at a time by
    `decoder` (the teacher, or its fast runtime model); the top-k cache comes from the HF teacher."""
    sampling = SamplingParams(temperature=cfg.temperature, top_k=cfg.top_k, top_p=cfg.top_p)
    columns: dict[str, list] = {name: [] for name in features(_cache_k(cfg), 1 if aux_layers else None)}
    for b, start in enumerate(range(0, len(rows), cfg.batch_size)):
        batch = rows[start : start + cfg.batch_size]
        generator = torch.Generator(device=teacher.device).manual_seed(seed_of(b))
        result = generate(
            decoder,
            None,
            [ids for _, ids, _ in batch],
            sampling=sampling,
            max_new_tokens=cfg.max_new_tokens,
            stop_token_ids=stop_ids,
            generator=generator,
        )
        seqs = [ids + new for (_, ids, _), new in zip(batch, result.tokens)]
        columns["id"] += [f"{r.id}#{s}" for r, _, s in batch]
        columns["category"] += [r.category for r, _, _ in batch]
        columns["input_ids"] += [np.asarray(seq, dtype=np.int32) for seq in seqs]
        columns["prompt_len"] += [len(ids) for _, ids, _ in batch]
        if cfg.teacher_cache:
            prompt_lens, k = [len(ids) for _, ids, _ in batch], cfg.teacher_cache_top_k
            logprobs, ids, aux = _teacher_topk(teacher, seqs, prompt_lens, k, aux_layers)
            columns["topk_logprobs"] += logprobs
            columns["topk_ids"] += ids
            if aux_layers:
                columns[AUX_HIDDEN] += aux
        progress(len(batch))
    return columns


SCORE_ROWS = 8
"""Rows per scoring forward of the top-k cache: the forward holds (rows, T, V) fp32 logits, their log-softmax and,
for EAGLE-3 candidates, every layer's hidden states; 32 rows of ~450 tokens of SmolLM2 peaked at ~11 GiB."""


def _teacher_topk(
    teacher, seqs: list[list[int]], prompt_lens: list[int], k: int, aux_layers: list[int] | None = None
) -> tuple[list[np.ndarray], list[np.ndarray], list[np.ndarray] | None]:
    """`_score_rows` over `SCORE_ROWS` rows at a time: the same per-row arrays with a bounded peak memory."""
    logprobs, ids, aux = [], [], [] if aux_layers else None
    for i in range(0, len(seqs), SCORE_ROWS):
        lp, top, hidden = _score_rows(teacher, seqs[i : i + SCORE_ROWS], prompt_lens[i : i + SCORE_ROWS], k, aux_layers)
        logprobs += lp
        ids += top
        if aux is not None:
            aux += hidden
    return logprobs, ids, aux


def _score_rows(
    teacher, seqs: list[list[int]], prompt_lens: list[int], k: int, aux_layers: list[int] | None = None
) -> tuple[list[np.ndarray], list[np.ndarray], list[np.ndarray] | None]:
    """One teacher forward over prompt + response rows -> per row (R, K) fp16 log-probs and (R, K) int32 ids, and
    with `aux_layers` the (len(seq), n_aux * H) fp16 hidden states of those layers (their inputs) at every position.

    Row j of a sequence's top-k arrays is the distribution that predicted its token prompt_len + j.
    """
    T = max(len(s) for s in seqs)
    # Right padding needs no attention mask: under causal attention, pads after a token cannot change its logits.
    x = torch.tensor([s + [0] * (T - len(s)) for s in seqs], device=teacher.device)  # (B, T)
    first = min(prompt_lens) - 1  # earliest position whose logits predict a response token
    with torch.inference_mode():
        out = teacher(input_ids=x, logits_to_keep=T - first, output_hidden_states=bool(aux_layers))
        logprobs, ids = topk_from_logits(out.logits[:, :-1], k)  # (B, T - 1 - first, K) each
        aux = torch.cat([out.hidden_states[i] for i in aux_layers], -1).half().cpu().numpy() if aux_layers else None
    logprobs, ids = logprobs.cpu().numpy(), ids.cpu().numpy()
    spans = [slice(p - 1 - first, len(s) - 1 - first) for s, p in zip(seqs, prompt_lens)]
    rows = [aux[b, : len(s)] for b, s in enumerate(seqs)] if aux is not None else None
    return [logprobs[b, span] for b, span in enumerate(spans)], [ids[b, span] for b, span in enumerate(spans)], rows


def _write_atomic(ds: datasets.Dataset, path: Path) -> None:
    """save_to_disk into a staged folder renamed into place: a shard folder either is complete or does not exist."""
    with staged_dir(path) as tmp:
        ds.save_to_disk(str(tmp))


def _merge(root: Path, shards: list[str], *, num_prompts: int, num_samples: int, aux_layers=None) -> dict:
    """Concatenate the shards into `root`, write the marker last, then drop the shards."""
    paths = [root / "shards" / name for name in shards]
    missing = [p.name for p in paths if not p.is_dir()]
    if missing:
        raise RuntimeError(
            f"{root}: {', '.join(missing)} missing; with world_size > 1 every rank must run "
            "generate_teacher_data, and concurrent ranks must pass barrier="
        )
    ds = datasets.concatenate_datasets([datasets.load_from_disk(str(p)) for p in paths])
    ds.save_to_disk(str(root))
    lengths = pc.list_value_length(ds.data.column("input_ids"))
    tokens = pc.sum(lengths).as_py() - pc.sum(ds.data.column("prompt_len")).as_py()
    summary = {"prompts": num_prompts, "samples": num_samples, "rows": len(ds), "response_tokens": tokens}
    if "topk_ids" in ds.column_names:
        summary["cache_bytes_per_token"] = _cache_payload(ds.data)["bytes_per_token"]
    if AUX_HIDDEN in ds.column_names:  # fp16 values over every position, per response token like the top-k
        values = pc.list_flatten(pc.list_flatten(ds.data.column(AUX_HIDDEN)))
        summary |= {"aux_layers": aux_layers, "aux_bytes_per_token": len(values) * 2 / max(tokens, 1)}
    write_text(root / COMPLETE, json.dumps(summary))
    shutil.rmtree(root / "shards", ignore_errors=True)
    return summary


def _summary(summary: dict, root: Path) -> str:
    cache = summary.get("cache_bytes_per_token")
    return (
        f"{summary['prompts']} prompts x {summary['samples']} samples = {summary['rows']} sequences, "
        f"{summary['response_tokens']} response tokens"
        + (f", offline teacher cache {cache:.0f} bytes/token" if cache is not None else "")
        + (
            f", aux hidden states of layers {summary['aux_layers']} {summary['aux_bytes_per_token']:.0f} bytes/token"
            if "aux_layers" in summary
            else ""
        )
        + f" -> {root}"
    )


def _cache_k(cfg: DataConfig) -> int | None:
    return cfg.teacher_cache_top_k if cfg.teacher_cache else None


@contextlib.contextmanager
def _datasets_bars_off() -> Iterator[None]:
    """datasets draws a bar for every shard it saves, which would bury the generation bar."""
    if datasets.utils.are_progress_bars_disabled():
        yield
        return
    datasets.utils.disable_progress_bars()
    try:
        yield
    finally:
        datasets.utils.enable_progress_bars()


# ----------------------------------------------------------------------------------------------------------------
# Self-instruct: the teacher writes the prompts (once; every rank and every resumed run reads the same file)


def _self_instruct_records(
    teacher,
    tokenizer,
    *,
    cfg: DataConfig,
    out_dir: Path,
    teacher_id: str,
    seed: int,
    stop_ids: list[int],
    rank: int,
    barrier: Callable[[], None] | None,
) -> list[PromptRecord]:
    settings = [cfg.self_instruct_count, cfg.max_new_tokens, cfg.batch_size]  # these decide the written prompts
    key = hashlib.sha256(json.dumps([FORMAT_VERSION, teacher_id, seed, settings]).encode())
    path = out_dir / f"{SELF_INSTRUCT}-{key.hexdigest()[:12]}.jsonl"
    if not path.is_file() and rank == 0:
        generator = torch.Generator(device=teacher.device).manual_seed(seed)

        def generate_fn(chats: list[list[dict]]) -> list[str]:
            prompts = [render_chat(tokenizer, chat) for chat in chats]
            result = generate(
                teacher,
                None,
                prompts,
                sampling=SELF_INSTRUCT_SAMPLING,
                generator=generator,
                max_new_tokens=cfg.max_new_tokens,
                stop_token_ids=stop_ids,
            )
            return [tokenizer.decode(t, skip_special_tokens=True) for t in result.tokens]

        records = self_instruct_prompts(generate_fn, cfg.self_instruct_count, seed, batch_size=cfg.batch_size)
        save_prompts(records, path)  # atomic: a crash never leaves half a prompt file that is then reused
        print(f"{SELF_INSTRUCT}: the teacher wrote {len(records)} prompts -> {path}")
    if barrier is not None:
        barrier()
    if not path.is_file():
        raise RuntimeError(
            f"{path} is missing: rank 0 writes the self_instruct prompts; concurrent ranks must pass barrier="
        )
    return load_prompts(path)


# ----------------------------------------------------------------------------------------------------------------
# Training batches: the distillation recipe's row order, micro-batches and on-policy rows

IGNORE = -100  # label of a position that predicts no response token


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
    columns = ds[indices]  # {column: [value per row]}
    return [dict(zip(columns, values)) for values in zip(*columns.values())]


def collate(rows: list[dict], *, max_seq_len: int, pad_id: int, topk: bool) -> dict[str, torch.Tensor]:
    """Right-padded batch of (prompt + response) rows, truncated to `max_seq_len` from the response end.

    labels[b, t] is the token that position t predicts when it is a response token, IGNORE elsewhere, so the loss
    mask is `labels != IGNORE`. With `topk`, the cached teacher top-k of response token j (which predicted token
    prompt_len + j) sits at position prompt_len + j - 1, aligned with labels.
    """
    ids = [row["input_ids"][:max_seq_len] for row in rows]
    B, T = len(rows), max(len(x) for x in ids)
    input_ids = torch.full((B, T), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((B, T), dtype=torch.long)
    labels = torch.full((B, T), IGNORE, dtype=torch.long)
    if topk:
        K = next((len(row["topk_ids"][0]) for row in rows if row["topk_ids"]), 1)
        # Harmless filler where no response token is predicted: K distinct ids holding K/(K+1) of the mass.
        topk_ids = torch.arange(K).expand(B, T, K).clone()  # (B, T, K)
        topk_logprobs = torch.full((B, T, K), -math.log(K + 1))  # (B, T, K)
    for b, (row, x) in enumerate(zip(rows, ids)):
        n, P = len(x), row["prompt_len"]
        input_ids[b, :n] = torch.tensor(x)
        attention_mask[b, :n] = 1
        first = max(P, 1)  # first response token that some position predicts
        if first < n:
            labels[b, first - 1 : n - 1] = input_ids[b, first:n]
            if topk:
                topk_ids[b, first - 1 : n - 1] = torch.tensor(row["topk_ids"][first - P : n - P])
                topk_logprobs[b, first - 1 : n - 1] = torch.tensor(row["topk_logprobs"][first - P : n - P])
    batch = {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}
    if topk:
        batch |= {"topk_ids": topk_ids, "topk_logprobs": topk_logprobs}
    return batch


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
