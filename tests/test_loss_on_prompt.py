"""`distill.loss_on_prompt` (issue 27): every token some position predicts is trained on, prompt tokens included.

The offline cache's prompt rows (`topk_start`) against an independent teacher forward, collate's alignment with and
without the flag and for caches written before the column existed, the data fingerprint, the loop's token count
(teacher online, from the cache, on-policy), the EAGLE-3 head's shifted masks and loss, and validation, which
measures response tokens whatever the flag.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers.models import eagle3_setup
from helpers.runs import make_teacher_data, metric_rows, tiny_setup, train_config

from distill.batches import IGNORE, collate, fetch_rows, load_training_split
from distill.data import TOPK_START, load_teacher_data

TEACHER_ID = "random:tiny-llama"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(teacher, tokenizer, response-only teacher data) of random:tiny-llama, in a module-private model cache."""
    root = tmp_path_factory.mktemp("tiny")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SPECDISTILL_CACHE", str(root / "cache"))
        yield tiny_setup(root)


def teacher_logprobs(teacher, ids: list[int]) -> torch.Tensor:
    """(T, V) fp32 log-probs of one forward over `ids`: row t is the distribution that predicts token t + 1."""
    with torch.inference_mode():
        logits = teacher(input_ids=torch.tensor([ids])).logits[0]
    return torch.log_softmax(logits.float(), -1)


# ----------------------------------------------------------------------------------------------------------------
# collate


def hand_rows() -> tuple[dict, dict, dict]:
    """One sequence, prompt [5, 6, 7] + response [8, 9], with a response-only cache (as written before topk_start
    existed), the same sequence with a cache of every predicted token, and a shorter one (padding)."""
    old = {
        "input_ids": [5, 6, 7, 8, 9],
        "prompt_len": 3,
        "topk_ids": [[8, 1], [9, 2]],
        "topk_logprobs": [[-0.1, -3.0], [-0.2, -4.0]],
    }
    full = {
        "input_ids": [5, 6, 7, 8, 9],
        "prompt_len": 3,
        "topk_ids": [[6, 10], [7, 11], [8, 1], [9, 2]],  # the rows that predicted tokens 1, 2, 3, 4
        "topk_logprobs": [[-0.5, -1.5], [-0.6, -1.6], [-0.1, -3.0], [-0.2, -4.0]],
        TOPK_START: 1,
    }
    short = {"input_ids": [5, 12, 13], "prompt_len": 2, "topk_ids": [[12, 3], [13, 4]], TOPK_START: 1}
    short["topk_logprobs"] = [[-0.7, -2.0], [-0.8, -2.5]]
    return old, full, short


def test_collate_labels_every_predicted_token_with_the_flag_and_reads_the_cache_at_its_offset():
    old, full, short = hand_rows()
    # Without the flag: response positions only, and a cache with prompt rows gives exactly the response-only batch.
    before = collate([old], max_seq_len=16, pad_id=0, topk=True)
    assert before["labels"].tolist() == [[IGNORE, IGNORE, 8, 9, IGNORE]]
    assert before["topk_ids"][0, 2:4].tolist() == [[8, 1], [9, 2]]
    read = collate([full], max_seq_len=16, pad_id=0, topk=True)
    assert read.keys() == before.keys() and all(torch.equal(read[k], before[k]) for k in read)

    # With it: position t predicts token t + 1 for every t but the last; its cached row is the one of token t + 1.
    batch = collate([full, short], max_seq_len=16, pad_id=0, topk=True, loss_on_prompt=True)
    assert batch["labels"].tolist() == [[6, 7, 8, 9, IGNORE], [12, 13, IGNORE, IGNORE, IGNORE]]  # no pad is trained
    assert batch["topk_ids"][0, :4].tolist() == full["topk_ids"]
    assert batch["topk_logprobs"][0, :2].flatten().tolist() == pytest.approx([-0.5, -1.5, -0.6, -1.6])
    assert batch["topk_ids"][1, :2].tolist() == short["topk_ids"]
    for b, row in enumerate([full, short]):  # label and top-k row agree: the cached row predicted the label
        for t in range(len(row["input_ids"]) - 1):
            assert batch["topk_ids"][b, t, 0] == batch["labels"][b, t] == row["input_ids"][t + 1], (b, t)
    truncated = collate([full], max_seq_len=3, pad_id=0, topk=True, loss_on_prompt=True)
    assert truncated["labels"].tolist() == [[6, 7, IGNORE]]
    assert truncated["topk_ids"][0, :2].tolist() == [[6, 10], [7, 11]]

    # Without a cache any row has its prompt labels; a response-only cache cannot give the prompt rows.
    assert collate([old], max_seq_len=16, pad_id=0, topk=False, loss_on_prompt=True)["labels"].tolist() == [
        [6, 7, 8, 9, IGNORE]
    ]
    with pytest.raises(ValueError, match="loss_on_prompt needs a cache with prompt rows"):
        collate([old], max_seq_len=16, pad_id=0, topk=True, loss_on_prompt=True)


def test_a_dataset_written_before_topk_start_loads_and_collates_as_before(tiny, tmp_path):
    """A response-only cache without the column (every cache written before it): loaded without it, each row's
    top-k sits at prompt_len - 1 + j, what collate always did; a cache with prompt rows brings its column along."""
    teacher, _, data = tiny
    ds = load_training_split(data.train, ["input_ids", "prompt_len", "topk_ids", "topk_logprobs"], split="train",
                             max_seq_len=64)  # fmt: skip
    assert TOPK_START not in ds.column_names
    rows = fetch_rows(ds, list(range(4)))
    batch = collate(rows, max_seq_len=64, pad_id=0, topk=True)
    for b, row in enumerate(rows):
        ids, P = row["input_ids"], row["prompt_len"]
        want = torch.full((batch["labels"].shape[1],), IGNORE)
        want[P - 1 : len(ids) - 1] = torch.tensor(ids[P:])
        assert torch.equal(batch["labels"][b], want)
        assert batch["topk_ids"][b, P - 1 : len(ids) - 1].tolist() == row["topk_ids"].tolist()
        np.testing.assert_allclose(batch["topk_logprobs"][b, P - 1 : len(ids) - 1].numpy(), row["topk_logprobs"])

    full = make_teacher_data(tmp_path, teacher, top_k=4, prompt_topk=True)
    columns = ["input_ids", "prompt_len", "topk_ids", "topk_logprobs"]
    assert TOPK_START in load_training_split(full.train, columns, split="train", max_seq_len=64).column_names
    assert TOPK_START not in load_training_split(full.train, columns[:2], split="train", max_seq_len=64).column_names
    # The response rows of the full cache are those of the old one: the same batch without the flag.
    same = collate(fetch_rows(load_training_split(full.train, columns, split="train", max_seq_len=64), [0, 1, 2, 3]),
                   max_seq_len=64, pad_id=0, topk=True)  # fmt: skip
    for key in batch:
        torch.testing.assert_close(same[key], batch[key], msg=key)


# ----------------------------------------------------------------------------------------------------------------
# the data stage: prompt rows, fingerprint


def data_cfg(tmp_path: Path, **overrides):
    from distill.config import DataConfig

    prompts = tmp_path / "train.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"p{i}", "prompt": f"Tell me about {w}"}) + "\n"
                               for i, w in enumerate(["owls", "rain", "maps"])))  # fmt: skip
    validation = tmp_path / "eval.jsonl"
    validation.write_text(json.dumps({"id": "e0", "prompt": "What is tea?"}) + "\n")
    cfg = DataConfig(prompts=str(prompts), validation_prompts=str(validation), max_new_tokens=6, batch_size=2,
                     shard_size=2, teacher_cache=True, teacher_cache_top_k=8)  # fmt: skip
    return dataclasses.replace(cfg, **overrides)


def test_the_data_stage_stores_the_teachers_top_k_at_every_predicting_position(tiny, tmp_path, capsys):
    from distill.data import generate_teacher_data

    teacher, tokenizer, _ = tiny
    cfg, out = data_cfg(tmp_path), tmp_path / "data"
    data = generate_teacher_data(teacher, tokenizer, cfg, out, teacher_id=TEACHER_ID, prompt_topk=True)
    assert "(prompt positions included)" in capsys.readouterr().out
    ds = load_teacher_data(data.train)
    assert ds[TOPK_START] == [1] * len(ds)
    for row in ds:
        ids = row["input_ids"]
        fresh = teacher_logprobs(teacher, ids)[:-1]  # (len - 1, V): the rows predicting tokens 1 .. len - 1
        logprobs, top = torch.tensor(row["topk_logprobs"]).float(), torch.tensor(row["topk_ids"]).long()  # (R, K)
        assert top.shape == (len(ids) - 1, 8) and row["prompt_len"] > 2  # prompt rows to check
        assert torch.equal(top[:, 0], fresh.argmax(-1))
        torch.testing.assert_close(logprobs, fresh.gather(-1, top), atol=1e-2, rtol=1e-2)
    # Validation measures response tokens only: its cache has the response rows, and its data is the same.
    assert TOPK_START not in load_teacher_data(data.validation).column_names
    summary = json.loads((data.train / ".complete").read_text())
    assert summary["cache_covers_prompt"] and summary["cache_bytes_per_token"] > 8 * (4 + 2)

    # A response-only cache is another dataset (a loss_on_prompt run never takes it), the validation split the same.
    plain = generate_teacher_data(teacher, tokenizer, cfg, out, teacher_id=TEACHER_ID)
    assert plain.train != data.train and plain.validation == data.validation
    old = load_teacher_data(plain.train)
    assert TOPK_START not in old.column_names and old["input_ids"] == ds["input_ids"]  # the same answers
    summary = json.loads((plain.train / ".complete").read_text())
    assert not summary["cache_covers_prompt"] and summary["cache_bytes_per_token"] == 8 * (4 + 2)
    # Without the cache there are no rows to cover: the flag changes nothing.
    off = dataclasses.replace(cfg, teacher_cache=False)
    no_cache = generate_teacher_data(teacher, tokenizer, off, out, teacher_id=TEACHER_ID, prompt_topk=True)
    assert no_cache == generate_teacher_data(teacher, tokenizer, off, out, teacher_id=TEACHER_ID)


def test_collate_gives_the_teachers_own_distribution_at_prompt_positions(tiny, tmp_path):
    """Batches from the data stage's cache: with the flag every labeled position, prompt ones included, holds the
    teacher's top-k of that position; without it the same cache gives the response positions only."""
    from distill.data import generate_teacher_data

    teacher, tokenizer, _ = tiny
    data = generate_teacher_data(teacher, tokenizer, data_cfg(tmp_path), tmp_path / "data", teacher_id=TEACHER_ID,
                                 prompt_topk=True)  # fmt: skip
    ds = load_training_split(data.train, ["input_ids", "prompt_len", "topk_ids", "topk_logprobs"], split="train",
                             max_seq_len=512)  # fmt: skip
    rows = fetch_rows(ds, list(range(len(ds))))
    for flag in (True, False):
        batch = collate(rows, max_seq_len=512, pad_id=0, topk=True, loss_on_prompt=flag)
        for b, row in enumerate(rows):
            ids, P = row["input_ids"], row["prompt_len"]
            fresh = teacher_logprobs(teacher, ids)  # (T, V)
            trained = list(range(0 if flag else P - 1, len(ids) - 1))
            assert (batch["labels"][b] != IGNORE).nonzero()[:, 0].tolist() == trained
            for t in trained:
                assert batch["labels"][b, t] == ids[t + 1]
                top = batch["topk_ids"][b, t].long()
                assert top[0] == fresh[t].argmax()
                torch.testing.assert_close(batch["topk_logprobs"][b, t], fresh[t, top], atol=1e-2, rtol=1e-2)


def test_the_fingerprint_tells_a_cache_with_prompt_rows_from_one_without(tiny, tmp_path):
    from distill.data import endpoint_fingerprint, fingerprint
    from distill.prompts import load_prompts, render_chat

    _, tokenizer, _ = tiny
    cfg = data_cfg(tmp_path)
    records = load_prompts(cfg.prompts)
    ids = [render_chat(tokenizer, r.messages) for r in records]
    args = ("teacher", records, ids, cfg, TEACHER_ID, "torch.float32", 0, [258], None)
    assert fingerprint(*args) == fingerprint(*args, False) != fingerprint(*args, True)
    end = ("teacher", "teacher-responses-abc", cfg, TEACHER_ID, "torch.float32", None)
    assert endpoint_fingerprint(*end) == endpoint_fingerprint(*end, False) != endpoint_fingerprint(*end, True)


def test_the_data_stage_stores_prompt_rows_when_a_cache_candidate_asks_for_them(monkeypatch, tmp_path):
    """stage_data asks for prompt rows when a candidate trains from the cache with the flag, not for one with the
    teacher online (it never reads the cache)."""
    from types import SimpleNamespace

    import distill.data
    from specdistill.pipeline import stage_data

    asked = []
    monkeypatch.setattr(distill.data, "generate_teacher_data", lambda *a, **k: asked.append(k["prompt_topk"]))
    target = (SimpleNamespace(config=SimpleNamespace(num_hidden_layers=4)), None, TEACHER_ID)
    dist = SimpleNamespace(rank=0, world_size=1, barrier=lambda: None)
    settings = ("data.teacher_cache=true",)
    for candidates, want in (
        (
            "candidates=[{name: a}, {name: b, overrides: {distill.teacher: cache, distill.loss_on_prompt: false}}]",
            False,
        ),
        ("candidates=[{name: a, overrides: {distill.loss_on_prompt: true}}]", False),  # the teacher online
        ("candidates=[{name: a}, {name: b, overrides: {distill.teacher: cache}}]", True),  # the default asks for them
        (
            "candidates=[{name: a, overrides: {distill.loss_on_prompt: false}},"
            " {name: b, overrides: {distill.teacher: cache, distill.loss_on_prompt: true}}]",
            True,
        ),
    ):
        stage_data(train_config(tmp_path, *settings, candidates), dist, target)
        assert asked[-1] is want, candidates


# ----------------------------------------------------------------------------------------------------------------
# the training loop


def spy_steps(monkeypatch) -> list[tuple[dict, float]]:
    """(batch, num_items) of every micro-batch the loop trains on."""
    from train.loop import DistillRecipe

    seen, real = [], DistillRecipe._loss_step

    def spy(self, batch, num_items):
        seen.append(({k: v.clone() for k, v in batch.items()}, float(num_items)))
        return real(self, batch, num_items)

    monkeypatch.setattr(DistillRecipe, "_loss_step", spy)
    return seen


def validation_response_tokens(path: Path, max_seq_len: int) -> int:
    ds = load_teacher_data(path)
    return sum(max(0, min(len(x), max_seq_len) - p) for x, p in zip(ds["input_ids"], ds["prompt_len"]))


@pytest.mark.parametrize("teacher_kind", ["online", "cache"])
def test_a_step_with_the_flag_counts_and_trains_every_predicted_token(tiny, tmp_path, monkeypatch, teacher_kind):
    """num_items is every non-padding position but each row's last (prompt positions included), the labels are the
    next tokens there; without the flag, response positions only. Validation counts response tokens either way."""
    from specdistill.pipeline import distill_candidate

    teacher, tokenizer, _ = tiny
    data = make_teacher_data(tmp_path / "data", teacher, prompt_topk=True)  # serves both runs (offset reads)
    seen = spy_steps(monkeypatch)
    tokens = {}
    for flag in (True, False):
        settings = (f"distill.teacher={teacher_kind}", f"distill.loss_on_prompt={flag}", "train.max_steps=1")
        cfg = train_config(tmp_path / str(flag), *settings)
        cand = distill_candidate(cfg, "draft", data, teacher=teacher, tokenizer=tokenizer)
        assert len(seen) == 1  # one step of one micro-batch
        for batch, num_items in seen:
            lengths = batch["attention_mask"].sum(-1)  # (B,)
            mask = batch["labels"] != IGNORE
            if flag:
                assert num_items == float((lengths - 1).sum())
                for b, n in enumerate(lengths.tolist()):
                    assert mask[b].nonzero()[:, 0].tolist() == list(range(n - 1))
                    assert torch.equal(batch["labels"][b, : n - 1], batch["input_ids"][b, 1:n])
            else:
                assert num_items == float(mask.sum()) < float((lengths - 1).sum())
            if teacher_kind == "cache":  # each trained position holds its own cached row, prompt positions included
                assert torch.equal(batch["topk_ids"][..., 0].long()[mask], teacher_argmax(teacher, batch)[mask])
        seen.clear()
        tokens[flag] = metric_rows(cand)[-1]["eval/tokens"]
    assert tokens[True] == tokens[False] == validation_response_tokens(data.validation, 64)


def teacher_argmax(teacher, batch: dict) -> torch.Tensor:
    """(B, T) the teacher's own argmax at each position of the batch, from a forward of its own."""
    with torch.inference_mode():
        return teacher(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.argmax(-1)


def test_the_flag_with_a_response_only_cache_is_refused_with_the_fix(tiny, tmp_path):
    from specdistill.pipeline import distill_candidate

    teacher, tokenizer, data = tiny
    cfg = train_config(tmp_path / "run", "distill.teacher=cache", "distill.loss_on_prompt=true")
    with pytest.raises(
        ValueError,
        match=r"loss_on_prompt=true \(the default\) with distill.teacher=cache needs .*specdistill data.*"
        r"loss_on_prompt=false to train on response tokens only",
    ):
        distill_candidate(cfg, "draft", data, teacher=teacher, tokenizer=tokenizer)


def test_on_policy_rows_train_their_prompt_positions_with_the_flag(tiny, tmp_path, monkeypatch):
    from specdistill.pipeline import distill_candidate

    teacher, tokenizer, data = tiny
    seen = spy_steps(monkeypatch)
    cfg = train_config(tmp_path / "run", "distill.lmbda=1.0", "distill.loss_on_prompt=true", "train.max_steps=1")
    distill_candidate(cfg, "draft", data, teacher=teacher, tokenizer=tokenizer)
    ((batch, num_items),) = seen
    lengths = batch["attention_mask"].sum(-1)
    assert num_items == float((lengths - 1).sum())
    for b, n in enumerate(lengths.tolist()):
        assert torch.equal(batch["labels"][b, : n - 1], batch["input_ids"][b, 1:n])


def test_validation_measures_response_tokens_whatever_the_flag(tiny):
    from types import SimpleNamespace

    from helpers.models import tiny_llama

    from distill.config import DistillConfig
    from train.config import TrainConfig
    from train.validation import validate

    teacher, _, data = tiny
    student = tiny_llama(seed=5, vocab_size=teacher.config.vocab_size)
    ds = load_training_split(data.validation, ["input_ids", "prompt_len"], split="validation", max_seq_len=64)
    acc = SimpleNamespace(process_index=0, num_processes=1, device=torch.device("cpu"), reduce=lambda x, _: x)
    train_cfg = TrainConfig(batch_size=2, max_seq_len=64)
    metrics = {
        flag: validate(student, teacher, ds, acc, DistillConfig(loss_on_prompt=flag), train_cfg, 0)
        for flag in (False, True)
    }
    assert metrics[True] == metrics[False]
    assert metrics[True]["eval/tokens"] == validation_response_tokens(data.validation, 64)


# ----------------------------------------------------------------------------------------------------------------
# EAGLE-3


def trained_rows(row: dict, j: int, flag: bool) -> list[int]:
    """Rows t of unrolled step j that learn something: the head at row t, step j, learns the teacher's distribution
    at position t + 1 + j, the one that predicts token t + 2 + j; trained when that token exists and, without the
    flag, is a response token."""
    n, P = len(row["input_ids"]), row["prompt_len"]
    return [t for t in range(n) if t + 2 + j <= n - 1 and (flag or t + 2 + j >= P)]


@pytest.mark.parametrize("cache", [False, True])
def test_the_eagle3_heads_unrolled_steps_train_prompt_positions_with_the_flag(monkeypatch, cache):
    """Each unrolled step's mask covers exactly the rows whose target token exists (prompt ones with the flag), the
    teacher's logits or the cache's rows alike, and the step-0 loss is the forward KL of exactly those rows."""
    import distill.eagle3 as e3
    from distill.config import DistillConfig
    from distill.students import DraftConfig

    target, head, aux_layers, rows = eagle3_setup(prompt_topk=True)
    embed_weight = e3.frozen_embedding(target, "cpu")
    distill_cfg = DistillConfig(objective={"forward_kl": 1.0})
    masks, real = [], e3.distill_loss
    monkeypatch.setattr(e3, "distill_loss", lambda *a, **k: masks.append(k["mask"].clone()) or real(*a, **k))
    losses = {}
    for flag in (True, False):
        batch = e3.collate_eagle3(rows, max_seq_len=64, pad_id=0, topk=cache, loss_on_prompt=flag)
        teacher, index = (None, torch.arange(batch["aux_hidden"].shape[-1])) if cache else (target, None)
        depth = DraftConfig(init="eagle3", ttt_depth=3, pack_sequences=False)  # masks in the padded layout
        masks.clear()
        e3.eagle3_loss(head, embed_weight, teacher, batch, 1, depth, distill_cfg, index, aux_layers=aux_layers)
        for j, mask in enumerate(masks):
            for b, row in enumerate(rows):
                assert mask[b].nonzero()[:, 0].tolist() == trained_rows(row, j, flag), (flag, j, b)
        one = DraftConfig(init="eagle3", ttt_depth=1)
        losses[flag] = e3.eagle3_loss(head, embed_weight, teacher, batch, 1, one, distill_cfg, index,
                                      aux_layers=aux_layers)  # fmt: skip

    # Step 0's forward KL, summed over its trained rows, from the teacher's logits and the head's own forward.
    ids = torch.nn.utils.rnn.pad_sequence([torch.tensor(r["input_ids"]) for r in rows], batch_first=True)
    with torch.no_grad():
        logits, aux = e3.target_aux_forward(target, ids, aux_layers)
        (_, draft_logits), *_ = e3.ttt_logits(head, aux, torch.nn.functional.embedding(ids, embed_weight), 1)
    p, q = torch.log_softmax(logits, -1), torch.log_softmax(draft_logits, -1)  # (B, T, V)
    for flag in (True, False):
        want = sum(
            (p[b, t + 1].exp() * (p[b, t + 1] - q[b, t])).sum() for b, row in enumerate(rows)
            for t in trained_rows(row, 0, flag)
        )  # fmt: skip
        torch.testing.assert_close(losses[flag].detach(), want, rtol=2e-2 if cache else 1e-4, atol=1e-3)
    assert losses[True] > losses[False]


def test_an_eagle3_cache_candidate_with_the_flag_trains_from_prompt_rows(tmp_path, isolated_cache):
    """The pipeline end to end: stage_data stores prompt rows (and the aux states) for an EAGLE-3 candidate with the
    flag that trains from the cache, the head trains from them, and validation counts response tokens."""
    from specdistill.pipeline import dist_state, distill_candidate, stage_data

    overrides = ("draft.init=eagle3", "draft.draft_vocab_size=48", "draft.ttt_depth=2", "distill.teacher=cache",
                 "distill.loss_on_prompt=true", "data.teacher_cache=true", "data.teacher_cache_top_k=8",
                 "data.max_prompts=4", "data.max_validation_prompts=2", "train.max_seq_len=512")  # fmt: skip
    cfg = train_config(tmp_path / "run", *overrides)
    data = stage_data(cfg, dist_state("cpu"))
    ds = load_teacher_data(data.train)
    assert ds[TOPK_START] == [1] * len(ds) and [len(r) for r in ds["topk_ids"]] == [len(x) - 1 for x in ds["input_ids"]]
    assert TOPK_START not in load_teacher_data(data.validation).column_names
    cand = distill_candidate(cfg, "draft", data)
    assert metric_rows(cand)[-1]["eval/tokens"] == validation_response_tokens(data.validation, 512)


# ----------------------------------------------------------------------------------------------------------------
# finished candidates and checkpoints


def test_runs_from_before_the_flag_keep_their_fingerprint_and_resume(tmp_path):
    from specdistill.config import to_dict
    from specdistill.pipeline import _without_new_defaults, config_drift, training_fingerprint

    # response tokens only, the value that trains as runs from before the key did; the default is the other one
    cfg, flagged = train_config(tmp_path, "distill.loss_on_prompt=false"), train_config(tmp_path)
    assert flagged.distill.loss_on_prompt
    saved = to_dict(cfg)
    del saved["distill"]["loss_on_prompt"]  # a checkpoint written before the key existed
    assert config_drift(saved, to_dict(cfg)) == []
    assert (
        config_drift(saved, to_dict(flagged))
        == config_drift(to_dict(cfg), to_dict(flagged))
        == ["distill.loss_on_prompt"]
    )
    assert training_fingerprint(cfg) != training_fingerprint(flagged)
    # the fingerprint of a response-only run is the one it had before the key existed: the key is left out of it
    assert "loss_on_prompt" not in _without_new_defaults(to_dict(cfg))["distill"]
    assert _without_new_defaults(to_dict(flagged))["distill"]["loss_on_prompt"] is True
