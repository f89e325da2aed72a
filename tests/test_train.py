"""The distillation loop on tiny random models: smoke + resume, the pure pieces, cache / on-policy / NaN paths.

Run builders shared with the other train tests (`tiny_setup`, `train_config`, `reference_run`, ...) live in
tests/helpers/.
"""

from __future__ import annotations

import dataclasses
import json
import math
import weakref
from pathlib import Path

import pytest
import torch
from helpers.runs import (
    ADAM_OUTLIERS,
    assert_same_logs,
    assert_same_weights,
    final_weights,
    first_step_gradients,
    make_teacher_data,
    metric_rows,
    tiny_setup,
    train_config,
)
from safetensors.torch import load_file

# ----------------------------------------------------------------------------------------------------------------
# Shared helpers


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """Built once per module: its own model cache and teacher data, shared read-only by the runs."""
    root = tmp_path_factory.mktemp("tiny")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SPECDISTILL_CACHE", str(root / "cache"))
        yield tiny_setup(root)


# ----------------------------------------------------------------------------------------------------------------
# Pure pieces


def test_lr_factor_warmup_then_cosine_to_floor():
    from train.loop import lr_factor

    f = [lr_factor(s, warmup=2, total=10, min_ratio=0.1) for s in range(11)]
    assert f[0] == pytest.approx(0.5) and f[1] == pytest.approx(1.0)  # linear warm-up
    assert f[2] == pytest.approx(1.0) and f[10] == pytest.approx(0.1)  # cosine from the peak to the floor
    assert all(a >= b for a, b in zip(f[1:], f[2:]))
    assert f[6] == pytest.approx(0.1 + 0.9 * 0.5)  # halfway through the decay


def test_micro_batches_cover_the_same_rows_for_any_split_of_the_global_batch():
    from distill.batches import micro_batch_indices

    order = list(range(100, 148))

    def step_rows(step, world, ga, bs):
        return sorted(
            i
            for r in range(world)
            for m in range(ga)
            for i in micro_batch_indices(order, step, m, rank=r, world=world, batch_size=bs, grad_accum=ga)
        )

    for step in range(3):
        expected = order[step * 8 : (step + 1) * 8]
        for world, ga, bs in [(1, 1, 8), (2, 1, 4), (1, 2, 4), (2, 2, 2), (4, 2, 1)]:
            assert step_rows(step, world, ga, bs) == expected


def test_epoch_order_is_a_seeded_permutation():
    from distill.batches import epoch_order

    assert sorted(epoch_order(50, 3, 0)) == list(range(50))
    assert epoch_order(50, 3, 0) == epoch_order(50, 3, 0)
    assert epoch_order(50, 3, 0) != epoch_order(50, 3, 1) != epoch_order(50, 4, 0)


def test_fetch_rows_reads_what_the_numpy_format_reads_through_an_indices_mapping():
    """The Arrow read of `fetch_rows` against datasets' numpy format: per-position columns as (T, K) arrays of the
    same dtype and values (rows of different lengths, one with none), ids as lists, scalars as Python values, on a
    shuffled selection (an indices mapping); the dataset's own format is left as it was."""
    import datasets
    import numpy as np

    from distill.batches import fetch_rows

    g = np.random.default_rng(0)
    lengths = [3, 0, 5, 2, 4]
    features = datasets.Features(
        {
            "input_ids": datasets.List(datasets.Value("int32")),
            "prompt_len": datasets.Value("int32"),
            "topk_ids": datasets.List(datasets.List(datasets.Value("int32"), length=4)),
            "aux": datasets.List(datasets.List(datasets.Value("float16"), length=6)),
        }
    )
    ds = datasets.Dataset.from_dict(
        {
            "input_ids": [list(range(n + 1)) for n in lengths],
            "prompt_len": lengths,
            "topk_ids": [g.integers(0, 50, (n, 4)).tolist() for n in lengths],
            "aux": [g.standard_normal((n, 6)).astype(np.float16).tolist() for n in lengths],
        },
        features=features,
    )
    view = ds.shuffle(seed=3)  # through an indices mapping
    indices = [4, 0, 2, 1, 3]
    got, expected = fetch_rows(view, indices), view.with_format("numpy")[indices]
    assert view.format["type"] is None and len(got) == 5 and any(len(row["topk_ids"]) == 0 for row in got)
    for i, row in enumerate(got):
        assert row["input_ids"] == expected["input_ids"][i].tolist() and row["prompt_len"] == expected["prompt_len"][i]
        for name, width in (("topk_ids", 4), ("aux", 6)):
            want = np.asarray(expected[name][i]).reshape(-1, width).astype(row[name].dtype)
            assert row[name].shape == want.shape and np.array_equal(row[name], want), name
    assert got[0]["topk_ids"].dtype == np.int64 and got[0]["aux"].dtype == np.float32 and fetch_rows(view, []) == []
    # Inner lists whose length the schema does not fix (types inferred), read the same way.
    inferred = datasets.Dataset.from_dict({name: ds[name] for name in ("topk_ids", "aux")})
    assert (
        not isinstance(inferred.features["aux"].feature, datasets.List) or inferred.features["aux"].feature.length == -1
    )
    for row, want in zip(fetch_rows(inferred, [0, 2]), [ds[0], ds[2]]):
        assert np.array_equal(row["topk_ids"], np.asarray(want["topk_ids"]).reshape(-1, 4))
        assert row["aux"].dtype == np.float32 and np.allclose(row["aux"], np.asarray(want["aux"]).reshape(-1, 6))


def test_collate_aligns_labels_and_cached_topk_with_the_predicting_position():
    from distill.batches import IGNORE, collate

    rows = [
        {"input_ids": [5, 6, 7, 8, 9], "prompt_len": 3, "topk_ids": [[8, 1], [9, 2]]},
        {"input_ids": [5, 6, 7], "prompt_len": 2, "topk_ids": [[7, 3]]},
    ]
    rows[0]["topk_logprobs"], rows[1]["topk_logprobs"] = [[-0.1, -3], [-0.2, -4]], [[-0.3, -2]]
    batch = collate(rows, max_seq_len=16, pad_id=0, topk=True)
    assert batch["input_ids"].tolist() == [[5, 6, 7, 8, 9], [5, 6, 7, 0, 0]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]]
    # position t predicts token t + 1: response tokens 8, 9 are predicted at positions 2, 3
    assert batch["labels"].tolist() == [[IGNORE, IGNORE, 8, 9, IGNORE], [IGNORE, 7, IGNORE, IGNORE, IGNORE]]
    assert batch["topk_ids"][0, 2].tolist() == [8, 1] and batch["topk_ids"][0, 3].tolist() == [9, 2]
    assert batch["topk_ids"][1, 1].tolist() == [7, 3]
    assert batch["topk_logprobs"][0, 3].tolist() == pytest.approx([-0.2, -4])
    # filler positions hold a valid distribution (no NaN in the loss for masked positions)
    assert batch["topk_logprobs"][0, 0].exp().sum() < 1

    truncated = collate(rows, max_seq_len=4, pad_id=0, topk=True)  # keeps the prompt and the first response token
    assert truncated["labels"][0].tolist() == [IGNORE, IGNORE, 8, IGNORE]
    assert truncated["topk_ids"][0, 2].tolist() == [8, 1]


def test_split_by_tokens_keeps_each_run_within_the_bound_and_cuts_its_padding():
    from distill.batches import collate, split_by_tokens

    lengths = [5, 2, 3, 7, 1]
    rows = [{"input_ids": list(range(1, n + 1)), "prompt_len": 1, "topk_ids": [[1]] * (n - 1)} for n in lengths]
    for row in rows:
        row["topk_logprobs"] = [[-0.5]] * len(row["topk_ids"])
    batch = collate(rows, max_seq_len=16, pad_id=0, topk=True)

    assert split_by_tokens(batch, 0) == [batch] and split_by_tokens(batch, 18) == [batch]  # off, or within
    runs = split_by_tokens(batch, 6)
    # consecutive rows, at most 6 real tokens each; the 7-token row alone
    assert [r["attention_mask"].sum(1).tolist() for r in runs] == [[5], [2, 3], [7], [1]]
    assert [r["input_ids"].shape[1] for r in runs] == [5, 3, 7, 1]  # each run as wide as its longest row
    for key, whole in batch.items():  # the runs hold the batch's real positions, nothing else
        parts = [r[key][b, : int(r["attention_mask"][b].sum())] for r in runs for b in range(len(r[key]))]
        mine = [whole[b, :n] for b, n in enumerate(lengths)]
        assert all(torch.equal(x, y) for x, y in zip(parts, mine, strict=True)), key
    assert [r["attention_mask"].sum().item() for r in split_by_tokens(batch, 1)] == lengths  # a row at a time


def test_token_runs_split_further_to_the_passes_another_process_needs():
    """Every process of a step runs as many passes as the one that needs the most: runs are split again, the run
    with the most tokens first, where its tokens reach half, never into an empty run."""
    from distill.batches import token_runs

    lengths = [5, 2, 3, 7, 1]
    assert token_runs(lengths, 6) == [(0, 1), (1, 3), (3, 4), (4, 5)]
    assert token_runs(lengths, 0) == [(0, 5)]
    assert token_runs(lengths, 0, passes=2) == [(0, 2), (2, 5)]  # 7 | 11 tokens: the cut nearest half of 18
    assert token_runs(lengths, 6, passes=5) == [(0, 1), (1, 2), (2, 3), (3, 4), (4, 5)]
    assert token_runs(lengths, 6, passes=9) == token_runs(lengths, 6, passes=5)  # at most a row each
    assert token_runs(lengths, 100, passes=3) == [(0, 2), (2, 3), (3, 5)]


def test_config_drift_allows_more_steps_but_not_another_objective(tmp_path):
    from specdistill.config import to_dict
    from specdistill.pipeline import config_drift, training_fingerprint

    a = train_config(tmp_path)
    more = train_config(tmp_path, "train.max_steps=9", "train.eval_every=3", "tracking.backend=wandb")
    other = train_config(tmp_path, "distill.objective=tv", "train.lr=1e-3")
    assert config_drift(to_dict(a), to_dict(more)) == []
    expected = ["distill.objective.forward_kl", "distill.objective.tv", "train.lr"]
    assert config_drift(to_dict(a), to_dict(other)) == expected
    assert training_fingerprint(a) == training_fingerprint(train_config(tmp_path, "eval.max_prompts=3"))
    assert training_fingerprint(a) != training_fingerprint(more)
    # Sharding the teacher changes where its weights live, not what is trained: resumable, same DONE fingerprint.
    sharded = train_config(tmp_path, "train.shard_teacher=always")
    assert config_drift(to_dict(a), to_dict(sharded)) == []
    assert training_fingerprint(a) == training_fingerprint(sharded)
    # So does packing an EAGLE-3 head's batch (the same loss and gradients), and a checkpoint from before the key.
    padded = train_config(tmp_path, "draft.pack_sequences=false")
    saved = to_dict(a)
    del saved["draft"]["pack_sequences"]
    assert config_drift(to_dict(a), to_dict(padded)) == config_drift(saved, to_dict(padded)) == []
    assert training_fingerprint(a) == training_fingerprint(padded)
    every_row = train_config(tmp_path, "draft.skip_untrained_rows=false")  # the same for the unroll's rows
    del saved["draft"]["skip_untrained_rows"]
    assert config_drift(to_dict(a), to_dict(every_row)) == config_drift(saved, to_dict(every_row)) == []
    assert training_fingerprint(a) == training_fingerprint(every_row)
    # And running a micro-batch in several passes.
    bounded = train_config(tmp_path, "train.max_micro_batch_tokens=256")
    del saved["train"]["max_micro_batch_tokens"]
    assert config_drift(to_dict(a), to_dict(bounded)) == config_drift(saved, to_dict(bounded)) == []
    assert training_fingerprint(a) == training_fingerprint(bounded)


def test_the_teacher_is_sharded_when_the_student_is_or_when_asked():
    from accelerate.utils import DistributedType

    from train.distributed import should_shard_teacher

    fsdp, ddp = DistributedType.FSDP, DistributedType.MULTI_GPU
    assert should_shard_teacher("auto", fsdp, world=8, cache=False)
    assert not should_shard_teacher("auto", ddp, world=8, cache=False)
    assert should_shard_teacher("always", ddp, world=2, cache=False)
    assert should_shard_teacher("always", DistributedType.MULTI_CPU, world=2, cache=False)
    assert not should_shard_teacher("never", fsdp, world=8, cache=False)
    assert not should_shard_teacher("always", DistributedType.NO, world=1, cache=False)  # nothing to shard over
    assert not should_shard_teacher("always", fsdp, world=8, cache=True)  # no teacher in memory


def test_on_policy_rows_keep_the_prompt_and_stop_at_eos(tiny):
    from distill.batches import on_policy_rows
    from distill.config import DataConfig

    model, tokenizer, _ = tiny
    rows = [{"input_ids": [10, 11, 12, 13, 14], "prompt_len": 3}, {"input_ids": [20, 21, 22, 23], "prompt_len": 2}]
    torch.manual_seed(0)
    eos = tokenizer.eos_token_id
    data = DataConfig(max_new_tokens=5)
    out = on_policy_rows(model, rows, stop_ids=[eos], pad_id=tokenizer.pad_token_id, data=data, max_seq_len=64)
    assert [r["prompt_len"] for r in out] == [3, 2]
    assert out[0]["input_ids"][:3] == [10, 11, 12] and out[1]["input_ids"][:2] == [20, 21]
    for r in out:
        response = r["input_ids"][r["prompt_len"] :]
        assert 1 <= len(response) <= 5 and eos not in response[:-1]
    # Every stop id ends an answer, not only the tokenizer's EOS (chat models list end-of-turn ids elsewhere): make
    # the first sampled token of row 0 a stop id and the same draw ends there.
    first = out[0]["input_ids"][3]
    torch.manual_seed(0)
    again = on_policy_rows(model, rows, stop_ids=[eos, first], pad_id=tokenizer.pad_token_id, data=data, max_seq_len=64)
    assert again[0]["input_ids"][3:] == [first]
    # no room left under max_seq_len: the rows are kept as they are
    assert on_policy_rows(model, rows, stop_ids=[eos], pad_id=0, data=DataConfig(), max_seq_len=3) is rows


# ----------------------------------------------------------------------------------------------------------------
# Runs


def test_two_step_smoke_run_then_resume(tmp_path, tiny, capsys):
    from transformers import AutoModelForCausalLM

    from specdistill.pipeline import distill_candidate
    from train.checkpoint import read_checkpoint

    teacher, tokenizer, data = tiny
    cand = distill_candidate(
        train_config(tmp_path / "run", "train.keep_last=1"), "draft", data, teacher=teacher, tokenizer=tokenizer
    )
    assert cand == tmp_path / "run" / "candidates" / "draft"
    rows = metric_rows(cand)
    train_rows = [r for r in rows if "train/loss" in r]
    assert [r["step"] for r in train_rows] == [1, 2]
    assert all(math.isfinite(r["train/loss"]) and r["train/loss"] > 0 for r in train_rows)
    evals = [r for r in rows if "eval/expected_acceptance" in r]
    assert [r["step"] for r in evals] == [1, 2] and all(0 < r["eval/expected_acceptance"] <= 1 for r in evals)

    # keep_last=1: only the newest checkpoint stays, complete and readable
    ckpts = sorted(p.name for p in (cand / "checkpoints").iterdir())
    assert ckpts == ["step-000002"]
    step2 = cand / "checkpoints" / "step-000002"
    for name in (
        "model.safetensors",
        "config.json",
        "tokenizer.json",
        "optimizer.pt",
        "scheduler.pt",
        "rng.json",
        "trainer_state.json",
        "config.yaml",
        "COMPLETE",
    ):
        assert (step2 / name).is_file(), name
    assert read_checkpoint(step2, adapter=False).state.step == 2

    # best/ is a plain HF folder with the best validation acceptance
    best = json.loads((cand / "best" / "metrics.json").read_text())
    assert best["eval/expected_acceptance"] == max(r["eval/expected_acceptance"] for r in evals)
    draft = AutoModelForCausalLM.from_pretrained(cand / "best")
    assert draft.config.num_hidden_layers == 2
    assert (cand / "DONE").is_file()
    capsys.readouterr()

    # resume: one more step from the step-2 checkpoint, metrics rows continue without duplicates
    distill_candidate(
        train_config(tmp_path / "run", "train.keep_last=1", "train.max_steps=3"),
        "draft",
        data,
        teacher=teacher,
        tokenizer=tokenizer,
    )
    assert "resumed draft from" in capsys.readouterr().out
    assert [r["step"] for r in metric_rows(cand) if "train/loss" in r] == [1, 2, 3]
    assert sorted(p.name for p in (cand / "checkpoints").iterdir()) == ["step-000003"]


def test_resume_refuses_a_checkpoint_of_other_settings(tmp_path, tiny):
    from specdistill.pipeline import distill_candidate

    teacher, tokenizer, data = tiny
    cfg = train_config(tmp_path / "run", "train.max_steps=1")
    distill_candidate(cfg, "draft", data, teacher=teacher, tokenizer=tokenizer)
    with pytest.raises(ValueError, match=r"other settings \(distill.kd_temperature\).*train.resume=false"):
        distill_candidate(
            train_config(tmp_path / "run", "train.max_steps=2", "distill.kd_temperature=2.0"),
            "draft",
            data,
            teacher=teacher,
            tokenizer=tokenizer,
        )
    # starting over is explicit
    distill_candidate(
        train_config(tmp_path / "run", "train.max_steps=1", "distill.kd_temperature=2.0", "train.resume=false"),
        "draft",
        data,
        teacher=teacher,
        tokenizer=tokenizer,
    )


class _Payload:
    """A pickle that runs code when it is loaded: what a crafted rng.pt in a copied run directory would hold."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (Path(self.marker),))


def test_resume_never_unpickles_the_rng_states(tmp_path, tiny, capsys):
    """RNG states are JSON (rng.json); a checkpoint that holds them only as a pickle (rng.pt) is skipped with the
    reason, and its pickle never runs."""
    from specdistill.pipeline import distill_candidate
    from train.checkpoint import read_checkpoint, rng_from_json, rng_state, rng_to_json

    state = rng_state()
    again = rng_from_json(json.loads(json.dumps(rng_to_json(state))))
    assert again["python"] == state["python"] and torch.equal(again["torch"], state["torch"])
    assert all((a == b).all() if hasattr(a, "all") else a == b for a, b in zip(again["numpy"], state["numpy"]))

    teacher, tokenizer, data = tiny
    cand = distill_candidate(
        train_config(tmp_path / "run", "train.max_steps=1"), "draft", data, teacher=teacher, tokenizer=tokenizer
    )
    step1 = cand / "checkpoints" / "step-000001"
    assert len(read_checkpoint(step1, adapter=False).rng) == 1
    marker = tmp_path / "pwned"
    (step1 / "rng.json").unlink()
    torch.save([_Payload(str(marker))], step1 / "rng.pt")
    capsys.readouterr()
    distill_candidate(
        train_config(tmp_path / "run", "train.max_steps=2"), "draft", data, teacher=teacher, tokenizer=tokenizer
    )
    assert not marker.exists(), "a checkpoint's pickle ran on resume"
    out = capsys.readouterr().out
    assert "skipping checkpoint" in out and "rng.pt" in out and "unpickling runs code" in out, out


def test_a_zero_partition_is_read_without_running_its_pickle(tmp_path):
    """A DeepSpeed run's optimizer partition is read by the weights-only unpickler with DeepSpeed's record classes
    allow-listed: a crafted partition in a copied run directory is refused (the checkpoint skipped), never run."""
    from safetensors.torch import save_file

    from train.checkpoint import MARKER, CorruptCheckpointError, TrainerState, read_checkpoint, zero_file

    step = tmp_path / "step-000001"
    step.mkdir()
    (step / "trainer_state.json").write_text(json.dumps(dataclasses.asdict(TrainerState(step=1))))
    save_file({"w": torch.zeros(2)}, step / "model.safetensors")
    marker = tmp_path / "pwned"
    torch.save({"state": _Payload(str(marker))}, step / zero_file(0))
    (step / MARKER).write_text("")
    with pytest.raises(CorruptCheckpointError, match=zero_file(0)):
        read_checkpoint(step, adapter=False, rank=0)
    assert not marker.exists(), "a checkpoint's pickle ran on resume"


def test_gradient_accumulation_equals_the_big_batch(tmp_path, tiny):
    """2 accumulated micro-batches of 2 take the step one batch of 4 takes: the same gradients at the first step
    (compared before Adam, whose eps-scale amplification of rounding depends on the CPU's kernels), the same
    losses, gradient norms and validation metrics at every step, and the same weights."""
    from specdistill.pipeline import distill_candidate

    teacher, tokenizer, data = tiny
    runs, rows, grads = {}, {}, {}
    for name, bs, ga in [("big", 4, 1), ("accum", 2, 2)]:
        cfg = train_config(
            tmp_path / name,
            f"train.batch_size={bs}",
            f"train.grad_accum={ga}",
            "train.eval_every=9",
            "train.save_every=9",
        )
        cands = []
        grads[name] = first_step_gradients(
            lambda cfg=cfg, cands=cands: cands.append(
                distill_candidate(cfg, "draft", data, teacher=teacher, tokenizer=tokenizer)
            )
        )
        runs[name], rows[name] = final_weights(cands[0], 2), metric_rows(cands[0])
    assert len(grads["big"]) == len(grads["accum"]) > 0
    for big, accum in zip(grads["big"], grads["accum"]):
        torch.testing.assert_close(accum, big, rtol=1e-4, atol=1e-6 * big.abs().max().item())
    assert any(g.abs().max() > 0 for g in grads["big"])
    assert_same_logs(rows["big"], rows["accum"])
    assert_same_weights(runs["big"], runs["accum"], outliers=ADAM_OUTLIERS)
    start = teacher.state_dict()["model.embed_tokens.weight"]
    assert not torch.allclose(runs["big"]["model.embed_tokens.weight"], start)  # it did train


def test_a_micro_batch_token_bound_takes_the_same_step_in_several_passes(tmp_path, tiny, monkeypatch):
    """train.max_micro_batch_tokens runs a micro-batch as several forward and backward passes: the same gradients at
    the first step, the same logs and weights as the micro-batch in one pass."""
    import train.loop
    from specdistill.pipeline import distill_candidate

    teacher, tokenizer, data = tiny
    passes = []
    split = train.loop.split_by_tokens
    monkeypatch.setattr(train.loop, "split_by_tokens", lambda *a: passes.append(len(out := split(*a))) or out)
    runs, rows, grads = {}, {}, {}
    for name, bound in [("whole", 0), ("bounded", 1)]:  # 1: a sequence per pass
        cfg = train_config(
            tmp_path / name, "train.batch_size=4", f"train.max_micro_batch_tokens={bound}", "train.eval_every=9"
        )
        cands = []
        grads[name] = first_step_gradients(
            lambda cfg=cfg, cands=cands: cands.append(
                distill_candidate(cfg, "draft", data, teacher=teacher, tokenizer=tokenizer)
            )
        )
        runs[name], rows[name] = final_weights(cands[0], 2), metric_rows(cands[0])
    assert passes == [1, 1, 4, 4]  # 2 steps each
    for whole, bounded in zip(grads["whole"], grads["bounded"], strict=True):
        torch.testing.assert_close(bounded, whole, rtol=1e-4, atol=1e-6 * whole.abs().max().item())
    assert_same_logs(rows["whole"], rows["bounded"])
    assert_same_weights(runs["whole"], runs["bounded"], outliers=ADAM_OUTLIERS)


def test_non_finite_loss_stops_and_keeps_the_last_good_checkpoint(tmp_path, tiny):
    from specdistill.pipeline import distill_candidate
    from train.checkpoint import read_checkpoint
    from train.loop import NonFiniteLossError

    teacher, tokenizer, data = tiny
    cfg = train_config(
        tmp_path / "run",
        "train.lr=1e30",
        "train.warmup_steps=0",
        "train.max_grad_norm=0",
        "train.max_steps=4",
        "train.keep_last=5",
    )
    with pytest.raises(NonFiniteLossError, match=r"non-finite loss .* at step 2; stopped without saving.*step-000001"):
        distill_candidate(cfg, "draft", data, teacher=teacher, tokenizer=tokenizer)
    cand = tmp_path / "run" / "candidates" / "draft"
    assert sorted(p.name for p in (cand / "checkpoints").iterdir()) == ["step-000001"]
    assert read_checkpoint(cand / "checkpoints" / "step-000001", adapter=False).state.step == 1
    assert max(r["step"] for r in metric_rows(cand)) == 1
    assert not (cand / "DONE").exists()


def test_teacher_cache_trains_without_running_the_teacher(tmp_path, tiny, monkeypatch):
    import train.loop
    from specdec_runtime.loading import load_model
    from specdistill.pipeline import distill_candidate

    _, _, data = tiny
    forwards, refs = [], []

    def load_counting(spec, **kwargs):
        model, tokenizer = load_model(spec, **kwargs)
        ref = weakref.ref(model)
        refs.append(ref)
        # deepcopies of the teacher (the truncated student) share the hook: count only the teacher itself
        model.register_forward_pre_hook(lambda module, args: forwards.append(1) if module is ref() else None)
        return model, tokenizer

    monkeypatch.setattr(train.loop, "load_model", load_counting)
    # the fixture's cache holds response rows only (the prompt rows' cache: tests/test_loss_on_prompt.py)
    cfg = train_config(
        tmp_path / "run", "distill.teacher=cache", "distill.objective=tv", "distill.loss_on_prompt=false"
    )
    cand = distill_candidate(cfg, "draft", data)
    assert len(refs) == 1 and forwards == []
    assert refs[0]() is None  # nothing holds the teacher after the run
    rows = metric_rows(cand)
    assert all(math.isfinite(r["train/loss"]) for r in rows if "train/loss" in r)
    assert all(0 < r["eval/expected_acceptance"] <= 1 for r in rows if "eval/expected_acceptance" in r)


def test_unusable_data_is_refused(tmp_path, tiny):
    from specdistill.pipeline import distill_candidate

    teacher, tokenizer, data = tiny
    no_cache = make_teacher_data(tmp_path, teacher, top_k=None)
    with pytest.raises(ValueError, match="data.teacher_cache=true"):
        distill_candidate(
            train_config(tmp_path / "run", "distill.teacher=cache"),
            "draft",
            no_cache,
            teacher=teacher,
            tokenizer=tokenizer,
        )
    with pytest.raises(ValueError, match="every prompt in .* fills train.max_seq_len=3"):
        distill_candidate(
            train_config(tmp_path / "run", "train.max_seq_len=3"), "draft", data, teacher=teacher, tokenizer=tokenizer
        )
    with pytest.raises(ValueError, match="fewer than one global batch"):
        distill_candidate(
            train_config(tmp_path / "run", "train.batch_size=32"), "draft", data, teacher=teacher, tokenizer=tokenizer
        )


def test_a_setup_error_frees_what_setup_built(tmp_path, tiny, monkeypatch):
    """distill() runs its cleanup when setup fails (here after the student is built): while the error's traceback
    still holds the recipe, nothing setup built is alive."""
    import gc

    import train.loop
    from specdistill.pipeline import distill_candidate

    teacher, tokenizer, data = tiny
    built, real = [], train.loop.build_student

    def build(*args, **kwargs):
        student = real(*args, **kwargs)
        built.append(weakref.ref(student))
        return student

    monkeypatch.setattr(train.loop, "build_student", build)
    with pytest.raises(ValueError, match="fewer than one global batch") as raised:
        distill_candidate(
            train_config(tmp_path / "run", "train.batch_size=32"), "draft", data, teacher=teacher, tokenizer=tokenizer
        )
    gc.collect()
    assert raised.traceback and len(built) == 1  # the traceback (distill()'s frame, the recipe) is alive
    assert built[0]() is None, "the student outlived its failed setup"


def test_on_policy_batches_are_generated_by_the_student(tmp_path, tiny, monkeypatch):
    import train.loop
    from specdistill.pipeline import distill_candidate

    teacher, tokenizer, data = tiny
    calls = []
    original = train.loop.on_policy_rows

    def spy(model, rows, **kwargs):
        out = original(model, rows, **kwargs)
        calls.append((rows, out))
        return out

    monkeypatch.setattr(train.loop, "on_policy_rows", spy)
    cfg = train_config(tmp_path / "run", "distill.lmbda=1.0", "train.max_steps=1", "train.grad_accum=2")
    cand = distill_candidate(cfg, "draft", data, teacher=teacher, tokenizer=tokenizer)
    assert len(calls) == 2  # every micro-batch of the step
    rows, out = calls[0]
    assert [r["input_ids"][: r["prompt_len"]] for r in rows] == [r["input_ids"][: r["prompt_len"]] for r in out]
    assert math.isfinite(metric_rows(cand)[0]["train/loss"])


def test_run_distill_trains_each_candidate_once(tmp_path, tiny, monkeypatch):
    import specdistill.pipeline as pipeline

    teacher, tokenizer, data = tiny
    two = "candidates=[{name: a}, {name: b, overrides: {distill.objective: tv}}]"
    cfg = train_config(tmp_path / "run", "train.max_steps=1", two)
    trained = []
    original = pipeline.distill_candidate
    monkeypatch.setattr(
        pipeline,
        "distill_candidate",
        lambda c, name, d, **given: trained.append((c, given["teacher"])) or original(c, name, d, **given),
    )
    best = pipeline.run_distill(cfg, data, target=(teacher, tokenizer, "random:tiny-llama"))
    assert best == {n: tmp_path / "run" / "candidates" / n / "best" for n in ("a", "b")}
    assert [c.distill.objective for c, _ in trained] == [{"forward_kl": 1.0}, {"tv": 1.0}]
    assert all(given is teacher for _, given in trained)  # the loaded target, not a second load
    assert all((p / "config.json").is_file() for p in best.values())
    pipeline.run_distill(cfg, data, target=(teacher, tokenizer, "random:tiny-llama"))  # finished: skipped
    assert len(trained) == 2
    more = train_config(tmp_path / "run", "train.max_steps=2", two)  # other settings: trained again (resumed)
    pipeline.run_distill(more, data)
    assert len(trained) == 4


def test_done_is_not_trusted_when_best_lost_its_weights(tmp_path, tiny, capsys):
    """DONE vouches for a whole best/: with its weights truncated or gone, `distill` trains the candidate to its end
    again (resuming at the last step, which validates anew) instead of skipping it, and eval finds weights."""
    from safetensors.torch import load_file

    import specdistill.pipeline as pipeline
    from train.checkpoint import best_is_complete

    teacher, tokenizer, data = tiny
    cfg = train_config(tmp_path / "run", "train.max_steps=1")
    best = pipeline.run_distill(cfg, data)["draft"]
    weights = best / "model.safetensors"
    good = weights.read_bytes()
    assert best_is_complete(best)
    for damage in (lambda: weights.write_bytes(good[: len(good) // 2]), weights.unlink):
        damage()
        assert not best_is_complete(best)
        capsys.readouterr()
        pipeline.run_distill(cfg, data)
        assert "already distilled" not in capsys.readouterr().out
        assert best_is_complete(best) and load_file(weights).keys()
    capsys.readouterr()
    pipeline.run_distill(cfg, data)
    assert "already distilled" in capsys.readouterr().out


def test_end_to_end_with_generated_teacher_data(tmp_path, tiny):
    """The data stage's real output (with the top-k cache) feeds an online and a cached candidate."""
    from distill.data import generate_teacher_data
    from specdistill.pipeline import run_distill

    teacher, tokenizer, _ = tiny
    data_settings = [
        "data.max_prompts=4",
        "data.max_validation_prompts=2",
        "data.max_new_tokens=4",
        "data.teacher_cache=true",
    ]
    two = "candidates=[{name: online}, {name: cached, overrides: {distill.teacher: cache}}]"
    cfg = train_config(tmp_path / "run", "train.max_steps=1", "train.max_seq_len=1024", *data_settings, two)
    # the top-k at the prompt rows too, as the data stage stores it for the cached candidate (trained on by default)
    out = tmp_path / "run" / "data"
    data = generate_teacher_data(teacher, tokenizer, cfg.data, out, teacher_id="tiny", prompt_topk=True)
    best = run_distill(cfg, data)
    for name, folder in best.items():
        metrics = json.loads((folder / "metrics.json").read_text())
        assert 0 < metrics["eval/expected_acceptance"] <= 1 and metrics["eval/tokens"] > 0, name


def test_lora_student_resumes_its_adapters_and_exports_merged(tmp_path, tiny):
    from transformers import AutoModelForCausalLM

    from specdistill.pipeline import distill_candidate

    teacher, tokenizer, data = tiny
    constant = ["draft.lora=true", "draft.lora_r=4", "train.warmup_steps=0", "train.min_lr_ratio=1.0"]
    straight = distill_candidate(
        train_config(tmp_path / "straight", *constant), "draft", data, teacher=teacher, tokenizer=tokenizer
    )
    distill_candidate(
        train_config(tmp_path / "resumed", *constant, "train.max_steps=1"),
        "draft",
        data,
        teacher=teacher,
        tokenizer=tokenizer,
    )
    resumed = distill_candidate(
        train_config(tmp_path / "resumed", *constant), "draft", data, teacher=teacher, tokenizer=tokenizer
    )
    step2 = resumed / "checkpoints" / "step-000002"
    assert (step2 / "adapter_model.safetensors").is_file() and (step2 / "config.json").is_file()
    adapters = load_file(step2 / "adapter_model.safetensors")
    assert adapters and all("lora_" in name for name in adapters)
    assert_same_weights(adapters, load_file(straight / "checkpoints" / "step-000002" / "adapter_model.safetensors"))
    assert_same_logs(metric_rows(resumed), metric_rows(straight))
    merged = AutoModelForCausalLM.from_pretrained(resumed / "best")  # a plain model: no peft modules left
    assert not any("lora" in name for name, _ in merged.named_parameters())


def test_lora_step_checkpoints_of_a_truncated_student_evaluate_as_that_student(tmp_path, tiny):
    """Step checkpoints hold adapters only; their base is the truncated teacher in lora_base/, not the full teacher
    their adapter_config names. eval must load base + adapters and get the student that was trained."""
    import shutil

    from eval.sweep import load_draft, resolve_candidates
    from specdistill.pipeline import distill_candidate

    teacher, tokenizer, data = tiny
    cfg = train_config(tmp_path / "run", "draft.lora=true", "draft.lora_r=4", "train.keep_last=2")
    cand = distill_candidate(cfg, "draft", data, teacher=teacher, tokenizer=tokenizer)
    assert (cand / "lora_base" / "config.json").is_file()
    best_step = json.loads((cand / "best" / "metrics.json").read_text())["step"]

    found = {c.name: c for c in resolve_candidates([cand])}
    ckpt = found[f"draft@step-{best_step:06d}"]
    draft, _ = load_draft(ckpt, "cpu", "float32")
    best, _ = load_draft(found["draft"], "cpu", "float32")
    assert draft.config.num_hidden_layers == 2 < teacher.config.num_hidden_layers
    assert_same_weights(dict(draft.state_dict()), dict(best.state_dict()), atol=1e-6)  # base + adapters == merged

    # Started over with other layers (no resume): lora_base/ is written anew, not kept from the previous settings.
    from transformers import AutoModelForCausalLM

    def first_base_layer() -> torch.Tensor:
        base = AutoModelForCausalLM.from_pretrained(cand / "lora_base")
        return base.model.layers[0].self_attn.q_proj.weight

    def teacher_layer(i: int) -> torch.Tensor:
        return teacher.model.layers[i].self_attn.q_proj.weight

    assert torch.equal(first_base_layer(), teacher_layer(0))
    lora = ("draft.lora=true", "draft.lora_r=4")
    again = train_config(tmp_path / "run", *lora, "draft.layers=[1,3]", "train.resume=false")
    distill_candidate(again, "draft", data, teacher=teacher, tokenizer=tokenizer)
    assert torch.equal(first_base_layer(), teacher_layer(1))

    shutil.rmtree(cand / "lora_base")  # without it the named base is the 4-layer teacher: refused, not guessed
    with pytest.raises(ValueError, match="num_hidden_layers"):
        load_draft(ckpt, "cpu", "float32")


def test_student_logits_chunked_in_the_loss_train_like_full_logits(tmp_path, tiny, monkeypatch):
    """The loop multiplies the student's hidden states by its head chunk by chunk inside the loss (no (B, T, V)
    student logits): same steps as the full-logits path. A head the check cannot reproduce keeps the full path."""
    import train.loop as loop
    from distill.students import DraftConfig, build_student, chunked_head
    from specdistill.pipeline import distill_candidate

    teacher, tokenizer, data = tiny
    student = build_student(teacher, DraftConfig(num_layers=2))
    assert chunked_head(student) is student.get_output_embeddings().weight
    student.lm_head = torch.nn.Linear(student.config.hidden_size, student.config.vocab_size, bias=True)
    assert chunked_head(student) is None

    heads = []
    real = chunked_head
    monkeypatch.setattr(loop, "chunked_head", lambda model: heads.append(real(model)) or heads[-1])
    chunked = distill_candidate(train_config(tmp_path / "chunked"), "draft", data, teacher=teacher, tokenizer=tokenizer)
    off = train_config(tmp_path / "full", "distill.chunked_head=false")
    full = distill_candidate(off, "draft", data, teacher=teacher, tokenizer=tokenizer)
    assert len(heads) == 1 and heads[0] is not None  # chunked_head=false does not even check
    assert_same_logs(metric_rows(chunked), metric_rows(full))
    assert_same_weights(final_weights(chunked, 2), final_weights(full, 2), atol=1e-5, outliers=ADAM_OUTLIERS)


@pytest.mark.parametrize("lora", ["false", "true"])
def test_bf16_autocast_trains_with_the_chunked_head(tmp_path, tiny, lora, monkeypatch):
    """accelerate autocasts the student's forward (bf16 on CUDA; here on the CPU) and the loop enters the same
    autocast for the head matmul it moved into the loss: a plain and a LoRA student train to finite losses."""
    import train.loop as loop
    from distill.students import chunked_head
    from specdistill.pipeline import distill_candidate

    teacher, tokenizer, data = tiny
    heads, real = [], chunked_head
    monkeypatch.setattr(loop, "chunked_head", lambda model: heads.append(real(model)) or heads[-1])
    cfg = train_config(tmp_path, "train.mixed_precision=bf16", f"draft.lora={lora}")
    cand = distill_candidate(cfg, "draft", data, teacher=teacher, tokenizer=tokenizer)
    assert heads and heads[0] is not None  # the chunked path ran
    rows = metric_rows(cand)
    assert rows[-1]["step"] == 2 and all(math.isfinite(r.get("train/loss", 0.0)) for r in rows)


def test_a_launcher_config_that_overrides_grad_accum_is_refused(tmp_path, tiny, monkeypatch):
    """`accelerate launch` exports a config file's gradient_accumulation_steps, which accelerate would use instead of
    train.grad_accum (the loss is scaled for the latter)."""
    from specdistill.pipeline import distill_candidate

    teacher, tokenizer, data = tiny
    monkeypatch.setenv("ACCELERATE_GRADIENT_ACCUMULATION_STEPS", "3")
    with pytest.raises(ValueError, match=r"gradient_accumulation_steps=3 but train.grad_accum=1: remove"):
        distill_candidate(train_config(tmp_path), "draft", data, teacher=teacher, tokenizer=tokenizer)
    assert not (tmp_path / "candidates" / "draft" / "checkpoints").exists()


def test_epochs_mode_runs_whole_passes_over_the_data(tmp_path, tiny):
    from specdistill.pipeline import distill_candidate

    teacher, tokenizer, data = tiny  # 16 sequences, global batch 8: 2 steps per epoch
    cfg = train_config(
        tmp_path / "run", "train.max_steps=0", "train.epochs=2", "train.batch_size=8", "train.eval_every=9"
    )
    cand = distill_candidate(cfg, "draft", data, teacher=teacher, tokenizer=tokenizer)
    assert [r["train/epoch"] for r in metric_rows(cand) if "train/loss" in r] == [0.5, 1.0, 1.5, 2.0]
