"""Promote the eval report's recommendation into the serving config (DESIGN.md, "Serving config contract").

    specdistill promote runs/quickstart/eval/report.json                        # -> runs/quickstart/serving.yaml
    specdistill promote runs/quickstart/eval/report.json --serving deploy/serving.yaml --dry-run   # diff only

One path under `specdistill run` and alone (issue 23): `promote` loads what it needs of the target (tokenizer and
config, unless the caller has the target loaded), refuses a report for another target and a draft whose vocabulary
differs, exports the draft (`eval.export.export_draft`, the only caller) and writes the serving config, in that
order: a refusal writes nothing.

The report is not trusted (issue 24): every field promote reads is checked against `REPORT_SCHEMA` (types, ranges,
shapes), the draft folder must exist and hold a draft of the kind the report claims, and the enable decision is made
again (`check_decision`) from the confirmation's numbers under the serving gates (`eval.recommend.gate`; the gates of
the run's config.yaml next to the report, else the ones the report recorded). A report whose `enabled` disagrees is
refused unless `force`. All of it happens before the first byte is written.

The serving file is rewritten as a whole but keeps what it does not own: unknown top-level keys, other engine
settings and non-speculative SGLang flags survive, and `history` grows by one entry per promotion (newest last).
Each engine's settings carry comments naming the engine version they assume and what they cannot express
(`eval.engines.engine_notes`). Writes go through `specdec_runtime.atomic` (temp file in the same folder, fsync,
rename): a crash at any point leaves either the old config or the new one. An exclusive `fcntl.flock` on
`<serving>.lock` serialises concurrent promotions, so both of two simultaneous promotions land in the history.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import fcntl
import json
import math
import os
import textwrap
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import yaml

from eval.config import ServingConfig
from eval.engines import (
    ENGINES,
    LOOKUP_KINDS,
    METHODS,
    ServingSetting,
    engine_notes,
    engine_snippets,
    kind_difference,
    recommended_setting,
    rule_difference,
)
from eval.export import check_export_dir, check_writable, export_draft, head_aux, not_an_export
from eval.recommend import gate, max_concurrency
from specdec_runtime import atomic
from specdec_runtime.eagle3 import CONFIG_FILE, is_eagle3_folder, is_speculators_config
from specdec_runtime.errors import UserError
from specdec_runtime.lookup import is_lookup_spec, lookup_draft

OWNED_KEYS = ("target", "speculative", "engines", "history")
HEADER = (
    "# Serving config written by `specdistill promote`; unknown keys are kept across promotions.\n"
    "# speculative.max_concurrency_measured is a measurement, not a cap: the largest measured batch size (and every\n"
    "# smaller one measured) whose confirmed speedup cleared the margin. speculative.concurrency_limit is the cap\n"
    "# (speculation off above it), set only when a larger measured batch size failed; null: no limit was measured.\n"
)
ENGINES_HEADER = (
    "# The comment above each engine names the engine version its settings assume (`needs:`), or that it cannot serve\n"
    "# the measured kind (`not served:`), and where its settings depart\n"
    '# from the measured setting (docs/eval-and-serving.md, "Engines").\n'
)


@dataclass
class TargetView:
    """What promotion needs of the target: its HF config (fingerprint, vocabulary, layer count) and tokenizer."""

    config: Any
    tokenizer: Any


def load_target_view(spec: str, trust_remote_code: bool = False) -> TargetView:
    """The target's config and tokenizer, without its weights."""
    from specdec_runtime.loading import load_config, load_tokenizer

    return TargetView(
        load_config(spec, trust_remote_code=trust_remote_code),
        load_tokenizer(spec, trust_remote_code=trust_remote_code),
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


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _count(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 1


def _interval(v) -> bool:
    return isinstance(v, list) and len(v) == 2 and all(map(_number, v)) and v[0] <= v[1]


def _folder_name(v) -> bool:
    return isinstance(v, str) and v != "" and not v.startswith(".") and not set(v) & {"/", "\\", "\0"}


def _mapping(v) -> bool:
    return isinstance(v, dict)


def _mappings(v) -> bool:
    return isinstance(v, list) and all(isinstance(x, dict) for x in v)


# key -> (check, what the value must be, required, nested schema). Required: True, or "enabled" for a key an enabled
# recommendation needs; a key that is not required may be absent or null. The report's other keys are not read here.
INTERVAL = "two numbers [lo, hi] with lo <= hi"
SETTING_SCHEMA = {
    "temperature": (lambda v: _number(v) and v >= 0, "a number >= 0", True, None),
    "draft_rule": (lambda v: isinstance(v, str), "a string", True, None),
    "num_draft_tokens": (_count, "an integer >= 1", True, None),
    "acceptance_rate": (lambda v: _number(v) and 0 <= v <= 1, "a number in [0, 1]", False, None),
    "mean_accepted_length": (_number, "a number", False, None),
    "speedup": (_number, "a number", False, None),
    "speedup_ci": (_interval, INTERVAL, False, None),
}
CONFIRMATION_SCHEMA = {
    "acceptance_rate": (lambda v: _number(v) and 0 <= v <= 1, "a number in [0, 1]", True, None),
    "speedup_ci": (_interval, INTERVAL, False, None),
    "speedup": (lambda v: _number(v) and v > 0, "a number > 0", False, None),
    "mean_accepted_length": (lambda v: _number(v) and v >= 1, "a number >= 1", False, None),
    "split": (lambda v: isinstance(v, str), "a string", False, None),
    "batch_size": (_count, "an integer >= 1", False, None),
    "prompts": (_count, "an integer >= 1", False, None),
    "max_concurrency": (_count, "an integer >= 1", False, None),
    "measured_concurrency": (
        lambda v: isinstance(v, list) and v != [] and all(map(_count, v)),
        "a list of integers >= 1",
        False,
        None,
    ),
}
BATCH_ROW_SCHEMA = {
    "batch_size": (_count, "an integer >= 1", True, None),
    "speedup_ci": (_interval, INTERVAL, False, None),
}
RECOMMENDATION_SCHEMA = {
    "enabled": (lambda v: isinstance(v, bool), "true or false", True, None),
    "reason": (lambda v: isinstance(v, str), "a string", True, None),
    "confirmation": (_mapping, "a mapping", True, CONFIRMATION_SCHEMA),
    "name": (_folder_name, "a folder name (no / and no leading dot)", False, None),
    "draft": (lambda v: isinstance(v, str) and v != "", "the draft folder's path or a lookup spec", "enabled", None),
    "kind": (lambda v: v in METHODS, f"one of {', '.join(METHODS)}", False, None),
    "num_draft_tokens": (_count, "an integer >= 1", "enabled", None),
    "draft_rule": (lambda v: v in ("greedy", "sample"), "greedy or sample", "enabled", None),
    "temperature": (lambda v: _number(v) and v >= 0, "a number >= 0", False, None),
    "gates": (_mapping, "a mapping", False, None),
    "by_batch_size": (_mappings, "a list of mappings", False, BATCH_ROW_SCHEMA),
}
CANDIDATE_SCHEMA = {
    "name": (lambda v: isinstance(v, str), "a string", True, None),
    "draft": (lambda v: isinstance(v, str), "a string", True, None),
    "settings": (_mappings, "a list of mappings", True, SETTING_SCHEMA),
}
REPORT_SCHEMA = {
    "target": (lambda v: isinstance(v, str) and v != "", "the target's model spec", True, None),
    "target_fingerprint": (lambda v: isinstance(v, str), "a string", False, None),
    "prompts": (_mapping, "a mapping", False, None),
    "candidates": (_mappings, "a list of mappings", False, CANDIDATE_SCHEMA),
    "recommendation": (_mapping, "a mapping", True, RECOMMENDATION_SCHEMA),
}


EDITED = "the report is damaged or was edited: run `specdistill eval` to write it again"


def _show(value) -> str:
    text = json.dumps(value)
    return text if len(text) <= 60 else text[:57] + "..."


def check_fields(value: dict, schema: dict, where: str, report_path: Path, enabled: bool) -> None:
    """UserError naming the first field of `value` (at `where`) that is missing or not what `schema` says."""
    for key, (ok, what, required, nested) in schema.items():
        field = f"{where}.{key}" if where else key
        if value.get(key) is None:
            if required is True or (required == "enabled" and enabled):
                raise UserError(f"{report_path}: {field} is missing, expected {what}; {EDITED}")
            continue
        if not ok(value[key]):
            raise UserError(f"{report_path}: {field} is {_show(value[key])}, expected {what}; {EDITED}")
        if nested is not None and isinstance(value[key], list):
            for i, item in enumerate(value[key]):
                check_fields(item, nested, f"{field}[{i}]", report_path, enabled)
        elif nested is not None:
            check_fields(value[key], nested, field, report_path, enabled)


def load_report(report_path: Path) -> dict:
    """The eval report at `report_path`, checked against `REPORT_SCHEMA` (UserError naming the file and the field)."""
    try:
        report = json.loads(Path(report_path).read_text(encoding="utf-8"))
    except ValueError as e:  # not JSON, truncated, or not UTF-8
        raise UserError(f"{report_path} is not valid JSON ({e}); {EDITED}") from None
    check_report(report, report_path)
    return report


def check_report(report: dict, report_path: Path) -> dict:
    """The report's recommendation, once every field promote and the model card read has its type and shape
    (`REPORT_SCHEMA`); UserError naming the field otherwise, or what is missing when the report is not a finished
    eval."""
    if not isinstance(report, dict) or report.get("schema_version") != 1:
        raise UserError(f"{report_path} is not a specdistill eval report (schema_version 1); run `specdistill eval`")
    rec = report.get("recommendation")
    if not isinstance(rec, dict):
        raise UserError(
            f"{report_path} has no recommendation; run `specdistill eval` to the end (it recommends a "
            "draft from the measured sweep)"
        )
    check_fields(report, REPORT_SCHEMA, "", report_path, rec.get("enabled") is True)
    return rec


# ----------------------------------------------------------------------------------------------------------------
# The decision, made again


def run_config(report_path: Path) -> tuple[Path, dict] | None:
    """(path, mapping) of <output_dir>/config.yaml next to <output_dir>/eval/report.json, when the report came from
    a run."""
    path = Path(report_path).resolve().parent.parent / "config.yaml"
    if not path.is_file():
        return None
    try:
        config = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (yaml.YAMLError, ValueError) as e:
        raise UserError(f"the run config {path} next to the report is not valid YAML ({e}); fix or remove it") from None
    return (path, config) if isinstance(config, dict) else None


def serving_gates(report_path: Path, rec: dict) -> tuple[ServingConfig, str]:
    """(gates, where they come from) the recommendation is checked against: the serving section of the run's
    config.yaml next to the report, else the gates the report recorded (`recommendation.gates`), else the defaults at
    the recommendation's own temperature and draft rule (a report made before the gates were recorded)."""
    found = run_config(report_path)
    if found is not None and isinstance(found[1].get("serving"), dict):
        return _gates(found[1]["serving"], f"{found[0]} (serving section)"), f"the serving gates of {found[0]}"
    if isinstance(rec.get("gates"), dict):
        return _gates(rec["gates"], f"{report_path}: recommendation.gates"), "the gates the report recorded"
    rule = rec.get("draft_rule") or "greedy"
    return ServingConfig(temperature=rec.get("temperature") or 0.0, draft_rule=rule), "the default serving gates"


def _gates(section: dict, where: str) -> ServingConfig:
    keys = [f.name for f in dataclasses.fields(ServingConfig) if f.name != "path"]
    fix = "fix it or re-run `specdistill eval`"
    if section.get("draft_rule", "greedy") not in ("greedy", "sample"):
        raise UserError(f"{where}: draft_rule must be greedy or sample, got {section['draft_rule']!r}; {fix}")
    try:
        return ServingConfig(**{k: section[k] for k in keys if k in section})
    except (TypeError, ValueError) as e:  # a value of the wrong type, or out of range
        raise UserError(f"{where} is not a valid serving section ({e}); {fix}") from None


def check_decision(rec: dict, report_path: Path) -> str | None:
    """How the report's decision disagrees with the one its own numbers give under the serving gates
    (`serving_gates`): served temperature and draft rule, `enabled` (`eval.recommend.gate` on the confirmation), and
    the confirmed concurrency (`eval.recommend.max_concurrency` on the measured batch sizes, when the report has
    them). None when they agree."""
    gates, source = serving_gates(report_path, rec)
    conf, threshold = rec["confirmation"], 1 + gates.min_speedup_margin
    served = (gates.temperature, "greedy" if gates.temperature == 0 else gates.draft_rule)
    if rec.get("temperature") is not None and rec.get("draft_rule") is not None:
        made = (rec["temperature"], "greedy" if rec["temperature"] == 0 else rec["draft_rule"])
        if made != served:
            return (
                f"the recommendation is for temperature {made[0]:g} ({made[1]}), but {source} serve temperature "
                f"{served[0]:g} ({served[1]})"
            )
    decided = gate(conf, gates)
    if decided == "passed" and not rec["enabled"]:
        return (
            f"recommendation.enabled is false, but its confirmation (speedup_ci {_show(conf.get('speedup_ci'))}, "
            f"acceptance_rate {conf['acceptance_rate']:g}) passes {source} (speedup_ci[0] > {threshold:g}, "
            f"acceptance_rate >= {gates.min_acceptance:g})"
        )
    if decided != "passed" and rec["enabled"]:
        failed = (
            f"its confirmation's speedup_ci {_show(conf.get('speedup_ci'))} does not clear 1 + min_speedup_margin = "
            f"{threshold:g}"
            if decided == "speedup_ci"
            else f"its confirmation's acceptance_rate {conf['acceptance_rate']:g} is below min_acceptance "
            f"{gates.min_acceptance:g}"
        )
        return f"recommendation.enabled is true, but {failed} ({source})"
    rows = rec.get("by_batch_size")
    if rec["enabled"] and rows and max_concurrency(rows, threshold) != conf.get("max_concurrency"):
        return (
            f"recommendation.confirmation.max_concurrency is {conf.get('max_concurrency')}, but its measured batch "
            f"sizes clear the margin up to {max_concurrency(rows, threshold)} ({source})"
        )
    return None


# ----------------------------------------------------------------------------------------------------------------
# The draft


def is_lookup(rec: dict) -> bool:
    """A zero-training draft (ngram, suffix): no folder, no weights, nothing to export; its spec is `draft`."""
    return rec.get("kind") in LOOKUP_KINDS or (
        isinstance(rec.get("draft"), str) and is_lookup_spec(rec["draft"]) and not Path(rec["draft"]).exists()
    )


def check_recommended_draft(rec: dict, report_path: Path) -> str:
    """The draft's kind, once its folder is known to exist, to hold a draft of the kind the report claims (an EAGLE-3
    head or a standalone model) and to have readable config and weights (headers only, no weights are loaded); for a
    zero-training draft, that its spec parses and names the kind claimed."""
    from specdec_runtime.loading import ModelLoadError, check_draft_folder, load_config

    if is_lookup(rec):
        try:
            kind = lookup_draft(rec["draft"]).kind
        except UserError as e:
            raise UserError(f"{report_path}: recommendation.draft: {e}; {EDITED}") from None
        if rec.get("kind", kind) != kind:
            raise UserError(
                f"{report_path}: recommendation.kind is {rec['kind']}, but draft is {rec['draft']}; {EDITED}"
            )
        return kind
    folder = Path(rec["draft"]).expanduser()
    if not folder.is_dir():
        raise UserError(
            f"{report_path}: recommendation.draft {folder} does not exist or is not a folder; restore the draft "
            "there, or re-run `specdistill eval` on where it is now"
        )
    kind = "eagle3" if is_eagle3_folder(folder) else "standalone"
    claimed = rec.get("kind") or kind
    if claimed != kind:
        holds = "an EAGLE-3 head" if kind == "eagle3" else "a standalone draft model, not an EAGLE-3 head"
        raise UserError(f"{report_path}: recommendation.kind is {claimed}, but {folder} holds {holds}; {EDITED}")
    check_draft_folder(folder)  # a config and weights, every file whole (headers only)
    if kind == "standalone" and (folder / CONFIG_FILE).is_file():
        try:  # the HF config a serving engine reads first
            load_config(str(folder))
        except (ModelLoadError, OSError, ValueError) as e:
            raise UserError(f"{folder}/{CONFIG_FILE} does not load as an HF model config ({e}); {EDITED}") from None
    return kind


def check_target(
    report: dict, report_path: Path, expected_target: str | None, expected_fingerprint: str | None
) -> None:
    """Refuse a report made for another target: the fingerprint decides when both sides have one, else the spec.
    Without `expected_target` the report's own target is served, and only its fingerprint can differ (its files
    changed since the eval)."""
    got, got_fp = report.get("target"), report.get("target_fingerprint")
    if expected_fingerprint is not None and got_fp is not None:
        if expected_fingerprint != got_fp and expected_target is None:
            raise UserError(
                f"{report_path} was made for target {got!r} with fingerprint {got_fp}; {got!r} now has fingerprint "
                f"{expected_fingerprint} (its vocabulary or architecture changed): re-run eval against it"
            )
        if expected_fingerprint != got_fp:
            raise UserError(
                f"{report_path} was made for target {got!r} (fingerprint {got_fp}), not for "
                f"{expected_target!r} (fingerprint {expected_fingerprint}): "
                "its vocabulary or architecture differ; re-run eval against this target"
            )
        return
    if expected_target is not None and not _same_spec(expected_target, got):
        raise UserError(
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


def check_draft(rec: dict, target: TargetView) -> None:
    """Refuse a draft whose token ids mean other text to the target (VocabMismatchError, a UserError): a standalone
    draft's tokenizer is checked against the target's; an EAGLE-3 head uses the target's ids and embeddings by
    construction, so its vocabulary and width must be the target's (and a tokenizer saved with it must agree)."""
    from specdec_runtime.loading import check_vocab_compatible, load_tokenizer

    folder = Path(rec["draft"])
    config = json.loads((folder / CONFIG_FILE).read_text()) if (folder / CONFIG_FILE).is_file() else {}
    if is_speculators_config(config):  # eval reads it (specdec_runtime.eagle3); the export would rewrite its config
        raise UserError(
            f"{folder} is an EAGLE-3 head saved by the speculators package: eval measures it, but promotion does not "
            "export that format yet; serve it with vLLM from its own folder (docs/eval-and-serving.md)"
        )
    # Our heads with speculators' other variants: the engines' EAGLE-3 layout has no fc norm weight (norm_before_fc)
    # and feeds later steps the pre-norm output (norm_output). vLLM reads norm_before_residual from config.json.
    unservable = [k for k in ("norm_before_fc", "norm_output") if config.get(k)]
    if is_eagle3_folder(folder) and unservable:
        raise UserError(
            f"{folder} is an EAGLE-3 head trained with {' and '.join(unservable)}, which the serving engines' EAGLE-3 "
            "layout does not compute: eval measures it, promotion does not export it; train it with "
            f"{' and '.join(f'draft.{k}=false' for k in unservable)} to promote it (docs/eval-and-serving.md)"
        )
    if is_eagle3_folder(folder):
        want = (target.config.vocab_size, target.config.hidden_size)
        if (config.get("vocab_size"), config.get("hidden_size")) != want:
            raise UserError(
                f"the EAGLE-3 head {folder} has vocab_size {config.get('vocab_size')}, hidden_size "
                f"{config.get('hidden_size')}; the target has {want[0]}, {want[1]}: it was trained for another "
                "target; promote it into that target's serving config"
            )
        if not (folder / "tokenizer_config.json").is_file():
            return
    check_vocab_compatible(target.tokenizer, load_tokenizer(str(folder)), config.get("vocab_size"))


def _path_or_spec(value: str | Path) -> str:
    """Absolute path for a local folder (the serving engine runs from another directory), else as given."""
    path = Path(value).expanduser()
    return str(path.resolve()) if path.exists() else str(value)


MEASURED_KEYS = ("acceptance_rate", "mean_accepted_length", "speedup", "speedup_ci", "split", "batch_size", "prompts")
"""The confirmation's numbers serving.yaml's `measured` copies under their report names."""


def serving_setting(rec: dict, draft: str, num_target_layers: int) -> ServingSetting:
    """What the engines must reproduce of an enabled recommendation, served from `draft` (the export's path); a
    zero-training draft is served from its knobs."""
    if is_lookup(rec):
        draft = lookup_draft(rec["draft"])
        return recommended_setting({**rec, "kind": draft.kind}, None, knobs=draft.knobs())
    folder, aux = Path(rec["draft"]), None
    if is_eagle3_folder(folder):  # the folder decides the kind; the layers eval measured: config.json's or the default
        aux = head_aux(json.loads((folder / CONFIG_FILE).read_text()), folder, None, num_target_layers)
    return recommended_setting({**rec, "kind": "eagle3" if aux else "standalone"}, draft, aux)


def export_dir_for(rec: dict, export_root: Path) -> Path:
    """<export_root>/<the recommendation's name> (the draft folder's name when the report names none)."""
    return Path(export_root).expanduser().resolve() / (rec.get("name") or Path(rec["draft"]).name)


def check_own_export_dir(rec: dict, export_dir: Path) -> None:
    """Promotion exports into <export_root>/<name> and replaces only what is there when it is its own previous export
    (`eval.export.not_an_export`): a folder holding anything else is refused, and so is a folder that is, holds or
    lies inside the draft (`eval.export.check_export_dir`)."""
    check_export_dir(Path(rec["draft"]), export_dir, force=True)
    why = not_an_export(export_dir) if export_dir.is_dir() and any(export_dir.iterdir()) else None
    if why is not None:
        raise UserError(
            f"export folder {export_dir} is not a previous export of {export_dir.name} ({why}): promote replaces only "
            "its own exports; move what is there away, or pass another --export-dir"
        )


def check_serving_path(path: Path) -> None:
    """The serving config is written next to itself (temp file and lock): a folder in its place, or a folder that
    cannot be written, is refused before the export is written."""
    if path.is_dir():
        raise UserError(f"serving config {path} is a folder; give a file path, e.g. --serving {path / 'serving.yaml'}")
    check_writable(path.parent, f"the serving config {path}")


def build_serving(
    old: dict,
    report: dict,
    report_path: Path,
    setting: ServingSetting | None,
    now: str,
    forced: str | None = None,
) -> dict:
    """The new serving config: `old` with target, speculative and engines replaced and one history entry added.
    `measured` holds the confirmation split's numbers (the ones the decision was made on), with their interval;
    `setting` is None when the recommendation is not enabled; `forced`: the disagreement `--force` overrode, kept in
    the reason and the history entry."""
    rec = report["recommendation"]
    conf = rec["confirmation"]
    draft = setting.draft if setting is not None else None
    if setting is not None and setting.knobs is not None:  # a zero-training draft: its spec names it
        draft = rec["draft"]
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
            "kind": setting.kind,
            **({"knobs": dict(setting.knobs)} if setting.knobs is not None else {}),
            "num_draft_tokens": setting.num_draft_tokens,
            "draft_rule": setting.draft_rule,
            "temperature": rec.get("temperature"),
            "max_concurrency_measured": measured["max_concurrency_measured"],
            "concurrency_limit": setting.concurrency_limit,
            "measured": measured,
            "reason": _with_difference(rec["reason"], _differences(setting)),
        }
        engines = _merge_engines(old.get("engines"), engine_snippets(setting))
    else:
        speculative = {"enabled": False, "reason": rec["reason"], "measured": measured}
        engines = _merge_engines(old.get("engines"), None)
    if forced is not None:
        speculative["reason"] = f"{speculative['reason']} [promoted with --force although {forced}]"
    previous = old.get("speculative") if isinstance(old.get("speculative"), dict) else {}
    entry = {
        "promoted_at": now,
        "draft": draft if rec["enabled"] else None,
        "enabled": bool(rec["enabled"]),
        "num_draft_tokens": rec["num_draft_tokens"] if rec["enabled"] else None,
        "measured": copy.deepcopy(measured),  # a copy: a shared object would be dumped as a YAML anchor/alias
        "replaced": previous.get("draft") if previous.get("enabled") else None,
    } | ({"forced": forced} if forced is not None else {})
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
    raw = path.read_bytes()
    text = raw.decode("utf-8", errors="replace")
    try:
        parsed = yaml.safe_load(raw.decode("utf-8"))
        problem = None if isinstance(parsed, dict) or parsed is None else f"a YAML {type(parsed).__name__}"
        if isinstance(parsed, dict) and not isinstance(parsed.get("history") or [], list):
            problem = "a mapping whose `history` is not a list"
    except yaml.YAMLError as e:
        problem = f"not valid YAML ({str(e).splitlines()[0]})"
    except UnicodeDecodeError:
        problem = "not UTF-8 text"
    if problem is None:
        return text, parsed or {}
    if not force:
        raise UserError(
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


def _differences(setting: ServingSetting) -> str | None:
    """What some engine cannot serve of the measured setting (its draft rule, or the kind at all), else None."""
    said = [d for d in (rule_difference(setting), kind_difference(setting)) if d]
    return " ".join(said) or None


def _with_difference(reason: str, difference: str | None) -> str:
    return reason if difference is None else f"{reason.rstrip('.')}. {difference}"


def dump_serving(config: dict, notes: dict[str, list[str]] | None = None) -> str:
    """The file's text: the header, then the YAML with each engine's `notes` as comments above its key."""
    text = yaml.safe_dump(config, sort_keys=False, default_flow_style=False, allow_unicode=True)
    if not notes:
        return HEADER + text
    lines, in_engines = [], False
    for line in text.splitlines(keepends=True):
        in_engines = line.startswith("engines:") or (in_engines and line.startswith(" "))
        key = line.strip().split(":", 1)[0]  # `vllm:` opens a mapping; `sglang: []` is an engine left empty
        if in_engines and line.startswith("  ") and not line.startswith("   ") and key in ENGINES:
            for note in notes.get(key, []):
                lines += [f"  # {part}\n" for part in textwrap.wrap(note, 114, subsequent_indent="  ")]
        lines.append(line)
    return HEADER + ENGINES_HEADER + "".join(lines)


# ----------------------------------------------------------------------------------------------------------------
# Entry point


def promote(
    report_path: Path,
    serving_path: Path,
    *,
    dry_run: bool = False,
    force: bool = False,
    expected_target: str | None = None,
    target: tuple | None = None,
    export_root: Path | None = None,
    trust_remote_code: bool = False,
) -> str:
    """Write the report's recommendation into `serving_path`; returns a one-line summary, or with `dry_run` the
    unified diff of old vs new (nothing written, nothing exported).

    The serving target is `expected_target` (the deployment's or the run's spec), else the report's own. `target`:
    its (model or config holder, tokenizer), already loaded (`run` passes its own); else its config and tokenizer are
    loaded here. Refuses (UserError), before writing anything: a report that is not a finished eval or breaks its
    schema (`load_report`), a report whose `enabled` disagrees with its numbers under the serving gates
    (`check_decision`; unless `force`, which promotes what it says and records the disagreement), a report made for
    another target (by fingerprint when both sides have one, else by spec), a missing draft folder or one of another
    kind (`check_recommended_draft`), an enabled draft whose vocabulary differs from the target's (`check_draft`), a
    serving path that cannot be written or an existing serving file that is not a YAML mapping (unless `force`), an
    export folder holding anything but this draft's previous export (`check_own_export_dir`).
    With `export_root`, the recommended draft (enabled or not: a disabled one for inspection) is exported to
    `export_root/<name>` and an enabled one is served from there, its model card holding the same engine settings.
    """
    from eval.results import target_fingerprint
    from specdec_runtime.loading import ModelLoadError

    report_path, serving_path = Path(report_path), Path(serving_path)
    report = load_report(report_path)
    rec = report["recommendation"]
    disagreement = check_decision(rec, report_path)
    if disagreement is not None and not force:
        raise UserError(
            f"{report_path}: {disagreement}; re-run `specdistill eval` (the report was edited, or made under other "
            "gates), or pass --force to promote what it says"
        )
    if target is None:
        try:
            view = load_target_view(expected_target or report["target"], trust_remote_code)
        except ModelLoadError:
            check_target(report, report_path, expected_target, None)  # another target's report says so first
            raise
    else:
        view = TargetView(target[0].config, target[1])
    check_target(report, report_path, expected_target, target_fingerprint(view, view.tokenizer))
    # a zero-training draft has no weights: nothing to export, its knobs are the serving setting
    exportable = rec.get("draft") and not is_lookup(rec)
    export_dir = export_dir_for(rec, export_root) if export_root is not None and exportable else None
    if rec["enabled"] or export_dir is not None:
        check_recommended_draft(rec, report_path)
    if rec["enabled"] and not is_lookup(rec):  # a lookup proposes the target's own tokens
        check_draft(rec, view)
    check_serving_path(serving_path)
    if not (force or dry_run):
        read_serving(serving_path, force=False)  # a broken serving file is refused before the export is written
    if export_dir is not None:
        check_own_export_dir(rec, export_dir)
    setting, notes = None, None
    if rec["enabled"]:
        draft = str(export_dir) if export_dir is not None else _path_or_spec(rec["draft"])
        setting = serving_setting(rec, draft, view.config.num_hidden_layers)
        notes = engine_notes(setting)
    now = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    if dry_run:
        old_text, old = _read_lenient(serving_path) if force else read_serving(serving_path, force=False)
        new_text = dump_serving(build_serving(old, report, report_path, setting, now, disagreement), notes)
        return "".join(
            difflib.unified_diff(
                old_text.splitlines(keepends=True),
                new_text.splitlines(keepends=True),
                fromfile=f"{serving_path} (current)",
                tofile=f"{serving_path} (promoted)",
            )
        )
    if export_dir is not None:  # force: check_own_export_dir found it absent, empty or this draft's previous export
        layers = view.config.num_hidden_layers
        export_draft(Path(rec["draft"]), export_dir, report=report, setting=setting, target_layers=layers, force=True)
    serving_path.parent.mkdir(parents=True, exist_ok=True)
    with locked(serving_path):
        _, old = read_serving(serving_path, force)
        new = build_serving(old, report, report_path, setting, now, disagreement)
        atomic.write_text(serving_path, dump_serving(new, notes))
    if not rec["enabled"]:
        return f"speculative decoding disabled in {serving_path}: {rec['reason']}"
    replaced, speedup, ci = (
        new["history"][-1]["replaced"],
        rec["confirmation"].get("speedup"),
        rec["confirmation"].get("speedup_ci"),
    )
    return (
        f"promoted {rec.get('name', setting.draft)} ({setting.draft}, num_draft_tokens={rec['num_draft_tokens']}"
        + (f", confirmed speedup {speedup:.2f}x" if isinstance(speedup, (int, float)) else "")
        + (f" [{ci[0]:.2f}, {ci[1]:.2f}]" if ci else "")
        + f") into {serving_path}"
        + (f", replacing {replaced}" if replaced else "")
    )


def _read_lenient(path: Path) -> tuple[str, dict]:
    """Dry run with force: show the diff against what force would start from (an unreadable file counts as empty)."""
    try:
        return read_serving(path, force=False)
    except UserError:
        return path.read_text(), {}
