"""Distillation steps, ours vs TRL's GKDTrainer: response tokens/s and peak memory on the same pair and data.

Teacher: the embedded SmolLM2-135M-Instruct (30 layers). Student: its 4-layer truncation (evenly spaced layers).
Data: a fixed set of builtin training prompts, each answered by the teacher with exactly --response-tokens tokens
(stop tokens ignored, so every step scores the same number of tokens), generated once (~3 minutes) and cached under
--out. Both trainers run the same objective (generalized JSD, beta 0.5, or forward KL), off-policy (lmbda 0), fp32
on the CPU, with the same batch size, lr schedule (cosine from --lr to 0, no warm-up), gradient clipping and batches
in the same order (TRL's dataset is put in our loop's first-epoch order and read sequentially); the per-step losses
of the two must agree (`losses_identical`) as a check that they optimise the same thing.

Each trainer runs in its own subprocess, so its peak RSS is its own: ours is `train.loop.distill` itself, TRL's is
`GKDTrainer.train()` (trl must be importable by --trl-python). The trainers alternate, one process each per round,
in ABBA order over --rounds rounds (`specdec_runtime.ab.paired_runs`: ours, TRL | TRL, ours | ...), so drift in the
machine's speed hits both alike; each process runs --warmup untimed steps, then --steps timed ones (at least 10
timed steps per trainer in all by default). Per round, the tokens/s ratio is ours / TRL over the timed steps (the
same batches, so the same tokens); `tokens_per_s_ratio` is the median over rounds with its 95 % bootstrap interval
(`ab.bootstrap_ci`), next to the ratio of the tokens/s pooled over every timed step. Peak RSS (training) is VmHWM
right after the last step (ours: when the loop starts its closing validation; TRL: at the last on_step_end); peak
RSS (process) is at exit, after ours' validation and checkpoint; their ratios are medians over rounds too.
--profile times one step's phases on one batch in one more process, with the RSS growth of each trainer's loss.

    .venv/bin/pip install --no-deps trl          # trl 1.16.0 into the project venv; its dependencies are already there
    python benchmarks/distill_bench.py --profile --json runs/distill-bench/distill_bench.json   # CPU, ~12 min + data
    python benchmarks/distill_bench.py --rounds 2 --warmup 1 --steps 2 --batch-size 1 --num-seqs 4 \
        --response-tokens 8 --objective forward_kl --out /tmp/distill-bench-smoke        # smoke, ~3 minutes

CPU only by design (fp32 is what both trainers run on a CPU; on a GPU both would autocast to bf16).
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import datasets
import torch

from distill.batches import epoch_order
from distill.data import COMPLETE, TeacherData, features, load_teacher_data
from distill.prompts import load_prompts, render_chat
from distill.students import evenly_spaced_layers, truncate_student
from specdec_runtime.ab import abba_order, bootstrap_ci, median, paired_runs, paired_speedup
from specdec_runtime.engine import SamplingParams, generate
from specdec_runtime.loading import load_model

TEACHER = "embedded:smollm2-135m-instruct"
SEED = 0
IGNORE = -100
LOSS_RTOL = 1e-4  # the two trainers' fp32 losses differ by summation order only


def peak_rss_mb() -> float:
    """This process's peak resident set size so far (VmHWM), in MiB. Read from /proc, not `ru_maxrss`: that one
    keeps the parent's RSS at the fork across exec (a floor of the launcher's size), and clear_refs leaves it."""
    status = Path("/proc/self/status").read_text().splitlines()
    return next(int(line.split()[1]) for line in status if line.startswith("VmHWM:")) / 1024


def reset_peak_rss() -> None:
    """Reset VmHWM to the current RSS (Linux >= 4.0), so the next peak_rss_mb() is the peak of what follows."""
    Path("/proc/self/clear_refs").write_text("5")


# ----------------------------------------------------------------------------------------------------------------
# Data


def bench_data(out: Path, *, num_seqs: int, response_tokens: int, batch: int = 16) -> TeacherData:
    """The fixed bench set (train: `num_seqs` rows; eval: its first 2 rows, for the loop's closing validation)."""
    root = out / f"data-{num_seqs}x{response_tokens}-seed{SEED}"
    data = TeacherData(train=root / "train", validation=root / "validation")
    if (data.train / COMPLETE).is_file() and (data.validation / COMPLETE).is_file():
        return data
    teacher, tokenizer = load_model(TEACHER, device="cpu")
    records = load_prompts("builtin:train", limit=num_seqs)
    prompts = [render_chat(tokenizer, r.messages) for r in records]
    responses = []
    for start in range(0, len(prompts), batch):
        result = generate(
            teacher,
            None,
            prompts[start : start + batch],
            sampling=SamplingParams(temperature=0.7, top_p=0.95),
            max_new_tokens=response_tokens,
            generator=torch.Generator().manual_seed(SEED * 1000 + start),
        )  # no stop_token_ids: every response is exactly response_tokens long
        responses += result.tokens
    rows = {
        "id": [f"{r.id}#0" for r in records],
        "category": [r.category for r in records],
        "input_ids": [p + t for p, t in zip(prompts, responses)],
        "prompt_len": [len(p) for p in prompts],
    }
    ds = datasets.Dataset.from_dict(rows, features=features(None))
    for path, split in ((data.train, ds), (data.validation, ds.select(range(2)))):
        split.save_to_disk(str(path))
        (path / COMPLETE).touch()
    return data


def step_tokens(ds: datasets.Dataset, order: list[int], batch_size: int, steps: int) -> list[int]:
    """Response tokens scored in each of the first `steps` batches of `order` (nothing is truncated)."""
    lengths = [len(ids) - p for ids, p in zip(ds["input_ids"], ds["prompt_len"])]
    return [sum(lengths[i] for i in order[s * batch_size : (s + 1) * batch_size]) for s in range(steps)]


# ----------------------------------------------------------------------------------------------------------------
# Trainers (each runs in its own subprocess: --child ours | trl | profile)


def run_ours(args, data: TeacherData) -> dict:
    """train.loop.distill with log_every=1: each step's tokens/s comes from the loop's own metrics.jsonl."""
    import train.loop as loop
    from specdistill.config import load_config
    from specdistill.pipeline import distill_candidate

    total = args.warmup + args.steps
    ds = load_teacher_data(data.train)
    objective = "{jsd: 1.0}" if args.objective == "jsd" else "{forward_kl: 1.0}"
    cfg = load_config(
        None,
        [
            f"output_dir={args.out / 'ours'}",
            f"seed={SEED}",
            f"target.model={TEACHER}",
            "target.device=cpu",
            "draft.init=truncate",
            f"draft.num_layers={args.student_layers}",
            f"distill.objective={objective}",
            "distill.beta=0.5",
            "distill.lmbda=0.0",
            "distill.loss_on_prompt=false",  # GKD's loss reads the completion tokens only: the same work
            f"train.max_steps={total}",
            f"train.batch_size={args.batch_size}",
            "train.grad_accum=1",
            f"train.max_seq_len={max(len(x) for x in ds['input_ids'])}",
            f"train.lr={args.lr}",
            "train.warmup_steps=0",
            "train.min_lr_ratio=0.0",
            "train.max_grad_norm=1.0",
            f"train.eval_every={total}",
            f"train.save_every={total}",
            "train.keep_last=1",
            "train.log_every=1",
            "train.resume=false",
            "tracking.backend=none",
        ],
    )
    marks = {}
    validate = loop.validation.validate

    def validate_after_training(*a, **kw):
        # The loop validates once, after its last step: the peak so far is that of loading plus training.
        marks.setdefault("peak_rss_mb", peak_rss_mb())
        return validate(*a, **kw)

    loop.validation.validate = validate_after_training
    cand = distill_candidate(cfg, "bench", data)
    rows = [json.loads(line) for line in (cand / "metrics.jsonl").read_text().splitlines()]
    rows = [row for row in rows if "train/loss" in row]
    tokens = step_tokens(ds, epoch_order(len(ds), SEED, 0), args.batch_size, total)
    return {
        "step_s": [n / row["train/tokens_per_s"] for n, row in zip(tokens, rows)],
        "loss": [row["train/loss"] for row in rows],
        "peak_rss_mb": marks["peak_rss_mb"],
        "process_peak_rss_mb": peak_rss_mb(),
    }


def collate_trl(rows: list[dict], *, pad_id: int) -> dict[str, torch.Tensor]:
    """Right-padded batch in TRL's convention: labels = input_ids on response tokens, -100 elsewhere (TRL shifts)."""
    T = max(len(row["input_ids"]) for row in rows)
    input_ids = torch.full((len(rows), T), pad_id, dtype=torch.long)  # (B, T)
    attention_mask = torch.zeros_like(input_ids)
    labels = torch.full_like(input_ids, IGNORE)
    for b, row in enumerate(rows):
        n = len(row["input_ids"])
        input_ids[b, :n] = torch.tensor(row["input_ids"])
        attention_mask[b, :n] = 1
        labels[b, row["prompt_len"] : n] = input_ids[b, row["prompt_len"] : n]
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


def gkd_config(args, total: int):
    from trl.experimental.gkd import GKDConfig

    return GKDConfig(
        output_dir=str(args.out / "trl"),
        per_device_train_batch_size=args.batch_size,
        gradient_accumulation_steps=1,
        max_steps=total,
        learning_rate=args.lr,
        lr_scheduler_type="cosine",
        warmup_steps=0,
        weight_decay=0.0,
        max_grad_norm=1.0,
        lmbda=0.0,  # off-policy, as ours
        beta=0.5 if args.objective == "jsd" else 0.0,  # TRL's beta=0 is forward KL(p || q)
        seq_kd=False,
        gradient_checkpointing=False,  # SFTConfig turns it on by default; ours does not checkpoint the model
        bf16=False,  # SFTConfig's default; fp32 like ours
        use_cpu=True,
        report_to="none",
        save_strategy="no",
        eval_strategy="no",
        logging_steps=1,
        train_sampling_strategy="sequential",
        dataloader_num_workers=0,
        seed=SEED,
        disable_tqdm=True,
    )


def run_trl(args, data: TeacherData) -> dict:
    """GKDTrainer.train() with a callback that clocks each step and reads the peak RSS after the last one."""
    from transformers import TrainerCallback
    from trl.experimental.gkd import GKDTrainer

    total = args.warmup + args.steps
    teacher, tokenizer = load_model(TEACHER, device="cpu")
    student = truncate_student(teacher, evenly_spaced_layers(teacher.config.num_hidden_layers, args.student_layers))
    ds = load_teacher_data(data.train).select_columns(["input_ids", "prompt_len"])
    ds = ds.select(epoch_order(len(ds), SEED, 0))  # our loop's order, read sequentially: the same batches

    class Clock(TrainerCallback):
        def __init__(self):
            self.times, self.loss, self.peak = [], [], None

        def on_train_begin(self, args, state, control, **kwargs):
            self.times.append(time.perf_counter())

        def on_step_end(self, args, state, control, **kwargs):
            self.times.append(time.perf_counter())
            if state.global_step == total:
                self.peak = peak_rss_mb()

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "loss" in logs:
                self.loss.append(logs["loss"])

    clock = Clock()
    trainer = GKDTrainer(
        model=student,
        teacher_model=teacher,
        args=gkd_config(args, total),
        data_collator=functools.partial(collate_trl, pad_id=tokenizer.pad_token_id),
        train_dataset=ds,
        processing_class=tokenizer,
        callbacks=[clock],
    )
    trainer.train()
    return {
        "step_s": [b - a for a, b in zip(clock.times, clock.times[1:])],
        "loss": clock.loss,
        "peak_rss_mb": clock.peak,
        "process_peak_rss_mb": peak_rss_mb(),
    }


def vm_rss_mb() -> float:
    status = Path("/proc/self/status").read_text().splitlines()
    return next(int(line.split()[1]) for line in status if line.startswith("VmRSS:")) / 1024


def run_profile(args, data: TeacherData) -> dict:
    """One step of each trainer split into phases on the same batch, each phase the fastest of --profile-reps rounds
    that run every phase in turn (so load from other processes hits all phases alike). The teacher forward is the
    same; the student differs as the loops do: ours returns its final hidden states and the loss applies the head
    chunk by chunk (distill/students.py `student_hidden` + `distill_loss(student_hidden=..., lm_head_weight=...)`, the
    teacher's inference-mode logits used as they are), TRL's returns full logits and its loss takes them. Reported:
    each phase, the RSS growth of each loss's forward + backward, and the optimizers (fused AdamW both: the HF
    Trainer's default, and ours on the CPU since issue 27)."""
    from trl.experimental.gkd import GKDTrainer

    from distill.batches import collate
    from distill.objectives import TeacherTargets, distill_loss, teacher_forward
    from distill.students import chunked_head, student_hidden

    teacher, tokenizer = load_model(TEACHER, device="cpu")
    student = truncate_student(teacher, evenly_spaced_layers(teacher.config.num_hidden_layers, args.student_layers))
    head = chunked_head(student)
    assert head is not None, "the truncated SmolLM2 student's logits are hidden @ W.T"
    student.train()
    ds = load_teacher_data(data.train)
    rows = [ds[i] for i in epoch_order(len(ds), SEED, 0)[: args.batch_size]]
    T = max(len(row["input_ids"]) for row in rows)
    batch = collate(rows, max_seq_len=T, pad_id=tokenizer.pad_token_id, topk=False)
    labels, mask, beta = batch["labels"], batch["labels"] != IGNORE, 0.5 if args.objective == "jsd" else 0.0
    objective = {"jsd": 1.0} if args.objective == "jsd" else {"forward_kl": 1.0}
    model_in = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"], "use_cache": False}
    teacher_logits = teacher_forward(teacher, batch)  # (B, T, V), an inference tensor
    targets = TeacherTargets(logits=teacher_logits)
    with torch.no_grad():  # the losses' own backward stops at these leaves
        hidden_leaf = student_hidden(student, batch).requires_grad_()  # (B, T, D)
        logits_leaf = student(**model_in).logits.requires_grad_()  # (B, T, V)
        trl_teacher_logits = teacher_logits.clone()  # TRL's trainer runs its teacher under no_grad

    def loss_ours() -> None:
        hidden_leaf.grad = None
        distill_loss(
            None, targets, labels, mask, objective, beta=beta, student_hidden=hidden_leaf, lm_head_weight=head
        )[0].backward()

    def loss_trl() -> None:
        logits_leaf.grad = None
        # TRL's compute_loss shifts logits and labels by one first; `collate` has already aligned them.
        GKDTrainer.generalized_jsd_loss(logits_leaf, trl_teacher_logits, labels=labels, beta=beta).backward()

    out = {}
    for name, fn in (("ours", loss_ours), ("trl", loss_trl)):
        fn()  # first-call allocations are nobody's peak
        rss = vm_rss_mb()
        reset_peak_rss()
        fn()
        out[f"loss_peak_rss_growth_{name}_mb"] = peak_rss_mb() - rss
    grads, held = {"ours": hidden_leaf.grad, "trl": logits_leaf.grad}, {}
    head.grad = None  # the head's gradient from loss_ours stays out of the student backward below

    def student_forward_ours() -> None:
        held["ours"] = student_hidden(student, batch)

    def student_forward_trl() -> None:
        held["trl"] = student(**model_in).logits

    optimizers = {
        name: torch.optim.AdamW(student.parameters(), lr=args.lr, **kw)
        for name, kw in (("ours", {"fused": True}), ("trl", {"fused": True}))
    }
    phases = {
        "teacher_forward": lambda: teacher_forward(teacher, batch),
        "student_forward_ours": student_forward_ours,
        "student_forward_trl": student_forward_trl,
        "loss_fwd_bwd_ours": loss_ours,
        "loss_fwd_bwd_trl": loss_trl,
        "student_backward_ours": lambda: held.pop("ours").backward(grads["ours"]),
        "student_backward_trl": lambda: held.pop("trl").backward(grads["trl"]),
        "optimizer_step_ours": optimizers["ours"].step,
        "optimizer_step_trl": optimizers["trl"].step,
    }
    best = dict.fromkeys(phases, math.inf)
    for _ in range(args.profile_reps):
        for name, fn in phases.items():
            start = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - start)
    return (
        out
        | {f"{name}_s": value for name, value in best.items()}
        | {
            f"sum_of_phases_{who}_s": best["teacher_forward"]
            + sum(best[f"{phase}_{who}"] for phase in ("student_forward", "loss_fwd_bwd", "student_backward"))
            + best[f"optimizer_step_{who}"]
            for who in ("ours", "trl")
        }
    )


# ----------------------------------------------------------------------------------------------------------------
# Parent: data, the children, the table


def check_trl(python: str) -> None:
    if subprocess.run([python, "-c", "import trl.experimental.gkd"], capture_output=True).returncode:
        sys.exit(f"{python} cannot import trl: .venv/bin/pip install --no-deps trl (or pass --trl-python)")


def child(args, name: str, python: str) -> dict:
    """Run `--child name` in a fresh process of `python`; returns its JSON result."""
    result = args.out / f"{name}.json"
    result.unlink(missing_ok=True)
    cmd = [python, __file__, "--child", name, "--result", str(result)] + [
        a for a in sys.argv[1:] if a not in ("--profile",)
    ]
    env = os.environ | {"TRL_EXPERIMENTAL_SILENCE": "1", "TQDM_DISABLE": "1"}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode:
        sys.exit(f"the {name} run failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(result.read_text())


def timed_s_per_token(calls: list[dict], *, tokens: list[int], warmup: int) -> float:
    """Seconds per response token over the timed steps of a round's call(s) of one trainer."""
    return sum(sum(c["step_s"][warmup:]) for c in calls) / (len(calls) * sum(tokens[warmup:]))


def losses_agree(a: list[float], b: list[float]) -> bool:
    return len(a) == len(b) and all(math.isclose(x, y, rel_tol=LOSS_RTOL, abs_tol=LOSS_RTOL) for x, y in zip(a, b))


def compare(runs: dict[str, list[list[dict]]], tokens: list[int], warmup: int) -> dict:
    """Per-round ratios ours / TRL -> medians with 95 % bootstrap intervals, pooled tokens/s, the losses check."""
    per_token = functools.partial(timed_s_per_token, tokens=tokens, warmup=warmup)
    speed = paired_speedup(runs["trl"], runs["ours"], per_token)  # TRL s/token / ours s/token = tokens/s ratio
    ours, trl = [u[0] for u in runs["ours"]], [u[0] for u in runs["trl"]]
    out = {
        "tokens_per_s": {name: 1 / per_token([c for u in runs[name] for c in u]) for name in ("ours", "trl")},
        "tokens_per_s_ratio": speed["speedup"],
        "tokens_per_s_ratio_ci": speed["speedup_ci"],
        "rounds": speed["units"],
        "timed_steps_per_trainer": speed["units"] * (len(tokens) - warmup),
    }
    out["tokens_per_s_ratio_pooled"] = out["tokens_per_s"]["ours"] / out["tokens_per_s"]["trl"]
    for key in ("peak_rss_mb", "process_peak_rss_mb"):
        ratios = [o[key] / t[key] for o, t in zip(ours, trl)]
        out[key.replace("_mb", "_ratio")] = median(ratios)
        out[key.replace("_mb", "_ratio_ci")] = bootstrap_ci(ratios)
    pairs = [(o["loss"], t["loss"]) for o, t in zip(ours, trl)] + [(ours[0]["loss"], o["loss"]) for o in ours[1:]]
    out["losses_identical"] = all(losses_agree(a, b) for a, b in pairs)  # ours = TRL, and every round the same
    out["loss_max_abs_diff"] = max(abs(x - y) for a, b in pairs for x, y in zip(a, b))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=5, help="ABBA rounds: one process per trainer each")
    parser.add_argument("--steps", type=int, default=2, help="timed steps per trainer and round")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first, in every process")
    parser.add_argument("--num-seqs", type=int, default=64)
    parser.add_argument("--response-tokens", type=int, default=200)
    parser.add_argument("--student-layers", type=int, default=4)
    parser.add_argument("--objective", choices=["jsd", "forward_kl"], default="jsd")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--trl-python", default=sys.executable, help="a python that can import trl")
    parser.add_argument("--out", type=Path, default=Path("runs/distill-bench"))
    parser.add_argument("--profile", action="store_true", help="also break one step into phases")
    parser.add_argument("--profile-reps", type=int, default=3, help="rounds of the phase timing")
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--child", choices=["ours", "trl", "profile"], help=argparse.SUPPRESS)
    parser.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.manual_seed(SEED)
    data = bench_data(args.out, num_seqs=args.num_seqs, response_tokens=args.response_tokens)
    if args.child:
        run = {"ours": run_ours, "trl": run_trl, "profile": run_profile}[args.child]
        args.result.write_text(json.dumps(run(args, data)))
        return

    check_trl(args.trl_python)
    ds = load_teacher_data(data.train)
    tokens = step_tokens(ds, epoch_order(len(ds), SEED, 0), args.batch_size, args.warmup + args.steps)
    start = time.perf_counter()
    python = {"ours": sys.executable, "trl": args.trl_python}
    runs = paired_runs(
        lambda unit, name, repeat: child(args, name, python[name]), units=args.rounds, arms=("ours", "trl"), repeats=1
    )
    profile = child(args, "profile", args.trl_python) if args.profile else None
    result = compare(runs, tokens, args.warmup)
    T = max(len(x) for x in ds["input_ids"])
    print(
        f"teacher {TEACHER}, student {args.student_layers} layers (truncation), objective {args.objective}, lmbda 0, "
        f"fp32 CPU ({torch.get_num_threads()} threads), batch {args.batch_size} x <= {T} tokens "
        f"({args.response_tokens} response tokens per sequence); {args.rounds} rounds in ABBA order, each "
        f"{args.warmup} warm-up + {args.steps} timed steps per trainer"
    )
    print(
        "\n| trainer | tokens/s (all timed steps) | s per step, per round (warm-up first) "
        "| peak RSS (training) MiB | peak RSS (process) MiB |"
    )
    print("| --- | ---: | --- | --- | --- |")
    for name, label in (("ours", "ours (train.loop.distill)"), ("trl", "TRL GKDTrainer")):
        calls = [u[0] for u in runs[name]]
        steps = " / ".join(" ".join(f"{x:.2f}" for x in c["step_s"]) for c in calls)
        peaks = " ".join(f"{c['peak_rss_mb']:.0f}" for c in calls)
        process = " ".join(f"{c['process_peak_rss_mb']:.0f}" for c in calls)
        print(f"| {label} | {result['tokens_per_s'][name]:.1f} | {steps} | {peaks} | {process} |")
    print("\nper-step loss, first round (same batches; equal when both compute the same objective):")
    print("  ours: " + " ".join(f"{x:.4f}" for x in runs["ours"][0][0]["loss"]))
    print("  trl:  " + " ".join(f"{x:.4f}" for x in runs["trl"][0][0]["loss"]))
    lo, hi = result["tokens_per_s_ratio_ci"]
    mlo, mhi = result["peak_rss_ratio_ci"]
    print(
        f"\nratios (ours / TRL) over {result['rounds']} rounds x {args.steps} timed steps: tokens/s "
        f"{result['tokens_per_s_ratio']:.2f}x (median of the rounds; 95% bootstrap CI [{lo:.2f}, {hi:.2f}]; pooled "
        f"{result['tokens_per_s_ratio_pooled']:.2f}x; goal >= 2), peak RSS (training) "
        f"{result['peak_rss_ratio']:.2f}x "
        f"[{mlo:.2f}, {mhi:.2f}] (goal <= 0.6), peak RSS (process) {result['process_peak_rss_ratio']:.2f}x; losses "
        f"identical: {'yes' if result['losses_identical'] else 'NO'} (max |diff| {result['loss_max_abs_diff']:.1e})"
    )
    if args.rounds * args.steps < 10:
        print(f"note: {args.rounds * args.steps} timed steps per trainer; the benchmark wants at least 10")
    if profile:
        print(f"\none step split into phases (same batch, fastest of {args.profile_reps} rounds):")
        for key, value in profile.items():
            print(f"  {key:28s} {value:9.3f}")
    print(f"\nwall {time.perf_counter() - start:.0f} s")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        order = [abba_order(("ours", "trl"), unit, 0) for unit in range(args.rounds)]
        runs_json = {name: [u[0] for u in runs[name]] for name in runs}
        args.json.write_text(
            json.dumps(
                {"args": {k: str(v) for k, v in vars(args).items()}, "order": order, "runs": runs_json}
                | result
                | {"profile": profile},
                indent=2,
            )
        )


if __name__ == "__main__":
    main()
