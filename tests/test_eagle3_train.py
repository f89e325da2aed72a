"""`draft.init: eagle3` through the distillation recipe: trains, writes best/ in the export layout, resumes exactly
with its stored vocabulary, trains from the offline cache's aux hidden states, exports as a copy with its card, runs
next to a standalone candidate from `specdistill distill`, stops on a NaN loss and logs to offline W&B.

On 2 CPU processes (gloo), against one module-scoped one-process run of 3 steps: DDP, FSDP2 (accelerate's plugin with
configs/accelerate/fsdp.yaml) and DeepSpeed ZeRO-2 take the same steps and resume from a stop after 2; bf16 (FSDP2,
DeepSpeed, and autocast in one process) resumes bit for bit; a SIGKILLed launch resumes to the same result."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import textwrap
import time

import psutil
import pytest
import torch
import yaml
from helpers.runs import (
    ADAM_OUTLIERS,
    PAUSE_AFTER_CHECKPOINT,
    TESTS,
    accelerate_launcher,
    assert_same_logs,
    assert_same_weights,
    final_weights,
    metric_rows,
    offline_run,
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


def test_the_heads_initialisation_options_reach_the_training(straight, tmp_path):
    """draft.init_std starts the trained head's linears from normal(0, init_std) (one step at a vanishing lr keeps
    them there); the default run's fc has Kaiming uniform's std, 1 / sqrt(3 fan_in)."""
    from specdistill.pipeline import distill_candidate

    root, data, ref = straight
    out = tmp_path / "normal"
    settings = (*EAGLE3, *COMMON, "train.max_steps=1", "train.eval_every=1", "train.lr=1e-9")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SPECDISTILL_CACHE", str(root / "cache"))
        distill_candidate(
            train_config(out, *settings, "draft.init_std=0.02", "draft.norm_from_target=false"), "draft", data
        )
    fc = final_weights(out / "candidates" / "draft", 1)["fc.weight"]
    assert fc.std().item() == pytest.approx(0.02, rel=0.1)
    default = final_weights(ref, 3)["fc.weight"]
    assert default.std().item() > 2 * 0.02  # 1 / sqrt(3 * 96) = 0.059 at the start, 3 small steps before this


def test_the_head_variants_reach_the_trained_head(straight, tmp_path):
    """draft.norm_before_residual / norm_before_fc / norm_output (speculators' head variants) build the head the
    training steps (an RMSNorm before fc among its trained weights) and stay in its config.json, which our loader
    reads back into the same layout; the default head has none of the three keys (the engines' layout)."""
    from distill.students import HEAD_VARIANTS
    from specdistill.pipeline import distill_candidate

    root, data, ref = straight
    out = tmp_path / "variants"
    variants = ("draft.norm_before_residual=true", "draft.norm_before_fc=true", "draft.norm_output=true")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SPECDISTILL_CACHE", str(root / "cache"))
        distill_candidate(train_config(out, *EAGLE3, *COMMON, "train.max_steps=1", *variants), "draft", data)
    step = out / "candidates" / "draft" / "checkpoints" / "step-000001"
    config = json.loads((step / "config.json").read_text())
    assert {k: config.get(k) for k in HEAD_VARIANTS} == dict.fromkeys(HEAD_VARIANTS, True)
    weights = final_weights(out / "candidates" / "draft", 1)
    assert {"fc.norm.weight", "fc.proj.weight"} <= set(weights) and "fc.weight" not in weights
    assert not torch.equal(weights["fc.norm.weight"], torch.ones_like(weights["fc.norm.weight"]))  # it was trained
    head = Eagle3Draft.from_pretrained(step)
    assert head.norm_output and head.midlayer.norm_before_residual and hasattr(head.fc, "norm")
    plain = json.loads((ref / "checkpoints" / "step-000003" / "config.json").read_text())
    assert not set(HEAD_VARIANTS) & set(plain)
    from eval.export import export_draft

    card = (export_draft(step, tmp_path / "export") / "README.md").read_text()
    assert "residual taken after hidden_norm" in card and "not verified here" in card  # engines that may ignore it


def test_a_token_bound_trains_a_packed_eagle3_head_in_several_passes_like_one(straight, tmp_path):
    """train.max_micro_batch_tokens with packed sequences (draft.pack_sequences): every sequence of a micro-batch
    in its own forward and backward pass, the steps of the packed micro-batches in one pass."""
    from specdistill.pipeline import distill_candidate

    root, data, ref = straight
    out = tmp_path / "bounded"
    settings = (*EAGLE3, *COMMON, "train.grad_accum=2", "train.max_steps=3", "train.max_micro_batch_tokens=1")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SPECDISTILL_CACHE", str(root / "cache"))
        distill_candidate(train_config(out, *settings), "draft", data)
    cand = out / "candidates" / "draft"
    assert_same_logs(metric_rows(cand), metric_rows(ref))
    assert_same_weights(final_weights(cand, 3), final_weights(ref, 3), outliers=ADAM_OUTLIERS)


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
    # the default layers of the 4-layer target, [2, L // 2, L - 3], named and written out (issue 23)
    assert "Kind: **eagle3**" in card and "target layers [2, 2, 1]" in card and f"{coverage:.2%}" in card
    assert '"method": "eagle3"' in card and "EAGLE3" in card and "decoding_type: Eagle3" in card
    assert "residual taken after hidden_norm" not in card  # the engines' original layout: nothing to check


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


TORCHRUN = ("-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2")

# accelerate turns FSDP on only for a multi-accelerator launch: on the CPU every process is MULTI_CPU and an FSDP
# launcher config trains plain DDP. The child calls its gloo launch MULTI_GPU before the recipe's Accelerator exists,
# so accelerate's FSDP plugin (fsdp.yaml's settings: FSDP2, TRANSFORMER_BASED_WRAP, CPU-RAM-efficient loading)
# shards the head as it would on GPUs.
FSDP_ON_CPU = """
from accelerate import PartialState
from accelerate.utils import DistributedType
PartialState(cpu=True).distributed_type = DistributedType.MULTI_GPU
"""


def child_script(root, data, runs: dict, *overrides: str, prelude: str = "") -> tuple[list[str], dict]:
    """(script arguments for a launcher, environment) of a script that distills the EAGLE-3 `draft` of each output
    folder in `runs` once per train.max_steps its value lists (its strings: overrides of that folder's runs), 1
    micro-batch of 2 per process unless `overrides` say otherwise; `prelude` runs before the first."""
    script = next(iter(runs)).with_suffix(".py")
    script.write_text(
        textwrap.dedent(f"""
        import sys
        from pathlib import Path
        sys.path.insert(0, {str(TESTS)!r})
        from distill.data import TeacherData
        from helpers.runs import train_config
        from specdistill.pipeline import distill_candidate
        """)
        + textwrap.dedent(prelude)
        + textwrap.dedent(f"""
        data = TeacherData(Path({str(data.train)!r}), Path({str(data.validation)!r}))
        for out, spec in {[(str(out), spec) for out, spec in runs.items()]!r}:
            settings = [*{(*EAGLE3, *COMMON, *overrides)!r}, *(s for s in spec if isinstance(s, str))]
            for max_steps in [s for s in spec if isinstance(s, int)]:
                distill_candidate(train_config(Path(out), *settings, f"train.max_steps={{max_steps}}"), "draft", data)
        """)
    )
    env = os.environ | {"SPECDISTILL_CACHE": str(root / "cache"), "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled"}
    return [str(script)], env


def run_two(root, data, runs: dict, *overrides, launcher=TORCHRUN, prelude: str = "") -> str:
    """Run `child_script` on 2 CPU processes (gloo) and return its stdout."""
    args, env = child_script(root, data, runs, *overrides, prelude=prelude)
    proc = subprocess.run([sys.executable, *launcher, *args], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    return proc.stdout


def assert_like_straight(cand, single) -> None:
    """The same logged steps, validation metrics and final weights as the one-process run."""
    assert '"world_size": 2' in (cand / "checkpoints" / "step-000003" / "trainer_state.json").read_text()
    assert_same_logs(metric_rows(cand), metric_rows(single))
    assert_same_weights(final_weights(cand, 3), final_weights(single, 3), outliers=ADAM_OUTLIERS)


def assert_bf16_resumes_exactly(straight_bf16, resumed, single, dtype: torch.dtype) -> None:
    """A bf16 run stopped after 2 steps and resumed ends bit for bit where a straight bf16 one does; its checkpoint
    weights are `dtype`; its losses are finite and near, but not equal to, the fp32 run's (bf16 did round)."""
    weights = final_weights(resumed, 3)
    assert {w.dtype for w in weights.values() if w.is_floating_point()} == {dtype}
    assert_same_logs(metric_rows(resumed), metric_rows(straight_bf16))
    assert_same_weights(weights, final_weights(straight_bf16, 3), atol=0)
    losses, fp32 = ([r["train/loss"] for r in metric_rows(c) if "train/loss" in r] for c in (resumed, single))
    assert len(losses) == 3 and all(math.isfinite(x) for x in losses)
    assert losses != fp32 and losses == pytest.approx(fp32, rel=0.1)


@pytest.mark.slow
def test_two_processes_train_an_eagle3_head_like_one_process(straight):
    """DDP on 2 CPU processes (gloo), one micro-batch of 2 each, against the one-process run with 2 micro-batches of
    2: the same global batch and token normalisation, so the same steps; stopped after 2 steps and resumed."""
    root, data, single = straight
    # And with train.max_micro_batch_tokens: a bound one process's micro-batch fits in and the other's does not, so
    # both run as many passes as the latter (DDP broadcasts the head's buffers in every forward), only the last synced.
    bound = uneven_bound(data.train, steps=3)
    runs = {root / "ddp": (2, 3), root / "ddp-bounded": (3, f"train.max_micro_batch_tokens={bound}")}
    assert "resumed draft from" in run_two(root, data, runs)
    assert_like_straight(root / "ddp" / "candidates" / "draft", single)
    assert_like_straight(root / "ddp-bounded" / "candidates" / "draft", single)


def uneven_bound(train, *, steps: int, seed: int = 0, max_seq_len: int = 64) -> int:
    """A token bound under which, at some step of 2 processes with a micro-batch of 2 each, one process's
    micro-batch is one pass and the other's two."""
    from distill.batches import epoch_order, micro_batch_indices, token_runs
    from distill.data import load_teacher_data

    lengths = [min(len(ids), max_seq_len) for ids in load_teacher_data(train)["input_ids"]]
    order = epoch_order(len(lengths), seed, 0)
    for step in range(steps):
        rows = [micro_batch_indices(order, step, 0, rank=r, world=2, batch_size=2, grad_accum=1) for r in (0, 1)]
        sums = sorted(sum(lengths[i] for i in mine) for mine in rows)
        if sums[0] < sums[1]:
            counts = [len(token_runs([lengths[i] for i in mine], sums[0])) for mine in rows]
            assert sorted(counts) == [1, 2]
            return sums[0]
    raise AssertionError("no step whose two micro-batches differ in tokens")


@pytest.mark.slow
def test_fsdp2_shards_an_eagle3_head_over_two_processes_like_one_process(straight):
    """configs/accelerate/fsdp.yaml on 2 CPU processes: accelerate's FSDP2 plugin shards the head (and, with
    train.shard_teacher=auto, the teacher); checkpoints and best/ hold the gathered full state, the steps are those
    of one process to the usual float tolerance (FSDP reduce-scatters where one process sums), and a stop after 2
    steps resumes, in the same process, from the full optimizer state. In bf16 (FSDP2's MixedPrecisionPolicy: bf16
    compute, fp32 gradient reduction and sharded fp32 weights) a resumed run ends exactly where a straight one does."""
    root, data, single = straight
    bf16 = "train.mixed_precision=bf16"
    bounded = "train.max_micro_batch_tokens=1"  # 2 passes per micro-batch, the first without gradient sync
    runs = {root / "fsdp": (2, 3), root / "fsdp-bf16-straight": (3, bf16), root / "fsdp-bf16": (2, 3, bf16),
            root / "fsdp-bounded": (3, bounded)}  # fmt: skip
    stdout = run_two(root, data, runs, launcher=accelerate_launcher("fsdp.yaml"), prelude=FSDP_ON_CPU)
    assert stdout.count("resumed draft from") == 2
    assert stdout.count("teacher sharded over 2 processes (FSDP2)") == 6  # accelerate ran FSDP, every time
    fsdp, straight_bf16, resumed, fsdp_bounded = (out / "candidates" / "draft" for out in runs)
    assert_like_straight(fsdp, single)
    assert_like_straight(fsdp_bounded, single)
    best, ref = load_file(fsdp / "best" / "model.safetensors"), load_file(single / "best" / "model.safetensors")
    assert best.keys() == ref.keys() and best["lm_head.weight"].shape == (48, 64)
    assert_bf16_resumes_exactly(straight_bf16, resumed, single, torch.float32)


@pytest.mark.slow
def test_deepspeed_zero2_trains_an_eagle3_head_and_resumes_like_one_process(straight):
    """configs/accelerate/deepspeed_zero2.yaml on 2 CPU processes, 2 accumulated micro-batches of 1 each: each rank
    checkpoints its ZeRO partition, and a stop after 2 steps resumes from it to the one-process steps."""
    root, data, single = straight
    accum = ("train.batch_size=1", "train.grad_accum=2")
    # and one micro-batch of 2 in 2 passes (train.max_micro_batch_tokens): the engine steps after the second only
    bounded = ("train.batch_size=2", "train.grad_accum=1", "train.max_micro_batch_tokens=1")
    runs = {root / "zero2": (2, 3), root / "zero2-bounded": (3, *bounded)}
    stdout = run_two(root, data, runs, *accum, launcher=accelerate_launcher("deepspeed_zero2.yaml"))
    assert "resumed draft from" in stdout
    zero2 = root / "zero2" / "candidates" / "draft"
    step = zero2 / "checkpoints" / "step-000003"
    assert sorted(p.name for p in step.glob("optimizer*")) == ["optimizer-zero-rank000.pt", "optimizer-zero-rank001.pt"]
    assert_like_straight(zero2, single)
    assert_like_straight(root / "zero2-bounded" / "candidates" / "draft", single)


# Every forward of a bf16 head (inside DeepSpeed's engine) checks that its rope frequencies are fp32 and exact.
ROPE_IN_BF16 = """
import torch
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
from specdec_runtime.eagle3 import Eagle3Draft
plain_forward, checked = Eagle3Draft.forward, []
def checked_forward(self, *args, **kwargs):
    if self.fc.weight.dtype == torch.bfloat16:
        freqs, want = self.rotary.inv_freq, LlamaRotaryEmbedding(self.config).inv_freq
        assert freqs.dtype == torch.float32 and torch.equal(freqs.cpu(), want), freqs
        if not checked:
            print("bf16 head, fp32 rope frequencies", flush=True)
            checked.append(True)
    return plain_forward(self, *args, **kwargs)
Eagle3Draft.forward = checked_forward
"""


@pytest.mark.slow
def test_deepspeed_bf16_eagle3_head_resumes_exactly_from_its_fp32_masters(straight):
    """train.mixed_precision=bf16 under DeepSpeed: the head, its aux states and embeddings run in bf16 (the
    checkpoint's weights are bf16) with fp32 masters in the ZeRO partitions, its rope frequencies stay fp32 (what
    vLLM / SGLang serve it with); a stop-and-resume run ends exactly where a straight one does, with finite losses."""
    root, data, single = straight
    runs = {root / "bf16-straight": (3,), root / "bf16-resumed": (2, 3)}
    launcher = accelerate_launcher("deepspeed_zero2.yaml")
    stdout = run_two(root, data, runs, "train.mixed_precision=bf16", launcher=launcher, prelude=ROPE_IN_BF16)
    assert "bf16 head, fp32 rope frequencies" in stdout
    straight_bf16, resumed = (out / "candidates" / "draft" for out in runs)
    assert_bf16_resumes_exactly(straight_bf16, resumed, single, torch.bfloat16)


def test_bf16_autocast_trains_an_eagle3_head_and_resumes_exactly(straight, tmp_path):
    """train.mixed_precision=bf16 with one CPU process: accelerate autocasts the head's matmuls to bf16 and keeps
    fp32 weights; a run stopped after 2 steps resumes to where a straight one ends."""
    from specdistill.pipeline import distill_candidate

    root, data, single = straight
    settings = (*EAGLE3, *COMMON, "train.grad_accum=2", "train.mixed_precision=bf16")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SPECDISTILL_CACHE", str(root / "cache"))
        for out, steps in ((tmp_path / "straight", (3,)), (tmp_path / "resumed", (2, 3))):
            for max_steps in steps:
                distill_candidate(train_config(out, *settings, f"train.max_steps={max_steps}"), "draft", data)
    straight_bf16, resumed = (tmp_path / name / "candidates" / "draft" for name in ("straight", "resumed"))
    assert_bf16_resumes_exactly(straight_bf16, resumed, single, torch.float32)


@pytest.mark.slow
def test_a_sigkilled_two_process_eagle3_run_resumes_to_the_same_result(straight):
    """Both processes of a torchrun launch SIGKILLed between steps (rank 0 pauses after its first checkpoint, rank
    1 waits for it); a new 2-process launch resumes from step 1 and ends where the one-process straight run does."""
    root, data, single = straight
    out = root / "killed"
    args, env = child_script(root, data, {out: (3,)}, prelude=PAUSE_AFTER_CHECKPOINT)
    child = subprocess.Popen([sys.executable, *TORCHRUN, *args], env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT)  # fmt: skip
    cand = out / "candidates" / "draft"
    marker = cand / "checkpoints" / "step-000001" / "COMPLETE"
    deadline = time.monotonic() + 180
    while not marker.is_file() and child.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    alive = child.poll() is None
    if alive:  # the launcher, then both workers (torchrun starts each in a session of its own), by pid: a lost node
        for pid in [child.pid, *(p.pid for p in psutil.Process(child.pid).children(recursive=True))]:
            os.kill(pid, signal.SIGKILL)
    log = child.communicate(timeout=30)[0].decode()
    assert marker.is_file() and alive, log[-3000:]
    assert not (cand / "DONE").exists() and not (cand / "checkpoints" / "step-000002").exists()

    stdout = run_two(root, data, {out: (3,)})
    assert f"resumed draft from {cand / 'checkpoints' / 'step-000001'}" in stdout
    assert_like_straight(cand, single)
    assert (cand / "DONE").is_file()


def test_a_non_finite_eagle3_loss_stops_and_keeps_the_last_good_checkpoint(straight, tmp_path):
    from specdistill.pipeline import distill_candidate
    from train.loop import NonFiniteLossError

    root, data, _ = straight
    settings = ("train.lr=1e30", "train.warmup_steps=0", "train.max_grad_norm=0", "train.max_steps=4")
    with pytest.MonkeyPatch.context() as mp, pytest.raises(NonFiniteLossError, match=r"at step 2;.*step-000001"):
        mp.setenv("SPECDISTILL_CACHE", str(root / "cache"))
        distill_candidate(train_config(tmp_path, *EAGLE3, *settings, "train.keep_last=5"), "draft", data)
    cand = tmp_path / "candidates" / "draft"
    assert sorted(p.name for p in (cand / "checkpoints").iterdir()) == ["step-000001"]
    assert max(r["step"] for r in metric_rows(cand)) == 1 and not (cand / "DONE").exists()


def test_an_eagle3_run_logs_its_validation_metrics_to_offline_wandb(straight, tmp_path):
    from specdistill.pipeline import distill_candidate

    root, data, _ = straight
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SPECDISTILL_CACHE", str(root / "cache"))
        cfg = train_config(tmp_path / "run", *EAGLE3, "tracking.backend=wandb", "tracking.mode=offline")
        cand = distill_candidate(cfg, "draft", data)
    history, artifacts, _ = offline_run(cand)
    logged = {(r["_step"], key): value for r in history for key, value in r.items() if not key.startswith("_")}
    final = metric_rows(cand)[-1]
    for key in ("eval/simulated_tau", "eval/simulated_tau_greedy", "eval/expected_acceptance_2",
                "eval/greedy_match_1", "eval/draft_vocab_coverage", "eval/loss"):  # fmt: skip
        assert logged[(2, key)] == pytest.approx(final[key]), key
    assert (1, "train/grad_norm") in logged and (1, "eval/simulated_tau") in logged
    assert [(a.name, a.type) for a in artifacts] == [("run-draft-best", "model")]
