"""`specdistill run` end to end on configs/smoke.yaml, from the CLI, plus the eval/promote/export commands' bad input.

One smoke run is shared by the module: its first attempt fails at the eval stage (a batch larger than the prompts
split into selection and confirmation halves; a missing prompt file would fail before any stage starts), the second
continues without redoing data generation or distillation. The outputs of that run are then checked file by file.
"""

from __future__ import annotations

import contextlib
import html.parser
import io
import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml
from helpers.runs import TRUNCATED_PROMPT_FILES, small_filesystem
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parent.parent


def cli(*args, env, cwd, check=True):
    """The real command line, in a subprocess (the `run` attempts: what a user types)."""
    r = subprocess.run(
        [sys.executable, "-m", "specdistill", *map(str, args)], capture_output=True, text=True, env=env, cwd=cwd
    )
    if check:
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return r


def cli_here(*args, env, cwd=None, check=True):
    """The same entry point in this process: the commands' error handling without paying the imports again."""
    from specdistill.cli import main

    out, err = io.StringIO(), io.StringIO()
    with pytest.MonkeyPatch.context() as mp, contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        for key in ("SPECDISTILL_CACHE", "WANDB_MODE", "HF_HUB_OFFLINE"):
            mp.setenv(key, env[key])
        try:
            rc = main([str(a) for a in args])
        except SystemExit as e:  # argparse: --help and usage errors
            rc = e.code or 0
    r = SimpleNamespace(returncode=rc, stdout=out.getvalue(), stderr=err.getvalue())
    if check:
        assert rc == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return r


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    home = tmp_path_factory.mktemp("home")
    return {
        **os.environ,
        "SPECDISTILL_CACHE": str(home / "cache"),
        "WANDB_MODE": "offline",
        "WANDB_SILENT": "true",
        "HF_HUB_OFFLINE": "1",
        "PYTHONPATH": str(ROOT),
    }


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory, env):
    """(output_dir, first attempt, second attempt, mtimes of best/ after the first)."""
    out = tmp_path_factory.mktemp("smoke") / "run"
    base = [ROOT / "configs" / "smoke.yaml", f"output_dir={out}"]
    failed = cli("run", *base, "eval.batch_sizes=[64]", env=env, cwd=ROOT, check=False)
    best_mtimes = {p: p.stat().st_mtime for p in sorted(out.glob("candidates/*/best/model.safetensors"))}
    resumed = cli("run", *base, env=env, cwd=ROOT)
    return out, failed, resumed, best_mtimes


def test_failed_stage_then_resume_continues(smoke_run):
    out, failed, resumed, best_mtimes = smoke_run
    assert failed.returncode == 2
    assert "batch size 64" in failed.stderr and "Traceback" not in failed.stderr
    assert len(best_mtimes) == 3, "data and distill finished before the eval stage failed"
    assert "cached" in resumed.stdout or "cached" in resumed.stderr, "teacher data was reused"
    for path, mtime in best_mtimes.items():
        assert path.stat().st_mtime == mtime, f"{path} was retrained on resume"
    assert "specdistill run: done" in resumed.stdout
    for needle in ("report:", "exported draft:", "serving config:"):
        assert needle in resumed.stdout


def test_run_layout(smoke_run):
    out = smoke_run[0]
    for rel in ("config.yaml", "eval/report.json", "eval/report.md", "eval/report.html", "serving.yaml"):
        assert (out / rel).is_file(), rel
    done = sorted(p.parent.name.rsplit("-", 1)[0] for p in (out / "data").glob("*/.complete"))
    assert done == ["teacher", "teacher-eval"], done
    for name in ("fkl", "tv-cache", "eagle3"):
        assert (out / "candidates" / name / "best" / "model.safetensors").is_file()
        assert (out / "candidates" / name / "metrics.jsonl").is_file()
        assert list((out / "candidates" / name / "wandb").glob("offline-run-*")), "an offline W&B run was written"
    assert list((out / "eval" / "wandb").glob("offline-run-*")), "the eval tables went to W&B too"


def test_report_keys_and_ranges(smoke_run):
    report = json.loads((smoke_run[0] / "eval" / "report.json").read_text())
    assert report["target"] == "random:tiny-llama" and len(report["target_fingerprint"]) == 16
    assert report["prompts"]["count"] == 4
    assert {(c["name"], c["kind"]) for c in report["candidates"]} == {
        ("fkl", "standalone"),
        ("tv-cache", "standalone"),
        ("eagle3", "eagle3"),
    }  # both kinds in one sweep and one report
    assert "| eagle3 | eagle3 |" in (smoke_run[0] / "eval" / "report.md").read_text()  # the kind column
    for cand in report["candidates"]:
        assert 0 <= cand["expected_acceptance"] <= 1
        # T=0 runs only the greedy rule (identical to sample there): 2 gammas x (T0 greedy, T1 greedy, T1 sample)
        assert len(cand["settings"]) == 6
        for s in cand["settings"]:
            assert 0 <= s["acceptance_rate"] <= 1 and 1 <= s["mean_accepted_length"] <= s["num_draft_tokens"] + 1
            assert len(s["per_position_acceptance"]) == s["num_draft_tokens"]
            assert 0 <= s["expected_acceptance"] <= 1
            assert s["speedup"] > 0 and s["predicted_speedup"] > 0 and s["cost_ratio"] > 0
            assert s["ttft_s"] > 0 and s["tokens_per_s"] > 0 and s["peak_memory_bytes"] > 0
            assert sum(v["count"] for v in s["by_category"].values()) == report["prompts"]["selection"] == 2
            assert set(s["by_length"]) <= {"short", "medium", "long"}
    rec = report["recommendation"]
    assert {"draft", "num_draft_tokens", "draft_rule", "temperature", "enabled", "reason"} <= set(rec)
    assert rec["temperature"] == 0.0 and rec["draft_rule"] == "greedy"
    conf = rec["confirmation"]  # enabled only on the confirmation split's interval (smoke: min_acceptance 0)
    assert rec["enabled"] == (conf["speedup_ci"][0] > 1.05), rec["reason"]


def test_html_is_self_contained(smoke_run):
    text = (smoke_run[0] / "eval" / "report.html").read_text()

    class Collect(html.parser.HTMLParser):
        srcs: list[str] = []

        def handle_starttag(self, tag, attrs):
            self.srcs += [v for k, v in attrs if k in ("src", "href") and v]

    parser = Collect()
    parser.feed(text)
    assert sum(s.startswith("data:image/png;base64,") for s in parser.srcs) >= 5
    assert not [s for s in parser.srcs if s.startswith(("http", "//"))]


def test_serving_config_and_export(smoke_run):
    from transformers import AutoModelForCausalLM

    out = smoke_run[0]
    serving = yaml.safe_load((out / "serving.yaml").read_text())
    report = json.loads((out / "eval" / "report.json").read_text())
    assert serving["target"] == "random:tiny-llama"
    assert serving["speculative"]["enabled"] == report["recommendation"]["enabled"]
    assert len(serving["history"]) == 1
    exported = out / "export" / report["recommendation"]["name"]
    assert (exported / "README.md").is_file() and (exported / "model.safetensors").is_file()
    assert not list(exported.glob("optimizer*")), "the export is the draft alone"
    if serving["speculative"]["enabled"]:
        assert serving["speculative"]["kind"] == report["recommendation"]["kind"]
    if report["recommendation"]["kind"] == "eagle3":  # the head's files are its export
        assert (
            load_file(exported / "model.safetensors").keys()
            == load_file(Path(report["recommendation"]["draft"]) / "model.safetensors").keys()
        )
        return
    draft = AutoModelForCausalLM.from_pretrained(exported)
    source = AutoModelForCausalLM.from_pretrained(report["recommendation"]["draft"])
    ids = torch.tensor([[1, 2, 3]])
    assert torch.equal(draft(ids).logits, source(ids).logits)


def test_rerun_is_a_no_op_and_promote_keeps_history(smoke_run, env, tmp_path):
    out = tmp_path / "run"  # a copy: the module's run stays as its other tests expect it (history of 1)
    shutil.copytree(smoke_run[0], out)  # copy2 + copystat: the mtimes that tell a current report are kept
    report, serving = out / "eval" / "report.json", out / "serving.yaml"
    again = cli("run", ROOT / "configs" / "smoke.yaml", f"output_dir={out}", env=env, cwd=ROOT)
    assert "eval: up to date" in again.stdout
    assert "already distilled" in again.stdout and "cached" in again.stdout + again.stderr
    assert len(yaml.safe_load(serving.read_text())["history"]) == 2, "run promoted once more"
    before = serving.read_text()
    dry = cli_here("promote", report, "--dry-run", env=env, cwd=ROOT)
    assert dry.stdout.startswith(f"--- {serving} (current)") and f"+++ {serving} (promoted)" in dry.stdout
    assert any(line.startswith("+") and "promoted_at" in line for line in dry.stdout.splitlines()), dry.stdout
    assert serving.read_text() == before, "a dry run writes nothing"


# --- bad input -------------------------------------------------------------------------------------------------------


def test_a_second_run_on_the_same_output_dir_is_refused_with_the_holders_pid(env, tmp_path):
    """Two runs writing one output_dir would mix their metrics, timings and promotions: the second is refused before
    it writes anything, naming the holder; once the holder is gone (killed: no clean exit), the lock is free."""
    out = tmp_path / "run"
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD_LOCK, str(out)], env=env, cwd=ROOT, stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout.readline().strip() == "locked"
        for command in ("data", "distill", "eval", "run"):
            r = cli_here(command, ROOT / "configs" / "smoke.yaml", f"output_dir={out}", env=env, check=False)
            assert r.returncode == 2, (command, r.stdout[-2000:], r.stderr[-2000:])
            assert f"in use by another specdistill run (PID {holder.pid}" in r.stderr, r.stderr
            assert "Traceback" not in r.stderr and sorted(p.name for p in out.iterdir()) == [".specdistill.lock"]
    finally:
        holder.kill()
        holder.wait()
    from specdistill.pipeline import dist_state, run_lock

    with run_lock(out, dist_state("cpu")):  # the dead holder's file is still there; its lock is not
        assert (out / ".specdistill.lock").read_text().split()[0] == str(os.getpid())


HOLD_LOCK = """
import sys, time
from specdistill.pipeline import dist_state, run_lock
with run_lock(sys.argv[1], dist_state("cpu")):
    print("locked", flush=True)
    time.sleep(600)
"""


@pytest.mark.parametrize(
    "argv, says",
    [
        (["bench", "--draft", "d", "--repeats", "0"], "argument --repeats: must be >= 1, got 0"),
        (["bench", "--draft", "d", "--batch-size", "0"], "argument --batch-size: must be >= 1, got 0"),
        (["bench", "--draft", "d", "--num-prompts", "0"], "argument --num-prompts: must be >= 1, got 0"),
        (["bench", "--draft", "d", "--num-draft-tokens", "0"], "argument --num-draft-tokens: must be >= 1, got 0"),
        (["generate", "--max-new-tokens", "0", "hi"], "argument --max-new-tokens: must be >= 1, got 0"),
        (["generate", "--top-p", "0", "hi"], "argument --top-p: must be in (0, 1], got 0.0"),
        (["generate", "--temperature", "-1", "hi"], "argument --temperature: must be in [0, 100], got -1.0"),
        (["generate", "--tree", "2,1", "hi"], "--tree needs --draft"),
        (["bench", "--draft", "d", "--json", "{tmp}"], "is a folder; give a file path"),
        (["bench", "--draft", "d", "--num-prompts", "2", "--batch-size", "4"], "--batch-size 4 needs at least 4"),
    ],
)
def test_cli_flags_out_of_range_name_the_flag_before_any_model_loads(argv, says, env, tmp_path):
    r = cli_here(*[a.format(tmp=tmp_path) for a in argv], env=env, check=False)
    assert r.returncode == 2 and says in r.stderr, r.stderr
    assert "Traceback" not in r.stderr and "draft=None" not in r.stderr and "tree=None" not in r.stderr


def test_an_output_dir_that_cannot_be_written_fails_before_any_work_with_one_line(env, tmp_path):
    smoke = ROOT / "configs" / "smoke.yaml"
    blocker = tmp_path / "a-file"
    blocker.write_text("mine")
    r = cli_here("data", smoke, f"output_dir={blocker}", env=env, check=False)
    assert r.returncode == 2 and f"cannot write to output_dir {blocker}" in r.stderr, r.stderr
    assert "a file is in the way" in r.stderr and "Traceback" not in r.stderr
    assert blocker.read_text() == "mine"
    with small_filesystem(tmp_path / "ro", "size=1m", "ro") as ro:
        r = cli_here("distill", smoke, f"output_dir={ro / 'run'}", env=env, check=False)
        assert r.returncode == 2 and "read-only file system" in r.stderr.lower(), r.stderr


def test_a_disk_that_fills_up_mid_stage_says_so_and_leaves_no_temporary_folders(env, tmp_path):
    with small_filesystem(tmp_path / "full", "size=12k") as full:
        r = cli("data", ROOT / "configs" / "smoke.yaml", f"output_dir={full / 'run'}", env=env, cwd=ROOT, check=False)
        assert r.returncode == 2 and "the disk is full" in r.stderr, r.stderr[-2000:]
        assert "Traceback" not in r.stderr
        assert not [p for p in full.rglob("*") if p.name.startswith(".tmp-")], sorted(full.rglob("*"))


def test_promote_refuses_a_report_for_another_target(smoke_run, env, tmp_path):
    serving = tmp_path / "serving.yaml"
    serving.write_text("target: meta-llama/Llama-3.1-8B-Instruct\n")
    r = cli_here("promote", smoke_run[0] / "eval" / "report.json", "--serving", serving, env=env, cwd=ROOT, check=False)
    assert r.returncode == 2 and "was made for target 'random:tiny-llama'" in r.stderr
    assert serving.read_text() == "target: meta-llama/Llama-3.1-8B-Instruct\n"


def test_promote_never_overwrites_invalid_yaml_silently(smoke_run, env, tmp_path):
    serving = tmp_path / "serving.yaml"
    serving.write_text("speculative: [unclosed\n")
    report = smoke_run[0] / "eval" / "report.json"
    r = cli_here("promote", report, "--serving", serving, env=env, cwd=ROOT, check=False)
    assert r.returncode == 2 and "--force" in r.stderr.replace("force=True", "--force")
    assert serving.read_text() == "speculative: [unclosed\n"
    cli_here("promote", report, "--serving", serving, "--force", env=env, cwd=ROOT)
    assert yaml.safe_load(serving.read_text())["target"] == "random:tiny-llama"


def test_eval_bad_inputs(env, tmp_path, smoke_run):
    no_weights = tmp_path / "draft"
    no_weights.mkdir()
    (no_weights / "config.json").write_text("{}")
    r = cli_here(
        "eval",
        "--target",
        "random:tiny-llama",
        "--drafts",
        no_weights,
        "--out",
        tmp_path / "e",
        env=env,
        cwd=ROOT,
        check=False,
    )
    assert r.returncode == 2 and "has no weights" in r.stderr

    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"text": "no accepted field here"}) + "\n")
    best = smoke_run[0] / "candidates" / "fkl" / "best"

    def eval_prompts(prompts):
        args = ("--target", "random:tiny-llama", "--drafts", best, "--prompts", prompts, "--out", tmp_path / "e")
        return cli_here("eval", *args, env=env, cwd=ROOT, check=False)

    r = eval_prompts(bad)
    assert r.returncode == 2 and "prompt" in r.stderr and "messages" in r.stderr and "turns" in r.stderr

    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    r = eval_prompts(empty)
    assert r.returncode == 2 and ("empty" in r.stderr or "no prompts" in r.stderr)


def one_error_line(r) -> str:
    """The answer promised to a mistake: exit 2, one `specdistill:` line, no traceback."""
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-3000:]
    lines = [line for line in r.stderr.splitlines() if line.startswith("specdistill:")]
    assert len(lines) == 1, r.stderr[-3000:]
    return lines[0]


@pytest.fixture(scope="module")
def tiny_draft(tmp_path_factory):
    """A real draft folder (the random tiny Llama saved by save_pretrained); tests damage their own copies."""
    from specdec_runtime.tiny import build_tiny_model

    return build_tiny_model("tiny-llama", tmp_path_factory.mktemp("draft") / "tiny")


@pytest.mark.parametrize("damaged", ["model.safetensors", "config.json"])
def test_a_truncated_file_in_a_draft_folder_is_named_in_one_line_by_every_command(damaged, tiny_draft, env, tmp_path):
    """Issue 24: a truncated model.safetensors gave a SafetensorError traceback from generate, eval and export."""
    draft = tmp_path / "draft"
    shutil.copytree(tiny_draft, draft)
    cut = (draft / damaged).read_bytes()[: (draft / damaged).stat().st_size // 2]
    (draft / damaged).write_bytes(cut)  # an interrupted copy
    target = ("--target", "random:tiny-llama")
    commands = [
        ("generate", *target, "--draft", draft, "--max-new-tokens", "2", "hi"),
        ("bench", *target, "--draft", draft, "--num-prompts", "2", "--repeats", "1"),
        ("eval", *target, "--drafts", draft, "--out", tmp_path / "eval"),
        ("export", draft, tmp_path / "export"),
    ]
    for argv in commands:
        line = one_error_line(cli_here(*argv, env=env, check=False))
        assert f"{draft / damaged} is truncated or corrupt" in line and "complete copy" in line, (argv[0], line)
    assert not (tmp_path / "export").exists() and (draft / damaged).read_bytes() == cut


@pytest.mark.parametrize(
    ("name", "data", "says"),
    [
        ("latin1.jsonl", b'{"prompt": "caf\xe9"}\n', " is not UTF-8 text (byte 0xe9 at offset 15); save it as UTF-8"),
        *TRUNCATED_PROMPT_FILES,
    ],
)
def test_undecodable_and_truncated_prompt_files_are_named_in_one_line(name, data, says, tiny_draft, env, tmp_path):
    """Issue 24: a non-UTF-8 prompt file gave a UnicodeDecodeError and a truncated one a JSON error, neither naming
    the file."""
    bad = tmp_path / name
    bad.write_bytes(data)
    commands = [
        ("data", ROOT / "configs" / "smoke.yaml", f"output_dir={tmp_path / 'run'}", f"data.prompts={bad}"),
        ("bench", "--draft", tiny_draft, "--prompts", bad),
        ("eval", "--target", "random:tiny-llama", "--drafts", tiny_draft, "--prompts", bad, "--out", tmp_path / "e"),
    ]
    for argv in commands:
        line = one_error_line(cli_here(*argv, env=env, check=False))
        assert f"{bad}{says}" in line, (argv[0], line)
    assert not (tmp_path / "run").exists()


def test_promote_into_a_folder_or_onto_a_read_only_path_fails_in_one_line_before_writing(smoke_run, env, tmp_path):
    report, export = smoke_run[0] / "eval" / "report.json", tmp_path / "export"
    folder = tmp_path / "deploy"
    folder.mkdir()
    line = one_error_line(
        cli_here("promote", report, "--serving", folder, "--export-dir", export, env=env, check=False)
    )
    assert f"{folder} is a folder" in line and not any(folder.iterdir()) and not export.exists(), line
    with small_filesystem(tmp_path / "ro", "size=1m", "ro") as ro:
        r = cli_here("promote", report, "--serving", ro / "serving.yaml", "--export-dir", export, env=env, check=False)
        line = one_error_line(r)
        assert str(ro / "serving.yaml") in line and "read-only" in line and not export.exists(), line


def test_a_bug_shows_its_traceback_and_asks_for_a_report(env, monkeypatch):
    """Issue 24: main() printed every ValueError as the user's mistake, a bug's included. Only a UserError is one
    line (exit 2); anything else keeps its traceback, followed by a line asking for a report (exit 1)."""
    from specdec_runtime.errors import UserError
    from specdistill import cli

    def bug(args):
        raise ValueError("an internal invariant broke")

    def mistake(args):
        raise UserError("x.yaml: the problem; the fix")

    monkeypatch.setitem(cli.COMMANDS, "config", bug)
    r = cli_here("config", "show", "x.yaml", env=env, check=False)
    assert r.returncode == 1 and "Traceback (most recent call last)" in r.stderr, r.stderr
    assert "ValueError: an internal invariant broke" in r.stderr and r.stderr.splitlines()[-1] == cli.BUG_LINE
    monkeypatch.setitem(cli.COMMANDS, "config", mistake)
    r = cli_here("config", "show", "x.yaml", env=env, check=False)
    assert r.returncode == 2 and r.stderr == "specdistill: error: x.yaml: the problem; the fix\n", r.stderr


@pytest.mark.parametrize("text", ['{"recommendation": {"enab', "[]", '{"recommendation": {}, "candidates": 3}'])
def test_a_damaged_report_is_not_current_so_run_evaluates_again(text, tmp_path):
    """A truncated or hand-edited eval/report.json made `run` stop with a traceback before its eval stage."""
    from specdistill.config import load_config
    from specdistill.pipeline import eval_is_current

    cfg = load_config(ROOT / "configs" / "smoke.yaml", [f"output_dir={tmp_path}"])
    report = tmp_path / "eval" / "report.json"
    report.parent.mkdir()
    report.write_text(text)
    assert eval_is_current(cfg, report) is False


def test_eval_spec_bench_file_by_category(env, tmp_path, smoke_run):
    spec_bench = tmp_path / "question.jsonl"
    rows = [
        {"question_id": i, "category": cat, "turns": [f"Tell me about {cat} number {i}.", "And more?"]}
        for i, cat in enumerate(["writing", "writing", "math", "math", "writing", "writing", "coding", "coding"])
    ]
    spec_bench.write_text("".join(json.dumps(r) + "\n" for r in rows))
    run_dir = smoke_run[0] / "candidates" / "fkl"
    cli_here(
        "eval",
        "--target",
        "random:tiny-llama",
        "--drafts",
        run_dir,
        "--prompts",
        spec_bench,
        "--out",
        tmp_path / "e",
        "eval.num_draft_tokens=[2]",
        "eval.temperatures=[0.0]",
        "eval.max_new_tokens=8",
        "eval.max_prompts=0",
        env=env,
        cwd=ROOT,
    )
    report = json.loads((tmp_path / "e" / "report.json").read_text())
    names = [c["name"] for c in report["candidates"]]
    assert names[0] == "fkl" and any("@step-" in n for n in names), "a run dir gives best/ and its kept checkpoints"
    # The sweep measures the selection half (alternate prompts): writing, math, writing, coding.
    by_cat = report["candidates"][0]["settings"][0]["by_category"]
    assert by_cat["writing"]["count"] == 2 and set(by_cat) == {"writing", "math", "coding"}


def test_cli_help_lists_only_working_commands(env):
    r = cli_here("--help", env=env, cwd=ROOT)
    commands = ["config", "generate", "bench", "data", "distill", "eval", "promote", "export", "run"]
    for name in commands:
        assert name in r.stdout
        sub = cli_here(name, "--help", env=env, cwd=ROOT, check=False)
        assert "example:" in sub.stdout, f"`specdistill {name} --help` shows an example"


@pytest.mark.slow
def test_eval_split_over_two_processes_matches_one(env, tmp_path, smoke_run):
    """torchrun through this interpreter (`python -m torch.distributed.run`), 2 CPU processes (gloo): prompts are
    split, counters merged on rank 0; at T=0 the pooled counts equal a 1-process run's exactly (same tokens, same
    accept decisions)."""
    best = smoke_run[0] / "candidates" / "fkl" / "best"
    args = [
        "eval",
        "eval.num_draft_tokens=[2]",
        "eval.temperatures=[0.0]",
        "eval.max_new_tokens=8",
        "eval.max_prompts=4",
        "tracking.backend=none",
        "--target",
        "random:tiny-llama",
        "--drafts",
        best,
    ]
    cli_here(*args, "--out", tmp_path / "one", env=env)
    two = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            "2",
            "-m",
            "specdistill",
            *map(str, args),
            "--out",
            tmp_path / "two",
        ],
        capture_output=True,
        text=True,
        env={**env, "OMP_NUM_THREADS": "1"},
        cwd=ROOT,
    )
    assert two.returncode == 0, two.stderr[-3000:]
    one_r, two_r = (json.loads((tmp_path / d / "report.json").read_text()) for d in ("one", "two"))
    assert two_r["prompts"]["count"] == one_r["prompts"]["count"] == 4
    s1, s2 = one_r["candidates"][0]["settings"][0], two_r["candidates"][0]["settings"][0]
    for key in ("acceptance_rate", "mean_accepted_length", "new_tokens", "target_forwards"):
        assert s2[key] == pytest.approx(s1[key]), key


@pytest.mark.slow
def test_data_and_distill_on_two_processes_with_the_shipped_launcher_file(env, tmp_path, smoke_run):
    """The README's CPU multi-process command, `accelerate launch --config_file configs/accelerate/cpu_2proc.yaml -m
    specdistill distill configs/smoke.yaml`: two processes split the teacher data (the same rows as one process)
    and train every candidate with world size 2."""
    from distill.data import load_teacher_data

    out = tmp_path / "two"
    with socket.socket() as sock:  # the file's port may be taken on a shared machine
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    cmd = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        ROOT / "configs" / "accelerate" / "cpu_2proc.yaml",
        "--main_process_port",
        port,
        "-m",
        "specdistill",
        "distill",
        ROOT / "configs" / "smoke.yaml",
        f"output_dir={out}",
    ]
    two = subprocess.run(
        [str(c) for c in cmd],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**env, "OMP_NUM_THREADS": "1"},
        timeout=600,
    )
    assert two.returncode == 0, (two.stdout + two.stderr)[-3000:]

    one_data = sorted((smoke_run[0] / "data").glob("teacher-*"))
    assert [p.name for p in sorted((out / "data").glob("teacher-*"))] == [p.name for p in one_data]
    for path in one_data:
        rows = {
            split: sorted(map(tuple, load_teacher_data(root / path.name)["input_ids"]))
            for split, root in (("one", smoke_run[0] / "data"), ("two", out / "data"))
        }
        assert rows["two"] == rows["one"], path.name
    for cand in ("fkl", "tv-cache", "eagle3"):
        last = sorted((out / "candidates" / cand / "checkpoints").glob("step-*"))[-1]
        assert json.loads((last / "trainer_state.json").read_text())["world_size"] == 2
        assert (out / "candidates" / cand / "best" / "model.safetensors").is_file()


def test_eval_refuses_test_prompts_the_drafts_were_trained_or_validated_on(tmp_path, isolated_cache):
    from distill.config import DataConfig
    from specdec_runtime.loading import load_model
    from specdistill.pipeline import eval_prompts

    _, tokenizer = load_model("random:tiny-llama", device="cpu")

    def write(name: str, prompts: list[str], prefix: str) -> str:
        rows = [{"id": f"{prefix}{i}", "prompt": p} for i, p in enumerate(prompts)]
        (tmp_path / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
        return str(tmp_path / name)

    evals = write("eval.jsonl", [f"Question number {i}?" for i in range(6)], "q")
    train = write("train.jsonl", ["question NUMBER 4?", "Something else"], "t")
    validation = write("split.jsonl", ["An unrelated held-out prompt"], "s")

    trained = DataConfig(prompts=train, validation_prompts=validation)
    with pytest.raises(ValueError, match=r"6 test prompts \(eval.prompts=.*eval.jsonl\) share 1 with the training"):
        eval_prompts(evals, tokenizer, 0, trained_on=trained)
    # Only the prompts the sweep uses count (eval.max_prompts=4 stops before q4); without a data section, no check.
    assert [p.id for p in eval_prompts(evals, tokenizer, 4, trained_on=trained)] == ["q0", "q1", "q2", "q3"]
    assert [p.id for p in eval_prompts(evals, tokenizer, 0)] == [f"q{i}" for i in range(6)]
    # Validating on the test prompts is refused too, although it keeps them out of training.
    with pytest.raises(ValueError, match="share 6 with the validation prompts"):
        eval_prompts(evals, tokenizer, 0, trained_on=DataConfig(prompts=train, validation_prompts=evals))


def test_run_with_overlapping_prompt_roles_refuses_to_start(env, tmp_path):
    out = tmp_path / "run"
    r = cli_here(
        "run",
        ROOT / "configs" / "smoke.yaml",
        f"output_dir={out}",
        "eval.prompts=builtin:validation",
        env=env,
        check=False,
    )
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "test prompts (eval.prompts=builtin:validation) share 4 with the validation prompts" in r.stderr
    assert not out.exists(), "refused before any stage wrote anything"
