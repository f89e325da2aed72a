"""Student (draft) construction (distill/students.py) on tiny random Llama/Qwen2 models, CPU."""

import ast
import dataclasses
import inspect

import pytest
import torch
from helpers.models import tiny_llama
from peft import PeftModel
from peft.tuners.tuners_utils import BaseTunerLayer
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import (
    DynamicCache,
    LlamaForCausalLM,
    PreTrainedModel,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
)

import distill.students
from distill.students import (
    DraftConfig,
    build_student,
    describe_student,
    evenly_spaced_layers,
    flops_per_token,
    merge_student,
    student_stats,
)

VOCAB = 64


def _teacher(num_layers: int = 5, tie: bool = False, vocab_size: int = VOCAB, seed: int = 0) -> LlamaForCausalLM:
    return tiny_llama(seed, vocab_size, num_layers, tie_word_embeddings=tie)


def _ids(seed: int = 0, length: int = 9) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, length), generator=torch.Generator().manual_seed(seed))


def _tokenizer(words: list[str]) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token=words[0]))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token=words[0])


def _shares_storage(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    ptrs = {p.untyped_storage().data_ptr() for p in a.parameters()}
    return any(p.untyped_storage().data_ptr() in ptrs for p in b.parameters())


# ----------------------------------------------------------------------------------------------------------------
# DraftConfig


def test_every_field_has_a_docstring_and_defaults_are_valid():
    DraftConfig()
    body = ast.parse(inspect.getsource(DraftConfig)).body[0].body
    documented = {
        stmt.target.id
        for stmt, nxt in zip(body, body[1:])
        if isinstance(stmt, ast.AnnAssign) and isinstance(nxt, ast.Expr) and isinstance(nxt.value.value, str)
    }
    assert documented == {f.name for f in dataclasses.fields(DraftConfig)}


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"layers": []}, "non-empty"),
        ({"layers": [0, 2, 2]}, "strictly increasing"),
        ({"layers": [-1, 2]}, ">= 0"),
        ({"layers": [0, 1], "init": "config"}, "only used by init=truncate"),
        ({"num_layers": 0}, "num_layers"),
        ({"hidden_size": 16}, "only apply to init=config"),
        ({"init": "config", "hidden_size": -1}, "hidden_size must be >= 0"),
        ({"init": "pretrained"}, "needs pretrained"),
        ({"pretrained": "some/model"}, "needs pretrained"),
        ({"init": "config", "lora": True}, "lora needs trained base weights"),
        ({"lora_r": 0}, "lora_r"),
        ({"lora_dropout": 1.0}, "lora_dropout"),
        ({"lora_target_modules": []}, "lora_target_modules"),
    ],
)
def test_validate_rejects_out_of_range(kwargs, message):
    with pytest.raises(ValueError, match=message):
        DraftConfig(**kwargs)


# ----------------------------------------------------------------------------------------------------------------
# truncate


def test_evenly_spaced_layers():
    assert evenly_spaced_layers(30, 4) == [0, 10, 19, 29]
    assert evenly_spaced_layers(5, 3) == [0, 2, 4]
    assert evenly_spaced_layers(4, 4) == [0, 1, 2, 3]
    assert evenly_spaced_layers(6, 2) == [0, 5]
    assert evenly_spaced_layers(7, 1) == [0]
    with pytest.raises(ValueError, match=r"\[1, 4\]"):
        evenly_spaced_layers(4, 5)


def test_truncate_keeps_chosen_layers_with_teacher_weights():
    teacher = _teacher()
    student = build_student(teacher, DraftConfig(layers=[0, 2, 4]))
    assert student.config.num_hidden_layers == 3 and len(student.model.layers) == 3
    assert teacher.config.num_hidden_layers == 5 and len(teacher.model.layers) == 5  # teacher untouched
    for new, old in zip(student.model.layers, [0, 2, 4]):
        for (name, p), (_, q) in zip(new.state_dict().items(), teacher.model.layers[old].state_dict().items()):
            assert torch.equal(p, q), name
    for module in ("embed_tokens", "norm"):
        assert torch.equal(getattr(student.model, module).weight, getattr(teacher.model, module).weight)
    assert torch.equal(student.lm_head.weight, teacher.lm_head.weight)
    assert not _shares_storage(student, teacher)
    assert [layer.self_attn.layer_idx for layer in student.model.layers] == [0, 1, 2]
    assert student.model.layers[0].self_attn.config is student.config

    with torch.no_grad():  # training the student must not move the teacher
        student.model.embed_tokens.weight.add_(1.0)
    assert not torch.equal(student.model.embed_tokens.weight, teacher.model.embed_tokens.weight)


def test_truncated_student_decodes_with_kv_cache():
    # The renumbered layer_idx must index a 3-layer cache: cached decoding equals a full forward.
    student = build_student(_teacher(), DraftConfig(layers=[1, 3, 4]))
    ids = _ids()
    with torch.no_grad():
        full = student(ids).logits
        cache = DynamicCache(config=student.config)
        student(ids[:, :-2], cache=cache, use_cache=True)
        step = student(ids[:, -2:], cache=cache, use_cache=True)
    assert cache.get_seq_length() == ids.shape[1]
    torch.testing.assert_close(step.logits, full[:, -2:], rtol=1e-4, atol=1e-5)


def test_truncate_evenly_spaced_and_round_trip(tmp_path):
    teacher = _teacher(tie=True)
    student = build_student(teacher, DraftConfig(num_layers=3))
    assert torch.equal(student.model.layers[1].mlp.up_proj.weight, teacher.model.layers[2].mlp.up_proj.weight)
    assert student.lm_head.weight is student.model.embed_tokens.weight  # the tie survives the copy
    student.save_pretrained(tmp_path)
    loaded = LlamaForCausalLM.from_pretrained(tmp_path).eval()
    assert loaded.config.num_hidden_layers == 3
    ids = _ids()
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, student(ids).logits)


def test_truncate_subsets_per_layer_config_lists(tmp_path):
    torch.manual_seed(0)
    types = ["full_attention", "sliding_attention", "full_attention", "sliding_attention"]
    config = Qwen2Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, use_sliding_window=True, sliding_window=4,
        layer_types=types,
    )  # fmt: skip
    teacher = Qwen2ForCausalLM(config).eval()
    student = build_student(teacher, DraftConfig(layers=[1, 2]))
    assert student.config.layer_types == ["sliding_attention", "full_attention"]
    assert teacher.config.layer_types == types
    student.save_pretrained(tmp_path)
    loaded = Qwen2ForCausalLM.from_pretrained(tmp_path).eval()
    ids = _ids()
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, student(ids).logits)


def test_truncate_rejects_out_of_range_layers():
    with pytest.raises(ValueError, match=r"\[0, 4\]"):
        build_student(_teacher(), DraftConfig(layers=[0, 5]))
    with pytest.raises(ValueError, match="num_layers"):
        build_student(_teacher(), DraftConfig(num_layers=6))


# ----------------------------------------------------------------------------------------------------------------
# config


def test_config_student_has_requested_shapes():
    teacher = _teacher()
    cfg = DraftConfig(init="config", num_layers=2, hidden_size=16, num_attention_heads=2, num_key_value_heads=1)
    student = build_student(teacher, cfg)
    c = student.config
    assert (c.num_hidden_layers, c.hidden_size, c.num_attention_heads, c.num_key_value_heads) == (2, 16, 2, 1)
    assert c.intermediate_size == 64 and c.head_dim == 8  # inherited / derived from the new sizes
    assert student.model.layers[0].self_attn.k_proj.weight.shape == (8, 16)
    assert student.model.layers[0].mlp.up_proj.weight.shape == (64, 16)
    assert student.model.embed_tokens.weight.shape == (VOCAB, 16)  # hidden differs: nothing copied
    assert student(_ids()).logits.shape == (2, 9, VOCAB)


def test_config_student_copies_embeddings_when_shapes_allow():
    teacher = _teacher()
    student = build_student(teacher, DraftConfig(init="config", num_layers=1, intermediate_size=24))
    assert student.config.intermediate_size == 24 and student.config.hidden_size == 32
    assert torch.equal(student.model.embed_tokens.weight, teacher.model.embed_tokens.weight)
    assert torch.equal(student.lm_head.weight, teacher.lm_head.weight)  # untied head copied too
    assert torch.equal(student.model.norm.weight, teacher.model.norm.weight)
    assert not torch.equal(
        student.model.layers[0].self_attn.q_proj.weight, teacher.model.layers[0].self_attn.q_proj.weight
    )
    assert not _shares_storage(student, teacher)


def test_config_student_rejects_indivisible_heads():
    with pytest.raises(ValueError, match="num_key_value_heads"):
        build_student(_teacher(), DraftConfig(init="config", num_attention_heads=3))


# ----------------------------------------------------------------------------------------------------------------
# pretrained


def _save(folder, model: PreTrainedModel, words: list[str]) -> str:
    """A local model folder (safetensors weights + tokenizer) that `load_model` reads like any HF folder."""
    model.save_pretrained(folder)
    _tokenizer(words).save_pretrained(folder)
    return str(folder)


def _same_weights(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_pretrained_with_mismatched_vocab_is_refused_naming_tokens(tmp_path):
    words = [f"w{i}" for i in range(VOCAB)]
    other = list(words)
    other[5], other[9] = "x5", "x9"
    teacher_tok = _tokenizer(words)
    cfg = DraftConfig(init="pretrained", pretrained=_save(tmp_path / "other", _teacher(num_layers=1, seed=1), other))
    with pytest.raises(
        ValueError, match=r"differ at id 5: target 'w5' vs draft 'x5'; id 9: target 'w9' vs draft 'x9' \(2 differing"
    ):
        build_student(_teacher(), cfg, teacher_tokenizer=teacher_tok)
    # The whole vocabulary counts: a student whose tokenizer lacks the teacher's last token is refused too.
    cfg = DraftConfig(init="pretrained", pretrained=_save(tmp_path / "fewer", _teacher(num_layers=1), words[:-1]))
    with pytest.raises(ValueError, match=rf"differ at id {VOCAB - 1}: target 'w{VOCAB - 1}' vs draft None"):
        build_student(_teacher(), cfg, teacher_tokenizer=teacher_tok)
    with pytest.raises(ValueError, match="needs the teacher's tokenizer"):
        build_student(_teacher(), cfg)


def test_pretrained_with_same_vocab_is_loaded_and_padded_rows_aligned(tmp_path, monkeypatch):
    words = [f"w{i}" for i in range(VOCAB)]
    draft = _teacher(num_layers=2, vocab_size=VOCAB + 8, seed=1)  # padded embedding rows, same tokenizer
    teacher = _teacher()
    cfg = DraftConfig(init="pretrained", pretrained=_save(tmp_path / "draft", draft, words))
    student = build_student(teacher, cfg, teacher_tokenizer=_tokenizer(words))
    assert student.config.vocab_size == VOCAB and student.config.num_hidden_layers == 2
    assert _same_weights(student.model.layers, draft.model.layers)  # the saved draft's weights, not the teacher's
    assert torch.equal(student.model.embed_tokens.weight, draft.model.embed_tokens.weight[:VOCAB])
    assert student(_ids()).logits.shape == (2, 9, VOCAB)
    # A loader handing back the teacher itself (e.g. from a cache) would train the teacher along: refused.
    monkeypatch.setattr(distill.students, "load_model", lambda spec, **options: (teacher, _tokenizer(words)))
    with pytest.raises(RuntimeError, match="shares tensors"):
        build_student(teacher, cfg, teacher_tokenizer=_tokenizer(words))


# ----------------------------------------------------------------------------------------------------------------
# LoRA


def test_lora_trains_only_adapters_and_merges_exactly():
    teacher = _teacher()
    cfg = DraftConfig(num_layers=2, lora=True, lora_r=4, lora_alpha=8.0, lora_target_modules=["q_proj", "down_proj"])
    student = build_student(teacher, cfg)
    assert isinstance(student, PeftModel)
    trainable = [n for n, p in student.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    assert len(trainable) == 2 * 2 * 2  # 2 layers x 2 modules x (A, B)
    torch.manual_seed(1)
    with torch.no_grad():  # lora_B starts at zero; make the adapters matter
        for name, p in student.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)
    student.eval()
    ids = _ids()
    with torch.no_grad():
        adapted = student(ids).logits
        with student.disable_adapter():
            base = student(ids).logits
    merged = merge_student(student)
    assert isinstance(merged, PreTrainedModel) and not isinstance(merged, PeftModel)
    assert not any(isinstance(m, BaseTunerLayer) for m in merged.modules())
    with torch.no_grad():
        torch.testing.assert_close(merged(ids).logits, adapted, rtol=0, atol=1e-5)
        torch.testing.assert_close(student(ids).logits, adapted)  # merged a copy: the adapters still train
    assert (adapted - base).abs().max() > 1e-2
    assert merge_student(teacher) is teacher


def test_lora_on_a_pretrained_student_wraps_the_loaded_model(tmp_path):
    words = [f"w{i}" for i in range(VOCAB)]
    draft = _teacher(num_layers=2, seed=1)
    spec = _save(tmp_path / "draft", draft, words)
    cfg = DraftConfig(init="pretrained", pretrained=spec, lora=True, lora_r=2, lora_target_modules=["v_proj"])
    student = build_student(_teacher(), cfg, teacher_tokenizer=_tokenizer(words))
    assert isinstance(student, PeftModel)
    with student.disable_adapter():  # the pretrained model itself under the adapters, not a truncated teacher
        ids = _ids()
        torch.testing.assert_close(student(ids).logits, draft(ids).logits, rtol=0, atol=0)
    trainable = [n for n, p in student.named_parameters() if p.requires_grad]
    assert len(trainable) == 2 * 2 and all("lora_" in n for n in trainable)  # 2 layers x v_proj x (A, B)
    assert merge_student(student).config.num_hidden_layers == 2


# ----------------------------------------------------------------------------------------------------------------
# describe


def test_describe_student_numbers():
    teacher = _teacher(num_layers=4)  # untied: the head is a matmul, the embedding a lookup
    student = build_student(teacher, DraftConfig(num_layers=2))
    stats = student_stats(student, teacher)
    embed = VOCAB * 32
    per_layer = sum(p.numel() for p in teacher.model.layers[0].parameters())
    assert stats["teacher_params"] == 2 * embed + 4 * per_layer + 32
    assert stats["params"] == 2 * embed + 2 * per_layer + 32
    assert stats["trainable_params"] == stats["params"]
    assert stats["flops_per_token"] == 2 * (embed + 2 * per_layer + 32)
    assert stats["flop_ratio"] == pytest.approx((embed + 2 * per_layer + 32) / (embed + 4 * per_layer + 32))
    text = describe_student(student, teacher)
    assert "2 layers" in text and "4 layers" in text and f"flop_ratio {stats['flop_ratio']:.3f}" in text

    tied = _teacher(num_layers=4, tie=True)
    assert flops_per_token(tied) == 2 * sum(p.numel() for p in tied.parameters())  # the table is the head

    lora = build_student(teacher, DraftConfig(num_layers=2, lora=True, lora_r=2, lora_target_modules=["q_proj"]))
    lora_stats = student_stats(lora, teacher)
    assert lora_stats["trainable_params"] == 2 * 2 * (32 + 32)  # 2 layers x r x (in + out)
    assert lora_stats["params"] == stats["params"] + lora_stats["trainable_params"]
