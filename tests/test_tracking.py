"""Experiment tracking: offline W&B runs hold the logged metrics, eval tables and no secrets; the no-op tracker
elsewhere."""

from __future__ import annotations

import json
import os
from pathlib import Path

from helpers.reports import make_report
from helpers.runs import offline_run, tiny_setup, train_config

from eval.report import TRACKER_COLUMNS, write_reports
from train.config import TrackingConfig
from train.tracking import NoOpTracker, is_secret_key, make_tracker, resolve_mode, strip_secrets

ROOT = Path(__file__).resolve().parent.parent


def test_secret_keys_are_recognised_without_dropping_token_counts():
    for name in ("api_key", "WANDB_API_KEY", "hf_token", "apikey", "wandbToken", "db-password", "client_secret"):
        assert is_secret_key(name), name
    for name in ("max_new_tokens", "max_prompt_tokens", "num_draft_tokens", "keep_last", "kd_temperature", "top_k"):
        assert not is_secret_key(name), name
    config = {"train": {"lr": 1.0, "api_key": "x"}, "hub": [{"token": "y", "repo": "z"}], "max_new_tokens": 8}
    assert strip_secrets(config) == {"train": {"lr": 1.0}, "hub": [{"repo": "z"}], "max_new_tokens": 8}


def test_no_op_tracker_off_the_main_process_and_with_backend_none(tmp_path):
    assert isinstance(make_tracker(TrackingConfig(mode="offline"), tmp_path / "a", {}, is_main=False), NoOpTracker)
    assert isinstance(make_tracker(TrackingConfig(backend="none"), tmp_path / "b", {}, is_main=True), NoOpTracker)
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_auto_mode_follows_the_environment(monkeypatch):
    assert resolve_mode("offline") == "offline" and resolve_mode("online") == "online"
    monkeypatch.setenv("WANDB_MODE", "disabled")
    assert resolve_mode("auto") == "disabled"
    monkeypatch.delenv("WANDB_MODE")
    monkeypatch.setenv("WANDB_API_KEY", "0" * 40)
    assert resolve_mode("auto") == "online"


def test_auto_mode_is_offline_without_any_key_and_never_prompts(tmp_path):
    """A fresh machine: no WANDB_* variables, an empty home (no netrc, no wandb settings), stdin closed."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if not k.startswith(("WANDB_", "NETRC"))}
    env |= {"HOME": str(tmp_path), "XDG_CONFIG_HOME": str(tmp_path / ".config"), "PYTHONPATH": str(ROOT)}
    code = "from train.tracking import resolve_mode; print(resolve_mode('auto'))"
    proc = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip().splitlines()[-1] == "offline"


def test_offline_run_holds_the_metrics_and_no_secret(tmp_path):
    secret = "sk-THIS-MUST-NOT-LEAK-1234"
    run_config = {"train": {"lr": 0.5, "api_key": secret}, "hf_token": secret, "data": {"max_new_tokens": 7}}
    tracker = make_tracker(TrackingConfig(mode="offline"), tmp_path, run_config, is_main=True, name="test-run")
    tracker.log({"train/loss": 1.5}, step=1)
    tracker.log({"train/loss": 1.25, "eval/expected_acceptance": 0.75}, step=2)
    (tmp_path / "best").mkdir()
    (tmp_path / "best" / "config.json").write_text("{}")
    tracker.log_artifact(tmp_path / "best", name="test-run-best", type="model")
    tracker.finish()

    history, artifacts, raw = offline_run(tmp_path)
    assert [(r["_step"], r["train/loss"]) for r in history] == [(1, 1.5), (2, 1.25)]
    assert history[1]["eval/expected_acceptance"] == 0.75
    assert [(a.name, a.type) for a in artifacts] == [("test-run-best", "model")]
    assert secret.encode() not in raw and b"max_new_tokens" in raw
    assert not any(secret in p.read_text(errors="ignore") for p in tmp_path.rglob("*") if p.is_file())


def test_distill_logs_training_and_validation_to_wandb(tmp_path, isolated_cache):
    from specdistill.pipeline import distill_candidate as distill

    teacher, tokenizer, data = tiny_setup(tmp_path)
    cfg = train_config(tmp_path / "run", "tracking.backend=wandb", "tracking.mode=offline", "train.max_steps=2")
    cand = distill(cfg, "draft", data, teacher=teacher, tokenizer=tokenizer)
    history, artifacts, _ = offline_run(cand)
    logged = {(r["_step"], key) for r in history for key in r if not key.startswith("_")}
    for step in (1, 2):
        for key in (
            "train/loss",
            "train/lr",
            "train/grad_norm",
            "train/tokens_per_s",
            "eval/expected_acceptance",
            "eval/greedy_match",
            "eval/loss",
        ):
            assert (step, key) in logged
    assert [(a.name, a.type) for a in artifacts] == [("run-draft-best", "model")]


def test_eval_report_table_reaches_offline_wandb_run(tmp_path, monkeypatch):
    """write_reports(tracker=WandbTracker): the settings table (chains and trees) lands in the run as a wandb.Table.

    2 candidates x 2 (temperature, draft_rule) x (3 gammas + 1 tree) = 16 rows."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    report = make_report(tmp_path / "sweep", trees=("2,2",))
    tracker = make_tracker(TrackingConfig(mode="offline"), tmp_path / "run", {}, is_main=True, name="eval")
    tracker.log({"train/loss": 1.5}, step=3)  # a table after step-numbered metrics goes to the current step
    write_reports(report, tmp_path / "eval", tracker=tracker)
    tracker.finish()

    history, artifacts, _ = offline_run(tmp_path / "run")
    # a logged table is a history row of nested keys (eval/settings/_type, .../path, ...) pointing at a JSON file
    (row,) = [r for r in history if "eval/settings/_type" in r]
    ref = {k.removeprefix("eval/settings/"): v for k, v in row.items() if k.startswith("eval/settings/")}
    assert ref["_type"] == "table-file" and ref["nrows"] == 12 + 2 * 2 and row["_step"] == 3
    (files,) = (tmp_path / "run").glob("wandb/offline-run-*/files")
    table = json.loads((files / ref["path"]).read_text())
    assert table["columns"] == TRACKER_COLUMNS
    keys = ("candidate", "tree", "num_draft_tokens", "temperature", "speedup", "nodes_per_step")
    got = [tuple(values[TRACKER_COLUMNS.index(k)] for k in keys) for values in table["data"]]
    expected = [(c["name"], *(s[k] for k in keys[1:])) for c in report["candidates"] for s in c["settings"]]
    assert sorted(got, key=repr) == sorted(expected, key=repr)
    assert sorted(a.type for a in artifacts) == ["eval-report", "run_table"]  # W&B stores a table as an artifact too
    assert [a.name for a in artifacts if a.type == "eval-report"] == ["eval-report"]


def test_no_op_tracker_takes_the_eval_report(tmp_path):
    paths = write_reports(make_report(tmp_path / "sweep"), tmp_path / "eval", tracker=NoOpTracker())
    assert paths["html"].is_file() and not list(tmp_path.rglob("wandb"))
