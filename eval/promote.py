"""Promote the eval report's recommendation into the serving config (DESIGN.md, "Serving config contract").

    specdistill promote runs/quickstart/eval/report.json                        # -> runs/quickstart/serving.yaml
    specdistill promote runs/quickstart/eval/report.json --serving deploy/serving.yaml --dry-run   # diff only

The serving file is rewritten as a whole but keeps what it does not own: unknown top-level keys, other engine
settings and non-speculative SGLang flags survive, and `history` grows by one entry per promotion (newest last).
Writes go through `specdec_runtime.atomic` (temp file in the same folder, fsync, rename): a crash at any point
leaves either the old config or the new one. An exclusive `fcntl.flock` on `<serving>.lock` serialises concurrent
promotions, so both of two simultaneous promotions land in the history.
"""

from __future__ import annotations

import copy
import difflib
import fcntl
import json
import os
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path

import yaml

from eval.engines import engine_snippets
from eval.export import export_draft
from specdec_runtime import atomic

OWNED_KEYS = ("target", "speculative", "engines", "history")
HEADER = (
    "# Serving config written by `specdistill promote`; unknown keys are kept across promotions.\n"
    "# speculative.max_concurrency_measured is a measurement, not a cap: the largest measured batch size (and every\n"
    "# smaller one measured) whose confirmed speedup cleared the margin. speculative.concurrency_limit is the cap\n"
    "# (speculation off above it), set only when a larger measured batch size failed; null: no limit was measured.\n"
)


# ----------------------------------------------------------------------------------------------------------------
# Engine settings


def _merge_engines(old: dict | None, new: dict | None) -> dict:
    """Engine settings of `old` with the speculative parts replaced by `new`'s (None = speculative decoding off)."""
    old = old if isinstance(old, dict) else {}
    vllm = {k: v for k, v in (old.get("vllm") or {}).items() if k != "speculative_config"}
    trtllm = {
        k: v
        for k, v in (old.get("trtllm") or {}).items()
        if k not in ("speculative_config", "disable_overlap_scheduler")
    }
    sglang = _strip_speculative_flags(old.get("sglang") or [])
    if new is not None:
        vllm.update(new["vllm"])
        trtllm.update(new["trtllm"])
        sglang += new["sglang"]
    engines = {k: v for k, v in old.items() if k not in ("vllm", "sglang", "trtllm", "speculative")}
    engines.update(vllm=vllm, sglang=sglang, trtllm=trtllm)
    if new is None:
        engines["speculative"] = "off: serve the target alone (no speculative_config, no --speculative-* flags)"
    return engines


def _strip_speculative_flags(args: list) -> list:
    """SGLang args without `--speculative-*` flags and their values (a value is the next item not starting --)."""
    out, skip_value = [], False
    for arg in args:
        if str(arg).startswith("--speculative-"):
            skip_value = "=" not in str(arg)
        elif skip_value and not str(arg).startswith("--"):
            skip_value = False
        else:
            skip_value = False
            out.append(arg)
    return out


# ----------------------------------------------------------------------------------------------------------------
# Building the new config


def check_report(report: dict, report_path: Path) -> dict:
    """The report's recommendation; ValueError naming what is missing when the report is not a finished eval."""
    if not isinstance(report, dict) or report.get("schema_version") != 1:
        raise ValueError(f"{report_path} is not a specdistill eval report (schema_version 1); run `specdistill eval`")
    rec = report.get("recommendation")
    if not isinstance(rec, dict):
        raise ValueError(
            f"{report_path} has no recommendation; run `specdistill eval` to the end (it recommends a "
            "draft from the measured sweep)"
        )
    needed = ["enabled", "reason", "confirmation"] + (
        ["draft", "num_draft_tokens", "draft_rule"] if rec["enabled"] else []
    )
    missing = [k for k in needed if rec.get(k) is None]
    if missing:
        raise ValueError(f"{report_path}: recommendation lacks {missing}")
    return rec


def check_target(
    report: dict, report_path: Path, expected_target: str | None, expected_fingerprint: str | None
) -> None:
    """Refuse a report made for another target: the fingerprint decides when both sides have one, else the spec."""
    got, got_fp = report.get("target"), report.get("target_fingerprint")
    if expected_fingerprint is not None and got_fp is not None:
        if expected_fingerprint != got_fp:
            raise ValueError(
                f"{report_path} was made for target {got!r} (fingerprint {got_fp}), not for "
                f"{expected_target or 'the serving target'!r} (fingerprint {expected_fingerprint}): "
                "its vocabulary or architecture differ; re-run eval against this target"
            )
        return
    if expected_target is not None and not _same_spec(expected_target, got):
        raise ValueError(
            f"{report_path} was made for target {got!r}, not for {expected_target!r}; re-run eval "
            "against this target or promote into that target's serving config"
        )


def _same_spec(a: str, b: str | None) -> bool:
    if b is None:
        return False
    if a == b:
        return True
    pa, pb = Path(a).expanduser(), Path(b).expanduser()
    return pa.exists() and pb.exists() and pa.resolve() == pb.resolve()


def check_vocab(rec: dict, target_tokenizer, draft_tokenizer) -> None:
    """Raise VocabMismatchError (a ValueError) when the draft's token ids mean other text to the target."""
    from specdec_runtime.loading import check_vocab_compatible

    config = Path(rec["draft"]) / "config.json"
    vocab_size = json.loads(config.read_text()).get("vocab_size") if config.is_file() else None
    check_vocab_compatible(target_tokenizer, draft_tokenizer, vocab_size)


def _path_or_spec(value: str | Path) -> str:
    """Absolute path for a local folder (the serving engine runs from another directory), else as given."""
    path = Path(value).expanduser()
    return str(path.resolve()) if path.exists() else str(value)


MEASURED_KEYS = ("acceptance_rate", "mean_accepted_length", "speedup", "speedup_ci", "split", "batch_size", "prompts")
"""The confirmation's numbers serving.yaml's `measured` copies under their report names."""


def concurrency_cap(rec: dict) -> int | None:
    """The batch size above which speculation should be off: the confirmed max_concurrency when a larger measured
    concurrency failed the margin, else None (no measured limit)."""
    conf = rec.get("confirmation") or {}
    limit, measured = conf.get("max_concurrency"), conf.get("measured_concurrency") or []
    return limit if limit is not None and measured and limit < max(measured) else None


def serving_snippets(rec: dict, draft: str) -> dict:
    """The engines' settings for an enabled recommendation."""
    return engine_snippets(draft, rec["num_draft_tokens"], concurrency_cap(rec), kind=rec.get("kind", "standalone"))


def build_serving(old: dict, report: dict, report_path: Path, draft: str | None, now: str) -> dict:
    """The new serving config: `old` with target, speculative and engines replaced and one history entry added.
    `measured` holds the confirmation split's numbers (the ones the decision was made on), with their interval."""
    rec = report["recommendation"]
    conf = rec["confirmation"]
    # The report's max_concurrency is serving.yaml's max_concurrency_measured: next to concurrency_limit, the cap,
    # a measured value must not read like one (docs/metrics.md).
    measured = {k: conf.get(k) for k in MEASURED_KEYS} | {
        "max_concurrency_measured": conf.get("max_concurrency"),
        "measured_concurrency": conf.get("measured_concurrency"),
    }
    measured = copy.deepcopy(measured)  # no list shared with rec
    measured["eval_report"] = str(Path(report_path).resolve())
    if rec["enabled"]:
        speculative = {
            "enabled": True,
            "draft": draft,
            "kind": rec.get("kind", "standalone"),
            "num_draft_tokens": rec["num_draft_tokens"],
            "draft_rule": rec["draft_rule"],
            "temperature": rec.get("temperature"),
            "max_concurrency_measured": measured["max_concurrency_measured"],
            "concurrency_limit": concurrency_cap(rec),
            "measured": measured,
            "reason": rec["reason"],
        }
        engines = _merge_engines(old.get("engines"), serving_snippets(rec, draft))
    else:
        speculative = {"enabled": False, "reason": rec["reason"], "measured": measured}
        engines = _merge_engines(old.get("engines"), None)
    previous = old.get("speculative") if isinstance(old.get("speculative"), dict) else {}
    entry = {
        "promoted_at": now,
        "draft": draft if rec["enabled"] else None,
        "enabled": bool(rec["enabled"]),
        "num_draft_tokens": rec["num_draft_tokens"] if rec["enabled"] else None,
        "measured": copy.deepcopy(measured),  # a copy: a shared object would be dumped as a YAML anchor/alias
        "replaced": previous.get("draft") if previous.get("enabled") else None,
    }
    new = {k: v for k, v in old.items() if k not in OWNED_KEYS}
    new.update(
        target=report["target"], speculative=speculative, engines=engines, history=[*(old.get("history") or []), entry]
    )
    return new


# ----------------------------------------------------------------------------------------------------------------
# Reading and writing the serving file


def read_serving(path: Path, force: bool) -> tuple[str, dict]:
    """(old text, parsed mapping); {} for a missing file. A file that is not a YAML mapping (or whose history is not
    a list) is refused unless `force`, which keeps it as `<name>.broken-<time>` and starts afresh."""
    if not path.exists():
        return "", {}
    text = path.read_text()
    try:
        parsed = yaml.safe_load(text)
        problem = None if isinstance(parsed, dict) or parsed is None else f"a YAML {type(parsed).__name__}"
        if isinstance(parsed, dict) and not isinstance(parsed.get("history") or [], list):
            problem = "a mapping whose `history` is not a list"
    except yaml.YAMLError as e:
        problem = f"not valid YAML ({str(e).splitlines()[0]})"
    if problem is None:
        return text, parsed or {}
    if not force:
        raise ValueError(
            f"existing serving config {path} is {problem}, not a serving config mapping; it was left "
            "untouched. Fix it, or pass force=True (--force) to replace it (the broken file is kept as "
            f"{path.name}.broken-<time>)"
        )
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%S%fZ")
    os.replace(path, path.with_name(f"{path.name}.broken-{stamp}"))
    return text, {}


@contextmanager
def locked(path: Path):
    """Exclusive lock on `<path>.lock`, released when the block exits (or the process dies)."""
    with open(path.with_name(path.name + ".lock"), "a") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def dump_serving(config: dict) -> str:
    return HEADER + yaml.safe_dump(config, sort_keys=False, default_flow_style=False, allow_unicode=True)


# ----------------------------------------------------------------------------------------------------------------
# Entry point


def promote(
    report_path: Path,
    serving_path: Path,
    *,
    dry_run: bool = False,
    force: bool = False,
    target_tokenizer=None,
    draft_tokenizer=None,
    expected_target: str | None = None,
    expected_fingerprint: str | None = None,
    export_dir: Path | None = None,
) -> str:
    """Write the report's recommendation into `serving_path`; returns a one-line summary, or with `dry_run` the
    unified diff of old vs new (nothing written).

    Refuses (ValueError) a report for another target (`expected_target` spec, or `expected_fingerprint` =
    `eval.results.target_fingerprint(target, tokenizer)`), a draft whose vocabulary differs from the target's (when
    both tokenizers are given), and an existing serving file that is not a YAML mapping (unless `force`).
    With `export_dir`, the draft is exported there (`eval.export.export_draft`) and the config points to it.
    """
    report_path, serving_path = Path(report_path), Path(serving_path)
    report = json.loads(report_path.read_text())
    rec = check_report(report, report_path)
    check_target(report, report_path, expected_target, expected_fingerprint)
    if rec["enabled"] and target_tokenizer is not None and draft_tokenizer is not None:
        check_vocab(rec, target_tokenizer, draft_tokenizer)
    draft = None
    if rec["enabled"]:
        draft = str(Path(export_dir).expanduser().resolve()) if export_dir else _path_or_spec(rec["draft"])
    now = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    if dry_run:
        old_text, old = _read_lenient(serving_path) if force else read_serving(serving_path, force=False)
        new_text = dump_serving(build_serving(old, report, report_path, draft, now))
        return "".join(
            difflib.unified_diff(
                old_text.splitlines(keepends=True),
                new_text.splitlines(keepends=True),
                fromfile=f"{serving_path} (current)",
                tofile=f"{serving_path} (promoted)",
            )
        )
    if rec["enabled"] and export_dir is not None:
        export_draft(Path(rec["draft"]), Path(export_dir), report=report, serving_snippets=serving_snippets(rec, draft))
    serving_path.parent.mkdir(parents=True, exist_ok=True)
    with locked(serving_path):
        _, old = read_serving(serving_path, force)
        new = build_serving(old, report, report_path, draft, now)
        atomic.write_text(serving_path, dump_serving(new))
    if not rec["enabled"]:
        return f"speculative decoding disabled in {serving_path}: {rec['reason']}"
    replaced, speedup, ci = (
        new["history"][-1]["replaced"],
        rec["confirmation"].get("speedup"),
        rec["confirmation"].get("speedup_ci"),
    )
    return (
        f"promoted {rec.get('name', draft)} ({draft}, num_draft_tokens={rec['num_draft_tokens']}"
        + (f", confirmed speedup {speedup:.2f}x" if isinstance(speedup, (int, float)) else "")
        + (f" [{ci[0]:.2f}, {ci[1]:.2f}]" if ci else "")
        + f") into {serving_path}"
        + (f", replacing {replaced}" if replaced else "")
    )


def _read_lenient(path: Path) -> tuple[str, dict]:
    """Dry run with force: show the diff against what force would start from (an unreadable file counts as empty)."""
    try:
        return read_serving(path, force=False)
    except ValueError:
        return path.read_text(), {}
