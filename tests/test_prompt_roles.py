"""Prompt roles (distill/prompt_roles.py): training, validation and test prompts stay disjoint, by content."""

import dataclasses
import json
from pathlib import Path

import pytest

from distill.config import DataConfig
from distill.prompt_roles import check_test_prompts, overlap_count, training_prompts, validation_prompts
from distill.prompts import PromptRecord, load_prompts

TOPICS = ("the moon", "bread", "a bicycle", "rain", "chess", "a violin", "tea", "a glacier", "owls", "maps")


def user(text):
    return [{"role": "user", "content": text}]


def write_prompts(path: Path, n: int, prefix: str) -> Path:
    rows = [{"id": f"{prefix}{i}", "prompt": f"{prefix}: tell me about {TOPICS[i % 10]}" + "!" * i} for i in range(n)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def make_cfg(tmp_path: Path, n_train: int = 10, n_eval: int = 2) -> DataConfig:
    return DataConfig(
        prompts=str(write_prompts(tmp_path / "train.jsonl", n_train, "p")),
        validation_prompts=str(write_prompts(tmp_path / "validation.jsonl", n_eval, "e")),
    )


def respelled(record: PromptRecord, new_id: str) -> PromptRecord:
    """The same prompt under another id, in other case and spacing."""
    text = record.messages[-1]["content"]
    return PromptRecord(id=new_id, messages=[{"role": "user", "content": f"  {text.upper()}  "}])


def test_overlap_count_ignores_ids_case_and_spacing():
    records = [PromptRecord(id="x", messages=user("What is  a  Cat?")), PromptRecord(id="y", messages=user("Other"))]
    others = [PromptRecord(id="z", messages=user(" what is a cat? "))]
    assert overlap_count(records, others) == 1 and overlap_count(others, records) == 1
    assert overlap_count(records, [PromptRecord(id="x", messages=user("What is a dog?"))]) == 0  # same id, new text


def test_training_prompts_drop_validation_prompts_then_take_the_first_max_prompts(tmp_path):
    cfg = make_cfg(tmp_path, n_train=5, n_eval=2)
    train = load_prompts(cfg.prompts)
    validation = [respelled(train[1], "v0"), PromptRecord(id="v1", messages=user("Only for validation"))]
    rows = [{"id": r.id, "messages": r.messages} for r in validation]
    (tmp_path / "v.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    cfg = dataclasses.replace(cfg, validation_prompts=str(tmp_path / "v.jsonl"), max_prompts=3)
    logged = []
    assert [r.id for r in training_prompts(cfg, log=logged.append)] == ["p0", "p2", "p3"]  # p1 is v0, respelled
    assert logged == [
        "data: dropped 1 of 5 training prompts that are also validation prompts (data.validation_prompts): "
        "validation prompts are never trained on"
    ]
    assert [r.id for r in validation_prompts(dataclasses.replace(cfg, max_validation_prompts=1))] == ["v0"]
    # A self_instruct source counts as empty until the data stage's teacher writes it; alone, it is unknown.
    written = [PromptRecord(id="s0", messages=user("Written by the teacher"))]
    listed = dataclasses.replace(cfg, prompts=["self_instruct", cfg.prompts], max_prompts=0)
    assert [r.id for r in training_prompts(listed)] == ["p0", "p2", "p3", "p4"]
    assert [r.id for r in training_prompts(listed, self_instruct=lambda: written)] == ["s0", "p0", "p2", "p3", "p4"]
    assert training_prompts(dataclasses.replace(cfg, prompts="self_instruct")) is None
    with pytest.raises(ValueError, match="every training prompt is also a validation prompt"):
        training_prompts(dataclasses.replace(cfg, prompts=cfg.validation_prompts))


def test_test_prompts_seen_in_training_or_validation_are_refused_with_the_counts(tmp_path):
    cfg = make_cfg(tmp_path, n_train=6, n_eval=3)
    train, validation = load_prompts(cfg.prompts), load_prompts(cfg.validation_prompts)
    unseen = [PromptRecord(id="u", messages=[{"role": "user", "content": "A prompt nobody has seen"}])]
    check_test_prompts(cfg, unseen, "unseen.jsonl")
    test = unseen + [respelled(train[0], "x0"), respelled(train[1], "x1"), respelled(validation[2], "x2")]
    with pytest.raises(
        ValueError,
        match=r"4 test prompts \(eval.prompts=mine.jsonl\) share 2 with the training prompts \(data.prompts=.*\) "
        r"and 1 with the validation prompts \(data.validation_prompts=.*\); .*builtin:test",
    ):
        check_test_prompts(cfg, test, "mine.jsonl")
    # Only the prompts each role uses count: training prompts past data.max_prompts are never answered, ...
    check_test_prompts(dataclasses.replace(cfg, max_prompts=2), [respelled(train[3], "x3")], "t")
    # ... nor validation prompts past data.max_validation_prompts.
    check_test_prompts(dataclasses.replace(cfg, max_validation_prompts=2), [respelled(validation[2], "x2")], "t")
    with pytest.raises(ValueError, match="share 1 with the validation prompts"):
        check_test_prompts(dataclasses.replace(cfg, max_validation_prompts=3), [respelled(validation[2], "x2")], "t")


def test_test_prompts_are_checked_against_every_source_of_a_list(tmp_path):
    cfg = make_cfg(tmp_path, n_train=4)
    listed = dataclasses.replace(cfg, prompts=[cfg.prompts, "self_instruct", "builtin:long-input"])
    check_test_prompts(listed, load_prompts("builtin:test"), "builtin:test")  # builtin:long-input is training-only
    long_input = load_prompts("builtin:long-input")
    test = [
        respelled(load_prompts(cfg.prompts)[0], "x0"),
        respelled(long_input[0], "x1"),
        respelled(long_input[1], "x2"),
    ]
    with pytest.raises(
        ValueError,
        match=r"3 test prompts \(eval.prompts=t\) share 1 with the training prompts \(data.prompts\[0\]=.*train.jsonl\)"
        r" and 2 with the training prompts \(data.prompts\[2\]=builtin:long-input\);",
    ):
        check_test_prompts(listed, test, "t")
    check_test_prompts(dataclasses.replace(listed, max_prompts=4), test[1:], "t")  # past max_prompts: never answered


def test_builtin_roles_pass_the_check_and_validation_as_test_is_refused():
    cfg = DataConfig()
    check_test_prompts(cfg, load_prompts("builtin:test"), "builtin:test")
    with pytest.raises(ValueError, match="16 test prompts .* share 16 with the validation prompts"):
        check_test_prompts(cfg, load_prompts("builtin:validation"), "builtin:validation")
    with pytest.raises(ValueError, match="share 5 with the training prompts"):
        check_test_prompts(cfg, load_prompts("builtin:train")[:5], "builtin:train")
