"""Draft export: a standalone HF folder (LoRA merged, no trainer state) that HF assisted generation uses as is, written
where it loses nothing: never over the draft itself, over a non-empty folder only with --force."""

from __future__ import annotations

import contextlib
import io
import json
import warnings
from pathlib import Path

import pytest
import torch
import yaml
from helpers.models import tiny_llama
from helpers.runs import small_filesystem
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from distill.students import truncate_student
from eval.export import export_draft
from eval.promote import promote
from specdec_runtime.tiny import byte_level_tokenizer

TRAINER_FILES = ("optimizer.pt", "scheduler.pt", "rng.json", "trainer_state.json", "COMPLETE")
# peft 0.21 asks transformers 5 a deprecated question while wrapping a model in the tests; not ours to fix.
PEFT_WARNING = pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")
TRAINING_CONFIG = "draft:\n  init: truncate\n  num_layers: 2\ndistill:\n  objective: fkl\n"


def pair():
    """A 4-layer random target and its 2-layer truncation, sharing the byte-level tokenizer."""
    tokenizer = byte_level_tokenizer()
    target = tiny_llama(
        vocab_size=len(tokenizer),
        layers=4,
        seed=0,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
    )
    target.generation_config = GenerationConfig(
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id
    )
    return target, truncate_student(target, [0, 3]).eval(), tokenizer


def save_checkpoint(model, tokenizer, folder):
    """A training checkpoint folder: the HF model plus the trainer's own files, which export must leave out."""
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    for name in TRAINER_FILES:
        (folder / name).write_bytes(b"trainer state")
    (folder / "config.yaml").write_text(TRAINING_CONFIG)
    return folder


def report_for(draft_folder, out_dir=None) -> dict:
    settings = [
        {
            "num_draft_tokens": g,
            "temperature": 0.0,
            "draft_rule": "greedy",
            "acceptance_rate": a,
            "mean_accepted_length": 1 + 2.5 * a,
            "speedup": s,
        }
        for g, a, s in ((2, 0.7123, 1.4567), (4, 0.6345, 1.7891))
    ]
    return {
        "schema_version": 1,
        "created_at": "2026-11-29T12:00:00Z",
        "target": "random:tiny-llama",
        "device": "cpu",
        "prompts": {"source": "builtin:test", "count": 12},
        "candidates": [
            {"name": "other", "draft": "/nonexistent/best", "settings": []},
            {"name": "trunc2", "draft": str(draft_folder), "settings": settings},
        ],
        "recommendation": {
            "name": "trunc2",
            "draft": str(draft_folder),
            "num_draft_tokens": 4,
            "draft_rule": "greedy",
            "temperature": 0.0,
            "enabled": True,
            "reason": "best measured speedup 1.79x",
        },
    }


def test_export_round_trip_and_assisted_generation(tmp_path):
    target, draft, tokenizer = pair()
    ckpt = save_checkpoint(draft, tokenizer, tmp_path / "candidates" / "trunc2" / "best")
    out = export_draft(ckpt, tmp_path / "export" / "trunc2")
    names = {p.name for p in out.iterdir()}
    assert {"model.safetensors", "config.json", "generation_config.json", "tokenizer.json", "README.md"} <= names
    assert not names & {*TRAINER_FILES, "config.yaml"} and not any(n.startswith(".") for n in names)
    assert not list(out.parent.glob(".*"))  # no temp folder left behind

    exported = AutoModelForCausalLM.from_pretrained(out).eval()
    assert exported.config.num_hidden_layers == 2
    ids = torch.tensor([tokenizer.encode("speculative decoding, exported")])
    with torch.no_grad():
        assert torch.equal(exported(ids).logits, draft(ids).logits)
    assert AutoTokenizer.from_pretrained(out).get_vocab() == tokenizer.get_vocab()

    # The exported folder, untouched, as HF assisted generation's assistant: same tokens as plain greedy decoding.
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi there"}], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    kwargs = dict(**prompt, do_sample=False, max_new_tokens=24)
    with torch.no_grad():
        plain = target.generate(**kwargs)
        assisted = target.generate(**kwargs, assistant_model=exported)
    assert plain.shape[1] > prompt["input_ids"].shape[1]
    assert torch.equal(assisted, plain)


@PEFT_WARNING
def test_lora_adapter_exports_merged(tmp_path):
    from peft import LoraConfig, PeftModel, get_peft_model

    _, draft, tokenizer = pair()
    draft.save_pretrained(tmp_path / "base")
    tokenizer.save_pretrained(tmp_path / "base")
    base = AutoModelForCausalLM.from_pretrained(tmp_path / "base")
    torch.manual_seed(1)
    # init_lora_weights=False: random non-zero B, so the adapters really change the outputs
    lora = get_peft_model(
        base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], init_lora_weights=False)
    ).eval()
    lora.save_pretrained(tmp_path / "adapter")  # adapter only: no tokenizer, the base's is used
    assert (tmp_path / "adapter" / "adapter_config.json").is_file()

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # exporting itself is warning-free
        out = export_draft(tmp_path / "adapter", tmp_path / "export")
    with safe_open(out / "model.safetensors", "pt") as f:
        keys = list(f.keys())
    assert keys and not [k for k in keys if "lora" in k or "base_model" in k or "base_layer" in k]
    assert not (out / "adapter_config.json").exists()
    exported = AutoModelForCausalLM.from_pretrained(out).eval()
    ids = torch.tensor([tokenizer.encode("low rank")])
    with torch.no_grad():
        merged_logits, lora_logits = exported(ids).logits, lora(ids).logits
        base_logits = AutoModelForCausalLM.from_pretrained(tmp_path / "base")(ids).logits
    assert torch.allclose(merged_logits, lora_logits, atol=1e-5)
    assert not torch.allclose(merged_logits, base_logits, atol=1e-3)
    assert "LoRA adapters merged" in (out / "README.md").read_text()
    assert isinstance(lora, PeftModel)


def test_model_card_holds_eval_numbers_config_and_snippets(tmp_path):
    _, draft, tokenizer = pair()
    ckpt = save_checkpoint(draft, tokenizer, tmp_path / "candidates" / "trunc2" / "best")
    out = export_draft(ckpt, tmp_path / "export" / "trunc2", report=report_for(ckpt))
    card = (out / "README.md").read_text()
    assert card.startswith("---\nlibrary_name: transformers\n")
    assert "# trunc2: a draft model" in card and "random:tiny-llama" in card
    for number in ("0.7123", "1.457", "0.6345", "1.789"):  # acceptance_rate / speedup of both settings
        assert number in card
    assert "| 4 | 0 | greedy | 0.6345 |" in card
    assert "Recommended serving setting: num_draft_tokens=4" in card
    assert f"```yaml\n{TRAINING_CONFIG.rstrip()}\n```" in card  # the checkpoint's config.yaml by default
    assert f'"model": "{out}", "num_speculative_tokens": 4, "method": "draft_model"' in card
    assert f"--speculative-draft-model-path {out} --speculative-num-steps 4" in card
    assert "decoding_type: DraftTarget" in card and "max_draft_len: 4" in card


def test_card_of_best_takes_the_runs_training_config(tmp_path):
    _, draft, tokenizer = pair()
    run = tmp_path / "candidates" / "trunc2"
    draft.save_pretrained(run / "best")
    tokenizer.save_pretrained(run / "best")
    for step, text in (("step-000010", "train:\n  max_steps: 10\n"), ("step-000020", "train:\n  max_steps: 20\n")):
        (run / "checkpoints" / step).mkdir(parents=True)
        (run / "checkpoints" / step / "config.yaml").write_text(text)
    card = (export_draft(run / "best", tmp_path / "out") / "README.md").read_text()
    assert "```yaml\ntrain:\n  max_steps: 20\n```" in card


def test_card_of_an_unevaluated_checkpoint_says_so(tmp_path):
    _, draft, tokenizer = pair()
    ckpt = save_checkpoint(draft, tokenizer, tmp_path / "candidates" / "trunc2" / "checkpoints" / "step-000010")
    out = export_draft(ckpt, tmp_path / "out", report=report_for(tmp_path / "elsewhere"), training_config="x: 1\n")
    card = (out / "README.md").read_text()
    assert "# trunc2@step-000010" in card and "not among the candidates" in card and "```yaml\nx: 1\n```" in card


def cli_export(*args) -> tuple[int, str, str]:
    """`specdistill export ...` through the CLI's entry point in this process: (exit code, stdout, stderr)."""
    from specdistill.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(["export", *map(str, args)])
    return rc, out.getvalue(), err.getvalue()


def snapshot(folder: Path) -> dict[str, bytes]:
    """Every file under `folder` with its bytes: what "untouched" means."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def refused(args: tuple, needle: str) -> None:
    rc, stdout, stderr = cli_export(*args)
    assert rc == 2 and stdout == "" and stderr.startswith("specdistill: error: ") and stderr.count("\n") == 1, stderr
    assert needle in stderr and "Traceback" not in stderr, stderr


def test_export_never_replaces_what_is_there_without_force_nor_the_draft_itself(tmp_path):
    """Issue 24: exporting onto another candidate's best/ deleted its weights and the user's file; `export best best`
    lost best/metrics.json. A non-empty folder is refused unless --force; the draft's own folder, one inside it and
    one around it are refused even with --force; --force replaces the folder once the new export is complete."""
    _, draft, tokenizer = pair()
    candidates = tmp_path / "run" / "candidates"
    best = save_checkpoint(draft, tokenizer, candidates / "trunc2" / "best")
    (best / "metrics.json").write_text('{"eval/loss": 1.5}')
    other = save_checkpoint(tiny_llama(seed=1, vocab_size=len(tokenizer)), tokenizer, candidates / "other" / "best")
    (other / "notes.txt").write_text("mine")
    before, best_before = snapshot(tmp_path / "run"), snapshot(best)

    refused((best, other), f"export folder {other} exists and is not empty (COMPLETE, chat_template.jinja")
    refused((best, best), "that folder is the draft being exported")
    refused((best, best / "sub"), "that folder lies inside the draft being exported")
    refused((best, candidates / "trunc2", "--force"), "that folder contains the draft being exported")
    refused((best, best, "--force"), "is the draft being exported")
    assert snapshot(tmp_path / "run") == before and not (best / "sub").exists()

    out = tmp_path / "export" / "trunc2"
    assert cli_export(best, out)[0] == 0
    refused((best, out), "pass --force to replace it")  # a previous export is a non-empty folder too
    rc, stdout, _ = cli_export(best, out, "--force")
    assert rc == 0 and stdout == f"exported: {out.resolve()}\n" and (out / "model.safetensors").is_file()
    rc, _, _ = cli_export(best, other, "--force")  # what --force is for: the folder is replaced as a whole
    assert rc == 0 and not (other / "notes.txt").exists() and (other / "README.md").is_file()
    assert snapshot(best) == best_before  # the source is never written
    leftovers = [p.name for p in [*candidates.iterdir(), *out.parent.iterdir()] if p.name.startswith(".")]
    assert not leftovers, leftovers  # no .tmp-* or .old-* folder left


def test_export_into_a_file_or_a_read_only_or_full_filesystem_is_one_line(tmp_path):
    _, draft, tokenizer = pair()
    best = save_checkpoint(draft, tokenizer, tmp_path / "best")
    blocker = tmp_path / "a-file"
    blocker.write_text("mine")
    refused((best, blocker), f"cannot export into {blocker}: it is a file")
    refused((best, blocker / "x"), f"{blocker} is a file, not a folder")
    assert blocker.read_text() == "mine"
    with small_filesystem(tmp_path / "ro", "size=1m", "ro") as ro:
        refused((best, ro / "x"), f"{ro} is on a read-only filesystem")
    with small_filesystem(tmp_path / "full", "size=48k") as full:  # the weights alone are larger
        rc, _, stderr = cli_export(best, full / "x")
        assert rc == 2 and "No space left on device" in stderr and stderr.count("\n") == 1, stderr
        assert list(full.iterdir()) == []  # the staged folder is removed


def test_promote_reexports_over_its_own_export_only(tmp_path):
    """Promotion exports into <export_root>/<name> every time it runs: its own previous export there is replaced
    (it holds the card and only files an export writes); a folder with anything else is refused, untouched."""
    from eval.export import not_an_export
    from specdec_runtime.errors import UserError

    ckpt, report = promotable(tmp_path)
    report["recommendation"]["confirmation"] = {"acceptance_rate": 0.63, "speedup": 1.79, "speedup_ci": [1.6, 1.9]}
    (tmp_path / "report.json").write_text(json.dumps(report))
    args = (tmp_path / "report.json", tmp_path / "serving.yaml")
    export = tmp_path / "export" / "trunc2"
    for _ in range(2):
        promote(*args, export_root=tmp_path / "export")
        assert not_an_export(export) is None and (export / "model.safetensors").is_file()
    assert len(yaml.safe_load((tmp_path / "serving.yaml").read_text())["history"]) == 2
    (export / "notes.txt").write_text("mine")
    before, serving = snapshot(export), (tmp_path / "serving.yaml").read_bytes()
    with pytest.raises(UserError, match=r"not a previous export of trunc2 \(files an export does not write: notes.txt"):
        promote(*args, export_root=tmp_path / "export")
    assert snapshot(export) == before and (tmp_path / "serving.yaml").read_bytes() == serving
    with pytest.raises(UserError, match="contains the draft being exported"):  # <root>/<name> around the draft
        promote(*args, export_root=tmp_path / "candidates")


def test_folder_without_weights_is_a_clear_error(tmp_path):
    empty = tmp_path / "checkpoints" / "step-000005"
    empty.mkdir(parents=True)
    (empty / "optimizer.pt").write_bytes(b"x")
    (empty / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ValueError, match=f"{empty} holds no draft weights: expected an HF model folder"):
        export_draft(empty, tmp_path / "out")
    with pytest.raises(ValueError, match="does not exist"):
        export_draft(tmp_path / "missing", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def promotable(tmp_path: Path) -> tuple[Path, dict]:
    """A target folder, a trained-looking draft checkpoint of it, and a report recommending that draft."""
    target, draft, tokenizer = pair()
    target.save_pretrained(tmp_path / "target")
    tokenizer.save_pretrained(tmp_path / "target")
    ckpt = save_checkpoint(draft, tokenizer, tmp_path / "candidates" / "trunc2" / "best")
    report = report_for(ckpt)
    report["target"] = str(tmp_path / "target")
    return ckpt, report


def test_promote_exports_and_points_serving_at_the_export(tmp_path):
    """Promotion is the one place export happens: the draft goes to <export_root>/<name> with a card holding the
    serving config's own snippets, and the serving config points at it."""
    ckpt, report = promotable(tmp_path)
    report["recommendation"]["confirmation"] = {
        "acceptance_rate": 0.6345,
        "mean_accepted_length": 2.6,
        "speedup": 1.79,
        "speedup_ci": [1.6, 1.9],
    }
    (tmp_path / "report.json").write_text(json.dumps(report))
    summary = promote(tmp_path / "report.json", tmp_path / "serving.yaml", export_root=tmp_path / "export")
    export = (tmp_path / "export" / "trunc2").resolve()
    serving = yaml.safe_load((tmp_path / "serving.yaml").read_text())
    assert serving["speculative"]["draft"] == str(export) and "1.79x" in summary
    assert serving["engines"]["vllm"]["speculative_config"]["model"] == str(export)
    assert (export / "model.safetensors").is_file()
    card = (export / "README.md").read_text()
    assert f"--speculative-draft-model-path {export} --speculative-num-steps 4" in card
    assert "- needs: vLLM >= 0.15.0" in card  # the notes under each engine, as serving.yaml's comments


@PEFT_WARNING
def test_lora_checkpoint_of_a_truncated_student_is_refused(tmp_path):
    """As train/checkpoint.py writes it: adapters + the student's config.json, while the adapter config names the
    4-layer target as its base; loading the adapters into the target would silently mix up layers."""
    from peft import LoraConfig, get_peft_model

    target, _, tokenizer = pair()
    target.save_pretrained(tmp_path / "target")
    student = truncate_student(AutoModelForCausalLM.from_pretrained(tmp_path / "target"), [0, 3])
    lora = get_peft_model(student, LoraConfig(r=2, target_modules=["q_proj"]))
    ckpt = tmp_path / "checkpoints" / "step-000002"
    lora.save_pretrained(ckpt)
    lora.get_base_model().config.save_pretrained(ckpt)
    tokenizer.save_pretrained(ckpt)
    assert json.loads((ckpt / "adapter_config.json").read_text())["base_model_name_or_path"] == str(tmp_path / "target")
    with pytest.raises(ValueError, match=r"differs from their base .*num_hidden_layers 2 vs 4.*best"):
        export_draft(ckpt, tmp_path / "out")
