"""Draft export: a standalone HF folder (LoRA merged, no trainer state) that HF assisted generation uses as is."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
import yaml
from helpers.models import tiny_llama
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


def test_reexport_replaces_and_foreign_folder_is_refused(tmp_path):
    _, draft, tokenizer = pair()
    ckpt = save_checkpoint(draft, tokenizer, tmp_path / "best")
    out = export_draft(ckpt, tmp_path / "out")
    (out / "stale.txt").write_text("from an older export")
    export_draft(ckpt, out)
    assert not (out / "stale.txt").exists() and (out / "model.safetensors").is_file()
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    with pytest.raises(ValueError, match="not a previous export"):
        export_draft(ckpt, tmp_path / "mine")
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep me"


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


def test_promote_exports_and_points_serving_at_the_export(tmp_path):
    """Promotion is the one place export happens: the draft goes to <export_root>/<name> with a card holding the
    serving config's own snippets, and the serving config points at it."""
    target, draft, tokenizer = pair()
    target.save_pretrained(tmp_path / "target")
    tokenizer.save_pretrained(tmp_path / "target")
    ckpt = save_checkpoint(draft, tokenizer, tmp_path / "candidates" / "trunc2" / "best")
    report = report_for(ckpt)
    report["target"] = str(tmp_path / "target")
    report["recommendation"]["confirmation"] = {"acceptance_rate": 0.6345, "mean_accepted_length": 2.6, "speedup": 1.79}
    (tmp_path / "report.json").write_text(json.dumps(report))
    summary = promote(tmp_path / "report.json", tmp_path / "serving.yaml", export_root=tmp_path / "export")
    export = (tmp_path / "export" / "trunc2").resolve()
    serving = yaml.safe_load((tmp_path / "serving.yaml").read_text())
    assert serving["speculative"]["draft"] == str(export) and "1.79x" in summary
    assert serving["engines"]["vllm"]["speculative_config"]["model"] == str(export)
    assert (export / "model.safetensors").is_file()
    card = (export / "README.md").read_text()
    assert f"--speculative-draft-model-path {export} --speculative-num-steps 4" in card
    assert "- needs: vLLM newer than 0.13.0" in card  # the notes under each engine, as serving.yaml's comments


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
