"""Prompt sources: files, `datasets` folders, the HF hub, the shipped sets, or prompts the teacher writes itself.

Every source becomes a list of `PromptRecord`s (chat messages ending with a user turn), which the data stage renders
with the teacher's chat template (`render_chat`) and answers. Accepted sources:

    load_prompts("prompts.jsonl")          # also .json ([...] or {"data": [...]}), .csv, .parquet
    load_prompts("my_prompts_dataset/")    # saved with datasets' save_to_disk (a DatasetDict needs split=...)
    load_prompts("builtin")                # every shipped prompt; builtin:train / :validation / :test are its splits
    load_prompts("builtin:long-input")     # shipped long-input tasks, for training only (not part of "builtin")
    load_prompts("owner/name", split="test")   # HF hub dataset (needs network or a warm datasets cache)

`data.prompts` is one source or a list of them, concatenated in order (`load_sources`, `concat_sources`), where
`self_instruct` stands for the prompts the teacher writes at data time (distill/self_instruct.py, distill/data.py):

    concat_sources(load_sources(["builtin:train", "builtin:long-input"]))   # ids must be unique across sources

Record fields: `prompt`, `messages` ({role, content} list), or `turns` (Spec-Bench / MT-bench user turns), with
`instruction` (+ `input`) and `question` as aliases of `prompt`; `question_id` / `id` and `category` are kept.

The shipped set (distill/prompt_files/) has three fixed, disjoint splits, one per prompt role (DESIGN.md "Metric
definitions"; distill/prompt_roles.py keeps a run's roles apart): `builtin:train` (distillation), `builtin:validation`
(checkpoint selection, `best/`) and `builtin:test` (the eval sweep and the promotion's confirmation). The train split
is the one every earlier version shipped (90 % of specdistill_prompts.jsonl by category); the other 10 % is halved by
category into validation and test (`stratified_split`), and the test split adds the prompts of
specdistill_test_prompts.jsonl, written for it, so that every category has six test prompts. The validation and test
splits come ordered round-robin over categories, two prompts at a time (`interleave_categories`), so the first N
prompts span the categories.

`builtin:long-input` (specdistill_long_input_prompts.jsonl, 60 prompts) holds tasks with a few hundred tokens of
given context, all under 384 tokens after SmolLM2's chat template (data.max_prompt_tokens): summaries of a given
passage, questions over a passage, paragraphs to translate, multi-sentence math word problems and multi-turn chats.
It is disjoint from every other shipped prompt and is no split of `builtin`, whose contents and order stay fixed.

This is where prompt sources are read: a missing, unreadable, non-UTF-8, truncated or malformed source raises
`UserError` naming the file (and the record), so the CLI prints one line.
"""

import csv
import difflib
import hashlib
import io
import json
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any

from specdec_runtime.atomic import write_text
from specdec_runtime.errors import UserError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

ACCEPTED_FIELDS = ("prompt", "messages", "turns", "instruction", "question")
FILE_SUFFIXES = (".jsonl", ".json", ".csv", ".parquet")
ROLES = ("system", "user", "assistant")
BUILTIN_SPLITS = ("train", "validation", "test")
BUILTIN_TRAINING_SETS = {"long-input": "specdistill_long_input_prompts.jsonl"}  # training-only, outside "builtin"
SELF_INSTRUCT = "self_instruct"  # the data.prompts source the teacher writes at data time
BUILTIN_FILES = "prompt_files"  # the shipped prompt files: a data folder of the distill package
BUILTIN_VALIDATION_TEST_FRACTION = 0.1  # of specdistill_prompts.jsonl; the rest is builtin:train, as in every version
BUILTIN_SEED = 0
BUILTIN_TEST_SEED = 1  # halves the validation + test part into validation and test


@dataclass
class PromptRecord:
    """One prompt: the chat the teacher (or, at eval time, the target) answers."""

    id: str
    """Stable id: the source's `question_id` / `id`, else a hash of the content; splits hash it."""
    messages: list[dict]
    """Chat messages ({role, content}) ending with a user turn; for `turns` records only the first turn."""
    category: str = "general"
    """Category for stratified splits and per-category reports."""
    turns: list[str] | None = None
    """Every user turn of a Spec-Bench / MT-bench record, answered one after another at eval; None otherwise."""


# ---------------------------------------------------------------------------------------------------------------
# loading


def load_prompts(source: str | Path, *, split: str | None = None, limit: int | None = None) -> list[PromptRecord]:
    """Load prompts from a file, a `datasets` folder, 'builtin[:train|:validation|:test]' or a hub dataset id.

    `split` picks a split of a DatasetDict folder or hub dataset, or 'train' / 'validation' / 'test' of the builtin
    set; `limit` keeps the first N records.
    """
    source = str(source)
    if limit is not None and limit < 1:
        raise ValueError(f"limit must be >= 1, got {limit}")
    if source == "builtin" or source.startswith("builtin:"):
        records = _load_builtin(source.partition(":")[2] or None, split)
    else:
        path = Path(source).expanduser()
        if path.is_dir():
            rows = _read_datasets_folder(path, split)
        elif path.is_file():
            if split is not None:
                raise UserError(
                    f"split={split!r} applies to datasets folders, hub ids and 'builtin'; {source} is a file"
                )
            rows = _read_file(path)
        elif _looks_like_path(source):
            raise UserError(f"prompt file not found: {source}")
        else:
            rows = _read_hub(source, split)
        records = records_from_rows(rows, source)
    if not records:
        raise UserError(f"{source} has no prompts (0 records); add prompts to it or pass another source")
    return records[:limit]


def records_from_rows(rows: Sequence[Any], name: str) -> list[PromptRecord]:
    """Parse raw rows (dicts) into records; `name` prefixes every error. Repeated ids get a '#k' suffix."""
    records = [_parse_row(row, i, name) for i, row in enumerate(rows)]
    seen: dict[str, int] = {}
    repeats = 0
    for r in records:
        seen[r.id] = seen.get(r.id, 0) + 1
        if seen[r.id] > 1:
            r.id, repeats = f"{r.id}#{seen[r.id]}", repeats + 1
    if repeats:
        warnings.warn(f"{name}: {repeats} records repeat an earlier id; suffixed them with '#k'", stacklevel=2)
    return records


def load_sources(
    sources: str | Sequence[str], *, self_instruct: Callable[[], list[PromptRecord]] | None = None
) -> list[tuple[str, list[PromptRecord]]]:
    """(source, records) for data.prompts, one source or a list of them, in order. A `self_instruct` source's
    records come from `self_instruct()` (the data stage's teacher writes them), or are [] when it is None. In a list,
    a source that fails to load is named with its index."""
    if isinstance(sources, str):  # one source: loaded, and failing, exactly as before lists existed
        return [(sources, _load_source(sources, self_instruct))]
    parts = []
    for i, source in enumerate(sources):
        try:
            parts.append((source, _load_source(source, self_instruct)))
        except UserError as e:
            raise UserError(f"data.prompts[{i}] ({source}): {e}") from None
    return parts


def _load_source(source: str, self_instruct: Callable[[], list[PromptRecord]] | None) -> list[PromptRecord]:
    if source == SELF_INSTRUCT:
        return self_instruct() if self_instruct is not None else []
    return load_prompts(source)


def concat_sources(parts: Sequence[tuple[str, Sequence[PromptRecord]]]) -> list[PromptRecord]:
    """The records of every (source, records) part in order; an id in two sources is refused, naming both (ids
    key the rows of the teacher data, so they must stay unique)."""
    source_of: dict[str, str] = {}  # id -> the earlier source that holds it
    out: list[PromptRecord] = []
    for source, records in parts:
        if clash := next((r.id for r in records if r.id in source_of), None):
            raise UserError(
                f"data.prompts: prompt id {clash!r} is in both {source_of[clash]} and {source}; ids must be unique "
                "across the sources: drop one of them or rename the id"
            )
        source_of.update((r.id, source) for r in records)
        out += records
    return out


def save_prompts(records: Sequence[PromptRecord], path: str | Path) -> None:
    """Write records atomically as JSONL that `load_prompts` reads back unchanged (the run's prompt files)."""
    rows = ({k: v for k, v in asdict(r).items() if v is not None} for r in records)
    write_text(Path(path), "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows))


def _load_builtin(name: str | None, split: str | None) -> list[PromptRecord]:
    if name and split and name != split:
        raise UserError(f"'builtin:{name}' conflicts with split={split!r}")
    which = name or split
    if which in BUILTIN_TRAINING_SETS:
        return _read_builtin_file(BUILTIN_TRAINING_SETS[which])
    if which not in (None, *BUILTIN_SPLITS):
        valid = [*BUILTIN_SPLITS, *BUILTIN_TRAINING_SETS]
        close = difflib.get_close_matches(which, valid, n=1)
        hint = f" Did you mean 'builtin:{close[0]}'?" if close else ""
        raise UserError(
            f"unknown builtin split {which!r}.{hint} Valid: 'builtin', " + ", ".join(f"builtin:{v}" for v in valid)
        )
    records = _read_builtin_file("specdistill_prompts.jsonl")
    extra_test = _read_builtin_file("specdistill_test_prompts.jsonl")
    if which is None:
        return records + extra_test
    train, validation_and_test = stratified_split(records, BUILTIN_VALIDATION_TEST_FRACTION, BUILTIN_SEED)
    validation, test = stratified_split(validation_and_test, 0.5, BUILTIN_TEST_SEED)
    splits = {
        "train": train,
        # Pairs of a category, round-robin: the first N span the categories, and the eval sweep's alternate halves
        # (selection, confirmation) hold the same ones.
        "validation": interleave_categories(validation, 2),
        "test": interleave_categories(test + extra_test, 2),
    }
    return splits[which]


def _read_builtin_file(name: str) -> list[PromptRecord]:
    text = resources.files("distill").joinpath(f"{BUILTIN_FILES}/{name}").read_text(encoding="utf-8")
    return records_from_rows(_parse_jsonl(text, f"builtin ({name})"), f"builtin ({name})")


def interleave_categories(records: Sequence[PromptRecord], run: int = 1) -> list[PromptRecord]:
    """Records ordered round-robin over categories (first-seen order), `run` at a time from each, so the first N
    span the categories; with run=2 and even category sizes (builtin:test) the even and odd positions (the eval
    sweep's selection and confirmation halves) hold the same categories. Order inside a category is kept."""
    by_category: dict[str, list[PromptRecord]] = {}
    for r in records:
        by_category.setdefault(r.category, []).append(r)
    rounds = max((len(v) for v in by_category.values()), default=0)
    return [r for k in range(0, rounds, run) for group in by_category.values() for r in group[k : k + run]]


def _looks_like_path(source: str) -> bool:
    # Hub ids are 'name' or 'owner/name'; anything else that does not exist is a mistyped local path.
    return (
        source.endswith(FILE_SUFFIXES) or source.startswith(("/", ".", "~")) or source.count("/") > 1 or "\\" in source
    )


def _read_file(path: Path) -> list[Any]:
    """The rows of a prompt file; a file that cannot be read or decoded is refused naming it and the fix."""
    suffix = path.suffix.lower()
    if suffix not in FILE_SUFFIXES:
        raise UserError(
            f"{path}: unsupported prompt file type {suffix!r}; use {', '.join(FILE_SUFFIXES)}, "
            "a datasets folder, or 'builtin'"
        )
    try:
        if suffix == ".parquet":
            return _read_parquet(path)
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise UserError(
            f"{path} is not UTF-8 text (byte {e.object[e.start]:#04x} at offset {e.start}); save it as UTF-8"
        ) from None
    except OSError as e:
        raise UserError(f"cannot read prompt file {path}: {e.strerror or e}") from None
    if suffix == ".jsonl":
        return _parse_jsonl(text, str(path))
    if suffix == ".json":
        return _parse_json(text, str(path))
    # An empty cell means "absent", so a CSV may mix prompt and messages columns.
    try:
        return [{k: v for k, v in row.items() if v != ""} for row in csv.DictReader(io.StringIO(text, newline=""))]
    except csv.Error as e:
        raise UserError(f"{path} is not a valid CSV file ({e}); fix it or save it again") from None


def _read_parquet(path: Path) -> list[Any]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        return pq.read_table(path).to_pylist()
    except pa.ArrowException as e:  # truncated, not parquet at all
        raise UserError(f"{path} is not a readable parquet file ({str(e).splitlines()[0]}); write it again") from None


def _parse_jsonl(text: str, name: str) -> list[Any]:
    rows = []
    lines = text.splitlines()
    for lineno, line in enumerate(lines, 1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                cut = ": the file ends there (truncated?)" if lineno == len(lines) else ""
                raise UserError(
                    f"{name}: line {lineno} is not valid JSON ({e.msg}: column {e.colno}){cut}; fix or drop the line"
                ) from None
    return rows


def _parse_json(text: str, name: str) -> list[Any]:
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        first = next((line for line in text.splitlines() if line.strip()), "")
        if _is_json(first):  # JSON Lines saved under a .json name
            return _parse_jsonl(text, name)
        ends_early = not text[e.pos :].strip() or e.msg.startswith("Unterminated string")
        cut = ": the file ends early (truncated?)" if ends_early else ""
        raise UserError(
            f"{name} is not valid JSON ({e.msg}: line {e.lineno} column {e.colno}){cut}; fix it, or write it as "
            "a JSON list of objects or JSON Lines"
        ) from None
    if isinstance(data, dict) and isinstance(data.get("data"), list):
        return data["data"]
    if isinstance(data, list):
        return data
    raise UserError(f'{name}: expected a list of objects or {{"data": [...]}}, got a {type(data).__name__}')


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except json.JSONDecodeError:
        return False
    return True


def _read_datasets_folder(path: Path, split: str | None) -> list[Any]:
    import datasets

    try:
        ds = datasets.load_from_disk(str(path))
    except FileNotFoundError:
        raise UserError(f"{path} is a folder but not a datasets folder saved with save_to_disk") from None
    except (OSError, ValueError) as e:  # a damaged folder: truncated arrow files, broken JSON metadata
        why = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise UserError(f"cannot read the datasets folder {path} ({why}); save it again with save_to_disk") from None
    if isinstance(ds, datasets.Dataset) and split is not None:
        raise UserError(f"{path} holds a single Dataset; drop split={split!r}")
    return _pick_split(ds, split, str(path)).to_list()


def _read_hub(dataset_id: str, split: str | None) -> list[Any]:
    import datasets

    from specdec_runtime.loading import hub_reachable

    offline = UserError(
        f"no network access to the Hugging Face hub for dataset '{dataset_id}'; pass a local file or folder "
        "(JSONL/JSON/CSV/parquet/datasets folder) or 'builtin'"
    )
    if not hub_reachable():  # fail at once instead of after the hub client's ~25 s of retries
        raise offline
    try:
        ds = datasets.load_dataset(dataset_id, split=split)
    except ConnectionError:
        raise offline from None
    except FileNotFoundError as e:  # datasets' DatasetNotFoundError: no such id, or a private one
        why = str(e).splitlines()[0] if str(e) else "not found"
        raise UserError(f"dataset '{dataset_id}' not found on the Hugging Face hub ({why}); check the id") from None
    except OSError as e:  # the hub answered with an HTTP error (gated, rate-limited, ...)
        why = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise UserError(f"cannot load dataset '{dataset_id}' from the Hugging Face hub: {why}") from None
    return _pick_split(ds, None, dataset_id).to_list()


def _pick_split(ds: Any, split: str | None, name: str) -> Any:
    import datasets

    if not isinstance(ds, datasets.DatasetDict):
        return ds
    if split is None and len(ds) == 1:
        return next(iter(ds.values()))
    if split is None or split not in ds:
        # Never guess between several splits: picking 'train' silently could train on a validation or test split.
        raise UserError(f"{name} has splits {list(ds)}; pass split=<one of them>")
    return ds[split]


# ---------------------------------------------------------------------------------------------------------------
# one row -> one record


def _parse_row(row: Any, index: int, name: str) -> PromptRecord:
    where = f"{name}: record {index}"
    if not isinstance(row, Mapping):
        raise UserError(f"{where} is a {type(row).__name__}, not an object with one of {', '.join(ACCEPTED_FIELDS)}")
    turns = None
    if row.get("messages") is not None:
        messages = _check_messages(_json_if_str(row["messages"]), where)
        if row.get("turns") is not None:
            turns = _check_turns(_json_if_str(row["turns"]), where)
    elif row.get("turns") is not None:
        turns = _check_turns(_json_if_str(row["turns"]), where)
        messages = [{"role": "user", "content": turns[0]}]
    else:
        messages = [{"role": "user", "content": _prompt_text(row, where)}]
    rid = row.get("question_id", row.get("id"))
    category = row.get("category")
    return PromptRecord(
        id=str(rid) if rid not in (None, "") else _content_id(messages),
        messages=messages,
        category=str(category) if category not in (None, "") else "general",
        turns=turns,
    )


def _prompt_text(row: Mapping, where: str) -> str:
    if row.get("prompt") is not None:
        key, text = "prompt", row["prompt"]
    elif row.get("instruction") is not None:
        key, text = "instruction", row["instruction"]
        extra = row.get("input")
        if isinstance(text, str) and isinstance(extra, str) and extra.strip():
            text = f"{text}\n\n{extra}"
    elif row.get("question") is not None:
        key, text = "question", row["question"]
    else:
        raise UserError(f"{where} has none of the accepted fields {', '.join(ACCEPTED_FIELDS)} (keys: {sorted(row)})")
    if not isinstance(text, str):
        raise UserError(f"{where}: field '{key}' must be a string, got {type(text).__name__}")
    if not text.strip():
        raise UserError(f"{where}: empty prompt in field '{key}'")
    return text


def _check_messages(messages: Any, where: str) -> list[dict]:
    if not isinstance(messages, list) or not messages:
        raise UserError(f"{where}: 'messages' must be a non-empty list of {{role, content}} objects")
    out = []
    for j, m in enumerate(messages):
        if not isinstance(m, Mapping) or m.get("role") not in ROLES or not isinstance(m.get("content"), str):
            raise UserError(f"{where}: message {j} must be {{role: one of {ROLES}, content: string}}, got {m!r}")
        if not m["content"].strip():
            raise UserError(f"{where}: message {j} has empty content")
        out.append({"role": m["role"], "content": m["content"]})
    # A conversation that ends with a reply loses that reply: the teacher writes its own (sequence-level KD).
    while out and out[-1]["role"] == "assistant":
        out.pop()
    if not out or out[-1]["role"] != "user":
        raise UserError(f"{where}: 'messages' has no user turn to answer")
    return out


def _check_turns(turns: Any, where: str) -> list[str]:
    if not isinstance(turns, list) or not turns or not all(isinstance(t, str) for t in turns):
        raise UserError(f"{where}: 'turns' must be a non-empty list of strings")
    if any(not t.strip() for t in turns):
        raise UserError(f"{where}: 'turns' has an empty turn")
    return list(turns)


def _json_if_str(value: Any) -> Any:
    # CSV cells hold chat lists as JSON text.
    if isinstance(value, str) and value.lstrip().startswith("["):
        try:
            return json.loads(value)
        except json.JSONDecodeError:
            return value
    return value


def _content_id(messages: list[dict]) -> str:
    # Content-derived, so an id-less record keeps its id (and its split) when other records are added.
    digest = hashlib.sha1(json.dumps(messages, sort_keys=True, ensure_ascii=False).encode("utf-8")).hexdigest()
    return f"p-{digest[:12]}"


# ---------------------------------------------------------------------------------------------------------------
# the builtin set's splits


def stratified_split(
    records: Sequence[PromptRecord], fraction: float, seed: int = 0
) -> tuple[list[PromptRecord], list[PromptRecord]]:
    """Split `fraction` of the records off: (rest, split off), stratified by category; deterministic from each id's
    hash with `seed`.

    Inside each category, records are ranked by hash(seed, id) and the first round(f * n) are split off. Categories
    are independent, so adding prompts to one never moves another's, and ranks never reshuffle: at most the
    boundary records of a category that grew change side. Categories too small for one split-off record are pooled
    and split the same way. Input order is kept inside each part.
    """
    if not 0.0 <= fraction < 1.0:
        raise ValueError(f"fraction must be in [0, 1), got {fraction}")
    by_category: dict[str, list[int]] = {}
    for i, r in enumerate(records):
        by_category.setdefault(r.category, []).append(i)
    groups = [idx for idx in by_category.values() if _split_off_count(len(idx), fraction) > 0]
    pooled = [i for idx in by_category.values() if _split_off_count(len(idx), fraction) == 0 for i in idx]
    split_off = set()
    for idx in [*groups, pooled]:
        ranked = sorted(idx, key=lambda i: _hash_rank(records[i].id, seed))
        split_off.update(ranked[: _split_off_count(len(idx), fraction)])
    if not split_off and fraction > 0 and len(records) > 1:  # split one record off, however small the set
        split_off.add(min(range(len(records)), key=lambda i: _hash_rank(records[i].id, seed)))
    rest = [r for i, r in enumerate(records) if i not in split_off]
    return rest, [r for i, r in enumerate(records) if i in split_off]


def _split_off_count(n: int, fraction: float) -> int:
    # Round half up (Python's round() rounds half to even), never the whole group.
    return min(int(fraction * n + 0.5), max(n - 1, 0))


def _hash_rank(record_id: str, seed: int) -> int:
    return int.from_bytes(hashlib.sha256(f"{seed}\x00{record_id}".encode()).digest()[:8], "big")


# ---------------------------------------------------------------------------------------------------------------
# chat template


def render_chat(
    tokenizer: "PreTrainedTokenizerBase", messages: list[dict], *, plain_fallback: bool = False
) -> list[int]:
    """Token ids of `messages` under the tokenizer's chat template, ending with the assistant generation prompt.

    With no chat template this raises, unless `plain_fallback=True`: then the chat is rendered as plain
    "User: ...\\nAssistant: ...\\n...Assistant:" text (roles capitalised) with the tokenizer's usual special tokens,
    which only suits base models that were never trained on a template.
    """
    if not messages or messages[-1]["role"] != "user":
        raise ValueError("messages must end with a user turn")
    if tokenizer.chat_template is None:
        if not plain_fallback:
            raise UserError(
                f"tokenizer {tokenizer.name_or_path or '(unnamed)'!r} has no chat template; use a chat/instruct "
                "model or add a chat_template to its tokenizer_config.json (in the API: plain_fallback=True for "
                "plain 'User: ...' text)"
            )
        text = "".join(f"{m['role'].capitalize()}: {m['content']}\n" for m in messages) + "Assistant:"
        return list(tokenizer(text)["input_ids"])
    out = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    # transformers 5 returns a BatchEncoding by default, 4.x a plain list of ids.
    ids = out["input_ids"] if isinstance(out, Mapping) else out
    return [int(i) for i in ids]
