"""Teacher-generated distillation data (sequence-level KD), written in resumable shards, and the offline top-k cache.

The teacher answers every training prompt `num_samples` times; the answers are the distillation data (Kim & Rush
2016, sequence-level KD). The validation prompts get the same treatment in a second dataset. Which prompts play
which role is distill/prompt_roles.py's call; the training batches are built from these datasets in
distill/batches.py.

    data = generate_teacher_data(teacher, tokenizer, cfg.data, Path(cfg.output_dir) / "data", teacher_id=spec)
    train = load_teacher_data(data.train)   # columns: id, category, input_ids, prompt_len[, topk_ids, topk_logprobs]
                                            # [, topk_start: with prompt_topk, the top-k rows start at token 1]

From the command line (CPU, 1 GPU, N processes: each writes its own shards, rank 0 merges):

    specdistill data configs/quickstart.yaml
    torchrun --nproc_per_node 2 -m specdistill data configs/quickstart.yaml

On disk, `<out_dir>/teacher-<fingerprint>/` (and `teacher-eval-<fingerprint>/`) is a `save_to_disk` folder finished
by a `.complete` marker. The rows, every (prompt, sample) pair in order, are generated batch_size at a time, batch j
with its own seeded generator, so the tokens depend neither on the process count nor on the shards. A shard is a run
of whole batches (about shard_size prompts, fewer when that would leave a process without one), written to
`shards/.tmp-shard-<first batch>` and renamed to `shards/shard-<first batch>`, so a killed run resumes at the first
missing shard with nothing lost or repeated, and writes the same tokens an uninterrupted one would.

With `data.generator: endpoint` the responses come from an OpenAI-compatible server instead (distill/endpoint.py
asks and stores): each row, keyed by its index, lands in `<out_dir>/<split>-responses-<key>/` as it arrives, and
only the rows of this process's missing shards that are not stored yet are asked for; the shards are then written
from the stored responses as above (the scoring pass is our teacher's), in the same format.

    specdistill data CONFIG data.generator=endpoint data.endpoint.url=http://localhost:8000/v1 \
        data.endpoint.model=NAME [--fetch-only]    # --fetch-only: the responses alone, no weights loaded
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import math
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import datasets
import numpy as np
import pyarrow.compute as pc
import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from distill.config import DataConfig
from distill.endpoint import Fetcher, Request, Sampling, endpoint_summary, response_store
from distill.prompt_roles import training_prompts, validation_prompts
from distill.prompts import SELF_INSTRUCT, PromptRecord, load_prompts, render_chat, save_prompts
from distill.self_instruct import self_instruct_prompts
from specdec_runtime.atomic import NETWORK_LAG_S, staged_dir, wait_for_files, write_text
from specdec_runtime.backends import BackendOptions, fast_model, plan_rows
from specdec_runtime.engine import SamplingParams, generate
from specdec_runtime.errors import UserError
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
    validation: Path
    """Teacher answers to the validation prompts, same format."""


AUX_HIDDEN = "aux_hidden"  # offline cache for EAGLE-3 heads: (tokens, n_aux * H) fp16, every prompt + response position
# The token the first top-k row predicts: 1 in a cache with prompt rows (distill.loss_on_prompt). Only such caches
# have the column; without it the rows start at prompt_len, as in every cache written before it existed.
TOPK_START = "topk_start"


def features(top_k: int | None, aux_width: int | None = None, prompt_topk: bool = False) -> datasets.Features:
    """Column types of the data; the top-k columns only when the offline teacher cache is on (top_k = K), the aux
    hidden states (n_aux * H wide) only when it also stores them for EAGLE-3 candidates, `TOPK_START` only when the
    top-k rows cover the prompt positions too (`prompt_topk`)."""
    cols = {
        "id": datasets.Value("string"),  # "<prompt id>#<sample>"
        "category": datasets.Value("string"),
        "input_ids": datasets.List(datasets.Value("int32")),  # prompt + response (stop token included if emitted)
        "prompt_len": datasets.Value("int32"),  # the response (and the loss mask) starts here
    }
    if top_k is not None:  # one row of K per predicted token: from TOPK_START (default prompt_len) to the end
        cols["topk_ids"] = datasets.List(datasets.List(datasets.Value("int32"), length=top_k))
        cols["topk_logprobs"] = datasets.List(datasets.List(datasets.Value("float16"), length=top_k))
        if prompt_topk:
            cols[TOPK_START] = datasets.Value("int32")
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
    prompt_topk: bool = False,
    backend: BackendOptions = BackendOptions(),
) -> TeacherData:
    """Generate (or find cached) teacher answers to the training and validation prompts.

    The answers are decoded by `specdec_runtime.backends.fast_model(teacher, backend)` (on the CPU the runtime's
    fast CPU path, `target.cpu_fast_path`, its steps compiled with `target.cpu_compile`: `TargetConfig.backend`), or
    with data.generator=endpoint asked of the server (those already stored are not asked again); the top-k cache
    and hidden states come from the HF teacher itself.

    `aux_layers` (HF output_hidden_states indices): with the offline cache on, also store the teacher's hidden
    states there, fp16, at every position (`AUX_HIDDEN`), for EAGLE-3 candidates that train from the cache.

    `prompt_topk`: with the offline cache on, the training split's top-k rows cover every position that predicts a
    token (tokens 1..len-1, `TOPK_START` = 1), for candidates with distill.loss_on_prompt; the validation split keeps
    the response rows only (validation measures response tokens).

    The prompts are `prompt_roles.training_prompts` (the self_instruct ones written here by the teacher) and
    `prompt_roles.validation_prompts`: validation prompts are never trained on, and the dropped count is printed.

    `teacher_id` identifies the teacher weights (spec + resolved folder) in the fingerprint. With world_size > 1,
    the i-th shard is written by rank i % world_size and rank 0 merges; `barrier` (e.g. `accelerator.wait_for_everyone`)
    must be passed when the ranks run concurrently, so rank 0 merges only once every shard is written.
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, world_size={world_size}), got {rank}")
    vocab = teacher.config.vocab_size
    if cfg.teacher_cache and cfg.teacher_cache_top_k > vocab:
        raise UserError(
            f"data.teacher_cache_top_k={cfg.teacher_cache_top_k} exceeds the teacher's vocabulary ({vocab}); lower it"
        )
    out_dir = Path(out_dir)
    stop_ids = list(stop_token_ids(teacher, tokenizer))
    job = dict(cfg=cfg, out_dir=out_dir, teacher_id=teacher_id, seed=seed, stop_ids=stop_ids, rank=rank)
    # The model the engine decodes with; with an endpoint only self_instruct decodes here, on the HF teacher.
    # the CPU fast path's layouts are planned for the batch's decode steps (every row count down to 1)
    decoder = fast_model(teacher, plan_rows(backend, cfg.batch_size, {1})) if cfg.generator == "runtime" else teacher
    write_self_instruct = functools.partial(_self_instruct_records, decoder, tokenizer, barrier=barrier, **job)
    context = getattr(teacher.config, "max_position_embeddings", None)
    splits = _prompt_splits(tokenizer, cfg, context, write_self_instruct, log=print if rank == 0 else None)
    split_job = dict(world_size=world_size, barrier=barrier, aux_layers=aux_layers if cfg.teacher_cache else None)
    # Validation measures response tokens only (train/validation.py): its cache never needs the prompt rows.
    prompt_rows = {"teacher": prompt_topk and cfg.teacher_cache, "teacher-eval": False}
    with _datasets_bars_off():
        if cfg.generator == "runtime":
            paths = {
                split: _generate_split(
                    split, records, ids, teacher, decoder, prompt_topk=prompt_rows[split], **split_job, **job
                )
                for split, (records, ids) in splits.items()
            }
        else:
            fetch = _fetcher(tokenizer, cfg, stop_ids, rank, world_size)
            paths = {
                split: _endpoint_split(
                    split, records, ids, teacher, fetch, prompt_topk=prompt_rows[split], **split_job, **job
                )
                for split, (records, ids) in splits.items()
            }
    return TeacherData(train=paths["teacher"], validation=paths["teacher-eval"])


def fetch_teacher_responses(
    tokenizer,
    cfg: DataConfig,
    out_dir: Path,
    *,
    context: int | None,
    stop_ids: list[int],
    teacher_id: str,
    seed: int = 0,
    rank: int = 0,
    world_size: int = 1,
    barrier: Callable[[], None] | None = None,
) -> list[Path]:
    """`specdistill data --fetch-only` (data.generator=endpoint): ask the server for every missing response of both
    splits and store it, with no model weights loaded (the server may hold every GPU). The scoring pass, the shards
    and the merged datasets come with the next `generate_teacher_data`, which finds the responses stored.

    `context` (the target's max_position_embeddings) and `stop_ids` (`stop_token_ids`) stand in for the model."""
    if cfg.generator != "endpoint":
        raise UserError("--fetch-only collects the responses of a server: set data.generator=endpoint")
    out_dir = Path(out_dir)
    job = dict(cfg=cfg, out_dir=out_dir, teacher_id=teacher_id, seed=seed, stop_ids=stop_ids, rank=rank)
    write_self_instruct = functools.partial(_self_instruct_records, None, tokenizer, barrier=barrier, **job)
    splits = _prompt_splits(tokenizer, cfg, context, write_self_instruct, log=print if rank == 0 else None)
    fetch, stores = _fetcher(tokenizer, cfg, stop_ids, rank, world_size), []
    for split, (records, ids) in splits.items():
        rows = _rows_of(records, ids, cfg)
        spans = [span for _, span in shard_spans(len(rows), cfg, world_size)]
        mine = [i for s in shards_for_rank(len(spans), rank, world_size) for i in range(spans[s].start, spans[s].stop)]
        stores.append(response_store(out_dir, split, records, ids, cfg, seed, stop_ids))
        fetch(stores[-1], mine, functools.partial(_request, rows, seed, split), desc=split)
    return stores


def load_teacher_data(path: Path) -> datasets.Dataset:
    """The finished dataset at `path`; refuses a folder whose generation has not completed."""
    path = Path(path)
    if not (path / COMPLETE).is_file():
        raise UserError(
            f"{path} is not a finished teacher dataset (no {COMPLETE} marker): its generation was "
            "interrupted or is still running; rerun `specdistill data` to finish it"
        )
    return datasets.load_from_disk(str(path))


# ----------------------------------------------------------------------------------------------------------------
# Leaf functions


def _prompt_splits(
    tokenizer, cfg: DataConfig, context: int | None, self_instruct, *, log
) -> dict[str, tuple[list[PromptRecord], list[list[int]]]]:
    """{split: (records, chat-templated prompt ids)} of the training and validation prompts, every prompt checked
    before any generation. The split names are in the fingerprints and seeds: renaming one regenerates all data."""
    splits = {
        "teacher": (cfg.prompts, training_prompts(cfg, self_instruct=self_instruct, log=log)),
        "teacher-eval": (cfg.validation_prompts, validation_prompts(cfg)),
    }
    out = {}
    for split, (source, records) in splits.items():
        if not records:
            raise UserError(f"no prompts to answer from {source!r}; pass a prompt set with at least one prompt")
        out[split] = (records, render_prompts(tokenizer, records, cfg.max_prompt_tokens))
        check_context(context, records, out[split][1], cfg.max_new_tokens)
    return out


def check_context(
    context: int | None, records: list[PromptRecord], prompt_ids: list[list[int]], max_new_tokens: int
) -> None:
    """Refuse, before any generation, a prompt whose answer could run past the teacher's context window."""
    if not context:
        return
    longest = max(range(len(records)), key=lambda i: len(prompt_ids[i]))
    if len(prompt_ids[longest]) + max_new_tokens > context:
        raise UserError(
            f"prompt {records[longest].id!r} has {len(prompt_ids[longest])} tokens: with data.max_new_tokens="
            f"{max_new_tokens} it exceeds the teacher's context of {context} tokens; lower data.max_new_tokens or "
            "data.max_prompt_tokens (longer prompts are refused)"
        )


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
            raise UserError(
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
    prompt_topk: bool = False,
) -> str:
    """sha256[:12] over everything that decides the written tokens (and cached aux layers, and whether the cached
    top-k covers the prompt positions), and nothing else.

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
    if prompt_topk:  # only then, likewise; a response-only cache is never taken for a loss_on_prompt run
        key["prompt_topk"] = True
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:12]


def endpoint_fingerprint(
    split: str,
    responses: str,
    cfg: DataConfig,
    teacher_id: str,
    teacher_dtype: str,
    aux_layers: list[int] | None,
    prompt_topk: bool = False,
) -> str:
    """sha256[:12] of an endpoint's finished split: its responses (`endpoint.response_store`) and what our target's
    scoring pass adds to them."""
    key = {
        "format": FORMAT_VERSION,
        "split": split,
        "responses": responses,
        "teacher": teacher_id,
        "dtype": teacher_dtype,
        "teacher_cache": cfg.teacher_cache_top_k if cfg.teacher_cache else 0,
        "aux_layers": aux_layers or [],
    }
    if prompt_topk:  # only then: finished splits written before the key existed keep their fingerprint
        key["prompt_topk"] = True
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
    prompt_topk: bool,
) -> Path:
    dtype = str(next(teacher.parameters()).dtype)
    key = fingerprint(split, records, prompt_ids, cfg, teacher_id, dtype, seed, stop_ids, aux_layers, prompt_topk)
    root = out_dir / f"{split}-{key}"
    if _cached(root, split, rank, barrier):
        return root
    rows = _rows_of(records, prompt_ids, cfg)
    shards = shard_spans(len(rows), cfg, world_size)
    todo = _shards_todo(root, shards, split, rank, world_size)
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
                prompt_topk,
            )
            shard = _shard_dataset(columns, cfg, teacher, aux_layers, prompt_topk)
            _write_atomic(shard, root / "shards" / shard_name(b))
    return _finish(root, split, shards, len(records), cfg, rank=rank, barrier=barrier, aux_layers=aux_layers)


def _endpoint_split(
    split: str,
    records: list[PromptRecord],
    prompt_ids: list[list[int]],
    teacher,
    fetch: Fetcher,
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
    prompt_topk: bool,
) -> Path:
    """`_generate_split` with the responses of a server (distill/endpoint.py): the rows of this rank's missing
    shards are asked for (those already stored are not), then scored by our teacher and written as shards alike."""
    store = response_store(out_dir, split, records, prompt_ids, cfg, seed, stop_ids)
    dtype = str(next(teacher.parameters()).dtype)
    key = endpoint_fingerprint(split, store.name, cfg, teacher_id, dtype, aux_layers, prompt_topk)
    root = out_dir / f"{split}-{key}"
    if _cached(root, split, rank, barrier):
        return root
    rows = _rows_of(records, prompt_ids, cfg)
    shards = shard_spans(len(rows), cfg, world_size)
    todo = _shards_todo(root, shards, split, rank, world_size)
    wanted = [i for _, span in todo for i in range(span.start, span.stop)]
    responses = fetch(store, wanted, functools.partial(_request, rows, seed, split), desc=split)
    where = responses["row"].to_numpy()
    quiet = rank != 0 or not cfg.teacher_cache  # without the cache the shards are written in a blink
    with tqdm(total=sum(span.stop - span.start for _, span in todo), desc=f"{split} scoring", disable=quiet) as bar:
        for b, span in todo:
            answers = responses["ids"].take(np.searchsorted(where, np.arange(span.start, span.stop))).to_pylist()
            columns = _empty_columns(cfg, aux_layers, prompt_topk)
            for start in range(0, len(answers), cfg.batch_size):  # scoring batches, as the runtime's
                batch, new = rows[span][start : start + cfg.batch_size], answers[start : start + cfg.batch_size]
                _append_rows(columns, teacher, batch, new, cfg, aux_layers, prompt_topk)
                bar.update(len(batch))
            shard = _shard_dataset(columns, cfg, teacher, aux_layers, prompt_topk)
            _write_atomic(shard, root / "shards" / shard_name(b))
    generator = functools.partial(endpoint_summary, store, cfg.endpoint.model)  # read once every rank has fetched
    job = dict(rank=rank, barrier=barrier, aux_layers=aux_layers, generator=generator)
    return _finish(root, split, shards, len(records), cfg, **job)


def _rows_of(records: list[PromptRecord], prompt_ids: list[list[int]], cfg: DataConfig) -> list[tuple]:
    """Every (prompt, prompt ids, sample) row of a split, in order: row i is the i-th of the split's data."""
    return [(r, ids, s) for r, ids in zip(records, prompt_ids) for s in range(cfg.num_samples)]


def _cached(root: Path, split: str, rank: int, barrier: Callable[[], None] | None) -> bool:
    """Whether `root` is a finished split, intact; a damaged one is said and removed (every rank reads it before
    rank 0 removes anything)."""
    # Listing the folders first: on a network filesystem a node that looked for the marker before rank 0 wrote it
    # may still hold the cached "no such file", and a rank that regenerates alone waits in `_finish`'s barrier.
    if wait_for_files([root / COMPLETE], 0.0):
        return False
    damage = _check_merged(root)
    if damage is None:
        if rank == 0:
            print(f"{split}: cached, {_summary(json.loads((root / COMPLETE).read_text()), root)}")
        return True
    if barrier is not None:
        barrier()
    if rank == 0:
        print(f"{split}: the cached data in {root} is damaged ({damage}); generating it again")
        shutil.rmtree(root)
    if barrier is not None:
        barrier()
    return False


def _shards_todo(root: Path, shards: list[tuple[int, slice]], split: str, rank: int, world_size: int) -> list:
    """This rank's shards that are not written whole yet."""
    mine = [shards[i] for i in shards_for_rank(len(shards), rank, world_size)]
    return [(b, span) for b, span in mine if not _shard_done(root / "shards" / shard_name(b), span, split)]


def _shard_dataset(
    columns: dict, cfg: DataConfig, teacher, aux_layers: list[int] | None, prompt_topk: bool
) -> datasets.Dataset:
    aux_width = len(aux_layers) * teacher.config.hidden_size if aux_layers else None
    return datasets.Dataset.from_dict(columns, features=features(_cache_k(cfg), aux_width, prompt_topk))


def _finish(
    root: Path,
    split: str,
    shards: list[tuple[int, slice]],
    num_prompts: int,
    cfg: DataConfig,
    *,
    rank: int,
    barrier: Callable[[], None] | None,
    aux_layers: list[int] | None,
    generator: Callable[[], dict] | None = None,
) -> Path:
    """Once every rank has written its shards, rank 0 merges them (with `generator()`, where the responses came
    from, in the marker); every rank returns once the merge exists."""
    if barrier is not None:
        barrier()
    if rank == 0:
        names = [shard_name(b) for b, _ in shards]
        if barrier is not None:  # renamed into place before the barrier, another node's shards may show late here
            wait_for_files([root / "shards" / name for name in names], NETWORK_LAG_S)
        job = dict(num_prompts=num_prompts, num_samples=cfg.num_samples, aux_layers=aux_layers)
        summary = _merge(root, names, **job, generator=generator() if generator else None)
        print(f"{split}: {_summary(summary, root)}")
    if barrier is not None:
        barrier()  # the other ranks return only once the merged dataset exists
        if rank != 0 and wait_for_files([root / COMPLETE], NETWORK_LAG_S):
            raise UserError(
                f"{root / COMPLETE}, written by rank 0, is not visible to rank {rank} after {NETWORK_LAG_S:.0f} s: "
                "output_dir must be on a filesystem every node shares (docs/distributed.md#multi-node)"
            )
    return root


MANIFEST = "manifest.json"  # in each shard: its row count and the sha256 of each of its files


def _shard_done(path: Path, span: slice, split: str) -> bool:
    """The shard is written, whole (its manifest's rows and checksums), with this layout (another process count
    lays out other shards, whose leftovers are redone or, unnamed now, dropped with shards/). A damaged shard is
    removed, said, and generated again."""
    if not path.is_dir():
        return False
    manifest = json.loads((path / MANIFEST).read_text()) if (path / MANIFEST).is_file() else {}
    damage = _check_files(path, manifest) if "files" in manifest else None  # older shards: rows only
    rows = _rows(path) if damage is None else None
    if damage is None and rows != span.stop - span.start:
        damage = "unreadable" if rows is None else f"{rows} rows where this layout has {span.stop - span.start}"
    if damage is None:
        return True
    print(f"{split}: shard {path.name} is damaged or stale ({damage}); generating it again")
    shutil.rmtree(path)
    return False


def _file_digests(folder: Path, *, checksums: bool = True) -> dict[str, dict]:
    """{file name: {bytes[, sha256]}} of the dataset files save_to_disk wrote into `folder`."""
    out = {}
    for path in sorted(p for p in folder.iterdir() if p.is_file() and p.name not in (MANIFEST, COMPLETE)):
        out[path.name] = {"bytes": path.stat().st_size}
        if checksums:
            digest = hashlib.sha256()
            with open(path, "rb") as f:
                for block in iter(lambda: f.read(1 << 20), b""):
                    digest.update(block)
            out[path.name]["sha256"] = digest.hexdigest()
    return out


def _check_files(folder: Path, record: dict, *, checksums: bool = True) -> str | None:
    """What is wrong with the files of a dataset folder against its record ({"files": ...}), None if nothing."""
    for name, want in record["files"].items():
        path = folder / name
        if not path.is_file():
            return f"{name} is missing"
        if path.stat().st_size != want["bytes"]:
            return f"{name} has {path.stat().st_size} bytes, {want['bytes']} were written"
    if checksums:
        have = _file_digests(folder)
        bad = [name for name, want in record["files"].items() if have[name]["sha256"] != want["sha256"]]
        if bad:
            return f"{bad[0]}'s checksum differs from the one written"
    return None


def _rows(folder: Path) -> int | None:
    try:
        return datasets.load_from_disk(str(folder)).num_rows
    except Exception:  # unreadable: counts as damage, reported by the caller
        return None


def _check_merged(root: Path) -> str | None:
    """What is wrong with a finished split (COMPLETE written): a file missing or of another size than the merge
    wrote, or fewer rows than it counted; None if nothing. Sizes, not checksums: a run checks them at every start,
    and a merged split can hold many GB (the shards' checksums guarded its parts while they were generated)."""
    record = json.loads((root / COMPLETE).read_text() or "{}")
    damage = _check_files(root, record, checksums=False) if "files" in record else None  # older splits: rows only
    if damage is not None:
        return damage
    rows = _rows(root)
    if rows is None:
        return "unreadable"
    return f"{rows} readable rows, {record['rows']} were written" if rows != record.get("rows", rows) else None


def _generate_shard(
    teacher,
    decoder,
    rows: list[tuple[PromptRecord, list[int], int]],
    cfg: DataConfig,
    stop_ids: list[int],
    seed_of: Callable[[int], int],
    progress: Callable[[int], object],
    aux_layers: list[int] | None = None,
    prompt_topk: bool = False,
) -> dict:
    """Columns of one shard: its (prompt, prompt ids, sample) rows, generated batch_size sequences at a time by
    `decoder` (the teacher, or its fast runtime model); the top-k cache comes from the HF teacher."""
    sampling = SamplingParams(temperature=cfg.temperature, top_k=cfg.top_k, top_p=cfg.top_p)
    columns = _empty_columns(cfg, aux_layers, prompt_topk)
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
        _append_rows(columns, teacher, batch, result.tokens, cfg, aux_layers, prompt_topk)
        progress(len(batch))
    return columns


def _empty_columns(cfg: DataConfig, aux_layers: list[int] | None, prompt_topk: bool = False) -> dict[str, list]:
    return {name: [] for name in features(_cache_k(cfg), 1 if aux_layers else None, prompt_topk)}


def _append_rows(
    columns: dict,
    teacher,
    batch: list[tuple],
    responses: list[list[int]],
    cfg: DataConfig,
    aux_layers,
    prompt_topk: bool = False,
) -> None:
    """Append a batch of (prompt, prompt ids, sample) rows and their response ids to `columns`; with the offline
    cache on, the teacher's top-k (and aux hidden states) over prompt + response come from one scoring forward: of
    the response tokens, or with `prompt_topk` of every token but the first (which no position predicts)."""
    seqs = [ids + list(new) for (_, ids, _), new in zip(batch, responses)]
    columns["id"] += [f"{r.id}#{s}" for r, _, s in batch]
    columns["category"] += [r.category for r, _, _ in batch]
    columns["input_ids"] += [np.asarray(seq, dtype=np.int32) for seq in seqs]
    columns["prompt_len"] += [len(ids) for _, ids, _ in batch]
    if cfg.teacher_cache:
        starts = [1 if prompt_topk else len(ids) for _, ids, _ in batch]  # the token each row's first top-k predicts
        logprobs, ids, aux = _teacher_topk(teacher, seqs, starts, cfg.teacher_cache_top_k, aux_layers)
        columns["topk_logprobs"] += logprobs
        columns["topk_ids"] += ids
        if prompt_topk:
            columns[TOPK_START] += starts
        if aux_layers:
            columns[AUX_HIDDEN] += aux


SCORE_ROWS = 8
"""Rows per scoring forward of the top-k cache: the forward holds (rows, T, V) fp32 logits, their log-softmax and,
for EAGLE-3 candidates, every layer's hidden states; 32 rows of ~450 tokens of SmolLM2 peaked at ~11 GiB. Keeping
the prompt rows' top-k too (distill.loss_on_prompt) adds only K values per position to what is kept."""


def _teacher_topk(
    teacher, seqs: list[list[int]], starts: list[int], k: int, aux_layers: list[int] | None = None
) -> tuple[list[np.ndarray], list[np.ndarray], list[np.ndarray] | None]:
    """`_score_rows` over `SCORE_ROWS` rows at a time: the same per-row arrays with a bounded peak memory."""
    logprobs, ids, aux = [], [], [] if aux_layers else None
    for i in range(0, len(seqs), SCORE_ROWS):
        lp, top, hidden = _score_rows(teacher, seqs[i : i + SCORE_ROWS], starts[i : i + SCORE_ROWS], k, aux_layers)
        logprobs += lp
        ids += top
        if aux is not None:
            aux += hidden
    return logprobs, ids, aux


def _score_rows(
    teacher, seqs: list[list[int]], starts: list[int], k: int, aux_layers: list[int] | None = None
) -> tuple[list[np.ndarray], list[np.ndarray], list[np.ndarray] | None]:
    """One teacher forward over prompt + response rows -> per row (R, K) fp16 log-probs and (R, K) int32 ids, and
    with `aux_layers` the (len(seq), n_aux * H) fp16 hidden states of those layers (their inputs) at every position.

    Row j of a sequence's top-k arrays is the distribution that predicted its token start + j (start: its prompt_len
    for the response rows, 1 for every predicted token), so R = len(seq) - start.
    """
    T = max(len(s) for s in seqs)
    # Right padding needs no attention mask: under causal attention, pads after a token cannot change its logits.
    x = torch.tensor([s + [0] * (T - len(s)) for s in seqs], device=teacher.device)  # (B, T)
    first = min(starts) - 1  # earliest position whose logits predict a kept token
    with torch.inference_mode():
        out = teacher(input_ids=x, logits_to_keep=T - first, output_hidden_states=bool(aux_layers))
        logprobs, ids = topk_from_logits(out.logits[:, :-1], k)  # (B, T - 1 - first, K) each
        aux = torch.cat([out.hidden_states[i] for i in aux_layers], -1).half().cpu().numpy() if aux_layers else None
    logprobs, ids = logprobs.cpu().numpy(), ids.cpu().numpy()
    spans = [slice(p - 1 - first, len(s) - 1 - first) for s, p in zip(seqs, starts)]
    rows = [aux[b, : len(s)] for b, s in enumerate(seqs)] if aux is not None else None
    return [logprobs[b, span] for b, span in enumerate(spans)], [ids[b, span] for b, span in enumerate(spans)], rows


def _write_atomic(ds: datasets.Dataset, path: Path) -> None:
    """save_to_disk into a staged folder renamed into place: a shard folder either is complete or does not exist."""
    with staged_dir(path) as tmp:
        ds.save_to_disk(str(tmp))
        write_text(tmp / MANIFEST, json.dumps({"rows": ds.num_rows, "files": _file_digests(tmp)}))


def _merge(
    root: Path, shards: list[str], *, num_prompts: int, num_samples: int, aux_layers=None, generator=None
) -> dict:
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
    if generator is not None:  # where the responses came from and what of the settings the server could not honour
        summary["generator"] = generator
    summary["files"] = _file_digests(root, checksums=False)
    if "topk_ids" in ds.column_names:
        summary["cache_bytes_per_token"] = _cache_bytes_per_token(ds.data, tokens)
        summary["cache_covers_prompt"] = TOPK_START in ds.column_names
    if AUX_HIDDEN in ds.column_names:  # fp16 values over every position, per response token like the top-k
        values = pc.list_flatten(pc.list_flatten(ds.data.column(AUX_HIDDEN)))
        summary |= {"aux_layers": aux_layers, "aux_bytes_per_token": len(values) * 2 / max(tokens, 1)}
    write_text(root / COMPLETE, json.dumps(summary))
    shutil.rmtree(root / "shards", ignore_errors=True)
    return summary


def _cache_bytes_per_token(table, response_tokens: int) -> float:
    """Raw payload of the offline teacher cache (both top-k columns) per response token: K x 6 bytes for a cache of
    response rows, more by the ratio of predicted tokens to response tokens for one with prompt rows."""
    payload = 0
    for name in ("topk_ids", "topk_logprobs"):
        values = pc.list_flatten(pc.list_flatten(table.column(name)))
        payload += len(values) * values.type.byte_width
    return payload / max(response_tokens, 1)


def _summary(summary: dict, root: Path) -> str:
    cache = summary.get("cache_bytes_per_token")
    return (
        f"{summary['prompts']} prompts x {summary['samples']} samples = {summary['rows']} sequences, "
        f"{summary['response_tokens']} response tokens"
        + (f", offline teacher cache {cache:.0f} bytes/token" if cache is not None else "")
        + (" (prompt positions included)" if summary.get("cache_covers_prompt") else "")
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
# Responses from an OpenAI-compatible server (data.generator=endpoint; the client is distill/endpoint.py)


def _fetcher(tokenizer, cfg: DataConfig, stop_ids: list[int], rank: int, world_size: int) -> Fetcher:
    sampling = Sampling(cfg.max_new_tokens, cfg.temperature, cfg.top_k, cfg.top_p)
    return Fetcher(cfg.endpoint, tokenizer, sampling, stop_ids, rank=rank, world_size=world_size)


def _request(rows: list[tuple], seed: int, split: str, row: int) -> Request:
    """Row `row`'s request; its seed is one per (seed, split, row), 31 bits (llama.cpp takes a uint32)."""
    return Request(row, rows[row][1], batch_seed(seed, split, 0, row) >> 32)


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
    if teacher is None and not path.is_file():  # --fetch-only: no model here to write them
        raise UserError(
            f"the {SELF_INSTRUCT} prompts are written by the target itself and {path} does not exist yet; run "
            "`specdistill data` once without --fetch-only, or drop self_instruct from data.prompts"
        )
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
        wait_for_files([path], NETWORK_LAG_S)  # rank 0 wrote it; on another node it may show late
    if not path.is_file():
        raise RuntimeError(
            f"{path} is missing: rank 0 writes the self_instruct prompts; concurrent ranks must pass barrier="
        )
    return load_prompts(path)
