"""The stages the CLI runs, composed from each folder's own entry points, plus `run`: all of them in order.

    data -> distill -> eval (report) -> promote (check, export the draft, write serving.yaml)

Each stage skips work whose outputs are already complete (teacher data by fingerprint, candidates by their DONE
marker, eval by a report made with the same config), so rerunning `specdistill run` after a crash continues where
it stopped. Multi-process launches (torchrun / accelerate launch) split data generation, distillation and eval;
the single-process stage (promote, which exports) runs on rank 0 only.

Across nodes (docs/distributed.md#multi-node): every process must see the same output_dir (checked when the run lock
is taken); model caches may be node-local. A choice that decides which collectives follow (skip a finished candidate,
reuse a report) is rank 0's, broadcast: another node's view of a network filesystem can lag behind.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from specdec_runtime.errors import UserError
from specdistill.config import RootConfig, dump_yaml, save_resolved, to_dict

if TYPE_CHECKING:  # train/ is imported by the stages that need it, so `specdistill --help` stays fast
    from train.loop import CandidateRun

# Config sections that decide what a candidate trains; their fingerprint marks a finished candidate (DONE).
TRAINING_SECTIONS = ("seed", "target", "draft", "data", "distill", "train")
# Keys that may change between a checkpoint and its resume (more steps, other cadences, another device).
RESUMABLE_CHANGES = {
    "target.device",
    "data.batch_size",
    "data.shard_size",
    "train.max_steps",
    "train.epochs",
    "train.eval_every",
    "train.save_every",
    "train.keep_last",
    "train.log_every",
    "train.resume",
    "train.mixed_precision",
    "train.shard_teacher",
    "train.timeout_minutes",
    "distill.chunked_head",
    "draft.pack_sequences",
    "draft.skip_untrained_rows",
    "train.max_micro_batch_tokens",
}
# Of those, the keys that change how a run executes and not what it trains (where the teacher's weights live, the
# process-group timeout, how the loss is chunked, whether an EAGLE-3 batch is packed or padded and its unroll skips
# the rows no loss reads, in how many passes a micro-batch runs: the same loss and gradients, so the same weights up
# to rounding). They stay out of the DONE fingerprint, so a finished candidate is not trained again when only they
# change.
EXECUTION_ONLY = {
    "train.shard_teacher",
    "train.timeout_minutes",
    "distill.chunked_head",
    "draft.pack_sequences",
    "draft.skip_untrained_rows",
    "train.max_micro_batch_tokens",
}


@dataclass
class Dist:
    """This process's place in a multi-process launch (one process: rank 0 of 1)."""

    rank: int
    world_size: int
    device: str
    state: object  # accelerate.PartialState

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def barrier(self) -> None:
        self.state.wait_for_everyone()

    def gather(self, obj) -> list:
        from accelerate.utils import gather_object

        return gather_object([obj])

    def broadcast(self, obj):
        """Rank 0's `obj` on every process."""
        return rank0_value(obj)


def rank0_value(value):
    """Rank 0's `value` on every process of the launch (`value` itself with one process)."""
    from accelerate import PartialState

    if PartialState().num_processes == 1:
        return value
    from accelerate.utils import broadcast_object_list

    return broadcast_object_list([value], from_process=0)[0]


LOCK_FILE = ".specdistill.lock"  # <output_dir>/.specdistill.lock: "PID HOST" of the run holding it


class RunLockedError(UserError):
    """Another run holds this output_dir's lock."""


class OutputDirError(UserError):
    """output_dir cannot be written."""


def describe_os_error(e: OSError) -> str:
    """An OSError from writing, said with its cause and the fix (a full disk, a read-only filesystem, a file in the
    way of a folder)."""
    import errno

    where = f" ({e.filename})" if e.filename else ""
    hints = {
        errno.ENOSPC: "the disk is full: free space there, or point output_dir at another disk",
        errno.EROFS: "read-only filesystem: point output_dir at a writable folder",
        errno.EACCES: "permission denied: point output_dir at a folder you can write",
        errno.EEXIST: "a file is in the way of a folder: remove it or choose another output_dir",
        errno.ENOTDIR: "a file is in the way of a folder: remove it or choose another output_dir",
    }
    return f"{e.strerror or e}{where}; " + hints.get(e.errno, "check the path")


@contextlib.contextmanager
def run_lock(output_dir: str | Path, dist: Dist, *, shared: bool = True):
    """One run per output_dir: rank 0 holds an exclusive lock on <output_dir>/.specdistill.lock for the block, and
    every process of its launch shares it. A second run (or launch) is refused with the holder's PID before it
    writes anything. The kernel drops the lock when its process dies (flock), so a file left by a killed run is no
    obstacle.

    Across nodes the lock is as good as the filesystem's: NFSv4 (and NFSv3 with lockd) holds it on the server, so a
    launch from any node is refused, and a lock whose node died is dropped when the server's lease ends (about 90
    s); a mount whose locks are node-local (NFS `nolock` or `local_lock=flock`, Lustre `localflock`) refuses only
    launches whose rank 0 shares the holder's node; a filesystem without locks (Lustre mounted without `flock`)
    runs unlocked, with a warning. `shared`: also check that every process sees the folder (`check_shared_dir`)."""
    import fcntl
    import os
    import socket
    import sys

    handle, holder = None, None
    if dist.is_main:
        path = Path(output_dir) / LOCK_FILE
        try:  # the first write of a run: an output_dir that cannot be written fails here, before any model loads
            path.parent.mkdir(parents=True, exist_ok=True)
            handle = open(path, "a+")  # held open (and locked) for the whole block
        except OSError as e:
            raise OutputDirError(f"cannot write to output_dir {output_dir}: {describe_os_error(e)}") from None
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            holder = handle.read().strip() or "unknown"
            handle.close()
            handle = None
        except OSError as e:  # ENOLCK, ENOSYS, EOPNOTSUPP: the lock is a safeguard; its absence must not stop the run
            print(
                f"specdistill: warning: {path}'s filesystem has no file locks ({e.strerror}): a second run on this "
                "output_dir would not be refused",
                file=sys.stderr,
                flush=True,
            )
            handle.close()
            handle = None
        else:
            handle.seek(0)
            handle.truncate()
            handle.write(f"{os.getpid()} {socket.gethostname()}\n")
            handle.flush()
    holder = dist.broadcast(holder)
    if holder is not None:
        pid, _, host = holder.partition(" ")
        raise RunLockedError(
            f"{output_dir} is in use by another specdistill run (PID {pid}{' on ' + host if host else ''}): wait "
            "for it to finish, or give this run another output_dir=..."
        )
    try:
        if shared:
            check_shared_dir(output_dir, dist)
        yield
    finally:
        if handle is not None:
            fcntl.flock(handle, fcntl.LOCK_UN)
            handle.close()


SHARED_PROBE_WAIT_S = 10.0  # how long a process looks for rank 0's probe file (a network filesystem may lag)


def check_shared_dir(folder: str | Path, dist: Dist) -> None:
    """Refuse on every process, before any model loads, a launch whose processes do not all see `folder` (issue 29).

    Ranks write their data shards, ZeRO partitions and endpoint responses into output_dir for rank 0 to merge, and
    read what rank 0 wrote there (merged data, checkpoints, best/). Across nodes that needs a filesystem every node
    mounts at the same path; a node-local disk there fails later and worse (a shard missing at the merge, a rank
    resuming from no checkpoint). Rank 0 writes a probe file under a fresh name and every process looks for it."""
    if dist.world_size == 1:
        return
    import socket
    import uuid

    from specdec_runtime.atomic import wait_for_files, write_text

    probe = Path(folder) / f".specdistill-probe-{uuid.uuid4().hex}" if dist.is_main else None
    if probe is not None:
        write_text(probe, socket.gethostname())
    name = dist.broadcast(probe.name if probe is not None else None)  # sent once the probe is written
    seen = not wait_for_files([Path(folder) / name], SHARED_PROBE_WAIT_S)
    views = dist.gather((seen, socket.gethostname()))
    if probe is not None:
        probe.unlink(missing_ok=True)
    blind = [f"rank {rank} ({host})" for rank, (ok, host) in enumerate(views) if not ok]
    if blind:
        raise OutputDirError(
            f"{folder} is not shared by every process: {', '.join(blind)} cannot see the file rank 0 ({views[0][1]}) "
            "wrote there. A multi-node run needs output_dir on a filesystem every node mounts at the same path (NFS, "
            "Lustre, GPFS, ...); see docs/distributed.md#multi-node"
        )


def dist_state(device: str = "auto", timeout_minutes: float | None = None) -> Dist:
    """The launch this process is part of; CPU launches use gloo (accelerate picks it). The first call creates the
    process group, with `timeout_minutes` (train.timeout_minutes; None: torch's default) as its timeout."""
    from datetime import timedelta

    import torch
    from accelerate import PartialState

    cpu = device == "cpu" or (device == "auto" and not torch.cuda.is_available())
    timeout = {} if timeout_minutes is None else {"timeout": timedelta(minutes=timeout_minutes)}
    state = PartialState(cpu=cpu, **timeout)
    dev = "cpu" if cpu else (str(state.device) if device == "auto" else device)
    return Dist(rank=state.process_index, world_size=state.num_processes, device=dev, state=state)


def print0(dist: Dist, *args) -> None:
    if dist.is_main:
        print(*args, flush=True)


def load_target(cfg: RootConfig, dist: Dist):
    from specdec_runtime.loading import load_model

    # Rank 0 first, then the first process of every other node, then the rest: a download or GGUF conversion fills
    # each model cache once, whether every node shares it (the others find it complete) or each node has its own.
    with dist.state.main_process_first(), dist.state.local_main_process_first():
        model, tokenizer = load_model(
            cfg.target.model,
            dtype=cfg.target.dtype,
            device=dist.device,
            trust_remote_code=cfg.target.trust_remote_code,
            allow_pickle=cfg.target.allow_pickle,
        )
    return model, tokenizer, launch_identity(cfg.target.model, dist)


def launch_identity(spec: str, dist: Dist) -> str:
    """`model_identity(spec)` as rank 0 has it, on every process, once the weights behind it agree everywhere.

    The identity names the teacher-data folders and holds the folder the weights were read from, which differs
    between nodes with model caches of their own (SPECDISTILL_CACHE, HF_HOME): each node would write its shards under
    another name and rank 0's merge would miss them (issue 29). The rest (config hash, file sizes) must be equal."""
    import socket

    from specdec_runtime.loading import model_identities

    identity, weights = model_identities(spec)
    if dist.world_size == 1:
        return identity
    views = dist.gather((weights, socket.gethostname()))
    odd = [f"rank {rank} ({host})" for rank, (w, host) in enumerate(views) if w != views[0][0]]
    if odd:
        raise UserError(
            f"target.model={spec} resolves to other weights on {', '.join(odd)} than on rank 0 ({views[0][1]}): "
            "clear that node's model cache (SPECDISTILL_CACHE, HF_HOME) or give every node the same files"
        )
    return dist.broadcast(identity)


# ----------------------------------------------------------------------------------------------------------------
# Stages


def stage_data(cfg: RootConfig, dist: Dist, target=None):
    """Teacher responses (and the optional top-k cache) for the train and validation prompts."""
    from distill.data import generate_teacher_data
    from distill.eagle3 import cached_aux_layers

    check_prompt_roles(cfg)
    teacher, tokenizer, teacher_id = target or load_target(cfg, dist)
    # EAGLE-3 candidates that train from the offline cache need the teacher's aux hidden states stored in it.
    candidates = [(c.draft, c.distill) for c in trained_configs(cfg).values()]
    aux_layers = cached_aux_layers(candidates, teacher.config.num_hidden_layers)
    # And those with distill.loss_on_prompt need the top-k of the prompt positions too (a response-only candidate
    # reads the same cache from its response rows on).
    prompt_topk = any(d.teacher == "cache" and d.loss_on_prompt for _, d in candidates)
    return generate_teacher_data(
        teacher,
        tokenizer,
        cfg.data,
        Path(cfg.output_dir) / "data",
        teacher_id=teacher_id,
        seed=cfg.seed,
        rank=dist.rank,
        world_size=dist.world_size,
        barrier=dist.barrier,
        aux_layers=aux_layers,
        prompt_topk=prompt_topk,
        backend=cfg.target.backend,
    )


def fetch_responses_stage(cfg: RootConfig, dist: Dist) -> list[Path]:
    """`specdistill data --fetch-only` (data.generator=endpoint): the server's responses, stored for a later `data`
    to score, with no model weights loaded: the tokenizer, config and generation config of the target only, since the
    server may hold every GPU. Returns the folders the responses are in."""
    from types import SimpleNamespace

    from transformers import GenerationConfig

    from distill.data import fetch_teacher_responses
    from specdec_runtime.loading import load_config, load_tokenizer, resolve_model_path, stop_token_ids

    check_prompt_roles(cfg)
    spec, trust = cfg.target.model, cfg.target.trust_remote_code
    with dist.state.main_process_first(), dist.state.local_main_process_first():  # each model cache filled once
        tokenizer, config = load_tokenizer(spec, trust_remote_code=trust), load_config(spec, trust_remote_code=trust)
        path, _ = resolve_model_path(spec)
    teacher_id = launch_identity(spec, dist)
    try:  # what load_model gives the model: generation_config.json, else the defaults of its config
        generation = GenerationConfig.from_pretrained(path)
    except OSError:
        generation = GenerationConfig.from_model_config(config)
    return fetch_teacher_responses(
        tokenizer,
        cfg.data,
        Path(cfg.output_dir) / "data",
        context=getattr(config, "max_position_embeddings", None),
        stop_ids=list(stop_token_ids(SimpleNamespace(generation_config=generation), tokenizer)),
        teacher_id=teacher_id,
        seed=cfg.seed,
        rank=dist.rank,
        world_size=dist.world_size,
        barrier=dist.barrier,
    )


def check_prompt_roles(cfg: RootConfig) -> None:
    """Refuse to start a run whose test prompts (the first eval.max_prompts of eval.prompts) overlap its training or
    validation prompts: DESIGN.md's three prompt roles stay disjoint."""
    from distill.prompt_roles import check_test_prompts
    from distill.prompts import load_prompts

    check_test_prompts(cfg.data, load_prompts(cfg.eval.prompts)[: cfg.eval.max_prompts or None], cfg.eval.prompts)


def run_distill(cfg: RootConfig, teacher_data, *, target=None) -> dict[str, Path]:
    """Distill every candidate in turn; returns {candidate name: its best/ folder (HF format)}.

    A candidate whose folder already holds best/ and a DONE marker for the same training settings is skipped.
    `target`: the loaded (model, tokenizer, identity) of cfg.target, the teacher of every candidate that keeps
    cfg.target (so `run` holds one target, not two); the others load their own, and so does a candidate that shards
    its teacher (free yours before: `run` does, see `shards_a_teacher`).
    """
    from accelerate import PartialState

    from train.checkpoint import is_done
    from train.loop import shards_teacher

    best = {}
    for name, resolved in trained_configs(cfg).items():  # a zero-training draft (ngram, suffix) has nothing to train
        run = candidate_run(resolved, name)
        if rank0_value(is_done(run.out_dir, run.fingerprint) if _is_rank0() else None):
            PartialState().print(f"{name}: already distilled with these settings ({run.out_dir / 'best'}); skipping")
        else:
            keeps = target and resolved.target == cfg.target and not shards_teacher(run)
            teacher, tokenizer, _ = target if keeps else (None, None, None)
            distill_candidate(resolved, name, teacher_data, teacher=teacher, tokenizer=tokenizer)
        best[name] = run.out_dir / "best"
    return best


def shards_a_teacher(cfg: RootConfig) -> bool:
    """Whether a candidate still to distill shards its teacher in this launch: it loads the target on the CPU, one
    shard per process, and a full target held next to it would be a second copy on every process."""
    from train.checkpoint import is_done
    from train.loop import shards_teacher

    for name, resolved in trained_configs(cfg).items():
        run = candidate_run(resolved, name)
        if shards_teacher(run) and not rank0_value(is_done(run.out_dir, run.fingerprint) if _is_rank0() else None):
            return True
    return False


def _is_rank0() -> bool:
    """Whether this process is rank 0, which reads the choices every rank then takes from it (`rank0_value`)."""
    from accelerate import PartialState

    return PartialState().process_index == 0


def free_memory() -> None:
    """Collect what was just dropped and hand the freed GPU memory back to the driver."""
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def distill_candidate(cfg: RootConfig, name: str, teacher_data, *, teacher=None, tokenizer=None) -> Path:
    """Distill candidate `name` and return its folder <output_dir>/candidates/<name>/.

    `cfg` is the candidate's resolved config (`root.candidate_configs[name]`; a config without candidates is its
    own). `teacher`, `tokenizer`: an already loaded target to reuse; loaded from `cfg.target` when None.
    """
    from train.loop import distill

    return distill(candidate_run(cfg, name), teacher_data, teacher=teacher, tokenizer=tokenizer)


def candidate_run(cfg: RootConfig, name: str) -> CandidateRun:
    """Candidate `name` as the recipe takes it, from its resolved config `cfg` (see `distill_candidate`): its
    sections, its folder, and the resolved config with the DONE fingerprint and the resume check made from it."""
    from train.loop import CandidateRun

    out = Path(cfg.output_dir)
    return CandidateRun(
        name=name,
        out_dir=out / "candidates" / name,
        run_name=f"{out.name}-{name}",
        seed=cfg.seed,
        target=cfg.target,
        draft=cfg.draft,
        data=cfg.data,
        distill=cfg.distill,
        train=cfg.train,
        tracking=cfg.tracking,
        resolved=to_dict(cfg),
        resolved_yaml=dump_yaml(cfg),
        fingerprint=training_fingerprint(cfg),
        config_drift=functools.partial(config_drift, current=to_dict(cfg)),
    )


def _flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(tree, dict):
        return {prefix: tree}
    return {k: v for key, sub in tree.items() for k, v in _flatten(sub, f"{prefix}{key}.").items()} or {prefix: {}}


def _data_identity(resolved: dict) -> dict:
    """`resolved` (a to_dict'ed config) with its data section as the DONE fingerprint and the resume check see it:
    with data.generator=runtime (the default) without the generator keys, as configs were before they existed, so
    finished candidates stay finished; with an endpoint, of data.endpoint only the served model (its url, key,
    concurrency, timeout and retries say how the server is reached, not what it answers)."""
    data = resolved.get("data")
    if not isinstance(data, dict):
        return resolved
    data = dict(data)
    if data.get("generator", "runtime") == "runtime":
        data.pop("generator", None)
        data.pop("endpoint", None)
    else:
        data["endpoint"] = {"model": (data.get("endpoint") or {}).get("model")}
    return {**resolved, "data": data}


# Training keys added after runs were finished, with the value that trains as before: at that value they are left out
# of the DONE fingerprint and the resume check, so those runs stay finished and resumable with the key set to it
# (distill.loss_on_prompt=false, since its default became true).
NEW_KEY_DEFAULTS = {("distill", "loss_on_prompt"): False}


def _without_new_defaults(resolved: dict) -> dict:
    """`resolved` without the `NEW_KEY_DEFAULTS` keys that hold their default (a checkpoint written before they
    existed has no such key)."""
    out = dict(resolved)
    for (section, name), default in NEW_KEY_DEFAULTS.items():
        if isinstance(out.get(section), dict) and out[section].get(name, default) == default:
            out[section] = {k: v for k, v in out[section].items() if k != name}
    return out


def training_fingerprint(cfg: RootConfig) -> str:
    """Hash of the sections that decide what a candidate trains (not eval, serving, tracking or output_dir)."""
    data = _without_new_defaults(_data_identity(to_dict(cfg)))
    for key in EXECUTION_ONLY:
        section, name = key.split(".")
        data[section].pop(name)
    blob = json.dumps({k: data[k] for k in TRAINING_SECTIONS}, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def config_drift(saved: dict, current: dict) -> list[str]:
    """Dotted keys whose values differ between a checkpoint's config and the current one and forbid a resume."""
    saved, current = (_without_new_defaults(_data_identity(c)) for c in (saved, current))
    old = _flatten({k: saved.get(k) for k in TRAINING_SECTIONS})
    new = _flatten({k: current.get(k) for k in TRAINING_SECTIONS})
    return sorted(
        k.rstrip(".")
        for k in old.keys() | new.keys()
        if old.get(k) != new.get(k) and k.rstrip(".") not in RESUMABLE_CHANGES
    )


def eval_prompts(source: str, tokenizer, limit: int, *, trained_on=None):
    """The first `limit` test prompts of `source`; with `trained_on` (the drafts' DataConfig) they are refused when
    they overlap the prompts the drafts were trained or validated on."""
    from distill.prompt_roles import check_test_prompts
    from distill.prompts import load_prompts, render_chat
    from eval.sweep import EvalPrompt

    records = load_prompts(source)[: limit or None]
    if trained_on is not None:
        check_test_prompts(trained_on, records, source)
    return [EvalPrompt(id=r.id, category=r.category, ids=render_chat(tokenizer, r.messages)) for r in records]


def stage_eval(cfg: RootConfig, dist: Dist, candidates, *, out_dir: Path, target=None, trained_on=None) -> Path:
    """Sweep every candidate against target-only decoding; write report.json/md/html; returns report.json.

    `trained_on`: the candidates' DataConfig; eval prompts they were trained or validated on are refused."""
    from eval.recommend import recommend
    from eval.report import write_reports
    from eval.results import save_report
    from eval.sweep import run_sweep
    from train.tracking import make_tracker

    target_model, tokenizer, _ = target or load_target(cfg, dist)
    prompts = eval_prompts(cfg.eval.prompts, tokenizer, cfg.eval.max_prompts, trained_on=trained_on)
    report = run_sweep(
        target_model,
        tokenizer,
        candidates,
        prompts,
        cfg.eval,
        target_spec=cfg.target.model,
        serving=cfg.serving,
        seed=cfg.seed,
        device=dist.device,
        dtype=cfg.target.dtype,
        rank=dist.rank,
        world_size=dist.world_size,
        gather=dist.gather,
        backend=cfg.target.backend,
    )
    path = out_dir / "report.json"
    if dist.is_main:
        report["recommendation"] = recommend(report, cfg.serving)
        report["eval_config"] = json.loads(json.dumps(cfg.eval.__dict__))
        save_report(report, out_dir)
        tracker = make_tracker(cfg.tracking, out_dir, to_dict(cfg), True, name=f"{Path(cfg.output_dir).name}-eval")
        write_reports(report, out_dir, tracker=tracker)  # W&B: the settings table and the report folder
        tracker.finish()
    dist.barrier()
    return path


def serving_path(cfg: RootConfig) -> Path:
    return Path(cfg.serving.path) if cfg.serving.path else Path(cfg.output_dir) / "serving.yaml"


def stage_promote(cfg: RootConfig, report_path: Path, *, target=None, force: bool = False) -> tuple[Path | None, str]:
    """`eval.promote.promote` with the run's target and folders, as `specdistill promote` runs it alone: check the
    report and the draft against the target, export the recommended draft to <output_dir>/export/<name> (a draft
    that is not enabled too, for inspection), write the serving config. Returns (the export or None, summary).

    `target`: the loaded (model, tokenizer, identity) of cfg.target; None: promote loads its config and tokenizer."""
    from eval.promote import export_dir_for, is_lookup, promote

    export_root = Path(cfg.output_dir) / "export"
    summary = promote(
        report_path,
        serving_path(cfg),
        force=force,
        expected_target=cfg.target.model,
        target=target[:2] if target else None,
        export_root=export_root,
        trust_remote_code=cfg.target.trust_remote_code,
    )
    rec = json.loads(report_path.read_text())["recommendation"]
    exported = export_dir_for(rec, export_root) if rec.get("draft") and not is_lookup(rec) else None
    return exported, summary


# ----------------------------------------------------------------------------------------------------------------
# run: every stage


def trained_configs(cfg: RootConfig) -> dict[str, RootConfig]:
    """The candidates distillation trains: all but the zero-training drafts (`draft.init: ngram | suffix`)."""
    return {name: c for name, c in cfg.candidate_configs.items() if not c.draft.lookup_specs}


def candidate_dirs(cfg: RootConfig) -> list[Path]:
    return [Path(cfg.output_dir) / "candidates" / name for name in trained_configs(cfg)]


def lookup_candidates(cfg: RootConfig) -> dict[str, str]:
    """Eval name -> lookup spec of every zero-training candidate: its name, or `<name>[<knobs>]` per knob setting when
    it sweeps several (`draft.lookup_knobs`)."""
    out = {}
    for name, resolved in cfg.candidate_configs.items():
        knobs, specs = resolved.draft.lookup_knobs, resolved.draft.lookup_specs
        for k, spec in zip(knobs, specs):
            out[name if len(specs) == 1 else f"{name}[{k or 'defaults'}]"] = spec
    return out


def config_candidates(cfg: RootConfig):
    from eval.results import Candidate
    from specdec_runtime.loading import check_draft_folder

    out = []
    for run_dir in candidate_dirs(cfg):
        if not (run_dir / "best").is_dir():
            raise UserError(
                f"candidate {run_dir.name} has no best/ checkpoint in {run_dir}; run `specdistill distill` first"
            )
        check_draft_folder(run_dir / "best")
        out.append(Candidate(name=run_dir.name, path=run_dir / "best", run_dir=run_dir))
    return out + [Candidate(name=name, path=None, lookup=spec) for name, spec in lookup_candidates(cfg).items()]


def eval_is_current(cfg: RootConfig, report_path: Path) -> bool:
    """A finished report made with the same eval settings, serving gates and candidates (so `run` can skip the
    sweep: promote would refuse a report whose recommendation was made under other gates)."""
    from eval.recommend import recorded_gates

    if not report_path.is_file():
        return False
    try:
        report = json.loads(report_path.read_text(encoding="utf-8"))
    except ValueError:  # damaged (truncated, edited): not a finished report, so the sweep runs again and rewrites it
        return False
    rec, cands = (report.get("recommendation"), report.get("candidates")) if isinstance(report, dict) else (None, None)
    if not (isinstance(rec, dict) and isinstance(cands, list) and all(isinstance(c, dict) for c in cands)):
        return False
    newest_best = max(((d / "best").stat().st_mtime for d in candidate_dirs(cfg) if (d / "best").exists()), default=0.0)
    return (
        report.get("eval_config") == json.loads(json.dumps(cfg.eval.__dict__))
        and "recommendation" in report
        and report["recommendation"].get("gates") == json.loads(json.dumps(recorded_gates(cfg.serving)))
        and report_path.stat().st_mtime >= newest_best
        and sorted(c["name"] for c in report["candidates"]) == sorted([*trained_configs(cfg), *lookup_candidates(cfg)])
    )


def run_all(cfg: RootConfig, *, force: bool = False) -> dict:
    """data -> distill -> eval -> promote (check, export, serving config), skipping what is complete."""
    start = time.time()
    from eval.promote import check_serving_path

    check_prompt_roles(cfg)  # before anything is written: a run that would test on seen prompts never starts
    dist = dist_state(cfg.target.device, cfg.train.timeout_minutes)
    # And one whose serving config cannot be written fails now, not at the end. Rank 0 alone writes it, and on
    # another node its folder need not exist: rank 0 checks, every process stops with its error.
    problem = None
    if dist.is_main:
        try:
            check_serving_path(serving_path(cfg))
        except UserError as e:
            problem = str(e)
    if problem := dist.broadcast(problem):
        raise UserError(problem)
    with run_lock(cfg.output_dir, dist):
        return _run_stages(cfg, dist, start, force=force)


def _run_stages(cfg: RootConfig, dist: Dist, start: float, *, force: bool) -> dict:
    out = Path(cfg.output_dir)
    if dist.is_main:
        save_resolved(cfg, out / "config.yaml")
    target = load_target(cfg, dist)
    trained = trained_configs(cfg)
    if trained:
        print0(dist, f"[1/4] data -> {out / 'data'}")
        teacher_data = stage_data(cfg, dist, target)
    else:  # only zero-training drafts: no teacher data to make
        print0(dist, "[1/4] data: no candidate trains (ngram / suffix only); skipped")
        teacher_data = None
    print0(dist, f"[2/4] distill {len(trained)} candidate(s) -> {out / 'candidates'}")
    if shards_a_teacher(cfg):  # freed while those candidates train, loaded again (memory-mapped) for eval
        target = None
        free_memory()
    run_distill(cfg, teacher_data, target=target)
    target = target or load_target(cfg, dist)
    report_path = out / "eval" / "report.json"
    if dist.broadcast(eval_is_current(cfg, report_path) if dist.is_main else None):  # ranks must agree to sweep
        print0(dist, f"[3/4] eval: up to date ({report_path})")
    else:
        print0(dist, f"[3/4] eval -> {out / 'eval'}")
        stage_eval(cfg, dist, config_candidates(cfg), out_dir=out / "eval", target=target, trained_on=cfg.data)
    result = {"report": report_path, "html": out / "eval" / "report.html", "serving": serving_path(cfg)}
    if dist.is_main:
        print0(dist, "[4/4] promote: check, export the draft, write the serving config")
        exported, summary = stage_promote(cfg, report_path, target=target, force=force)
        report = json.loads(report_path.read_text())
        result.update(
            exported=exported, summary=summary, recommendation=report["recommendation"], wall_s=time.time() - start
        )
    dist.barrier()
    return result
