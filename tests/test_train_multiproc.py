"""Two CPU processes (torchrun, gloo) with the same global batch as one process take the same optimizer steps.

The two-process run also stops after 2 steps and resumes for a third, so checkpointing under DDP (optimizer state,
per-rank RNG) is exercised too. A constant learning rate keeps the stop-and-resume schedule equal to a straight run.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
from test_train import (
    TESTS,
    assert_same_logs,
    assert_same_weights,
    final_weights,
    metric_rows,
    tiny_setup,
    train_config,
)

COMMON = ("train.warmup_steps=0", "train.min_lr_ratio=1.0", "train.eval_every=2", "train.keep_last=1")


@pytest.mark.slow
def test_two_processes_match_one_process_with_the_same_global_batch(tmp_path, isolated_cache):
    from train.loop import distill

    teacher, tokenizer, data = tiny_setup(tmp_path)
    # One process: 2 micro-batches of 2. Two processes: 1 micro-batch of 2 each. Global batch 4 either way.
    single = distill(
        train_config(tmp_path / "single", *COMMON, "train.max_steps=3", "train.grad_accum=2"),
        "draft",
        data,
        teacher=teacher,
        tokenizer=tokenizer,
    )

    script = tmp_path / "ddp.py"
    script.write_text(
        textwrap.dedent(f"""
        import sys
        from pathlib import Path
        sys.path.insert(0, {str(TESTS)!r})
        from distill.data import TeacherData
        from test_train import train_config
        from train.loop import distill

        data = TeacherData(Path({str(data.train)!r}), Path({str(data.eval)!r}))
        for steps in (2, 3):
            cfg = train_config(Path({str(tmp_path / "ddp")!r}), *{COMMON!r}, f"train.max_steps={{steps}}")
            distill(cfg, "draft", data)
    """)
    )
    env = os.environ | {"SPECDISTILL_CACHE": str(isolated_cache), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(script)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    assert "resumed draft from" in proc.stdout

    ddp = tmp_path / "ddp" / "candidates" / "draft"
    state = (ddp / "checkpoints" / "step-000003" / "trainer_state.json").read_text()
    assert '"world_size": 2' in state
    assert_same_logs(metric_rows(ddp), metric_rows(single))
    assert_same_weights(final_weights(ddp, 3), final_weights(single, 3))
