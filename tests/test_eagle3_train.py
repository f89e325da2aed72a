"""`draft.init: eagle3` through the distillation recipe: trains, writes best/ in the export layout, resumes exactly
with its stored vocabulary, trains from the offline cache's aux hidden states, exports as a copy with its card, runs
next to a standalone candidate from `specdistill distill`, and takes the same steps on 2 CPU processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import yaml
from helpers import (
    TESTS,
    assert_same_logs,
    assert_same_weights,
    final_weights,
    metric_rows,
    reference_run,
    train_config,
)
from safetensors.torch import load_file

from specdec_runtime.eagle3 import Eagle3Draft, target_aux_forward

EAGLE3 = ("draft.init=eagle3", "draft.draft_vocab_size=48", "draft.ttt_depth=3", "train.min_lr_ratio=1.0")
COMMON = ("train.warmup_steps=0", "train.eval_every=2", "train.keep_last=1")


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """(root, teacher data, candidate folder) of an uninterrupted 3-step EAGLE-3 run, 2 micro-batches of 2."""
    return reference_run(tmp_path_factory, "e3", *EAGLE3, *COMMON, "train.max_steps=3", "train.grad_accum=2")


def test_an_eagle3_candidate_trains_and_writes_best_in_the_export_layout(straight):
    _, _, cand = straight
    rows = [r for r in metric_rows(cand) if "eval/loss" in r]
    assert [r["step"] for r in rows] == [2, 3]
    for key in ("eval/expected_acceptance_0", "eval/expected_acceptance_2", "eval/greedy_match_1",
                "eval/simulated_tau", "eval/simulated_tau_greedy", "eval/draft_vocab_coverage"):  # fmt: skip
        assert key in rows[-1], key
    accept = [rows[-1][f"eval/expected_acceptance_{j}"] for j in range(3)]
    tau = 1 + accept[0] + accept[0] * accept[1] + accept[0] * accept[1] * accept[2]
    assert rows[-1]["eval/simulated_tau"] == pytest.approx(tau)
    assert rows[-1]["eval/expected_acceptance"] == rows[-1]["eval/expected_acceptance_0"]

    best = cand / "best"
    config = json.loads((best / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["draft_vocab_size"] == 48
    weights = load_file(best / "model.safetensors")
    assert "embed_tokens.weight" not in weights and weights["lm_head.weight"].shape == (48, 64)
    vocab = json.loads((cand / "draft_vocab.json").read_text())
    assert vocab["size"] == 48 and torch.equal(Eagle3Draft.from_pretrained(best).t2d.nonzero()[:, 0],
                                               torch.tensor(vocab["ids"]))  # fmt: skip
    assert rows[-1]["eval/draft_vocab_coverage"] == pytest.approx(vocab["coverage"])


def test_a_resumed_eagle3_run_ends_where_a_straight_one_does_with_its_stored_vocabulary(straight, tmp_path):
    from specdistill.pipeline import distill_candidate

    root, data, ref = straight
    out = tmp_path / "resumed"
    settings = (*EAGLE3, *COMMON, "train.grad_accum=2")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SPECDISTILL_CACHE", str(root / "cache"))
        distill_candidate(train_config(out, *settings, "train.max_steps=2"), "draft", data)
        cand = out / "candidates" / "draft"
        vocab = json.loads((cand / "draft_vocab.json").read_text())
        (cand / "draft_vocab.json").write_text(json.dumps(vocab | {"coverage": 0.125}))  # marks the stored record
        distill_candidate(train_config(out, *settings, "train.max_steps=3"), "draft", data)
    assert_same_weights(final_weights(cand, 3), final_weights(ref, 3))
    rows, ref_rows = metric_rows(cand), metric_rows(ref)
    assert rows[-1]["eval/draft_vocab_coverage"] == 0.125  # read back, not counted again
    for row in (rows[-1], ref_rows[-1]):
        row.pop("eval/draft_vocab_coverage")
    assert_same_logs(rows, ref_rows)


def test_eagle3_trains_from_the_offline_cache_of_aux_hidden_states(tmp_path, isolated_cache):
    """The data stage stores the aux layers an EAGLE-3 cache candidate reads (fp16, every position), and the head
    trains from them with the teacher dropped; a cache without them is refused with the fix."""
    from distill.data import load_teacher_data
    from specdec_runtime.loading import load_model
    from specdistill.pipeline import dist_state, distill_candidate, stage_data

    overrides = (*EAGLE3, "distill.teacher=cache", "data.teacher_cache=true", "data.teacher_cache_top_k=8",
                 "data.max_prompts=4", "data.max_validation_prompts=2", "train.max_seq_len=512")  # fmt: skip
    cfg = train_config(tmp_path / "run", *overrides)
    data = stage_data(cfg, dist_state("cpu"))
    summary = json.loads((data.train / ".complete").read_text())
    assert summary["aux_layers"] == [1, 2]  # tiny-llama has 4 layers: [2, 4 // 2, 4 - 3], deduplicated
    assert summary["aux_bytes_per_token"] > 0
    row = load_teacher_data(data.train)[0]
    teacher, _ = load_model("random:tiny-llama", device="cpu")
    ids = torch.tensor([row["input_ids"]])
    _, aux = target_aux_forward(teacher, ids, [1, 2])
    torch.testing.assert_close(torch.tensor(row["aux_hidden"], dtype=torch.float16), aux[0].half(), rtol=0, atol=2e-3)

    cand = distill_candidate(cfg, "draft", data)
    assert (cand / "best" / "model.safetensors").is_file()
    assert metric_rows(cand)[-1]["eval/tokens"] > 0

    plain = stage_data(train_config(tmp_path / "plain", "data.teacher_cache=true", "data.max_prompts=4",
                                    "data.max_validation_prompts=2"), dist_state("cpu"))  # fmt: skip
    with pytest.raises(ValueError, match="holds no aux hidden states"):
        distill_candidate(train_config(tmp_path / "plain", *overrides), "draft", plain)


def test_export_of_an_eagle3_head_is_a_copy_with_its_card(straight, tmp_path):
    from eval.export import export_draft

    _, _, cand = straight
    out = export_draft(cand / "best", tmp_path / "export")
    assert {p.name for p in out.iterdir()} >= {"config.json", "model.safetensors", "README.md"}
    assert not any(p.name.startswith(("optimizer", "metrics", "trainer")) for p in out.iterdir())
    assert (out / "model.safetensors").read_bytes() == (cand / "best" / "model.safetensors").read_bytes()
    assert (out / "config.json").read_text() == (cand / "best" / "config.json").read_text()
    card = (out / "README.md").read_text()
    coverage = json.loads((cand / "draft_vocab.json").read_text())["coverage"]
    assert "Kind: **eagle3**" in card and "[2, L // 2, L - 3]" in card and f"{coverage:.2%}" in card
    assert '"method": "eagle3"' in card and "EAGLE3" in card and "decoding_type: Eagle3" in card


def test_specdistill_distill_trains_both_kinds_in_one_run(tmp_path, isolated_cache):
    """The CLI on a smoke-style config: a standalone truncation and two EAGLE-3 candidates (teacher online and from
    the offline cache) distilled by one `specdistill distill`."""
    config = yaml.safe_load((TESTS.parent / "configs" / "smoke.yaml").read_text())
    config |= {"output_dir": str(tmp_path / "run"), "tracking": {"backend": "none"}}
    config["data"] |= {"max_prompts": 4, "max_validation_prompts": 2}
    config["train"] |= {"max_steps": 2, "batch_size": 2}
    eagle = {"draft.init": "eagle3", "draft.draft_vocab_size": 64, "draft.ttt_depth": 2}
    config["candidates"] = [
        {"name": "trunc", "overrides": {"draft.init": "truncate"}},
        {"name": "eagle3", "overrides": eagle},
        {"name": "eagle3-cache", "overrides": eagle | {"distill.teacher": "cache", "distill.objective": {"tv": 1.0}}},
    ]
    path = tmp_path / "smoke-eagle3.yaml"
    path.write_text(yaml.safe_dump(config))
    env = os.environ | {"OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled"}
    proc = subprocess.run([sys.executable, "-m", "specdistill", "distill", str(path)], env=env, capture_output=True,
                          text=True, timeout=600)  # fmt: skip
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    for name in ("trunc", "eagle3", "eagle3-cache"):
        assert (tmp_path / "run" / "candidates" / name / "best" / "config.json").is_file(), name
    kinds = {
        name: json.loads((tmp_path / "run" / "candidates" / name / "best" / "config.json").read_text())["architectures"]
        for name in ("trunc", "eagle3")
    }
    assert kinds == {"trunc": ["LlamaForCausalLM"], "eagle3": ["LlamaForCausalLMEagle3"]}
    assert "draft vocabulary of 64 of 259 tokens covers" in proc.stdout


@pytest.mark.slow
def test_two_processes_train_an_eagle3_head_like_one_process(straight):
    """DDP on 2 CPU processes (gloo), one micro-batch of 2 each, against the one-process run with 2 micro-batches of
    2: the same global batch and token normalisation, so the same steps; stopped after 2 steps and resumed."""
    root, data, single = straight
    out = root / "ddp"
    script = out.with_suffix(".py")
    script.write_text(
        textwrap.dedent(f"""
        import sys
        from pathlib import Path
        sys.path.insert(0, {str(TESTS)!r})
        from distill.data import TeacherData
        from helpers import train_config
        from specdistill.pipeline import distill_candidate

        data = TeacherData(Path({str(data.train)!r}), Path({str(data.eval)!r}))
        for steps in (2, 3):
            cfg = train_config(Path({str(out)!r}), *{(*EAGLE3, *COMMON)!r}, f"train.max_steps={{steps}}")
            distill_candidate(cfg, "draft", data)
    """)
    )
    env = os.environ | {"SPECDISTILL_CACHE": str(root / "cache"), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(script)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    assert "resumed draft from" in proc.stdout
    ddp = out / "candidates" / "draft"
    assert '"world_size": 2' in (ddp / "checkpoints" / "step-000003" / "trainer_state.json").read_text()
    assert_same_logs(metric_rows(ddp), metric_rows(single))
    assert_same_weights(final_weights(ddp, 3), final_weights(single, 3))
