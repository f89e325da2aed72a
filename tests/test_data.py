"""Teacher data: the on-disk contract, caching, kill + resume, the offline top-k cache, rank splits, bad inputs."""

import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow.compute as pc
import pytest
import torch

import distill.data as data
from distill.config import DataConfig
from distill.data import (
    fingerprint,
    generate_teacher_data,
    load_teacher_data,
    shards_for_rank,
    topk_from_logits,
)
from distill.prompt_roles import training_prompts, validation_prompts
from distill.prompts import load_prompts, render_chat
from specdec_runtime.loading import load_model

TEACHER_ID = "random:tiny-llama"
TOPICS = ("the moon", "bread", "a bicycle", "rain", "chess", "a violin", "tea", "a glacier", "owls", "maps")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """random:tiny-llama (teacher, tokenizer), built once into a private SPECDISTILL_CACHE for the whole module."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SPECDISTILL_CACHE", str(tmp_path_factory.mktemp("cache")))
        yield load_model(TEACHER_ID, device="cpu")


def write_prompts(path: Path, n: int, prefix: str = "p") -> Path:
    rows = [
        {
            "id": f"{prefix}{i}",
            "category": ("qa", "writing")[i % 2],
            "prompt": f"{'Tell me about' if prefix == 'p' else 'What is'} {TOPICS[i % 10]}" + "!" * i,
        }
        for i in range(n)
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def make_cfg(tmp_path: Path, n_train: int = 10, n_eval: int = 2, **overrides) -> DataConfig:
    cfg = DataConfig(
        prompts=str(write_prompts(tmp_path / "train.jsonl", n_train)),
        validation_prompts=str(write_prompts(tmp_path / "eval.jsonl", n_eval, prefix="e")),
        max_new_tokens=8,
        batch_size=4,
        shard_size=4,
        temperature=0.7,
        top_p=0.95,
    )
    return dataclasses.replace(cfg, **overrides)


def run(tiny, cfg: DataConfig, out: Path, **kwargs) -> data.TeacherData:
    teacher, tokenizer = tiny
    return generate_teacher_data(teacher, tokenizer, cfg, out, teacher_id=TEACHER_ID, seed=3, **kwargs)


def count_engine_calls(monkeypatch) -> list:
    calls = []
    real = data.generate

    def counted(*args, **kwargs):
        calls.append(len(args[2]))
        return real(*args, **kwargs)

    monkeypatch.setattr(data, "generate", counted)
    return calls


# ----------------------------------------------------------------------------------------------------------------
# format and caching


def test_generation_writes_the_contract_format(tiny, tmp_path, monkeypatch):
    teacher, tokenizer = tiny
    # Twenty extra stop tokens (~8% of the vocabulary) so that some rows stop early and others run to the limit.
    stops = [tokenizer.eos_token_id, *range(20)]
    monkeypatch.setattr(teacher.generation_config, "eos_token_id", stops)
    cfg = make_cfg(tmp_path, n_train=10, num_samples=2)
    out = run(tiny, cfg, tmp_path / "data")

    assert out.train.parent == tmp_path / "data" and out.train.name.startswith("teacher-")
    assert out.validation.name.startswith("teacher-eval-")
    assert (out.train / ".complete").is_file() and not (out.train / "shards").exists()
    ds = load_teacher_data(out.train)
    schema = ds.data.schema
    assert schema.names == ["id", "category", "input_ids", "prompt_len"]
    assert str(schema.field("input_ids").type) == "list<item: int32>"
    assert str(schema.field("prompt_len").type) == "int32"

    records = load_prompts(cfg.prompts)
    assert ds["id"] == [f"{r.id}#{s}" for r in records for s in range(2)]
    lengths = []
    for row, (record, _) in zip(ds, [(r, s) for r in records for s in range(2)]):
        prompt = render_chat(tokenizer, record.messages)
        assert row["category"] == record.category
        assert row["prompt_len"] == len(prompt) and row["input_ids"][: len(prompt)] == prompt
        response = row["input_ids"][len(prompt) :]
        assert 1 <= len(response) <= cfg.max_new_tokens
        assert not set(response[:-1]) & set(stops)  # generation stops at the first stop token
        if len(response) < cfg.max_new_tokens:
            assert response[-1] in stops
        lengths.append(len(response))
    assert min(lengths) < cfg.max_new_tokens and max(lengths) == cfg.max_new_tokens  # both endings exercised
    assert load_teacher_data(out.validation)["id"] == [f"e{i}#{s}" for i in range(2) for s in range(2)]  # same format


def test_second_call_is_a_cache_hit(tiny, tmp_path, monkeypatch):
    cfg = make_cfg(tmp_path, n_train=6)
    first = run(tiny, cfg, tmp_path / "data")
    calls = count_engine_calls(monkeypatch)
    assert run(tiny, cfg, tmp_path / "data") == first
    assert calls == []


def test_single_source_teacher_data_keeps_its_fingerprint(tiny, tmp_path, monkeypatch):
    # Pinned before data.prompts took lists: data written by earlier versions is found again, never regenerated.
    cfg = make_cfg(tmp_path, n_train=4)
    out = run(tiny, cfg, tmp_path / "data")
    assert (out.train.name, out.validation.name) == ("teacher-debff41e4e9d", "teacher-eval-367fc4802285")
    calls = count_engine_calls(monkeypatch)
    assert run(tiny, dataclasses.replace(cfg, prompts=[cfg.prompts]), tmp_path / "data") == out and calls == []
    # The defaults' keys (builtin:train, builtin:validation) with this teacher's tokenizer, pinned the same way.
    _, tokenizer = tiny
    keys = {}
    for split, records in (
        ("teacher", training_prompts(DataConfig())),
        ("teacher-eval", validation_prompts(DataConfig())),
    ):
        ids = [render_chat(tokenizer, r.messages) for r in records]
        keys[split] = fingerprint(split, records, ids, DataConfig(), TEACHER_ID, "torch.float32", 0, [258])
    assert keys == {"teacher": "b8140b80eafc", "teacher-eval": "f2af773382ae"}


def test_fingerprint_changes_with_every_setting_and_nothing_else(tiny, tmp_path):
    _, tokenizer = tiny
    cfg = make_cfg(tmp_path, n_train=4)
    records = load_prompts(cfg.prompts)
    ids = [render_chat(tokenizer, r.messages) for r in records]

    def fp(cfg=cfg, records=records, ids=ids, teacher_id=TEACHER_ID, dtype="torch.float32", seed=0, stops=(258,)):
        return fingerprint("teacher", records, ids, cfg, teacher_id, dtype, seed, list(stops))

    base = fp()
    assert fp(cfg=dataclasses.replace(cfg)) == base
    unrelated = dict(
        max_prompt_tokens=999,
        max_validation_prompts=3,
        validation_prompts="builtin:validation",
        teacher_cache_top_k=8,
        shard_size=2,  # shards are runs of whole batches: the tokens do not depend on them
    )
    for name, value in unrelated.items():  # top-k only matters with the cache on
        assert fp(cfg=dataclasses.replace(cfg, **{name: value})) == base, name
    changed = dict(
        temperature=0.5,
        top_k=5,
        top_p=0.9,
        num_samples=2,
        max_new_tokens=9,
        batch_size=2,
        teacher_cache=True,
    )
    seen = {base}
    for name, value in changed.items():
        seen.add(fp(cfg=dataclasses.replace(cfg, **{name: value})))
    on = dataclasses.replace(cfg, teacher_cache=True)
    seen.add(fp(cfg=dataclasses.replace(on, teacher_cache_top_k=8)))
    seen |= {fp(teacher_id="other"), fp(dtype="torch.bfloat16"), fp(seed=1), fp(stops=(258, 3))}
    edited = [dataclasses.replace(records[0], messages=[{"role": "user", "content": "changed"}]), *records[1:]]
    seen |= {fp(records=edited), fp(records=records[:3], ids=ids[:3]), fp(ids=[i + [5] for i in ids])}
    assert len(seen) == 1 + len(changed) + 1 + 4 + 3


# ----------------------------------------------------------------------------------------------------------------
# kill + resume

KILLED_RUN = """
import json, sys, time
from pathlib import Path
from distill.config import DataConfig
from distill.data import generate_teacher_data
from specdec_runtime.loading import load_model
teacher, tokenizer = load_model("random:tiny-llama", device="cpu")
teacher.register_forward_pre_hook(lambda *args: time.sleep(0.1))  # slow enough to be killed between shards
cfg = DataConfig(**json.loads(sys.argv[1]))
generate_teacher_data(teacher, tokenizer, cfg, Path(sys.argv[2]), teacher_id="random:tiny-llama", seed=3)
"""


@pytest.mark.slow
def test_killed_run_resumes_without_loss_or_duplicates(tiny, tmp_path, monkeypatch):
    cfg = make_cfg(tmp_path, n_train=10, batch_size=2, shard_size=2, teacher_cache=True, teacher_cache_top_k=4)
    killed = tmp_path / "killed"
    proc = subprocess.Popen(
        [sys.executable, "-c", KILLED_RUN, json.dumps(dataclasses.asdict(cfg)), str(killed)],
        env=os.environ,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        deadline = time.monotonic() + 120
        while not list(killed.glob("teacher-*/shards/shard-*")):
            assert proc.poll() is None, proc.stderr.read().decode()
            assert time.monotonic() < deadline, "the subprocess wrote no shard in 120 s"
            time.sleep(0.02)
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()
    (root,) = killed.glob("teacher-*")
    done = sorted(p.name for p in (root / "shards").glob("shard-*"))
    assert 1 <= len(done) < 5 and not (root / ".complete").exists()

    calls = count_engine_calls(monkeypatch)
    resumed = run(tiny, cfg, killed)
    assert resumed.train == root
    assert len(calls) == 5 - len(done) + 1  # the missing train shards (one batch each) and the eval split
    monkeypatch.undo()
    reference = run(tiny, cfg, tmp_path / "uninterrupted")

    rows = load_teacher_data(resumed.train).to_list()
    assert sorted(r["id"] for r in rows) == sorted(f"p{i}#0" for i in range(10))
    assert rows == load_teacher_data(reference.train).to_list()  # token for token, cache columns included


# ----------------------------------------------------------------------------------------------------------------
# offline teacher cache


def test_topk_from_logits_matches_log_softmax():
    torch.manual_seed(0)
    logits = torch.randn(2, 3, 50) * 4  # (B, T, V)
    logprobs, ids = topk_from_logits(logits, 5)
    assert logprobs.shape == ids.shape == (2, 3, 5)
    assert logprobs.dtype == torch.float16 and ids.dtype == torch.int32
    full = torch.log_softmax(logits, -1)
    torch.testing.assert_close(logprobs.float(), full.topk(5, -1).values, atol=2e-3, rtol=1e-3)
    assert torch.equal(ids.long(), full.topk(5, -1).indices)


def cache_stats(path: Path) -> dict:
    """Size of the offline teacher cache at `path`: {"tokens", "bytes_per_token", "top_k"}, the raw payload of both
    top-k columns counted from the Arrow buffers, independently of the summary the data stage prints."""
    table = load_teacher_data(path).data
    tokens = pc.sum(pc.list_value_length(table.column("topk_ids"))).as_py() or 0
    payload = 0
    for name in ("topk_ids", "topk_logprobs"):
        values = pc.list_flatten(pc.list_flatten(table.column(name)))
        payload += len(values) * values.type.byte_width
    top_k = table.schema.field("topk_ids").type.value_type.list_size
    return {"tokens": tokens, "bytes_per_token": payload / max(tokens, 1), "top_k": top_k}


def test_teacher_cache_holds_the_teachers_top_k(tiny, tmp_path, capsys):
    teacher, _ = tiny
    cfg = make_cfg(tmp_path, n_train=6, teacher_cache=True, teacher_cache_top_k=32)
    out = run(tiny, cfg, tmp_path / "data")
    assert "offline teacher cache 192 bytes/token" in capsys.readouterr().out  # 32 x (int32 id + float16 logprob)
    ds = load_teacher_data(out.train)
    assert str(ds.data.schema.field("topk_ids").type) == "list<item: fixed_size_list<item: int32>[32]>"
    assert str(ds.data.schema.field("topk_logprobs").type) == "list<item: fixed_size_list<item: halffloat>[32]>"
    tokens = 0
    for row in ds.with_format("torch"):
        x, p = row["input_ids"], int(row["prompt_len"])
        logprobs, ids = row["topk_logprobs"].float(), row["topk_ids"]  # (R, K)
        assert logprobs.shape == ids.shape == (len(x) - p, 32)
        assert (logprobs <= 0).all() and (logprobs.exp().sum(-1) <= 1 + 1e-3).all()
        with torch.inference_mode():
            fresh = torch.log_softmax(teacher(input_ids=x[None].long()).logits[0, p - 1 : -1].float(), -1)  # (R, V)
        assert torch.equal(ids[:, 0].long(), fresh.argmax(-1))
        torch.testing.assert_close(logprobs, fresh.gather(-1, ids.long()), atol=1e-2, rtol=1e-2)
        tokens += len(x) - p
    assert load_teacher_data(out.validation).column_names == ds.column_names
    stats = cache_stats(out.train)
    assert stats == {"tokens": tokens, "bytes_per_token": 32 * (4 + 2), "top_k": 32}
    assert stats["bytes_per_token"] <= 256


# ----------------------------------------------------------------------------------------------------------------
# multi-process split


@pytest.mark.parametrize("num_shards", [1, 5, 8])
@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_rank_split_covers_every_shard_once(num_shards, world_size):
    owned = [i for rank in range(world_size) for i in shards_for_rank(num_shards, rank, world_size)]
    assert sorted(owned) == list(range(num_shards))
    assert all(
        i % world_size == rank for rank in range(world_size) for i in shards_for_rank(num_shards, rank, world_size)
    )


def test_two_ranks_write_their_own_shards_and_rank_0_merges(tiny, tmp_path):
    cfg = make_cfg(tmp_path, n_train=7, n_eval=1, shard_size=2, batch_size=2, max_new_tokens=4)  # 4 train shards
    out = tmp_path / "data"
    with pytest.raises(RuntimeError, match="shard-00001, shard-00003 missing"):
        run(tiny, cfg, out, rank=0, world_size=2)  # rank 1 has not written its shards yet
    run(tiny, cfg, out, rank=1, world_size=2)
    (root,) = out.glob("teacher-????????????")
    assert sorted(p.name for p in (root / "shards").iterdir()) == [f"shard-{i:05d}" for i in range(4)]
    merged = run(tiny, cfg, out, rank=0, world_size=2)
    single = run(tiny, cfg, tmp_path / "single")
    assert load_teacher_data(merged.train).to_list() == load_teacher_data(single.train).to_list()
    assert load_teacher_data(merged.validation).to_list() == load_teacher_data(single.validation).to_list()


def test_damaged_teacher_data_is_detected_said_and_regenerated(tiny, tmp_path, capsys):
    """A truncated merged .arrow is not "cached"; a shard truncated or bit-flipped since an interrupted run is not
    "done": each is named, generated again, and the result equals an undamaged run's."""
    cfg = make_cfg(tmp_path, n_train=5, n_eval=1, shard_size=2, batch_size=2, max_new_tokens=4)  # 3 train shards
    want = load_teacher_data(run(tiny, cfg, tmp_path / "reference").train).to_list()
    out = tmp_path / "data"
    root = run(tiny, cfg, out).train
    (arrow,) = root.glob("*.arrow")
    arrow.write_bytes(arrow.read_bytes()[:-100])
    capsys.readouterr()
    again = run(tiny, cfg, out)
    said = capsys.readouterr().out
    assert f"the cached data in {root} is damaged ({arrow.name} has" in said and "generating it again" in said, said
    assert load_teacher_data(again.train).to_list() == want

    # An interrupted run leaves shards; one is truncated, one has a flipped byte, one is whole.
    shutil.rmtree(root)
    with pytest.MonkeyPatch.context() as mp:
        real = data._merge
        mp.setattr(data, "_merge", lambda *a, **k: (_ for _ in ()).throw(KeyboardInterrupt))
        with pytest.raises(KeyboardInterrupt):
            run(tiny, cfg, out)
        mp.setattr(data, "_merge", real)
    shards = sorted((root / "shards").iterdir())
    assert [p.name for p in shards] == ["shard-00000", "shard-00001", "shard-00002"]
    (cut,) = shards[0].glob("*.arrow")
    cut.write_bytes(cut.read_bytes()[:-50])
    (flip,) = shards[1].glob("*.arrow")
    raw = bytearray(flip.read_bytes())
    raw[-60] ^= 0xFF
    flip.write_bytes(bytes(raw))
    capsys.readouterr()
    again = run(tiny, cfg, out)
    said = capsys.readouterr().out
    assert f"shard shard-00000 is damaged or stale ({cut.name} has" in said, said
    assert f"shard shard-00001 is damaged or stale ({flip.name}'s checksum differs" in said, said
    assert "shard-00002" not in said
    assert load_teacher_data(again.train).to_list() == want


# ----------------------------------------------------------------------------------------------------------------
# self-instruct and bad inputs


def test_self_instruct_prompts_are_written_once_and_reused(tiny, tmp_path, monkeypatch):
    cfg = make_cfg(tmp_path, prompts="self_instruct", self_instruct_count=2, max_new_tokens=16, batch_size=2)
    out = run(tiny, cfg, tmp_path / "data")
    (prompts_file,) = (tmp_path / "data").glob("self_instruct-*.jsonl")
    records = load_prompts(prompts_file)
    assert 1 <= len(records) <= 2
    assert load_teacher_data(out.train)["id"] == [f"{r.id}#0" for r in records]
    calls = count_engine_calls(monkeypatch)
    assert run(tiny, cfg, tmp_path / "data") == out and calls == []


def test_a_list_of_sources_is_answered_in_order_and_max_prompts_cuts_the_whole(tiny, tmp_path):
    other = tmp_path / "other.jsonl"
    other.write_text("".join(json.dumps({"id": f"q{i}", "prompt": f"Name a {w}"}) + "\n" for i, w in enumerate("AB")))
    cfg = make_cfg(tmp_path, n_train=3, self_instruct_count=2, max_new_tokens=16, batch_size=2)
    cfg = dataclasses.replace(cfg, prompts=[cfg.prompts, "self_instruct", str(other)])
    out = run(tiny, cfg, tmp_path / "data")
    (prompts_file,) = (tmp_path / "data").glob("self_instruct-*.jsonl")  # the teacher's part, written as before
    written = [r.id for r in load_prompts(prompts_file)]
    assert load_teacher_data(out.train)["id"] == [f"{i}#0" for i in ["p0", "p1", "p2", *written, "q0", "q1"]]
    cut = dataclasses.replace(cfg, max_prompts=4)
    assert load_teacher_data(run(tiny, cut, tmp_path / "data").train)["id"] == [
        "p0#0",
        "p1#0",
        "p2#0",
        f"{written[0]}#0",
    ]
    # Before data time the teacher's part is unknown: the other sources count as if it were empty.
    assert [r.id for r in training_prompts(cut)] == ["p0", "p1", "p2", "q0"]


def test_prompts_key_takes_a_list_and_names_a_bad_entry():
    from specdistill.config import ConfigError, load_config

    sources = ["builtin:train", "builtin:long-input", "self_instruct"]
    assert (
        load_config(None, ["data.prompts=[builtin:train, builtin:long-input, self_instruct]"]).data.prompts == sources
    )
    assert load_config(None, ["data.prompts=builtin:train"]).data.prompts == "builtin:train"
    for override, match in (
        ("data.prompts=[]", "prompts is an empty list"),
        ("data.prompts=[builtin:train, '  ']", r"prompts\[1\] must be a prompt source .*got '  '"),
        (
            "data.prompts=[self_instruct, a.jsonl, self_instruct]",
            r"'self_instruct' twice \(prompts\[0\] and prompts\[2\]\)",
        ),
    ):
        with pytest.raises(ConfigError, match=match):
            load_config(None, [override])


def test_empty_prompt_set_is_refused(tiny, tmp_path):
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(ValueError, match="no prompts"):
        run(tiny, make_cfg(tmp_path, prompts=str(tmp_path / "empty.jsonl")), tmp_path / "data")


@pytest.mark.parametrize("field", ["prompts", "validation_prompts"])
def test_long_prompt_is_refused_by_id(tiny, tmp_path, field):
    path = tmp_path / "long.jsonl"
    rows = [{"id": "short-1", "prompt": "Hi?"}, {"id": "long-7", "prompt": "word " * 100}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(ValueError, match=r"prompt 'long-7' has \d+ tokens .*max_prompt_tokens=64"):
        run(tiny, make_cfg(tmp_path, max_prompt_tokens=64, **{field: str(path)}), tmp_path / "data")
    assert not (tmp_path / "data").exists()  # refused before anything is generated


def test_answers_that_would_overrun_the_teachers_context_are_refused_up_front(tiny, tmp_path):
    teacher, _ = tiny
    context = teacher.config.max_position_embeddings
    with pytest.raises(ValueError, match=rf"exceeds the teacher's context of {context} tokens"):
        run(tiny, make_cfg(tmp_path, max_new_tokens=context), tmp_path / "data")
    assert not (tmp_path / "data").exists()


def test_unfinished_folder_is_refused(tmp_path):
    (tmp_path / "teacher-abc" / "shards").mkdir(parents=True)
    with pytest.raises(ValueError, match="not a finished teacher dataset"):
        load_teacher_data(tmp_path / "teacher-abc")


def test_training_prompts_that_are_validation_prompts_are_dropped(tiny, tmp_path, capsys):
    # Training prompts p0 and p1 become the validation prompts e0 and e1, p1 with other case and spacing: the same
    # prompt under another id. Both are dropped.
    cfg = make_cfg(tmp_path, n_train=6, n_eval=2)
    rows = [json.loads(line) for line in Path(cfg.prompts).read_text().splitlines()]
    rows[0]["prompt"] = f"What is {TOPICS[0]}"
    rows[1]["prompt"] = f"  what IS   {TOPICS[1]}!"
    Path(cfg.prompts).write_text("".join(json.dumps(r) + "\n" for r in rows))
    result = run(tiny, cfg, tmp_path / "data")
    assert "dropped 2 of 6 training prompts that are also validation prompts" in capsys.readouterr().out
    trained = {row_id.split("#")[0] for row_id in load_teacher_data(result.train)["id"]}
    assert trained == {"p2", "p3", "p4", "p5"}


def test_training_on_the_validation_prompts_only_is_refused(tiny, tmp_path):
    cfg = make_cfg(tmp_path, n_eval=3)
    with pytest.raises(ValueError, match="every training prompt is also a validation prompt"):
        run(tiny, dataclasses.replace(cfg, prompts=cfg.validation_prompts), tmp_path / "data")
    assert not (tmp_path / "data").exists()


def test_the_top_k_cache_is_scored_a_few_rows_at_a_time_with_the_same_arrays(monkeypatch):
    """`_teacher_topk` bounds its peak memory by scoring SCORE_ROWS rows per forward; the per-row arrays are those of
    one forward over every row (right padding to another length changes no logit a row keeps)."""
    from helpers.models import tiny_llama

    teacher = tiny_llama(seed=3, layers=3)
    gen = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, 64, (int(n),), generator=gen).tolist() for n in torch.randint(6, 20, (11,), generator=gen)]
    prompt_lens = [max(2, len(s) // 2 - i % 3) for i, s in enumerate(seqs)]
    monkeypatch.setattr(data, "SCORE_ROWS", 4)
    chunked = data._teacher_topk(teacher, seqs, prompt_lens, 5, [1, 2, 2])
    whole = data._score_rows(teacher, seqs, prompt_lens, 5, [1, 2, 2])
    for got, want in zip(chunked, whole):
        assert len(got) == len(want) == len(seqs)
        for g, w in zip(got, want):
            assert g.shape == w.shape
            np.testing.assert_allclose(g.astype(np.float32), w.astype(np.float32), atol=2e-3)
