"""The config system: every preset validates, overrides apply, every kind of mistake fails with a clear message."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from specdistill.config import (
    ConfigError,
    RootConfig,
    candidate_config,
    dump_yaml,
    field_docs,
    load_config,
)

CONFIGS = Path(__file__).resolve().parent.parent / "configs"
PRESETS = sorted(p for p in CONFIGS.glob("*.yaml"))


@pytest.mark.parametrize("path", PRESETS, ids=lambda p: p.name)
def test_every_preset_loads_and_round_trips(path, tmp_path):
    from specdistill.pipeline import check_prompt_roles

    cfg = load_config(path)
    assert isinstance(cfg, RootConfig) and cfg.output_dir
    check_prompt_roles(cfg)  # its test prompts are disjoint from its training and validation prompts
    assert list(cfg.candidate_configs) == ([c.name for c in cfg.candidates] or ["draft"])
    resolved = tmp_path / "resolved.yaml"
    resolved.write_text(dump_yaml(cfg))
    assert dump_yaml(load_config(resolved)) == dump_yaml(cfg)
    lines = path.read_text().splitlines()
    header = "\n".join(lines[: next(i for i, line in enumerate(lines) if not line.startswith("#"))])
    assert "specdistill " in header, "the header comment gives the launch commands"


@pytest.mark.parametrize("path", sorted((CONFIGS / "accelerate").glob("*.yaml")), ids=lambda p: p.name)
def test_accelerate_configs_parse(path):
    data = yaml.safe_load(path.read_text())
    assert data["num_processes"] >= 1
    assert path.read_text().startswith("#") and "accelerate launch" in path.read_text()


def test_presets_required_by_the_project_exist():
    names = {p.name for p in PRESETS}
    assert {"quickstart.yaml", "smoke.yaml", "llama-3.1-8b.yaml"} <= names
    acc = {p.name for p in (CONFIGS / "accelerate").glob("*.yaml")}
    assert {"cpu_2proc.yaml", "single_gpu.yaml", "ddp.yaml", "fsdp.yaml"} <= acc


def test_quickstart_and_embedded_best_compare_an_eagle3_head_with_a_standalone_draft():
    for name in ("quickstart.yaml", "embedded-best.yaml"):
        cfg = load_config(CONFIGS / name)
        assert cfg.target.model == "embedded:smollm2-135m-instruct"
        kinds = {c.overrides.get("draft.init", cfg.draft.init) for c in cfg.candidates}
        assert "eagle3" in kinds and kinds - {"eagle3"}, (name, kinds)
        assert cfg.serving.temperature in cfg.eval.temperatures


def test_embedded_best_trains_the_quickstarts_head_recipe_for_longer():
    """configs/embedded-best.yaml is the quickstart's head with more data and steps, every other setting the same: a
    recipe change adopted in one preset and not the other fails here."""
    cadence = {"train.max_steps", "train.warmup_steps", "train.eval_every", "train.save_every"}
    heads, distill = {}, {}
    for name in ("quickstart.yaml", "embedded-best.yaml"):
        cfg = load_config(CONFIGS / name)
        (head,) = [c for c in cfg.candidates if c.overrides.get("draft.init") == "eagle3"]
        heads[name] = {k: v for k, v in head.overrides.items() if k not in cadence}
        distill[name] = cfg.distill
    assert heads["quickstart.yaml"] == heads["embedded-best.yaml"]
    assert distill["quickstart.yaml"] == distill["embedded-best.yaml"] and distill["quickstart.yaml"].loss_on_prompt


def test_overrides_apply_with_types(tmp_path):
    cfg = load_config(
        CONFIGS / "smoke.yaml",
        [
            "train.max_steps=7",
            "train.lr=3e-4",
            "distill.objective=tv",
            "eval.num_draft_tokens=[1,3]",
            "tracking.entity=null",
        ],
    )
    assert cfg.train.max_steps == 7 and cfg.train.lr == pytest.approx(3e-4)
    assert cfg.distill.objective == {"tv": 1.0}
    assert cfg.eval.num_draft_tokens == [1, 3]
    assert cfg.tracking.entity is None


def test_default_output_dir_is_runs_stem(tmp_path):
    path = tmp_path / "myexp.yaml"
    path.write_text("train: {max_steps: 3}\n")
    assert load_config(path).output_dir == str(Path("runs") / "myexp")


def test_candidate_overrides_are_applied_and_checked():
    cfg = load_config(CONFIGS / "smoke.yaml")
    tv = candidate_config(cfg, "tv-cache")
    assert tv.distill.objective == {"tv": 1.0} and tv.distill.teacher == "cache"
    with pytest.raises(ConfigError, match="unknown candidate"):
        candidate_config(cfg, "nope")


def test_bad_candidate_override_fails_at_load(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("candidates:\n  - name: a\n    overrides: {distill.objectiv: {tv: 1.0}}\n")
    with pytest.raises(ConfigError, match="objective"):
        load_config(path)
    path.write_text("candidates:\n  - name: a\n    overrides: {eval.max_prompts: 3}\n")
    with pytest.raises(ConfigError, match="only draft"):
        load_config(path)


@pytest.mark.parametrize("name", ["..", ".", ".hidden", "a/b", ""])
def test_candidate_names_that_are_not_a_plain_folder_name_fail(tmp_path, name):
    """`..` once wrote into output_dir and overwrote the run's config.yaml: every name is one plain folder."""
    path = tmp_path / "c.yaml"
    path.write_text(f"candidates:\n  - name: {name!r}\n")
    with pytest.raises(ConfigError, match="candidates/<name>/"):
        load_config(path)
    assert load_config(None, ["candidates=[{name: v1.2_a-b}]"]).candidates[0].name == "v1.2_a-b"


# --- bad input -----------------------------------------------------------------------------------------------------


def test_missing_file():
    with pytest.raises(ConfigError, match="config file not found: .*nope.yaml"):
        load_config("nope.yaml")


def test_invalid_yaml_names_the_line(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("train:\n  max_steps: 3\n  lr: [1, 2\n")
    with pytest.raises(ConfigError, match=r"invalid YAML in .*bad.yaml at line \d+"):
        load_config(path)


def test_unknown_key_lists_valid_keys_and_closest_match(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("train:\n  max_step: 3\n")
    with pytest.raises(ConfigError) as e:
        load_config(path)
    msg = str(e.value)
    assert "unknown key train.'max_step'" in msg and "Did you mean 'max_steps'?" in msg and "grad_accum" in msg


def test_unknown_section(tmp_path):
    with pytest.raises(ConfigError, match="Did you mean 'train'"):
        load_config(None, ["trian.max_steps=3"])


def test_wrong_type(tmp_path):
    with pytest.raises(ConfigError, match="train.max_steps: expected an integer, got 'ten'"):
        load_config(None, ["train.max_steps=ten"])
    with pytest.raises(ConfigError, match="train.resume: expected true or false"):
        load_config(None, ["train.resume=3"])
    with pytest.raises(ConfigError, match="serving.draft_rule: 'greedi' is not one of"):
        load_config(None, ["serving.draft_rule=greedi"])


@pytest.mark.parametrize(
    "override, match",
    [
        ("train.lr=-1", "lr must be > 0"),
        ("distill.lmbda=1.5", r"lmbda must be in \[0, 1\]"),
        ("distill.lmbda=-0.1", r"lmbda must be in \[0, 1\]"),
        ("distill.kd_temperature=0", "kd_temperature must be > 0"),  # checked here, not again by distill_loss
        ("distill.objective={tv: .nan}", "objective weights must be finite"),
        ("data.top_p=0", r"top_p must be in \(0, 1\]"),
        ("eval.num_draft_tokens=[0, 2]", "num_draft_tokens"),
        ("distill.objective=kl", "unknown objective 'kl'; valid objectives: forward_kl, reverse_kl, jsd, tv, ce"),
    ],
)
def test_out_of_range(override, match):
    with pytest.raises(ConfigError, match=match):
        load_config(None, [override])


def test_every_field_has_a_docstring():
    import dataclasses

    def check(cls):
        docs = field_docs(cls)
        for f in dataclasses.fields(cls):
            assert docs.get(f.name), f"{cls.__name__}.{f.name} has no docstring"
            tp = f.type if not isinstance(f.type, str) else None
            if tp is not None and dataclasses.is_dataclass(tp):
                check(tp)

    check(RootConfig)
    for section in dataclasses.fields(RootConfig):
        value = getattr(RootConfig(), section.name)
        if dataclasses.is_dataclass(value):
            check(type(value))


def test_cli_config_show_and_errors():
    ok = subprocess.run(
        [sys.executable, "-m", "specdistill", "config", "show", str(CONFIGS / "smoke.yaml"), "train.max_steps=9"],
        capture_output=True,
        text=True,
    )
    assert ok.returncode == 0, ok.stderr
    assert yaml.safe_load(ok.stdout)["train"]["max_steps"] == 9
    bad = subprocess.run(
        [sys.executable, "-m", "specdistill", "config", "show", str(CONFIGS / "smoke.yaml"), "train.max_stepz=9"],
        capture_output=True,
        text=True,
    )
    assert bad.returncode == 2
    assert "Did you mean 'max_steps'" in bad.stderr and "Traceback" not in bad.stderr
    assert len(bad.stderr.strip().splitlines()) == 1


def test_the_old_prompt_key_names_and_builtin_eval_fail_like_any_unknown_key_or_split(tmp_path):
    from specdistill.pipeline import check_prompt_roles

    valid = r"Valid keys of data: prompts, validation_prompts, max_prompts, max_validation_prompts, "
    path = tmp_path / "old.yaml"
    for old in ("eval_prompts", "max_eval_prompts"):  # renamed to validation_prompts, max_validation_prompts
        path.write_text(f"data: {{{old}: 5}}\n")
        error = rf"^unknown key data.'{old}'\. Did you mean '\w+'\? {valid}"
        with pytest.raises(ConfigError, match=error):
            load_config(path)
        with pytest.raises(ConfigError, match=error):
            load_config(None, [f"data.{old}=5"])
    # builtin:eval was split into builtin:validation and builtin:test: refused by the run's first check.
    for key in ("data.validation_prompts", "eval.prompts"):
        cfg = load_config(None, [f"{key}=builtin:eval"])
        with pytest.raises(ValueError, match=r"^unknown builtin split 'eval'\. Valid: 'builtin', builtin:train, "):
            check_prompt_roles(cfg)


def test_tracking_none_is_shorthand_for_its_backend(tmp_path):
    data = yaml.safe_load((CONFIGS / "smoke.yaml").read_text())
    data["tracking"] = "none"
    path = tmp_path / "t.yaml"
    path.write_text(yaml.safe_dump(data))
    assert load_config(path).tracking.backend == "none"
    assert load_config(CONFIGS / "smoke.yaml", ["tracking=none"]).tracking.backend == "none"
    with pytest.raises(ConfigError, match="tracking.backend: 'nope' is not one of 'wandb', 'none'"):
        load_config(CONFIGS / "smoke.yaml", ["tracking=nope"])


def test_the_8b_preset_trains_an_eagle3_head_for_its_32_layer_target():
    """Users of Llama-3.1-8B serve an EAGLE-3 head: the preset has one, with aux layers valid for 32 layers (the
    engines' default, written explicitly), the anchors' 7 TTT steps, a 32k draft vocabulary and an online teacher
    (an offline cache of 3 x 4096 states per token would not fit), and its header says the memory per GPU."""
    from specdec_runtime.eagle3 import check_aux_layers, default_aux_layers

    path = CONFIGS / "llama-3.1-8b.yaml"
    head = load_config(path).candidate_configs["eagle3"]
    assert head.draft.init == "eagle3" and head.draft.aux_layers == default_aux_layers(32) == [2, 16, 29]
    check_aux_layers(head.draft.aux_layers, 32)
    assert head.draft.ttt_depth == 7 and head.draft.draft_vocab_size == 32000 and head.distill.teacher == "online"
    assert "Memory per GPU" in path.read_text().split("\noutput_dir:")[0]
