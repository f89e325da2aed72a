"""Export a draft checkpoint as a standalone HF-format folder with a model card.

    specdistill export runs/quickstart/candidates/trunc4-fkl/best runs/quickstart/export/trunc4-fkl
    specdistill export runs/quickstart/candidates/lora/checkpoints/step-000200 out/lora-draft   # LoRA merged

Input: an HF folder (`best/`, `checkpoints/step-N/`, any `save_pretrained` output) or a peft LoRA adapter folder
(`adapter_config.json`, its base read from `base_model_name_or_path`, or from the folder itself when it also holds
the base weights). Output: safetensors weights, config.json, generation_config.json, tokenizer files and README.md
(eval numbers, training config, serving snippets), and nothing else: no optimizer, RNG or trainer state. The folder
is written under a temporary name and renamed (`atomic.staged_dir`), so an interrupted export never looks finished.

Nothing already there is lost by accident (issue 24): the export folder is checked before the draft is read. It may
never be the draft's own folder, lie inside it or contain it (`--force` or not); an existing non-empty folder is
refused unless `force` (`--force`), which replaces it only once the new export is complete. `promote` re-exports into
<export_root>/<name> over its own previous export (`not_an_export`: the card and only the files an export writes),
never over a folder holding anything else.

An EAGLE-3 head (`draft.init: eagle3`) is already in the layout vLLM and SGLang load (shared/EAGLE3.md): its export is
its config.json (with the aux layer ids always written, issue 23), model.safetensors and tokenizer files, plus the
card, which states the kind, the aux layers, the draft vocabulary's coverage and the `speculators convert` command.

The card's serving snippets are the serving config's (`eval.engines`): `specdistill promote` passes the setting it
promotes; a plain export takes the report's recommendation for this draft, else its best measured gamma.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
from collections.abc import Iterator
from datetime import datetime, timezone
from pathlib import Path

import yaml

from eval.engines import (
    ENGINE_NAMES,
    ServingSetting,
    engine_notes,
    engine_snippets,
    recommended_setting,
    speculators_convert_command,
)
from specdec_runtime import atomic
from specdec_runtime.eagle3 import CONFIG_FILE, WEIGHTS_FILE, aux_layer_keys, default_aux_layers, is_eagle3_folder
from specdec_runtime.errors import UserError
from specdec_runtime.loading import load_checkpoint

# Files of an EAGLE-3 checkpoint copied into its export besides config.json and model.safetensors: the tokenizer's.
TOKENIZER_PREFIXES = ("tokenizer", "special_tokens_map", "chat_template", "vocab", "merges", "added_tokens")
# The card's front matter tag line: with only export files beside it, a folder is an export `promote` may replace.
CARD_TAGS = "tags: [speculative-decoding, draft-model, specdistill]"
CARD_COLUMNS = [
    "num_draft_tokens",
    "temperature",
    "draft_rule",
    "acceptance_rate",
    "mean_accepted_length",
    "speedup",
    "speedup_ci",
]


# ----------------------------------------------------------------------------------------------------------------
# Model card


def find_training_config(checkpoint: Path) -> str | None:
    """The resolved config saved with a checkpoint; best/ has none of its own, so the newest of its run's
    checkpoints/step-*/config.yaml (all written from the same run config)."""
    found = [checkpoint / "config.yaml"]
    if checkpoint.name == "best":
        found += sorted((checkpoint.parent / "checkpoints").glob("step-*/config.yaml"), reverse=True)
    return next((p.read_text() for p in found if p.is_file()), None)


def find_candidate(report: dict, checkpoint: Path) -> dict | None:
    """The report's candidate evaluated from `checkpoint` (same folder), if any."""
    for cand in report.get("candidates", []):
        draft = Path(cand.get("draft", "")).expanduser()
        if draft.exists() and draft.resolve() == checkpoint.resolve():
            return cand
    return None


def _cell(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, list):  # an interval, speedup_ci
        return "[" + ", ".join(f"{v:.4g}" for v in value) + "]"
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def eval_section(report: dict | None, checkpoint: Path) -> str:
    if report is None:
        return "No eval report was given at export time; run `specdistill eval` to measure this draft."
    cand = find_candidate(report, checkpoint)
    if cand is None:
        return (
            f"This checkpoint ({checkpoint}) is not among the candidates of the eval report made on "
            f"{report.get('created_at', '?')}; run `specdistill eval` on it to measure it."
        )
    rows = sorted(cand["settings"], key=lambda s: (s["temperature"], s["draft_rule"], s["num_draft_tokens"]))
    table = ["| " + " | ".join(CARD_COLUMNS) + " |", "|" + " --- |" * len(CARD_COLUMNS)]
    table += ["| " + " | ".join(_cell(s.get(k)) for k in CARD_COLUMNS) + " |" for s in rows]
    prompts = report.get("prompts") or {}
    lines = [
        f"Measured by `specdistill eval` against target `{report.get('target')}` on {report.get('device', '?')}, "
        f"{prompts.get('count', '?')} prompts from {prompts.get('source', '?')} "
        f"({report.get('created_at', '?')}). "
        "`speedup` is target-only decode seconds per token / speculative decode seconds per token (prefill "
        "excluded), the median of paired per-prompt ratios (ABBA order, repeated), with `speedup_ci` its 95 % "
        "bootstrap interval over prompts; the table holds the selection split. `acceptance_rate` is accepted / "
        "judged draft tokens; `mean_accepted_length` is tokens emitted per target verify step.",
        "",
        *table,
    ]
    rec = report.get("recommendation") or {}
    if rec.get("enabled") and rec.get("name") == cand["name"]:
        conf = rec.get("confirmation") or {}
        ci = conf.get("speedup_ci")
        lines += [
            "",
            f"Recommended serving setting: num_draft_tokens={rec['num_draft_tokens']}, "
            f"draft_rule={rec['draft_rule']}, temperature={rec.get('temperature')}; re-measured on "
            f"{conf.get('prompts', '?')} confirmation prompts the choice never saw: speedup "
            f"{_cell(conf.get('speedup'))}"
            + (f" (95% CI {ci[0]:.3g}-{ci[1]:.3g})" if ci else "")
            + f", acceptance_rate {_cell(conf.get('acceptance_rate'))} ({rec.get('reason')}).",
        ]
    return "\n".join(lines)


def serving_section(snippets: dict, notes: dict[str, list[str]], target: str, convert: str | None = None) -> str:
    """The card's serving commands, each engine's notes under it (`eval.engines.engine_notes`)."""
    vllm = json.dumps(snippets["vllm"]["speculative_config"])
    trtllm = yaml.safe_dump(snippets["trtllm"], sort_keys=False).rstrip()
    blocks = {
        "vllm": ["```bash", f"vllm serve {target} --speculative-config '{vllm}'", "```"],
        "sglang": [
            "```bash",
            f"python -m sglang.launch_server --model-path {target} " + " ".join(map(str, snippets["sglang"])),
            "```",
        ],
        "trtllm": ["`trtllm-serve TARGET --config spec.yaml` with this spec.yaml:", "", "```yaml", trtllm, "```"],
    }
    lines = []
    for engine, block in blocks.items():
        lines += [f"{ENGINE_NAMES[engine]}:", "", *block, "", *(f"- {n}" for n in notes.get(engine, [])), ""]
    if convert is not None:
        lines += [
            "speculators format (vLLM also loads it): the converter reads the aux layers only from "
            "`--algorithm-kwargs`, never from config.json, so keep them in the command:",
            "",
            "```bash",
            convert,
            "```",
            "",
        ]
    return "\n".join(lines).rstrip()


def model_card(
    *,
    name: str,
    checkpoint: Path,
    num_parameters: int,
    merged_lora: bool,
    report: dict | None,
    training_config: str | None,
    setting: ServingSetting,
    kind_section: str | None = None,
    convert: str | None = None,
) -> str:
    target = (report or {}).get("target", "TARGET")
    return "\n".join(
        [
            "---",
            "library_name: transformers",
            "pipeline_tag: text-generation",
            CARD_TAGS,
            "---",
            "",
            f"# {name}: a draft model for speculative decoding",
            "",
            f"Draft for target `{target}`, distilled with specdistill and exported from `{checkpoint}` on "
            f"{datetime.now(timezone.utc).strftime('%Y-%m-%d')}. {num_parameters / 1e6:.2f}M parameters"
            + (", LoRA adapters merged into the weights." if merged_lora else "."),
            "",
            "It shares the target's tokenizer: draft token ids mean the same text to the target, which speculative "
            "decoding requires.",
            "",
            *([kind_section, ""] if kind_section else []),
            "## Eval",
            "",
            eval_section(report, checkpoint),
            "",
            "## Training config",
            "",
            "```yaml",
            (training_config or "# not recorded").rstrip(),
            "```",
            "",
            "## Serving",
            "",
            serving_section(engine_snippets(setting), engine_notes(setting), target, convert),
            "",
        ]
    )


def _draft_name(checkpoint: Path) -> str:
    """candidates/<name>/best -> <name>; candidates/<name>/checkpoints/step-N -> <name>@step-N; else the folder."""
    checkpoint = checkpoint.resolve()
    if checkpoint.name == "best":
        return checkpoint.parent.name
    if checkpoint.parent.name == "checkpoints":
        return f"{checkpoint.parent.parent.name}@{checkpoint.name}"
    return checkpoint.name


def _best_gamma(cand: dict | None) -> int:
    """num_draft_tokens of this draft's best measured speedup, else 4."""
    measured = [s for s in (cand or {}).get("settings", []) if s.get("speedup") is not None]
    return max(measured, key=lambda s: s["speedup"])["num_draft_tokens"] if measured else 4


# ----------------------------------------------------------------------------------------------------------------
# Entry point


def export_draft(
    checkpoint: Path,
    out_dir: Path,
    *,
    report: dict | None = None,
    training_config: str | None = None,
    setting: ServingSetting | None = None,
    target_layers: int | None = None,
    force: bool = False,
) -> Path:
    """Write the draft in `checkpoint` as a standalone HF folder at `out_dir` (`check_export_dir` first: an existing
    non-empty `out_dir` is replaced only with `force`, once the new export is complete).

    `training_config` (YAML text) defaults to the run's resolved config (`find_training_config`); `setting` (what the
    card's serving snippets reproduce, its draft the export) defaults to `card_setting`. `target_layers`: the
    target's layer count, which gives the aux layers of an EAGLE-3 head saved without them (else read from the
    report's target).
    """
    checkpoint, out_dir = Path(checkpoint), check_export_dir(checkpoint, out_dir, force=force)
    if is_eagle3_folder(checkpoint):
        return export_eagle3(checkpoint, out_dir, report, training_config, setting, target_layers)
    model, tokenizer, merged = load_checkpoint(checkpoint)
    if training_config is None:
        training_config = find_training_config(checkpoint)
    with staged_export(out_dir) as tmp:
        model.save_pretrained(tmp)  # safetensors, config.json and generation_config.json
        tokenizer.save_pretrained(tmp)
        (tmp / "README.md").write_text(
            model_card(
                name=_draft_name(checkpoint),
                checkpoint=checkpoint,
                num_parameters=model.num_parameters(),
                merged_lora=merged,
                report=report,
                training_config=training_config,
                setting=setting or card_setting(report, checkpoint, out_dir),
            )
        )
    return out_dir


def check_export_dir(checkpoint: Path, out_dir: Path, *, force: bool) -> Path:
    """`out_dir` resolved, once it is known that writing the export there loses nothing by accident: it is not the
    draft's folder, inside it or around it (refused even with `force`: the export would replace its own source or
    write into it), not a file, empty or absent unless `force`, and on a writable filesystem. UserError otherwise."""
    src, out = Path(checkpoint).expanduser().resolve(), Path(out_dir).expanduser().resolve()
    where = "is" if out == src else "lies inside" if src in out.parents else "contains" if out in src.parents else None
    if where:
        raise UserError(
            f"cannot export {checkpoint} into {out_dir}: that folder {where} the draft being exported; choose an "
            "export folder outside it (e.g. <output_dir>/export/<name>)"
        )
    if out.exists() and not out.is_dir():
        raise UserError(f"cannot export into {out_dir}: it is a file; give a new or empty folder")
    entries = sorted(p.name for p in out.iterdir()) if out.is_dir() else []
    if entries and not force:
        shown = ", ".join(entries[:4]) + (", ..." if len(entries) > 4 else "")
        raise UserError(
            f"export folder {out_dir} exists and is not empty ({shown}); choose a new or empty folder, or pass "
            "--force to replace it (it is swapped for the new export once that is complete)"
        )
    check_writable(out.parent, f"the export into {out_dir}")  # it is staged next to out_dir and renamed into place
    return out


@contextlib.contextmanager
def staged_export(out_dir: Path) -> Iterator[Path]:
    """`atomic.staged_dir` for the export: a disk that fills up (or fails) while it is written is the user's to fix,
    said in one line; the temp folder is gone and a previous folder at `out_dir` is kept."""
    from safetensors import SafetensorError

    try:
        with atomic.staged_dir(out_dir) as tmp:
            yield tmp
    except (OSError, SafetensorError) as e:
        if isinstance(e, SafetensorError) and "os error" not in str(e):  # not I/O (safetensors has no errno): a bug
            raise
        raise UserError(
            f"writing the export to {out_dir} failed ({str(e).splitlines()[0]}); free space there or choose another "
            "folder (nothing was replaced)"
        ) from None


def check_writable(folder: Path, what: str) -> None:
    """UserError naming `what` cannot be written when `folder` (or its nearest existing ancestor, where it would be
    created) is a file, on a read-only filesystem or not writable by this user. Nothing is created."""
    folder = Path(folder).expanduser().resolve()
    existing = next(p for p in (folder, *folder.parents) if p.exists())
    problem = None
    if not existing.is_dir():
        problem = f"{existing} is a file, not a folder"
    elif os.statvfs(existing).f_flag & os.ST_RDONLY:
        problem = f"{existing} is on a read-only filesystem"
    elif not os.access(existing, os.W_OK | os.X_OK):
        problem = f"{existing} is not writable by this user"
    if problem:
        raise UserError(f"cannot write {what}: {problem}; choose a folder you can write")


def _export_file(name: str) -> bool:
    """A file an export writes: the card, the HF model's and generation configs, its weights, the tokenizer's."""
    return (
        name in ("README.md", CONFIG_FILE, "generation_config.json")
        or name.endswith((".safetensors", ".safetensors.index.json"))
        or name.startswith(TOKENIZER_PREFIXES)
    )


def not_an_export(folder: Path) -> str | None:
    """Why the non-empty `folder` is not a previous export, or None when it is one: specdistill's model card (its
    front matter's tag line) and only files an export writes. A user's own file, or another model's folder, is named."""
    card = Path(folder) / "README.md"
    if not card.is_file() or CARD_TAGS not in card.read_text(errors="replace").split("\n---", 1)[0]:
        return "no specdistill model card (README.md)"
    strangers = sorted(p.name for p in Path(folder).iterdir() if not (p.is_file() and _export_file(p.name)))
    return f"files an export does not write: {', '.join(strangers[:4])}" if strangers else None


def card_setting(
    report: dict | None, checkpoint: Path, out_dir: Path, aux_layers: tuple[int, ...] | None = None
) -> ServingSetting:
    """The setting a plain export's card shows: the report's recommendation when it is this draft (gamma, rule,
    concurrency cap), else this draft's best measured gamma (or 4) with the greedy rule. `aux_layers`: an EAGLE-3
    head's (None: a standalone draft)."""
    kind = "standalone" if aux_layers is None else "eagle3"
    cand = find_candidate(report, checkpoint) if report else None
    rec = (report or {}).get("recommendation") or {}
    if cand is not None and rec.get("name") == cand["name"] and rec.get("num_draft_tokens"):
        return recommended_setting({**rec, "kind": kind}, str(out_dir), aux_layers)
    return ServingSetting(str(out_dir), _best_gamma(cand), kind, aux_layers=aux_layers)


# ----------------------------------------------------------------------------------------------------------------
# EAGLE-3 heads: their files are the export


def eagle3_section(checkpoint: Path, aux: tuple[int, ...]) -> str:
    """The card's paragraph on an EAGLE-3 head: kind, aux layers in each engine's convention, draft vocabulary and
    its coverage."""
    config = json.loads((checkpoint / CONFIG_FILE).read_text())
    metrics = checkpoint / "metrics.json"
    coverage = json.loads(metrics.read_text()).get("eval/draft_vocab_coverage") if metrics.is_file() else None
    vocab = checkpoint.parent.parent / "draft_vocab.json"  # a step checkpoint's candidate folder
    if coverage is None and vocab.is_file():
        coverage = json.loads(vocab.read_text()).get("coverage")
    outputs = [i - 1 for i in aux]
    return (
        "Kind: **eagle3**, an EAGLE-3 head (one decoder layer fed with the target's hidden states; "
        f"architecture LlamaForCausalLMEagle3). It reads the inputs of target layers {list(aux)} (HF "
        "output_hidden_states indices: config.json's eagle_aux_hidden_state_layer_ids, which vLLM reads; SGLang reads "
        f"eagle_config's {outputs}, the outputs of layers {outputs}; TensorRT-LLM reads neither, its snippet below "
        f"passes eagle3_layers_to_capture {outputs}) and drafts from a {config['draft_vocab_size']}-token vocabulary "
        f"of the target's {config['vocab_size']} "
        + (
            f"covering {coverage:.2%} of the teacher's training response tokens"
            if coverage is not None
            else "(coverage not recorded)"
        )
        + ". Serve it with the target: it has no embeddings of its own, and only vLLM (`method: eagle3`), SGLang "
        "(`EAGLE3`), TensorRT-LLM (`Eagle3`) and specdistill's runtime run it; HF assisted generation cannot."
        + (
            " It was trained with the layer's residual taken after hidden_norm (config.json's norm_before_residual: "
            "true, speculators' layout), which vLLM's EAGLE-3 layers read and specdistill's runtime computes; check "
            "that your SGLang or TensorRT-LLM release reads it too (not verified here): an engine that ignores it "
            "drafts with the original layout's residual, at a lower acceptance than measured."
            if config.get("norm_before_residual")
            else ""
        )
    )


def head_aux(config: dict, checkpoint: Path, report: dict | None, target_layers: int | None) -> tuple[int, ...]:
    """The head's aux layers as eval measured them: config.json's ids, or the default for the target's layer count
    (a head saved before they were always written)."""
    ids = config.get("eagle_aux_hidden_state_layer_ids")
    if ids:
        return tuple(ids)
    if target_layers is None and report is not None:
        from specdec_runtime.loading import load_config

        target_layers = load_config(report["target"]).num_hidden_layers
    if target_layers is None:
        raise UserError(
            f"{checkpoint}/{CONFIG_FILE} names no eagle_aux_hidden_state_layer_ids (a head saved before specdistill "
            "always wrote them), and the target's layer count that gives the default is unknown: pass the eval "
            "report (--report), whose target gives it"
        )
    return tuple(default_aux_layers(target_layers))


def export_eagle3(
    checkpoint: Path,
    out_dir: Path,
    report: dict | None,
    training_config: str | None,
    setting: ServingSetting | None,
    target_layers: int | None,
) -> Path:
    """The head's files (they are the export; config.json with its aux layer ids made explicit) and its card; see
    `export_draft`."""
    from safetensors import safe_open

    config = json.loads((checkpoint / CONFIG_FILE).read_text())
    aux = head_aux(config, checkpoint, report, target_layers)
    setting = setting or card_setting(report, checkpoint, out_dir, aux)
    if training_config is None:
        training_config = find_training_config(checkpoint)
    with safe_open(checkpoint / WEIGHTS_FILE, "pt") as f:  # parameters: every tensor but the vocabulary maps
        params = sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys() if k not in ("d2t", "t2d"))
    target = (report or {}).get("target")
    convert = speculators_convert_command(str(out_dir), _verifier(target), aux)
    with staged_export(out_dir) as tmp:
        (tmp / CONFIG_FILE).write_text(json.dumps({**config, **aux_layer_keys(list(aux))}, indent=2) + "\n")
        for path in checkpoint.iterdir():
            if path.name == WEIGHTS_FILE or path.name.startswith(TOKENIZER_PREFIXES):
                shutil.copy2(path, tmp / path.name)
        (tmp / "README.md").write_text(
            model_card(
                name=_draft_name(checkpoint),
                checkpoint=checkpoint,
                num_parameters=params,
                merged_lora=False,
                report=report,
                training_config=training_config,
                setting=setting,
                kind_section=eagle3_section(checkpoint, aux),
                convert=convert,
            )
        )
    return out_dir


def _verifier(target: str | None) -> str:
    """`speculators convert --verifier`: an HF id or folder. A local folder as an absolute path; our own specs
    (embedded:, random:, .gguf) have no such name, so the card says TARGET_HF_FOLDER (their converted folder under
    $SPECDISTILL_CACHE)."""
    if not target or target.startswith(("embedded:", "random:")) or target.endswith(".gguf"):
        return "TARGET_HF_FOLDER"
    path = Path(target).expanduser()
    return str(path.resolve()) if path.exists() else target
