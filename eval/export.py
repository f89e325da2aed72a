"""Export a draft checkpoint as a standalone HF-format folder with a model card.

    specdistill export runs/quickstart/candidates/trunc4-fkl/best runs/quickstart/export/trunc4-fkl
    specdistill export runs/quickstart/candidates/lora/checkpoints/step-000200 out/lora-draft   # LoRA merged

Input: an HF folder (`best/`, `checkpoints/step-N/`, any `save_pretrained` output) or a peft LoRA adapter folder
(`adapter_config.json`, its base read from `base_model_name_or_path`, or from the folder itself when it also holds
the base weights). Output: safetensors weights, config.json, generation_config.json, tokenizer files and README.md
(eval numbers, training config, serving snippets), and nothing else: no optimizer, RNG or trainer state. The folder
is written under a temporary name and renamed, so an interrupted export never looks finished.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import warnings
from datetime import datetime, timezone
from pathlib import Path

import yaml

from eval.promote import engine_snippets

ARCH_KEYS = (
    "num_hidden_layers",
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "vocab_size",
)
CARD_COLUMNS = ["num_draft_tokens", "temperature", "draft_rule", "acceptance_rate", "mean_accepted_length", "speedup"]


# ----------------------------------------------------------------------------------------------------------------
# Loading the checkpoint


def _has_weights(folder: Path, exclude: str = "") -> bool:
    return any(p.name != exclude for p in folder.glob("*.safetensors"))


def _lora_base(checkpoint: Path) -> Path | str:
    """Where the adapter's base model lives: the folder itself when it holds base weights, the run's lora_base/ for
    a step checkpoint of a LoRA-on-truncate student (<cand>/checkpoints/step-N -> <cand>/lora_base), else the
    adapter's `base_model_name_or_path`."""
    if (checkpoint / "config.json").is_file() and _has_weights(checkpoint, exclude="adapter_model.safetensors"):
        return checkpoint
    from train.checkpoint import LORA_BASE  # the run layout's name for it

    run_base = checkpoint.parent.parent / LORA_BASE
    if checkpoint.parent.name == "checkpoints" and (run_base / "config.json").is_file():
        return run_base
    base = json.loads((checkpoint / "adapter_config.json").read_text()).get("base_model_name_or_path")
    if not base:
        raise ValueError(
            f"{checkpoint}/adapter_config.json names no base_model_name_or_path and the folder holds no "
            "base weights; export a folder with the merged model (best/) instead"
        )
    return base


def load_checkpoint(checkpoint: Path):
    """(plain model with any LoRA merged, tokenizer, whether LoRA was merged) from a checkpoint folder."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    checkpoint = Path(checkpoint)
    if not checkpoint.is_dir():
        raise ValueError(f"checkpoint folder {checkpoint} does not exist")
    is_lora = (checkpoint / "adapter_config.json").is_file()
    if is_lora and not (checkpoint / "adapter_model.safetensors").is_file():
        raise ValueError(
            f"{checkpoint} has adapter_config.json but no adapter_model.safetensors: expected a complete "
            "peft LoRA adapter folder"
        )
    if not is_lora and not ((checkpoint / "config.json").is_file() and _has_weights(checkpoint)):
        raise ValueError(
            f"{checkpoint} holds no draft weights: expected an HF model folder (config.json + "
            "*.safetensors, e.g. candidates/<name>/best or checkpoints/step-N) or a peft LoRA adapter "
            "(adapter_config.json + adapter_model.safetensors)"
        )
    if is_lora:
        from peft import PeftModel

        base_path = _lora_base(checkpoint)
        try:
            base = AutoModelForCausalLM.from_pretrained(base_path, dtype="auto", use_safetensors=True)
        except OSError as e:
            reason = str(e).splitlines()[0]
            raise ValueError(f"cannot load the LoRA base {base_path} of {checkpoint}: {reason}") from None
        _check_same_architecture(checkpoint, base_path, base.config.to_dict())
        with warnings.catch_warnings():
            # peft asks transformers 5 a deprecated question (is_gradient_checkpointing) while wrapping: not ours
            warnings.filterwarnings("ignore", "`is_gradient_checkpointing` is deprecated", FutureWarning)
            model = PeftModel.from_pretrained(base, checkpoint).merge_and_unload()
    else:
        base_path = checkpoint
        model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype="auto", use_safetensors=True)
    return model.eval(), _load_tokenizer(checkpoint, base_path, AutoTokenizer), is_lora


def _check_same_architecture(checkpoint: Path, base_path: Path | str, base_config: dict) -> None:
    """A LoRA checkpoint's config.json (the student the adapters were trained on) must match the base we load.

    A truncated student's adapter names the *target* as its base (the truncation copies the target's config), and
    adapters for layers 0..N-1 would load silently into the wrong target layers."""
    path = checkpoint / "config.json"
    if not path.is_file():
        return
    student = json.loads(path.read_text())
    differ = [k for k in ARCH_KEYS if k in student and student[k] != base_config.get(k)]
    if differ:
        shown = ", ".join(f"{k} {student[k]} vs {base_config.get(k)}" for k in differ)
        raise ValueError(
            f"the LoRA adapters in {checkpoint} were trained on a student that differs from their base {base_path} "
            f"({shown}): the base weights of this student are not saved in the folder; export the merged model "
            "(candidates/<name>/best) instead"
        )


def _load_tokenizer(checkpoint: Path, base: Path | str, auto_cls):
    for folder in dict.fromkeys([checkpoint, base]):  # the checkpoint's own tokenizer first
        try:
            return auto_cls.from_pretrained(folder)
        except (OSError, ValueError):
            continue
    raise ValueError(
        f"no tokenizer in {checkpoint} (nor in its base {base}): an exported draft needs the target's "
        "tokenizer files (tokenizer.json / tokenizer_config.json) next to its weights"
    )


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
        "`speedup` is target-only wall time / speculative wall time on the same prompts; `acceptance_rate` is "
        "accepted / drafted tokens; `mean_accepted_length` is tokens emitted per target forward.",
        "",
        *table,
    ]
    rec = report.get("recommendation") or {}
    if rec.get("enabled") and rec.get("name") == cand["name"]:
        lines += [
            "",
            f"Recommended serving setting: num_draft_tokens={rec['num_draft_tokens']}, "
            f"draft_rule={rec['draft_rule']}, temperature={rec.get('temperature')} ({rec.get('reason')}).",
        ]
    return "\n".join(lines)


def serving_section(snippets: dict, target: str) -> str:
    vllm = json.dumps(snippets["vllm"]["speculative_config"])
    trtllm = yaml.safe_dump(snippets["trtllm"], sort_keys=False).rstrip()
    return "\n".join(
        [
            "vLLM:",
            "",
            "```bash",
            f"vllm serve {target} --speculative-config '{vllm}'",
            "```",
            "",
            "SGLang:",
            "",
            "```bash",
            f"python -m sglang.launch_server --model-path {target} " + " ".join(map(str, snippets["sglang"])),
            "```",
            "",
            "TensorRT-LLM (`trtllm-serve TARGET --extra_llm_api_options spec.yaml` with this spec.yaml):",
            "",
            "```yaml",
            trtllm,
            "```",
        ]
    )


def model_card(
    *,
    name: str,
    checkpoint: Path,
    num_parameters: int,
    merged_lora: bool,
    report: dict | None,
    training_config: str | None,
    serving_snippets: dict,
) -> str:
    target = (report or {}).get("target", "TARGET")
    return "\n".join(
        [
            "---",
            "library_name: transformers",
            "pipeline_tag: text-generation",
            "tags: [speculative-decoding, draft-model, specdistill]",
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
            serving_section(serving_snippets, target),
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


def _best_gamma(report: dict | None, checkpoint: Path) -> int:
    """num_draft_tokens for the card's snippets: the recommendation's, else this draft's best measured, else 4."""
    cand = find_candidate(report, checkpoint) if report else None
    rec = (report or {}).get("recommendation") or {}
    if cand and rec.get("name") == cand["name"] and rec.get("num_draft_tokens"):
        return rec["num_draft_tokens"]
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
    serving_snippets: dict | None = None,
) -> Path:
    """Write the draft in `checkpoint` as a standalone HF folder at `out_dir` (replacing a previous export there).

    `training_config` (YAML text) defaults to the run's resolved config (`find_training_config`);
    `serving_snippets` (the `engines` section of the serving config) default to `engine_snippets(out_dir, gamma)`
    with the recommended gamma.
    """
    checkpoint, out_dir = Path(checkpoint), Path(out_dir).expanduser().resolve()
    if out_dir.exists() and any(out_dir.iterdir()) and not (out_dir / "config.json").is_file():
        raise ValueError(f"{out_dir} exists and is not a previous export (no config.json); pick an empty or new folder")
    model, tokenizer, merged = load_checkpoint(checkpoint)
    if training_config is None:
        training_config = find_training_config(checkpoint)
    if serving_snippets is None:
        serving_snippets = engine_snippets(str(out_dir), _best_gamma(report, checkpoint))
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out_dir.parent, prefix=f".{out_dir.name}.tmp-"))
    try:
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
                serving_snippets=serving_snippets,
            )
        )
        _replace_dir(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def _replace_dir(new: Path, dest: Path) -> None:
    """Move `new` to `dest`; an existing `dest` is renamed aside first and deleted only once `new` is in place."""
    if not dest.exists():
        new.rename(dest)
        return
    old = dest.with_name(f".{dest.name}.old-{datetime.now(timezone.utc).strftime('%Y%m%dT%H%M%S%f')}")
    dest.rename(old)
    new.rename(dest)
    shutil.rmtree(old, ignore_errors=True)
