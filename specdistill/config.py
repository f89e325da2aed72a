"""Strict, typed configs: dataclasses in, YAML files and `key=value` overrides on top, every mistake caught early.

Each stage owns the dataclass of its own section (`distill/config.py`, `train/config.py`, `eval/config.py`, ...;
`target` lives in `specdec_runtime/backends.py`); this module composes them into `RootConfig`, loads YAML, applies
dotted overrides and validates:

    cfg = load_config("configs/quickstart.yaml", ["train.max_steps=20", "distill.objective=tv"])

Unknown keys fail with the list of valid keys and the closest match; wrong types and out-of-range values fail with
the dotted path of the offending key. Every error is a `ConfigError` (a `UserError`, so a `ValueError`), which the
CLI turns into one line and exit code 2.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import functools
import inspect
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from distill.config import DataConfig, DistillConfig
from distill.students import DraftConfig
from eval.config import EvalConfig, ServingConfig
from specdec_runtime import atomic
from specdec_runtime.backends import TargetConfig
from specdec_runtime.errors import UserError
from train.config import TrackingConfig, TrainConfig


class ConfigError(UserError):
    """A config file or override is wrong; the message names the key and the fix."""


@dataclass
class CandidateConfig:
    name: str = ""
    """Candidate name: its folder under <output_dir>/candidates/ and its label in reports."""
    overrides: dict[str, Any] = field(default_factory=dict)
    """Dotted `draft.*`, `distill.*` or `train.*` keys applied on top of the root config for this candidate."""

    def __post_init__(self) -> None:
        # A folder name under candidates/: "." and ".." (and any leading dot) would name another folder or a hidden one.
        if not self.name or self.name.startswith(".") or not all(c.isalnum() or c in "-_." for c in self.name):
            raise ValueError(
                f"candidate name {self.name!r} must be non-empty, use only letters, digits, - _ . and not start with "
                "a dot: it names the folder candidates/<name>/"
            )
        bad = [k for k in self.overrides if k.split(".")[0] not in ("draft", "distill", "train")]
        if bad:
            raise ValueError(f"candidate {self.name!r} overrides {bad}: only draft.*, distill.* and train.* keys")


@dataclass
class RootConfig:
    output_dir: str = ""
    """Where every stage writes (config.yaml, data/, candidates/, eval/, export/, serving.yaml); default runs/<stem>."""
    seed: int = 0
    """Global seed; each process adds its rank."""
    target: TargetConfig = field(default_factory=TargetConfig)
    """The target (teacher) model."""
    draft: DraftConfig = field(default_factory=DraftConfig)
    """How the draft (student) is built from the target or loaded."""
    data: DataConfig = field(default_factory=DataConfig)
    """Prompts and teacher-generated distillation data."""
    distill: DistillConfig = field(default_factory=DistillConfig)
    """The distillation objective."""
    train: TrainConfig = field(default_factory=TrainConfig)
    """The training loop."""
    eval: EvalConfig = field(default_factory=EvalConfig)
    """Acceptance-rate evaluation sweep."""
    serving: ServingConfig = field(default_factory=ServingConfig)
    """Promotion into the serving config."""
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    """Experiment tracking (W&B)."""
    candidates: list[CandidateConfig] = field(default_factory=list)
    """Candidate drafts to distill and compare; empty = one candidate named `draft` from the sections above."""

    def __post_init__(self) -> None:
        names = [c.name for c in self.candidates]
        if len(set(names)) != len(names):
            raise ValueError(f"candidates: duplicate names in {names}")
        # Each candidate is resolved here, once: its overrides type-check before any work starts, and every stage
        # reads the result instead of applying the overrides again. Not a field: it stays out of config.yaml and
        # of every fingerprint. A config without candidates is its own single candidate, `draft`.
        self.candidate_configs: dict[str, RootConfig] = (
            {c.name: _apply_overrides(self, c) for c in self.candidates} if self.candidates else {"draft": self}
        )


# ----------------------------------------------------------------------------------------------------------------
# Field docs: the string literal under each field is its documentation (shown by `config show --docs` and errors).


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """{field name: docstring} read from the class source, where each field is followed by a string literal."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        body = ast.parse(inspect.getsource(klass).lstrip()).body[0].body
        for stmt, nxt in zip(body, body[1:]):
            is_field = isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)
            if is_field and isinstance(nxt, ast.Expr) and isinstance(getattr(nxt, "value", None), ast.Constant):
                if isinstance(nxt.value.value, str):
                    docs[stmt.target.id] = nxt.value.value.strip()
    return docs


# ----------------------------------------------------------------------------------------------------------------
# dict -> dataclass, strictly typed


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _unknown_key(key: str, valid: list[str], where: str) -> ConfigError:
    close = difflib.get_close_matches(key, valid, n=1)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    return ConfigError(
        f"unknown key {where}{key!r}.{hint} Valid keys{' of ' + where[:-1] if where else ''}: {', '.join(valid)}"
    )


def _coerce(value: Any, tp: Any, path: str) -> Any:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in (a for a in args if a is not type(None)):
            try:
                return _coerce(value, arg, path)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(errors[0] if len(errors) == 1 else f"{path}: {value!r} matches none of {_type_name(tp)}")
    if origin is Literal:
        if value not in args:
            close = difflib.get_close_matches(str(value), [str(a) for a in args], n=1)
            hint = f" Did you mean {close[0]!r}?" if close else ""
            raise ConfigError(f"{path}: {value!r} is not one of {', '.join(map(repr, args))}.{hint}")
        return value
    if dataclasses.is_dataclass(tp):
        shorthand = getattr(tp, "SHORTHAND", None)
        if shorthand is not None and isinstance(value, str):  # e.g. `tracking: none` = `tracking: {backend: none}`
            value = {shorthand: value}
        if not isinstance(value, dict):
            raise ConfigError(f"{path}: expected a mapping (section {tp.__name__}), got {type(value).__name__}")
        return from_dict(tp, value, path + ".")
    if origin is list:
        if not isinstance(value, list | tuple):
            raise ConfigError(f"{path}: expected a list, got {value!r}")
        return [_coerce(v, args[0], f"{path}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{path}: expected a mapping, got {value!r}")
        return {_coerce(k, args[0], path): _coerce(v, args[1], f"{path}.{k}") for k, v in value.items()}
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{path}: expected true or false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{path}: expected an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(f"{path}: expected a number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{path}: expected a string, got {value!r} (quote it in YAML)")
        return value
    raise ConfigError(f"{path}: unsupported config type {_type_name(tp)}")


def from_dict(cls: type, data: dict, where: str = "") -> Any:
    """Build dataclass `cls` from `data`, refusing unknown keys and wrong types; missing keys keep their defaults."""
    hints = typing.get_type_hints(cls)
    valid = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in data.items():
        if key not in valid:
            raise _unknown_key(str(key), valid, where)
        kwargs[key] = _coerce(value, hints[key], f"{where}{key}")
    try:
        return cls(**kwargs)  # each section checks its ranges in __post_init__
    except ConfigError:
        raise
    except ValueError as e:
        raise ConfigError(f"{where.rstrip('.') or 'config'}: {e}") from None


def to_dict(obj: Any) -> Any:
    return dataclasses.asdict(obj)


# ----------------------------------------------------------------------------------------------------------------
# YAML files and key=value overrides


def read_yaml(path: str | Path) -> dict:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file not found: {path} (presets live in configs/, e.g. configs/quickstart.yaml)")
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark
        where = f"line {mark.line + 1}, column {mark.column + 1}" if mark else "unknown position"
        raise ConfigError(f"invalid YAML in {path} at {where}: {e.problem}") from None
    except (UnicodeDecodeError, yaml.YAMLError) as e:  # a binary file, another encoding
        raise ConfigError(f"{path} cannot be read as YAML ({str(e).splitlines()[0]}); save it as UTF-8 text") from None
    except OSError as e:
        raise ConfigError(f"cannot read config file {path}: {e.strerror or e}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections, got {type(data).__name__}")
    return data


def parse_override(text: str) -> tuple[str, Any]:
    """`train.lr=3e-4` -> ("train.lr", 0.0003); the value is parsed as YAML so lists and null work too."""
    key, sep, raw = text.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"override {text!r} must look like section.key=value, e.g. train.max_steps=20")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    if isinstance(value, str) and _looks_like_float(raw):
        value = float(raw)  # YAML 1.1 reads 3e-4 as a string; users mean the number
    return key.strip(), value


def _looks_like_float(raw: str) -> bool:
    try:
        float(raw)
        return True
    except ValueError:
        return False


def set_dotted(data: dict, key: str, value: Any, cls: type = RootConfig) -> None:
    """Set `a.b.c` in nested dict `data`, checking each part against the schema so typos fail with suggestions."""
    parts = key.split(".")
    node, tp, where = data, cls, ""
    for i, part in enumerate(parts):
        if not dataclasses.is_dataclass(tp):
            raise ConfigError(f"override {key!r}: {where.rstrip('.')} is not a section")
        valid = [f.name for f in dataclasses.fields(tp)]
        if part not in valid:
            raise _unknown_key(part, valid, where)
        if i == len(parts) - 1:
            node[part] = value
            return
        tp = typing.get_type_hints(tp)[part]
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"override {key!r}: {where}{part} is not a mapping in the config file")
        where += part + "."


def load_config(path: str | Path | None, overrides: list[str] | tuple[str, ...] = ()) -> RootConfig:
    """YAML file (or the defaults when None) + `key=value` overrides -> validated RootConfig, its candidates
    resolved (`RootConfig.candidate_configs`)."""
    data = read_yaml(path) if path is not None else {}
    for text in overrides:
        set_dotted(data, *parse_override(text))
    if not data.get("output_dir"):  # before the candidates are resolved: they inherit it
        data["output_dir"] = str(Path("runs") / (Path(path).stem if path else "default"))
    return from_dict(RootConfig, data)


def _apply_overrides(cfg: RootConfig, cand: CandidateConfig) -> RootConfig:
    """The root config as candidate `cand` sees it: its overrides applied on top of the shared sections."""
    data = to_dict(cfg)
    data["candidates"] = []
    try:
        for key, value in cand.overrides.items():
            set_dotted(data, key, value)
        return from_dict(RootConfig, data)
    except ConfigError as e:
        raise ConfigError(f"candidates[{cand.name}].overrides: {e}") from None


def candidate_config(cfg: RootConfig, name: str) -> RootConfig:
    """Candidate `name`'s resolved config (a lookup: candidates are resolved when the root config is built)."""
    if name not in cfg.candidate_configs:
        raise ConfigError(f"unknown candidate {name!r}; candidates: {list(cfg.candidate_configs)}")
    return cfg.candidate_configs[name]


def dump_yaml(cfg: RootConfig) -> str:
    return yaml.safe_dump(to_dict(cfg), sort_keys=False, default_flow_style=None, width=120)


def save_resolved(cfg: RootConfig, path: str | Path) -> None:
    """Write the resolved config atomically, so a crash never leaves half a config."""
    atomic.write_text(Path(path), dump_yaml(cfg))
