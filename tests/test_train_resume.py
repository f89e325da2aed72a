"""Exact resume: a SIGKILLed run and a run whose newest checkpoints are damaged both end where an uninterrupted run
ends (same step, same weights, same logged metrics).

The runs sample on-policy batches (lmbda=0.5, temperature 1), so matching also needs the RNG states and the data
position restored, not just the weights and the optimizer.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from helpers.runs import (
    PAUSE_AFTER_CHECKPOINT,
    TESTS,
    assert_same_logs,
    assert_same_weights,
    final_weights,
    metric_rows,
    reference_run,
    train_config,
)

# seed 2: steps 1 and 4 are on-policy, so the sampling RNG is used both before and after each resume point.
SETTINGS = (
    "seed=2",
    "distill.lmbda=0.5",
    "data.temperature=1.0",
    "train.max_steps=4",
    "train.keep_last=4",
    "train.eval_every=2",
)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """An uninterrupted run with checkpoints at every step: (root, teacher data, candidate folder)."""
    return reference_run(tmp_path_factory, "reference", *SETTINGS)


def assert_matches_reference(cand: Path, reference: Path) -> None:
    assert_same_weights(final_weights(cand, 4), final_weights(reference, 4))
    assert_same_logs(metric_rows(cand), metric_rows(reference))


@pytest.mark.slow
def test_sigkilled_run_resumes_to_the_same_result(reference, tmp_path):
    from specdistill.pipeline import distill_candidate

    root, data, ref_cand = reference
    out = tmp_path / "killed"
    # The child pauses after its first checkpoint, so the SIGKILL always lands between two steps of a live run.
    script = tmp_path / "child.py"
    script.write_text(
        PAUSE_AFTER_CHECKPOINT
        + textwrap.dedent(f"""
        import sys
        from pathlib import Path
        sys.path.insert(0, {str(TESTS)!r})
        import specdistill.pipeline
        from distill.data import TeacherData
        from helpers.runs import train_config

        data = TeacherData(Path({str(data.train)!r}), Path({str(data.validation)!r}))
        specdistill.pipeline.distill_candidate(train_config(Path({str(out)!r}), *{SETTINGS!r}), "draft", data)
    """)
    )
    env = os.environ | {"SPECDISTILL_CACHE": str(root / "cache"), "OMP_NUM_THREADS": "1"}
    child = subprocess.Popen([sys.executable, str(script)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    marker = out / "candidates" / "draft" / "checkpoints" / "step-000001" / "COMPLETE"
    deadline = time.monotonic() + 120
    while not marker.is_file() and child.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert marker.is_file(), child.communicate(timeout=5)[0].decode()[-3000:] if child.poll() is not None else "timeout"
    os.kill(child.pid, signal.SIGKILL)
    assert child.wait(timeout=30) == -signal.SIGKILL

    cand = out / "candidates" / "draft"
    assert not (cand / "DONE").exists() and not (cand / "checkpoints" / "step-000002").exists()
    distill_candidate(train_config(out, *SETTINGS), "draft", data)
    assert_matches_reference(cand, ref_cand)
    assert (cand / "DONE").is_file()


def test_half_written_and_corrupt_newest_checkpoints_are_skipped(reference, tmp_path, capsys):
    from specdistill.pipeline import distill_candidate

    root, data, ref_cand = reference
    out = tmp_path / "damaged"
    shutil.copytree(ref_cand.parent.parent, out)
    ckpts = out / "candidates" / "draft" / "checkpoints"
    (ckpts / "step-000004" / "COMPLETE").unlink()  # half-written: no marker
    weights = ckpts / "step-000003" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])  # unreadable file
    capsys.readouterr()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SPECDISTILL_CACHE", str(root / "cache"))
        distill_candidate(train_config(out, *SETTINGS), "draft", data)
    printed = capsys.readouterr().out
    assert f"skipping checkpoint {ckpts / 'step-000004'}: no COMPLETE marker" in printed
    assert f"skipping checkpoint {ckpts / 'step-000003'}: model.safetensors" in printed
    assert f"resuming from the older checkpoint {ckpts / 'step-000002'} instead of {ckpts / 'step-000004'}" in printed
    assert_matches_reference(out / "candidates" / "draft", ref_cand)
