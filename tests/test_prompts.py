"""Prompt sources: every file format, datasets folders, the builtin set and its splits, bad inputs, chat template."""

import csv
import hashlib
import json
import os
import random
import re
from collections import Counter

import pytest
from helpers.runs import TRUNCATED_PROMPT_FILES

from distill.prompt_roles import overlap_count, prompt_key
from distill.prompts import (
    ACCEPTED_FIELDS,
    BUILTIN_SPLITS,
    SELF_INSTRUCT,
    PromptRecord,
    concat_sources,
    interleave_categories,
    load_prompts,
    load_sources,
    render_chat,
    save_prompts,
    stratified_split,
)
from specdec_runtime.errors import UserError


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def user(text):
    return [{"role": "user", "content": text}]


# ---------------------------------------------------------------------------------------------------------------
# formats


def test_jsonl_prompt_field(tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", [{"id": "a", "prompt": "Hi there?", "category": "qa"}, {"prompt": "Bye."}])
    records = load_prompts(path)
    assert records[0] == PromptRecord(id="a", messages=user("Hi there?"), category="qa")
    assert records[1].messages == user("Bye.") and records[1].category == "general" and records[1].turns is None
    assert records[1].id.startswith("p-")  # content hash: stable when other prompts are added
    assert (
        load_prompts(write_jsonl(tmp_path / "q.jsonl", [{"prompt": "zzz"}, {"prompt": "Bye."}]))[1].id == records[1].id
    )


def test_json_messages_list_and_data_wrapper(tmp_path):
    chat = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "Blue."},
        {"role": "user", "content": "Another one?"},
        {"role": "assistant", "content": "Red."},  # a reply at the end is dropped: the teacher writes its own
    ]
    rows = [{"messages": chat, "id": 7}, {"messages": user("Solo turn")}]
    (tmp_path / "list.json").write_text(json.dumps(rows))
    (tmp_path / "wrapped.json").write_text(json.dumps({"data": rows}))
    for name in ("list.json", "wrapped.json"):
        records = load_prompts(tmp_path / name)
        assert [r.id for r in records][0] == "7"
        assert records[0].messages == chat[:4] and records[1].messages == user("Solo turn")


def test_csv_with_aliases_and_json_cells(tmp_path):
    path = tmp_path / "p.csv"
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=["id", "category", "prompt", "instruction", "input", "messages"])
        w.writeheader()
        w.writerow({"id": "c1", "category": "math", "prompt": "What is 2 + 2?"})
        w.writerow({"id": "c2", "instruction": "Translate to French.", "input": "Good morning."})
        w.writerow({"id": "c3", "messages": json.dumps(user("From a JSON cell"))})
    records = load_prompts(path)
    assert [r.id for r in records] == ["c1", "c2", "c3"]
    assert records[0].category == "math" and records[1].category == "general"
    assert records[1].messages == user("Translate to French.\n\nGood morning.")
    assert records[2].messages == user("From a JSON cell")


def test_parquet(tmp_path):
    import datasets

    rows = [
        {"question_id": 1, "category": "coding", "prompt": "Write a loop.", "messages": None},
        {"question_id": 2, "category": "chat", "prompt": None, "messages": user("Hello!")},
    ]
    datasets.Dataset.from_list(rows).to_parquet(str(tmp_path / "p.parquet"))
    records = load_prompts(tmp_path / "p.parquet")
    assert [(r.id, r.category, r.messages) for r in records] == [
        ("1", "coding", user("Write a loop.")),
        ("2", "chat", user("Hello!")),
    ]


def test_datasets_folders(tmp_path):
    import datasets

    train = datasets.Dataset.from_list([{"question": "Why is the sea salty?"}, {"question": "What is rain?"}])
    test = datasets.Dataset.from_list([{"question": "Who was Ada Lovelace?"}])
    train.save_to_disk(str(tmp_path / "single"))
    datasets.DatasetDict({"train": train, "test": test}).save_to_disk(str(tmp_path / "dict"))

    assert [r.messages for r in load_prompts(tmp_path / "single")] == [
        user("Why is the sea salty?"),
        user("What is rain?"),
    ]
    assert [r.messages for r in load_prompts(tmp_path / "dict", split="test")] == [user("Who was Ada Lovelace?")]
    with pytest.raises(ValueError, match=r"splits \['train', 'test'\]"):
        load_prompts(tmp_path / "dict")  # never guess which split to train on
    with pytest.raises(ValueError, match="single Dataset"):
        load_prompts(tmp_path / "single", split="test")
    (tmp_path / "plain").mkdir()
    with pytest.raises(ValueError, match="not a datasets folder"):
        load_prompts(tmp_path / "plain")


def test_specbench_turns(tmp_path):
    rows = [
        {"question_id": 81, "category": "writing", "turns": ["Write a travel blog post.", "Now rewrite it as a poem."]},
        {"question_id": 82, "category": "math", "turns": ["What is 3 * 4?"]},
    ]
    records = load_prompts(write_jsonl(tmp_path / "question.jsonl", rows))
    assert records[0].id == "81" and records[0].category == "writing"
    assert records[0].turns == ["Write a travel blog post.", "Now rewrite it as a poem."]
    assert records[0].messages == user("Write a travel blog post.")  # the first turn only
    assert records[1].turns == ["What is 3 * 4?"]


def test_save_prompts_round_trip(tmp_path):
    records = load_prompts("builtin:test") + [PromptRecord(id="t", messages=user("a"), turns=["a", "b"])]
    save_prompts(records, tmp_path / "data" / "test.jsonl")
    assert load_prompts(tmp_path / "data" / "test.jsonl") == records
    assert [p.name for p in (tmp_path / "data").iterdir()] == ["test.jsonl"]  # no temp file left beside it


def test_save_prompts_never_leaves_half_a_file(tmp_path, monkeypatch):
    path = tmp_path / "prompts.jsonl"
    save_prompts([PromptRecord(id="old", messages=user("the old prompt"))], path)
    real_fsync = os.fsync

    def crash(fd):  # dies after the new bytes are written, before they are renamed into place
        raise OSError("disk gone")

    monkeypatch.setattr(os, "fsync", crash)
    with pytest.raises(OSError, match="disk gone"):
        save_prompts([PromptRecord(id=f"n{i}", messages=user(f"new {i}")) for i in range(100)], path)
    monkeypatch.setattr(os, "fsync", real_fsync)
    assert [r.id for r in load_prompts(path)] == ["old"] and [p.name for p in tmp_path.iterdir()] == [path.name]


def test_repeated_ids_get_suffixed(tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", [{"id": "x", "prompt": "one"}, {"id": "x", "prompt": "two"}])
    with pytest.warns(UserWarning, match="1 records repeat an earlier id"):
        records = load_prompts(path)
    assert [r.id for r in records] == ["x", "x#2"]


def test_limit(tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": f"prompt {i}"} for i in range(5)])
    assert [r.messages[0]["content"] for r in load_prompts(path, limit=2)] == ["prompt 0", "prompt 1"]


# ---------------------------------------------------------------------------------------------------------------
# the builtin set


def test_builtin_set_is_large_varied_and_unique():
    records = load_prompts("builtin")
    counts = Counter(r.category for r in records)
    assert len(records) >= 300 and len(counts) >= 9
    assert sum(n >= 30 for n in counts.values()) >= 9
    assert 10 <= counts["multi_turn"] <= 20
    assert len({r.id for r in records}) == len(records)
    texts = [" ".join(json.dumps(r.messages).lower().split()) for r in records]
    assert len(set(texts)) == len(texts)
    for r in records:
        assert r.messages[-1]["role"] == "user" and r.messages[-1]["content"].strip()
        if r.category == "multi_turn":
            assert [m["role"] for m in r.messages][-3:] == ["user", "assistant", "user"]
        if r.category == "summarization":  # the instruction plus a 60-150 word passage
            assert 60 <= len(r.messages[0]["content"].split()) <= 170


def ids_digest(records):
    return hashlib.sha256(json.dumps([r.id for r in records]).encode()).hexdigest()[:12]


def test_builtin_splits_one_per_role_disjoint_fixed_and_complete():
    everything = load_prompts("builtin")
    splits = {name: load_prompts(f"builtin:{name}") for name in BUILTIN_SPLITS}
    assert all(load_prompts("builtin", split=name) == records for name, records in splits.items())
    keys = {name: {prompt_key(r) for r in records} for name, records in splits.items()}
    for a, b in (("train", "validation"), ("train", "test"), ("validation", "test")):
        assert not keys[a] & keys[b], (a, b)  # disjoint by content, not just by id
    assert sorted(r.id for records in splits.values() for r in records) == sorted(r.id for r in everything)
    # Fixed: the same ids in the same order in every version (train is the split every earlier version shipped).
    assert {name: (len(r), ids_digest(r)) for name, r in splits.items()} == {
        "train": (309, "14160fb319cd"),
        "validation": (16, "d3e715cec7ed"),
        "test": (60, "298bd542a2e9"),
    }
    # Every category in validation; six test prompts per category, so both halves of any sweep span them.
    categories = Counter(r.category for r in everything)
    assert set(Counter(r.category for r in splits["validation"])) == set(categories)
    assert Counter(r.category for r in splits["test"]) == {c: 6 for c in categories}


def contents_digest(records):
    return hashlib.sha256(json.dumps([[r.id, r.category, r.messages] for r in records]).encode()).hexdigest()[:12]


def test_builtin_set_and_splits_keep_their_contents_and_order():
    # builtin:long-input ships beside them, never inside: teacher data keyed on them and the eval prompts stay put.
    sources = ("builtin", "builtin:train", "builtin:validation", "builtin:test")
    assert {s: (len(records := load_prompts(s)), contents_digest(records)) for s in sources} == {
        "builtin": (385, "43c0f01d178a"),
        "builtin:train": (309, "f0e4956aa060"),
        "builtin:validation": (16, "a70c10276122"),
        "builtin:test": (60, "bda68b86de60"),
    }


LONG_INPUT_CATEGORIES = ("summarization", "qa", "translation", "math", "multi_turn")


def words(text):
    return len(text.split())


def test_builtin_long_input_is_varied_long_and_disjoint_from_every_shipped_prompt():
    records = load_prompts("builtin:long-input")
    assert Counter(r.category for r in records) == {c: 12 for c in LONG_INPUT_CATEGORIES}
    assert len({r.id for r in records}) == 60 and all(r.id.startswith("long-") for r in records)
    assert len({prompt_key(r) for r in records}) == 60
    for split in ("test", "validation", "train"):  # never a test or validation prompt, nor a repeat of train
        others = load_prompts(f"builtin:{split}")
        assert overlap_count(records, others) == 0 and not {r.id for r in records} & {r.id for r in others}, split
    assert load_prompts("builtin", split="long-input") == records
    languages = Counter()
    for r in records:
        text = "\n\n".join(m["content"] for m in r.messages)
        assert r.messages[-1]["role"] == "user" and words(text) <= 300, r.id  # ~384 SmolLM2 tokens (slow test)
        if r.category == "summarization":  # an instruction, then a 150-300 word passage
            assert 150 <= words(text.split("\n\n", 1)[1]) <= 300, r.id
        elif r.category in ("qa", "multi_turn"):
            assert words(text) >= 150, r.id
        elif r.category == "translation":
            languages.update(lang for lang in ("French", "German", "Spanish") if lang in r.messages[0]["content"])
            assert words(text.split("\n\n", 1)[1]) >= 100, r.id
        else:  # math: a word problem with a multi-sentence setup
            assert text.count(". ") >= 3 and re.search(r"\d", text), r.id
        if r.category == "multi_turn":  # earlier turns, ending with the user's
            roles = [m["role"] for m in r.messages]
            assert len(roles) >= 3 and roles == ["user", "assistant"] * (len(roles) // 2) + ["user"], r.id
        else:
            assert len(r.messages) == 1, r.id
    assert languages == {"French": 4, "German": 4, "Spanish": 4}


@pytest.mark.slow
def test_builtin_long_input_fits_the_data_stage_under_smollm2s_chat_template():
    from distill.config import DataConfig
    from specdec_runtime.loading import DEFAULT_TARGET, load_tokenizer

    tokenizer = load_tokenizer(DEFAULT_TARGET)
    lengths = sorted(len(render_chat(tokenizer, r.messages)) for r in load_prompts("builtin:long-input"))
    assert lengths[-1] <= DataConfig().max_prompt_tokens  # the data stage refuses longer prompts
    assert lengths[0] >= 128 and lengths[len(lengths) // 2] >= 250  # a few hundred tokens of context


def test_builtin_test_prompts_pair_categories_so_both_sweep_halves_span_them():
    test = [r.category for r in load_prompts("builtin:test")]
    for n in range(2, len(test) + 1, 2):  # eval.max_prompts = n; the sweep alternates selection / confirmation
        assert Counter(test[:n][0::2]) == Counter(test[:n][1::2]), n
    assert len(set(test[0:20:2])) == len(set(test)) == 10  # the first 20 hold every category in each half
    validation = [r.category for r in load_prompts("builtin:validation")]
    assert len(set(validation[:12])) == 7 and len(set(validation)) == 10  # quickstart validates on the first 12


def test_an_unknown_builtin_split_names_the_closest_and_every_valid_one():
    valid = r"Valid: 'builtin', builtin:train, builtin:validation, builtin:test, builtin:long-input$"
    with pytest.raises(ValueError, match=r"^unknown builtin split 'tset'\. Did you mean 'builtin:test'\? " + valid):
        load_prompts("builtin:tset")
    for source, split in (("builtin:eval", None), ("builtin", "eval")):  # the old name of validation + test: gone
        with pytest.raises(ValueError, match=r"^unknown builtin split 'eval'\. " + valid):
            load_prompts(source, split=split)


def test_interleave_categories_round_robin_in_runs():
    records = [
        PromptRecord(id=f"{c}{i}", messages=user(f"{c} {i}"), category=c)
        for c, i in [("a", 0), ("a", 1), ("a", 2), ("b", 0), ("c", 0), ("c", 1), ("c", 2), ("c", 3)]
    ]
    assert [r.id for r in interleave_categories(records)] == ["a0", "b0", "c0", "a1", "c1", "a2", "c2", "c3"]
    assert [r.id for r in interleave_categories(records, 2)] == ["a0", "a1", "b0", "c0", "c1", "a2", "c2", "c3"]
    assert sorted(interleave_categories(records, 2), key=lambda r: r.id) == sorted(records, key=lambda r: r.id)


# ---------------------------------------------------------------------------------------------------------------
# lists of sources (data.prompts)


def test_sources_concatenate_in_order_and_one_string_loads_as_before(tmp_path):
    a = str(write_jsonl(tmp_path / "a.jsonl", [{"id": "a0", "prompt": "first"}, {"id": "a1", "prompt": "second"}]))
    b = str(write_jsonl(tmp_path / "b.jsonl", [{"id": "b0", "prompt": "third"}]))
    assert load_sources(a) == [(a, load_prompts(a))]
    assert load_sources(SELF_INSTRUCT) == [(SELF_INSTRUCT, [])]  # written by the teacher at data time
    written = [PromptRecord(id="self_instruct-00000", messages=user("a prompt the teacher wrote"))]
    parts = load_sources([a, SELF_INSTRUCT, b], self_instruct=lambda: written)
    assert [source for source, _ in parts] == [a, SELF_INSTRUCT, b]
    assert [r.id for r in concat_sources(parts)] == ["a0", "a1", "self_instruct-00000", "b0"]
    assert concat_sources(load_sources([a, SELF_INSTRUCT, b])) == load_prompts(a) + load_prompts(b)


def test_sources_refuse_an_id_in_two_of_them_and_name_a_bad_one(tmp_path):
    a = str(write_jsonl(tmp_path / "a.jsonl", [{"id": "a0", "prompt": "first"}, {"id": "x", "prompt": "second"}]))
    b = str(write_jsonl(tmp_path / "b.jsonl", [{"id": "x", "prompt": "another prompt"}]))
    with pytest.raises(ValueError, match=rf"prompt id 'x' is in both {re.escape(a)} and {re.escape(b)}"):
        concat_sources(load_sources([a, b]))
    with pytest.raises(ValueError, match="prompt id 'writing-001' is in both builtin:train and builtin;"):
        concat_sources(load_sources(["builtin:train", "builtin"]))
    with pytest.raises(ValueError, match=r"^data.prompts\[1\] \(builtin:long_input\): unknown builtin split"):
        load_sources([a, "builtin:long_input"])
    with pytest.raises(UserError, match=r"^data.prompts\[0\] \(gone.jsonl\): prompt file not found"):
        load_sources(["gone.jsonl", a])
    with pytest.raises(UserError, match=r"^prompt file not found: gone.jsonl$"):  # one source: as before
        load_sources("gone.jsonl")


# ---------------------------------------------------------------------------------------------------------------
# stratified_split (the builtin set's splits)


def make_records(n, categories=("a", "b", "c"), prefix="r"):
    return [
        PromptRecord(id=f"{prefix}{i}", messages=user(f"q{i}"), category=categories[i % len(categories)])
        for i in range(n)
    ]


def test_split_is_stratified_and_ignores_input_order():
    records = make_records(300)
    rest, split_off = stratified_split(records, fraction=0.2, seed=3)
    assert len(split_off) == 60 and len(rest) == 240
    assert Counter(r.category for r in split_off) == {"a": 20, "b": 20, "c": 20}
    shuffled = records[:]
    random.Random(0).shuffle(shuffled)
    assert {r.id for r in stratified_split(shuffled, 0.2, seed=3)[1]} == {r.id for r in split_off}
    assert {r.id for r in stratified_split(records, 0.2, seed=4)[1]} != {r.id for r in split_off}
    assert [r.id for r in split_off] == sorted((r.id for r in split_off), key=lambda i: int(i[1:]))  # order kept


def test_adding_prompts_moves_only_boundary_records():
    old = make_records(300)
    old_split_off = {r.id for r in stratified_split(old, 0.1, seed=0)[1]}
    # a new category leaves every existing assignment alone
    assert {r.id for r in stratified_split(old + make_records(40, ("d",), "n"), 0.1, seed=0)[1]} >= old_split_off
    # growing a category moves at most its boundary records (a reshuffle would move ~54 of the 300)
    new_split_off = {r.id for r in stratified_split(old + make_records(40, ("a",), "n"), 0.1, seed=0)[1]}
    moved = {r.id for r in old} & (old_split_off ^ new_split_off)
    assert len(moved) <= 4 and {r.category for r in old if r.id in moved} <= {"a"}


def test_split_edge_cases():
    assert stratified_split(make_records(1), 0.5) == (make_records(1), [])
    # categories too small for one split-off record are pooled: 30 singletons still split ~10% off
    rest, split_off = stratified_split(make_records(30, categories=[str(i) for i in range(30)]), 0.1)
    assert len(split_off) == 3 and len(rest) == 27
    rest, split_off = stratified_split(make_records(5, categories=("a", "b", "c", "d", "e")), 0.1)
    assert len(split_off) == 1 and len(rest) == 4
    assert [len(part) for part in stratified_split(make_records(2, categories=("a",)), 0.9)] == [1, 1]  # rest kept
    assert stratified_split(make_records(10), 0.0)[1] == []
    with pytest.raises(ValueError, match=r"fraction must be in \[0, 1\)"):
        stratified_split(make_records(10), 1.0)


# ---------------------------------------------------------------------------------------------------------------
# bad inputs


def test_record_without_accepted_fields(tmp_path):
    path = write_jsonl(tmp_path / "bad.jsonl", [{"prompt": "fine"}, {"text": "no accepted field"}])
    with pytest.raises(ValueError) as e:
        load_prompts(path)
    msg = str(e.value)
    assert str(path) in msg and "record 1" in msg
    assert all(field in msg for field in ACCEPTED_FIELDS)


@pytest.mark.parametrize(
    ("rows", "match"),
    [
        ([{"prompt": "ok"}, {"prompt": "ok2"}, {"prompt": "   \n"}], r"record 2: empty prompt"),
        ([{"messages": [{"role": "assistant", "content": "Hi"}]}], r"record 0: 'messages' has no user turn"),
        ([{"messages": [{"role": "bot", "content": "Hi"}]}], r"record 0: message 0 must be"),
        ([{"turns": []}], r"record 0: 'turns' must be a non-empty list"),
        ([{"prompt": 3}], r"record 0: field 'prompt' must be a string"),
        (["just a string"], r"record 0 is a str"),
    ],
)
def test_bad_records_name_the_index(tmp_path, rows, match):
    with pytest.raises(ValueError, match=match):
        load_prompts(write_jsonl(tmp_path / "bad.jsonl", rows))


def test_missing_empty_and_malformed_files(tmp_path):
    with pytest.raises(UserError, match="prompt file not found: .*nope.jsonl"):
        load_prompts(tmp_path / "nope.jsonl")
    with pytest.raises(UserError):
        load_prompts("./no/such/folder")
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(ValueError, match="has no prompts"):
        load_prompts(tmp_path / "empty.jsonl")
    (tmp_path / "empty.json").write_text("[]")
    with pytest.raises(ValueError, match="has no prompts"):
        load_prompts(tmp_path / "empty.json")
    (tmp_path / "broken.jsonl").write_text('{"prompt": "a"}\n{"prompt": \n')
    with pytest.raises(ValueError, match="line 2 is not valid JSON"):
        load_prompts(tmp_path / "broken.jsonl")
    (tmp_path / "p.txt").write_text("hello")
    with pytest.raises(ValueError, match="unsupported prompt file type '.txt'"):
        load_prompts(tmp_path / "p.txt")
    with pytest.raises(ValueError, match="applies to datasets folders"):
        load_prompts(write_jsonl(tmp_path / "p.jsonl", [{"prompt": "a"}]), split="train")


LATIN1 = "café".encode("latin-1")
NOT_UTF8 = " is not UTF-8 text (byte 0xe9 at offset {}); save it as UTF-8"


@pytest.mark.parametrize(
    ("name", "data", "says"),
    [
        (
            "latin1.jsonl",
            b'{"prompt": "' + LATIN1 + b'"}\n',
            NOT_UTF8.format(15),
        ),
        (
            "latin1.json",
            b'[{"prompt": "' + LATIN1 + b'"}]',
            NOT_UTF8.format(16),
        ),
        ("latin1.csv", b"prompt\n" + LATIN1 + b"\n", NOT_UTF8.format(10)),
        *TRUNCATED_PROMPT_FILES,
    ],
)
def test_undecodable_and_truncated_files_are_named_with_the_fix(tmp_path, name, data, says):
    """Issue 24: a non-UTF-8 or cut-off prompt file gave a UnicodeDecodeError or a JSON error without the file."""
    path = tmp_path / name
    path.write_bytes(data)
    with pytest.raises(UserError) as e:
        load_prompts(path)
    assert str(e.value).startswith(str(path) + says), str(e.value)


def test_a_truncated_parquet_file_is_named(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "prompts.parquet"
    pq.write_table(pa.table({"prompt": [f"prompt {i}" for i in range(50)]}), path)
    path.write_bytes(path.read_bytes()[:100])
    with pytest.raises(UserError, match=rf"^{re.escape(str(path))} is not a readable parquet file .*; write it again$"):
        load_prompts(path)


def test_hub_id_without_network_fails_with_one_line(monkeypatch):
    import datasets
    import huggingface_hub

    # Both libraries read HF_HUB_OFFLINE at import time, so patch their copies too: the test must never hang.
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(UserError) as e:
        load_prompts("specdistill-test/no-such-prompts")
    assert str(e.value) == (
        "no network access to the Hugging Face hub for dataset 'specdistill-test/no-such-prompts'; pass a local "
        "file or folder (JSONL/JSON/CSV/parquet/datasets folder) or 'builtin'"
    )
    assert e.value.__cause__ is None and (e.value.__context__ is None or e.value.__suppress_context__)


# ---------------------------------------------------------------------------------------------------------------
# render_chat

TEMPLATE = (
    "{% for m in messages %}<|{{ m.role }}|> {{ m.content }} <|end|> {% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


@pytest.fixture
def word_tokenizer():
    """A whitespace word-level tokenizer built in code (no hub), so expected ids can be written by hand."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit
    from transformers import PreTrainedTokenizerFast

    words = ["[UNK]", "<|user|>", "<|assistant|>", "<|system|>", "<|end|>", "User:", "Assistant:", "hello", "there"]
    backend = Tokenizer(WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    backend.pre_tokenizer = WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]")


def test_render_chat_applies_template_with_generation_prompt(word_tokenizer, monkeypatch):
    word_tokenizer.chat_template = TEMPLATE
    chat = [{"role": "system", "content": "hello"}, {"role": "user", "content": "hello there"}]
    assert render_chat(word_tokenizer, chat) == [3, 7, 4, 1, 7, 8, 4, 2]
    with pytest.raises(ValueError, match="end with a user turn"):
        render_chat(word_tokenizer, chat + [{"role": "assistant", "content": "hello"}])
    # transformers 4.x returned a plain list of ids instead of a BatchEncoding
    monkeypatch.setattr(word_tokenizer, "apply_chat_template", lambda *a, **k: [5, 6])
    assert render_chat(word_tokenizer, chat) == [5, 6]


def test_render_chat_without_template(word_tokenizer):
    assert word_tokenizer.chat_template is None
    with pytest.raises(ValueError, match="has no chat template.*plain_fallback=True"):
        render_chat(word_tokenizer, user("hello there"))
    assert render_chat(word_tokenizer, user("hello there"), plain_fallback=True) == [5, 7, 8, 6]
