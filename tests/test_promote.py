"""Promotion into the serving config: the contract's layout, history, dry-run diff, refusals (in the library and from
the standalone command), atomicity, locking. Promotion loads the target's config and tokenizer itself: the reports
here name `random:tiny-llama` (built once into this module's cache) or a local folder."""

from __future__ import annotations

import contextlib
import copy
import io
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import yaml

from eval.promote import load_target_view, promote
from eval.results import target_fingerprint
from specdec_runtime.errors import UserError
from specdec_runtime.loading import VocabMismatchError
from specdec_runtime.tiny import byte_level_tokenizer

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module", autouse=True)
def tiny_cache(tmp_path_factory):
    """One model cache for the module (its subprocesses inherit it): random:tiny-llama is built once."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SPECDISTILL_CACHE", str(tmp_path_factory.mktemp("cache")))
        yield


def fingerprint_of(spec: str) -> str:
    view = load_target_view(spec)
    return target_fingerprint(view, view.tokenizer)


def write_report(
    folder: Path,
    name: str = "trunc2-fkl",
    gamma: int = 4,
    enabled: bool = True,
    target: str = "random:tiny-llama",
    fingerprint: str | None = None,
    max_concurrency: int = 16,
    measured_concurrency: tuple[int, ...] = (1, 4, 16),
) -> Path:
    """A report.json (contract of eval/results.py) recommending `name` with `gamma`, its draft folder a tiny
    2-layer Llama with the target's tokenizer."""
    from helpers.models import tiny_llama

    draft = folder / "candidates" / name / "best"
    if not (draft / "model.safetensors").is_file():
        tiny_llama(vocab_size=259, layers=2).save_pretrained(draft)
        byte_level_tokenizer().save_pretrained(draft)
    confirmation = {
        "acceptance_rate": 0.71,
        "mean_accepted_length": 3.1,
        "speedup": 1.8 if enabled else 0.9,
        "speedup_ci": [1.7, 1.9] if enabled else [0.85, 0.95],
        "split": "confirmation",
        "batch_size": 1,
        "prompts": 16,
        "max_concurrency": max_concurrency if enabled else None,
        "measured_concurrency": list(measured_concurrency),
    }
    report = {
        "schema_version": 1,
        "created_at": "2026-11-29T12:00:00Z",
        "target": target,
        "target_fingerprint": fingerprint,
        "device": "cpu",
        "candidates": [],
        "recommendation": {
            "name": name,
            "draft": str(draft),
            "num_draft_tokens": gamma,
            "draft_rule": "greedy",
            "temperature": 0.0,
            "enabled": enabled,
            "confirmation": confirmation,
            "reason": "both gates passed: 1.80x [1.70, 1.90] on the confirmation split"
            if enabled
            else "speedup gate: 0.90x [0.85, 0.95] on the confirmation split does not clear 1.05",
        },
    }
    path = folder / f"report-{name}-{gamma}.json"
    path.write_text(json.dumps(report))
    return path


def word_level_tokenizer(words: list[str]):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate([*words, "<unk>"])}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>")


def load(path: Path) -> dict:
    return yaml.safe_load(path.read_text())


def test_promote_writes_the_serving_contract(tmp_path):
    report = write_report(tmp_path)
    serving = tmp_path / "serving.yaml"
    summary = promote(report, serving)
    cfg = load(serving)
    draft = str((tmp_path / "candidates" / "trunc2-fkl" / "best").resolve())
    assert "trunc2-fkl" in summary and str(serving) in summary
    assert cfg["target"] == "random:tiny-llama"
    spec = cfg["speculative"]
    assert spec["enabled"] is True and spec["draft"] == draft and spec["num_draft_tokens"] == 4
    assert spec["draft_rule"] == "greedy"
    assert spec["measured"] == {
        "acceptance_rate": 0.71,
        "mean_accepted_length": 3.1,
        "speedup": 1.8,
        "speedup_ci": [1.7, 1.9],
        "split": "confirmation",
        "batch_size": 1,
        "prompts": 16,
        "max_concurrency_measured": 16,
        "measured_concurrency": [1, 4, 16],
        "eval_report": str(report.resolve()),
    }
    assert spec["max_concurrency_measured"] == 16 and spec["concurrency_limit"] is None
    assert "max_concurrency" not in spec and spec["kind"] == "standalone"
    engines = cfg["engines"]
    assert engines["vllm"] == {
        "speculative_config": {"model": draft, "num_speculative_tokens": 4, "method": "draft_model"}
    }
    sglang = engines["sglang"]
    flags = dict(zip(sglang[::2], sglang[1::2]))
    assert flags == {
        "--speculative-algorithm": "STANDALONE",
        "--speculative-draft-model-path": draft,
        "--speculative-num-steps": 4,
        "--speculative-eagle-topk": 1,
        "--speculative-num-draft-tokens": 5,
    }
    assert engines["trtllm"]["speculative_config"] == {
        "decoding_type": "DraftTarget",
        "max_draft_len": 4,
        "speculative_model": draft,
    }
    text = serving.read_text()  # each engine's version floor, as a comment above its settings
    assert (
        "  # needs: vLLM >= 0.15.0 for V1 draft models (`method: draft_model`, PR #24322; 0.14.1 refuses it)\n  vllm:"
        in text
    )
    assert "  # needs: SGLang >= 0.5.2 for `--speculative-algorithm STANDALONE` (PR #10090)\n  sglang:" in text
    assert "  # needs: TensorRT-LLM PyTorch backend with DraftTargetDecodingConfig and `speculative_model`" in text
    (entry,) = cfg["history"]
    assert entry["draft"] == draft and entry["replaced"] is None and entry["measured"] == spec["measured"]
    assert entry["promoted_at"].endswith("Z")
    assert "*id" not in serving.read_text() and "&id" not in serving.read_text()  # plain YAML, no aliases


def test_history_across_promotions_keeps_foreign_settings(tmp_path):
    serving = tmp_path / "serving.yaml"
    promote(write_report(tmp_path, "first", gamma=4), serving)
    cfg = load(serving)
    # A deployment's own settings, which promotion must not touch.
    cfg["port"] = 8000
    cfg["engines"]["vllm"]["tensor_parallel_size"] = 2
    cfg["engines"]["sglang"] = ["--tp-size", 2, *cfg["engines"]["sglang"], "--mem-fraction-static", 0.8]
    serving.write_text(yaml.safe_dump(cfg, sort_keys=False))
    summary = promote(write_report(tmp_path, "second", gamma=3), serving)
    cfg = load(serving)
    first = str((tmp_path / "candidates" / "first" / "best").resolve())
    second = str((tmp_path / "candidates" / "second" / "best").resolve())
    assert f"replacing {first}" in summary
    assert [h["draft"] for h in cfg["history"]] == [first, second]
    assert cfg["history"][1]["replaced"] == first and cfg["history"][1]["num_draft_tokens"] == 3
    assert cfg["speculative"]["draft"] == second and cfg["speculative"]["num_draft_tokens"] == 3
    assert cfg["port"] == 8000 and cfg["engines"]["vllm"]["tensor_parallel_size"] == 2
    assert cfg["engines"]["vllm"]["speculative_config"]["num_speculative_tokens"] == 3
    sglang = cfg["engines"]["sglang"]
    assert sglang[:4] == ["--tp-size", 2, "--mem-fraction-static", 0.8]
    assert sglang.count("--speculative-num-steps") == 1 and sglang[sglang.index("--speculative-num-steps") + 1] == 3
    assert sglang[sglang.index("--speculative-draft-model-path") + 1] == second


def test_disabled_recommendation_turns_speculation_off(tmp_path):
    serving = tmp_path / "serving.yaml"
    promote(write_report(tmp_path, "first"), serving)
    summary = promote(write_report(tmp_path, "weak", enabled=False), serving)
    cfg = load(serving)
    assert "disabled" in summary
    assert cfg["speculative"]["enabled"] is False and "speedup gate" in cfg["speculative"]["reason"]
    assert cfg["speculative"]["measured"]["speedup_ci"] == [0.85, 0.95]
    assert "draft" not in cfg["speculative"]
    engines = cfg["engines"]
    assert "speculative_config" not in engines["vllm"] and "speculative_config" not in engines["trtllm"]
    assert not [a for a in engines["sglang"] if str(a).startswith("--speculative")]
    assert engines["speculative"].startswith("off")
    assert cfg["history"][-1]["draft"] is None and cfg["history"][-1]["enabled"] is False
    assert cfg["history"][-1]["replaced"] == str((tmp_path / "candidates" / "first" / "best").resolve())


def test_dry_run_prints_diff_and_writes_nothing(tmp_path):
    serving = tmp_path / "serving.yaml"
    diff = promote(write_report(tmp_path, "first"), serving, dry_run=True)
    assert not serving.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["candidates", "report-first-4.json"]
    assert diff.startswith(f"--- {serving} (current)\n+++ {serving} (promoted)\n")
    assert "+  num_draft_tokens: 4" in diff
    promote(write_report(tmp_path, "first"), serving)
    before = serving.read_bytes()
    listing = sorted(p.name for p in tmp_path.iterdir())
    diff = promote(write_report(tmp_path, "second", gamma=2), serving, dry_run=True)
    assert serving.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([*listing, "report-second-2.json"])
    assert "-  num_draft_tokens: 4" in diff and "+  num_draft_tokens: 2" in diff
    assert "+  replaced: " in diff  # the new history entry names the draft it replaces


def test_refuses_vocabulary_mismatch(tmp_path):
    """The draft's own tokenizer, loaded by promote, against the target's."""
    report, serving = write_report(tmp_path), tmp_path / "serving.yaml"
    word_level_tokenizer(["hello", "world"]).save_pretrained(tmp_path / "candidates" / "trunc2-fkl" / "best")
    with pytest.raises(VocabMismatchError, match="differ at id 0"):
        promote(report, serving)
    assert not serving.exists()
    byte_level_tokenizer().save_pretrained(tmp_path / "candidates" / "trunc2-fkl" / "best")
    promote(report, serving)
    assert load(serving)["speculative"]["enabled"] is True


def local_target(folder: Path, layers: int = 4) -> str:
    """A target as a local HF folder (a tiny Llama and the byte-level tokenizer)."""
    from helpers.models import tiny_llama

    tokenizer = byte_level_tokenizer()
    tiny_llama(vocab_size=len(tokenizer), layers=layers).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


def test_refuses_report_for_another_target(tmp_path):
    a, b = local_target(tmp_path / "a"), local_target(tmp_path / "b", layers=3)
    serving = tmp_path / "serving.yaml"
    report = write_report(tmp_path, target=a)  # no fingerprint: the spec decides
    with pytest.raises(ValueError, match=f"made for target '{a}', not for '{b}'"):
        promote(report, serving, expected_target=b)
    report = write_report(tmp_path, target="org/model-a", fingerprint=fingerprint_of(a))  # the fingerprint decides
    with pytest.raises(ValueError, match=rf"fingerprint {fingerprint_of(a)}\).*fingerprint {fingerprint_of(b)}"):
        promote(report, serving, expected_target=b)
    assert not serving.exists()
    promote(report, serving, expected_target=a)  # another name of the same target: its fingerprint agrees
    assert serving.exists()


def test_refuses_a_report_whose_target_changed_since_the_eval(tmp_path):
    a = local_target(tmp_path / "a")
    report = write_report(tmp_path, target=a, fingerprint="ffffffffffffffff")
    with pytest.raises(ValueError, match="now has fingerprint .* re-run eval against it"):
        promote(report, tmp_path / "serving.yaml")
    assert not (tmp_path / "serving.yaml").exists()


def test_same_target_through_another_path_is_accepted(tmp_path):
    target = local_target(tmp_path / "target")
    report = write_report(tmp_path, target=target, fingerprint=fingerprint_of(target))
    promote(report, tmp_path / "serving.yaml", expected_target=str(tmp_path / "." / "target"))
    assert load(tmp_path / "serving.yaml")["target"] == target


@pytest.mark.parametrize(
    "content, problem", [("target: [unclosed\n", "not valid YAML"), ("- a\n- list\n", "a YAML list")]
)
def test_refuses_to_overwrite_a_broken_serving_file(tmp_path, content, problem):
    report, serving = write_report(tmp_path), tmp_path / "serving.yaml"
    serving.write_text(content)
    with pytest.raises(ValueError, match=f"is {problem}.*force=True"):
        promote(report, serving)
    with pytest.raises(ValueError, match="force=True"):
        promote(report, serving, dry_run=True)
    assert serving.read_text() == content
    promote(report, serving, force=True)
    assert load(serving)["speculative"]["enabled"] is True and len(load(serving)["history"]) == 1
    (broken,) = tmp_path.glob("serving.yaml.broken-*")
    assert broken.read_text() == content


def test_refuses_an_unfinished_report(tmp_path):
    path = tmp_path / "report.json"
    path.write_text(json.dumps({"schema_version": 1, "target": "t", "candidates": []}))
    with pytest.raises(ValueError, match="has no recommendation"):
        promote(path, tmp_path / "serving.yaml")


def test_failed_rename_leaves_old_config(tmp_path, monkeypatch):
    serving = tmp_path / "serving.yaml"
    promote(write_report(tmp_path, "first"), serving)
    before = serving.read_bytes()

    def crash(*args):
        raise OSError("simulated crash before rename")

    monkeypatch.setattr("specdec_runtime.atomic.os.replace", crash)
    with pytest.raises(OSError, match="simulated crash"):
        promote(write_report(tmp_path, "second"), serving)
    assert serving.read_bytes() == before
    assert not list(tmp_path.glob(".serving.yaml.*.tmp"))


HALF_WRITE = textwrap.dedent("""
    import os, pathlib, sys, time
    import eval.promote as P
    import specdec_runtime.atomic as A

    real_fdopen = os.fdopen

    class HalfThenHang:
        # Writes half of the new config to the temp file, signals the test, then hangs until killed.
        def __init__(self, f):
            self.f = f
        def __enter__(self):
            return self
        def __exit__(self, *exc):
            self.f.close()
        def write(self, text):
            self.f.write(text[: len(text) // 2])
            self.f.flush()
            pathlib.Path(sys.argv[3]).touch()
            time.sleep(120)
        def __getattr__(self, name):
            return getattr(self.f, name)

    A.os.fdopen = lambda fd, mode="r": HalfThenHang(real_fdopen(fd, mode))
    P.promote(pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2]))
""")


def test_kill_mid_write_leaves_old_config(tmp_path):
    serving = tmp_path / "serving.yaml"
    promote(write_report(tmp_path, "first"), serving)
    before = serving.read_bytes()
    marker = tmp_path / "half-written"
    proc = subprocess.Popen(
        [sys.executable, "-c", HALF_WRITE, str(write_report(tmp_path, "second")), str(serving), str(marker)], cwd=REPO
    )
    try:
        deadline = time.time() + 60
        while not marker.exists():
            assert proc.poll() is None and time.time() < deadline, "the writer never reached the half-way point"
            time.sleep(0.05)
        (temp,) = tmp_path.glob(".serving.yaml.*.tmp")
        assert 0 < temp.stat().st_size < len(before) + 200  # half of the new file sits in the temp file
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    assert serving.read_bytes() == before
    assert load(serving)["speculative"]["draft"].endswith("first/best")
    promote(write_report(tmp_path, "third"), serving)  # the stale lock of the killed process does not block
    assert len(load(serving)["history"]) == 2


CONCURRENT = textwrap.dedent("""
    import pathlib, sys, time
    import yaml
    import eval.promote as P

    real_load = yaml.safe_load

    def slow_load(text):
        # Widen the read-modify-write window: without the lock, both processes would read the same old history.
        out = real_load(text)
        time.sleep(0.5)
        return out

    P.yaml.safe_load = slow_load
    go = pathlib.Path(sys.argv[3])
    while not go.exists():
        time.sleep(0.01)
    print(P.promote(pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])))
""")


def test_concurrent_promotions_both_land(tmp_path):
    serving = tmp_path / "serving.yaml"
    promote(write_report(tmp_path, "first"), serving)
    go = tmp_path / "go"
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", CONCURRENT, str(write_report(tmp_path, name)), str(serving), str(go)],
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for name in ("a", "b")
    ]
    time.sleep(0.5)  # let both interpreters start and wait on the go file
    go.touch()
    for proc in procs:
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, err
    history = load(serving)["history"]
    names = [Path(h["draft"]).parent.name for h in history]
    assert names[0] == "first" and sorted(names[1:]) == ["a", "b"]
    assert history[2]["replaced"] == history[1]["draft"]  # the second writer saw the first one's result


def test_concurrency_limit_becomes_vllms_batch_size_schedule(tmp_path):
    """Speculation confirmed up to batch size 4 of the measured [1, 4, 16]: vLLM drafts nothing above 4."""
    serving = tmp_path / "serving.yaml"
    promote(write_report(tmp_path, max_concurrency=4), serving)
    cfg = load(serving)
    assert cfg["speculative"]["max_concurrency_measured"] == 4 and cfg["speculative"]["concurrency_limit"] == 4
    spec = cfg["engines"]["vllm"]["speculative_config"]
    assert spec["num_speculative_tokens_per_batch_size"] == [[1, 4, 4], [5, 5, 0]]
    promote(write_report(tmp_path, max_concurrency=16), serving)  # cleared at every measured batch size: no limit
    cfg = load(serving)
    assert cfg["speculative"]["max_concurrency_measured"] == 16 and cfg["speculative"]["concurrency_limit"] is None
    assert "num_speculative_tokens_per_batch_size" not in cfg["engines"]["vllm"]["speculative_config"]


def test_only_batch_one_measured_is_no_cap(tmp_path):
    """Batch size 1 alone measured: serving.yaml says it was measured there, sets no limit and no vLLM schedule."""
    serving = tmp_path / "serving.yaml"
    promote(write_report(tmp_path, max_concurrency=1, measured_concurrency=(1,)), serving)
    text, cfg = serving.read_text(), load(serving)
    spec = cfg["speculative"]
    assert spec["max_concurrency_measured"] == 1 and spec["concurrency_limit"] is None
    assert spec["measured"]["max_concurrency_measured"] == 1 and spec["measured"]["measured_concurrency"] == [1]
    assert "max_concurrency:" not in text and "a measurement, not a cap" in text
    assert "num_speculative_tokens_per_batch_size" not in cfg["engines"]["vllm"]["speculative_config"]


def cli_promote(*args) -> tuple[int, str, str]:
    """`specdistill promote ...` through the CLI's entry point in this process: (exit code, stdout, stderr)."""
    from specdistill.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(["promote", *map(str, args)])
    return rc, out.getvalue(), err.getvalue()


def test_standalone_promote_checks_exports_and_refuses_in_one_line(tmp_path, monkeypatch):
    """`specdistill promote` alone is `run`'s promotion: it loads the run's target and the draft's tokenizer, refuses
    a draft with another tokenizer or a report for another target (the run's, or the deployment file's) with one
    line and exit code 2, writing and exporting nothing; otherwise it exports the draft and serves the export."""
    from helpers.models import tiny_llama

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # the hub id below is refused without a network round trip
    out, a, b = tmp_path / "run", local_target(tmp_path / "a"), local_target(tmp_path / "b", layers=3)
    (out / "eval").mkdir(parents=True)
    report = write_report(out, target=a, fingerprint=fingerprint_of(a)).rename(out / "eval" / "report.json")
    draft = out / "candidates" / "trunc2-fkl" / "best"
    tiny_llama(vocab_size=259, layers=2).save_pretrained(draft)
    word_level_tokenizer(["hello", "world"]).save_pretrained(draft)

    def refused(needle: str) -> None:
        rc, stdout, stderr = cli_promote(report)
        assert rc == 2 and stdout == "" and stderr.startswith("specdistill: error: ") and stderr.count("\n") == 1
        assert needle in stderr, stderr
        assert sorted(p.name for p in out.iterdir()) == ["candidates", "config.yaml", "eval"]  # nothing written

    (out / "config.yaml").write_text(yaml.safe_dump({"target": {"model": a}}))
    refused("differ at id 0")  # the draft's tokenizer is not the target's
    byte_level_tokenizer().save_pretrained(draft)
    (out / "config.yaml").write_text(yaml.safe_dump({"target": {"model": b}}))
    refused(f"was made for target '{a}' (fingerprint {fingerprint_of(a)}), not for '{b}'")  # the run's target
    (out / "config.yaml").write_text(yaml.safe_dump({"target": {"model": a}}))
    rc, stdout, _ = cli_promote(report, "--serving", tmp_path / "deploy.yaml", "--dry-run")
    assert rc == 0 and "+target: " + a in stdout and not (out / "export").exists()  # a dry run exports nothing
    (tmp_path / "deploy.yaml").write_text("target: org/another-model\n")
    rc, _, stderr = cli_promote(report, "--serving", tmp_path / "deploy.yaml")
    assert rc == 2 and "not for 'org/another-model'" in stderr and stderr.count("\n") == 1  # the deployment's target
    assert (tmp_path / "deploy.yaml").read_text() == "target: org/another-model\n"

    rc, stdout, _ = cli_promote(report)
    export = out / "export" / "trunc2-fkl"
    assert rc == 0 and f"({export}, num_draft_tokens=4" in stdout
    assert (export / "model.safetensors").is_file() and (export / "README.md").is_file()
    assert load(out / "serving.yaml")["speculative"]["draft"] == str(export)


def tree(folder: Path) -> dict[str, bytes]:
    """Every file under `folder` with its bytes: what "untouched" means."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def edit(report: dict, change) -> dict:
    edited = copy.deepcopy(report)
    change(edited["recommendation"])
    return edited


HAND_EDITS = {  # issue 24's hand-edited reports (and their kin): each is refused with one line naming the problem
    "enabled against a failed gate": (
        lambda r: r["confirmation"].update(speedup=0.80, speedup_ci=[0.19, 1.40]),
        "recommendation.enabled is true, but its confirmation's speedup_ci [0.19, 1.4] does not clear "
        "1 + min_speedup_margin = 1.05",
    ),
    "disabled against passed gates": (
        lambda r: r.update(enabled=False),
        "recommendation.enabled is false, but its confirmation (speedup_ci [1.7, 1.9], acceptance_rate 0.71) passes",
    ),
    "a draft that does not exist": (
        lambda r: r.update(draft=r["draft"].replace("trunc2-fkl", "gone")),
        "/candidates/gone/best does not exist or is not a folder",
    ),
    "a draft of another tokenizer": (
        lambda r: r.update(draft=r["draft"].replace("trunc2-fkl", "words")),
        "differ at id 0",
    ),
    "acceptance_rate: high": (
        lambda r: r["confirmation"].update(acceptance_rate="high"),
        'recommendation.confirmation.acceptance_rate is "high", expected a number in [0, 1]',
    ),
    "speedup_ci: [2.0]": (
        lambda r: r["confirmation"].update(speedup_ci=[2.0]),
        "recommendation.confirmation.speedup_ci is [2.0], expected two numbers [lo, hi] with lo <= hi",
    ),
    "num_draft_tokens: 0": (lambda r: r.update(num_draft_tokens=0), "num_draft_tokens is 0, expected an integer >= 1"),
    "kind: eagle3 for a standalone draft": (
        lambda r: r.update(kind="eagle3"),
        "recommendation.kind is eagle3, but",
    ),
    "kind: medusa": (lambda r: r.update(kind="medusa"), 'recommendation.kind is "medusa", expected one of standalone'),
    "name: ..": (lambda r: r.update(name=".."), 'recommendation.name is "..", expected a folder name'),
}


def test_hand_edited_reports_are_refused_before_anything_is_written(tmp_path):
    """Issue 24: a hand-edited report was promoted with `enabled: true` against a failed gate, a missing draft, a draft
    of another tokenizer, `acceptance_rate: "high"`, `speedup_ci: [2.0]` (serving.yaml written, then a traceback).
    Through `specdistill promote` on a run's folder: each is exit 2 with one line, serving.yaml and the export
    untouched; the decision is made again under the run config's gates, and --force promotes a disagreeing report
    with the disagreement recorded."""
    from helpers.models import tiny_llama

    out, a = tmp_path / "run", local_target(tmp_path / "a")
    (out / "eval").mkdir(parents=True)
    report_path = write_report(out, target=a, fingerprint=fingerprint_of(a)).rename(out / "eval" / "report.json")
    words = out / "candidates" / "words" / "best"
    tiny_llama(vocab_size=259, layers=2).save_pretrained(words)
    word_level_tokenizer(["hello", "world"]).save_pretrained(words)
    serving = {"temperature": 0.0, "draft_rule": "greedy", "min_acceptance": 0.5, "min_speedup_margin": 0.05}
    (out / "config.yaml").write_text(yaml.safe_dump({"target": {"model": a}, "serving": serving}))
    rc, stdout, stderr = cli_promote(report_path)
    assert rc == 0, stderr
    report, before = json.loads(report_path.read_text()), tree(out)

    for case, (change, needle) in HAND_EDITS.items():
        report_path.write_text(json.dumps(edit(report, change)))
        rc, stdout, stderr = cli_promote(report_path)
        assert rc == 2 and stdout == "" and stderr.startswith("specdistill: error: "), (case, stderr)
        assert stderr.count("\n") == 1 and needle in stderr, (case, stderr)
        after = tree(out)
        assert after.pop("eval/report.json") != before["eval/report.json"]
        assert after == {k: v for k, v in before.items() if k != "eval/report.json"}, case  # nothing written
    report_path.write_text('{"schema_version": 1, "recommendation": {"enab')  # truncated
    rc, _, stderr = cli_promote(report_path)
    assert rc == 2 and f"{report_path} is not valid JSON" in stderr and stderr.count("\n") == 1

    report_path.write_text(json.dumps(edit(report, HAND_EDITS["enabled against a failed gate"][0])))
    rc, stdout, _ = cli_promote(report_path, "--force")  # promoted as it says, the disagreement on record
    spec = load(out / "serving.yaml")["speculative"]
    assert (
        rc == 0
        and spec["enabled"] is True
        and "[promoted with --force although recommendation.enabled" in spec["reason"]
    )
    assert "does not clear" in load(out / "serving.yaml")["history"][-1]["forced"]


def test_gates_come_from_the_run_config_else_the_report(tmp_path):
    """The decision is checked against the run config's serving section next to the report; without one, against the
    gates the report recorded; a run config that changed the gates since the eval makes the report stale."""
    report_path, serving = write_report(tmp_path), tmp_path / "serving.yaml"
    report = json.loads(report_path.read_text())
    report["recommendation"]["gates"] = {"min_acceptance": 0.9, "min_speedup_margin": 0.05}
    report_path.write_text(json.dumps(report))
    with pytest.raises(UserError, match=r"acceptance_rate 0.71 is below min_acceptance 0.9 \(the gates the report"):
        promote(report_path, serving)
    (tmp_path / "eval").mkdir()
    moved = report_path.rename(tmp_path / "eval" / "report.json")
    (tmp_path / "config.yaml").write_text(yaml.safe_dump({"serving": {"temperature": 1.0, "draft_rule": "sample"}}))
    with pytest.raises(UserError, match=r"is for temperature 0 \(greedy\), but the serving gates of .*yaml serve"):
        promote(moved, serving)
    (tmp_path / "config.yaml").write_text(yaml.safe_dump({"serving": {"min_acceptance": 0.7}}))
    promote(moved, serving)  # the run's gates decide, and the report's numbers pass them
    assert load(serving)["speculative"]["enabled"] is True


def test_a_serving_path_that_is_a_folder_or_read_only_is_one_line_before_the_export(tmp_path):
    from helpers.runs import small_filesystem

    report, export = write_report(tmp_path), tmp_path / "drafts"
    (tmp_path / "deploy").mkdir()
    rc, _, stderr = cli_promote(report, "--serving", tmp_path / "deploy", "--export-dir", export)
    assert rc == 2 and "is a folder; give a file path" in stderr and stderr.count("\n") == 1, stderr
    with small_filesystem(tmp_path / "ro", "size=1m", "ro") as ro:
        rc, _, stderr = cli_promote(report, "--serving", ro / "serving.yaml", "--export-dir", export)
        assert rc == 2 and f"{ro} is on a read-only filesystem" in stderr and stderr.count("\n") == 1, stderr
    assert not export.exists()  # refused before the export was written


def test_a_head_saved_by_speculators_is_refused_by_name(tmp_path):
    """A speculators-format head (eval reads it) is refused with the reason, not as a head of another target."""
    from types import SimpleNamespace

    from eval.promote import TargetView, check_draft

    folder = tmp_path / "spec"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"speculators_model_type": "eagle3", "draft_vocab_size": 8}))
    target = TargetView(SimpleNamespace(vocab_size=259, hidden_size=64), None)
    with pytest.raises(UserError, match="saved by the speculators package.*serve it with vLLM"):
        check_draft({"draft": str(folder)}, target)


def test_a_head_with_a_variant_the_engines_do_not_compute_is_refused_by_name(tmp_path):
    """Our head trained with draft.norm_before_fc or draft.norm_output (eval measures it) is refused naming the key
    to train it without; norm_before_residual, which vLLM reads from config.json, goes on to the usual checks."""
    from types import SimpleNamespace

    from eval.promote import TargetView, check_draft

    folder = tmp_path / "head"
    folder.mkdir()
    base = {"architectures": ["LlamaForCausalLMEagle3"], "vocab_size": 259, "hidden_size": 64, "draft_vocab_size": 8}
    target = TargetView(SimpleNamespace(vocab_size=259, hidden_size=64), None)
    for variant in ("norm_before_fc", "norm_output"):
        (folder / "config.json").write_text(json.dumps(base | {variant: True}))
        with pytest.raises(UserError, match=f"trained with {variant}.*draft.{variant}=false"):
            check_draft({"draft": str(folder)}, target)
    (folder / "config.json").write_text(json.dumps(base | {"norm_before_residual": True, "hidden_size": 32}))
    with pytest.raises(UserError, match="trained for another target"):  # past the variant check
        check_draft({"draft": str(folder)}, target)
