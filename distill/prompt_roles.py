"""The three prompt roles of a run and the checks that keep them disjoint (DESIGN.md "Metric definitions").

- training prompts: `data.prompts` (a list's sources concatenated), without any validation prompt, the first
  `data.max_prompts` of them; the teacher answers them for distillation;
- validation prompts: the first `data.max_validation_prompts` of `data.validation_prompts`, scored to pick the
  checkpoint (`best/`); never trained on;
- test prompts: `eval.prompts`, for the eval sweep and the promotion's confirmation; refused when they share a prompt
  with either role above.

    records = training_prompts(cfg.data)            # None for data.prompts=self_instruct (written at data time)
    check_test_prompts(cfg.data, load_prompts(cfg.eval.prompts), cfg.eval.prompts)

Two prompts are the same one when their messages are (`prompt_key`: case and whitespace aside, ids ignored, since
ids differ across sources). Loading the sources is distill/prompts.py's job.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from distill.config import DataConfig
from distill.prompts import SELF_INSTRUCT, PromptRecord, concat_sources, load_prompts, load_sources
from specdec_runtime.errors import UserError


def prompt_key(record: PromptRecord) -> tuple:
    """What makes two prompts the same one: their messages, case and whitespace aside (ids differ across sources)."""
    return tuple((m["role"], " ".join(str(m["content"]).split()).lower()) for m in record.messages)


def without_prompts(records: Sequence[PromptRecord], others: Sequence[PromptRecord]) -> list[PromptRecord]:
    """`records` minus those whose messages also appear in `others` (order kept)."""
    keys = {prompt_key(r) for r in others}
    return [r for r in records if prompt_key(r) not in keys]


def overlap_count(records: Sequence[PromptRecord], others: Sequence[PromptRecord]) -> int:
    """How many of `records` also appear in `others`, compared by `prompt_key` (as `without_prompts` does)."""
    return len(records) - len(without_prompts(records, others))


# ----------------------------------------------------------------------------------------------------------------
# The roles


def training_prompts(
    cfg: DataConfig,
    *,
    self_instruct: Callable[[], list[PromptRecord]] | None = None,
    log: Callable[[str], object] | None = None,
) -> list[PromptRecord] | None:
    """The prompts the `data` stage answers for training: data.prompts (a list's sources concatenated) without the
    data.validation_prompts, the first data.max_prompts of them. `self_instruct()` gives the prompts of a
    self_instruct source (the data stage's teacher writes them); without it they count as none, and data.prompts=
    self_instruct alone gives None. `log` reports the training prompts dropped as validation prompts."""
    if cfg.prompts == SELF_INSTRUCT and self_instruct is None:
        return None
    return [r for _, records in training_prompts_by_source(cfg, self_instruct=self_instruct, log=log) for r in records]


def training_prompts_by_source(
    cfg: DataConfig,
    *,
    self_instruct: Callable[[], list[PromptRecord]] | None = None,
    log: Callable[[str], object] | None = None,
) -> list[tuple[str, list[PromptRecord]]]:
    """`training_prompts` as (source, records) per source of data.prompts. A self_instruct source without
    `self_instruct` counts as empty, so the other sources keep at least the prompts the data stage answers."""
    parts = load_sources(cfg.prompts, self_instruct=self_instruct)
    kept = drop_validation_prompts(concat_sources(parts), load_prompts(cfg.validation_prompts), log=log)
    ids = {r.id for r in kept[: cfg.max_prompts or None]}
    return [(source, [r for r in records if r.id in ids]) for source, records in parts]


def validation_prompts(cfg: DataConfig) -> list[PromptRecord]:
    """The prompts the `data` stage answers for validation (checkpoint selection, best/): the first
    data.max_validation_prompts of data.validation_prompts."""
    return load_prompts(cfg.validation_prompts)[: cfg.max_validation_prompts or None]


# ----------------------------------------------------------------------------------------------------------------
# The checks between roles


def drop_validation_prompts(
    records: list[PromptRecord], validation: Sequence[PromptRecord], *, log: Callable[[str], object] | None = None
) -> list[PromptRecord]:
    """The training `records` without the prompts that also appear in `validation` (all of data.validation_prompts,
    not only the first max_validation_prompts; order kept); refused when nothing is left."""
    kept = without_prompts(records, validation)
    if len(kept) < len(records) and log is not None:
        log(
            f"data: dropped {len(records) - len(kept)} of {len(records)} training prompts that are also validation "
            "prompts (data.validation_prompts): validation prompts are never trained on"
        )
    if records and not kept:
        raise UserError(
            "every training prompt is also a validation prompt; point data.prompts and data.validation_prompts at "
            "disjoint sets (e.g. builtin:train and builtin:validation)"
        )
    return kept


def check_test_prompts(cfg: DataConfig, test: Sequence[PromptRecord], source: str) -> None:
    """Refuse test prompts (eval.prompts=`source`) that the drafts were trained or selected on: compared with the
    training and validation prompts the data stage answers, by `prompt_key`, with the count per source of a
    data.prompts list. Prompts of a self_instruct source are written at data time and not checked."""
    parts = training_prompts_by_source(cfg)
    keys = ["data.prompts"] if isinstance(cfg.prompts, str) else [f"data.prompts[{i}]" for i in range(len(parts))]
    roles = {f"training prompts ({key}={source})": records for key, (source, records) in zip(keys, parts)}
    roles[f"validation prompts (data.validation_prompts={cfg.validation_prompts})"] = validation_prompts(cfg)
    shared = {role: n for role, records in roles.items() if (n := overlap_count(test, records))}
    if shared:
        overlaps = " and ".join(f"{n} with the {role}" for role, n in shared.items())
        raise UserError(
            f"{len(test)} test prompts (eval.prompts={source}) share {overlaps}; test prompts must be unseen by "
            "training and checkpoint selection: point eval.prompts at a disjoint set (e.g. builtin:test)"
        )
