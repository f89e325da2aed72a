"""Draft quality per distillation objective at equal compute, before and after distillation.

For each candidate of the config (by default configs/bench-objectives.yaml: a 4-layer truncation of the embedded
SmolLM2-135M-Instruct distilled with ce (sequence-level KD), forward KL and TV, same data, steps, batch and lr
schedule), it reports the validation `expected_acceptance` (sum_v min(p, q)) and greedy top-1 match with the target:
"before" measured on the untrained student by the trainer's own validation loop (`train.validation.validate`, on the
same validation teacher data), "after" read from the candidate's best/metrics.json, plus each candidate's wall time.

    python benchmarks/objectives_bench.py                                      # CPU: ~12 minutes on 2 cores
    python benchmarks/objectives_bench.py train.max_steps=4 --json objectives_bench.json   # key=value overrides
    python benchmarks/objectives_bench.py target.device=cuda                   # 1 GPU

The stages are the pipeline's own (`stage_data`, then `train.loop.distill` per candidate with the loaded target);
the config restarts every candidate (train.resume=false), so the wall times are those of fresh runs.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from accelerate import Accelerator
from accelerate.utils import set_seed

from distill.data import TeacherData, load_teacher_data
from distill.students import build_student
from specdistill.config import RootConfig, load_config, to_dict
from specdistill.pipeline import dist_state, load_target, stage_data
from specdistill.pipeline import distill_candidate as distill
from train.validation import validate

METRICS = ("eval/expected_acceptance", "eval/greedy_match")


def untrained_metrics(cfg: RootConfig, teacher, tokenizer, teacher_data: TeacherData, device: str) -> dict:
    """Validation metrics of the student as `distill` builds it, before its first step."""
    set_seed(cfg.seed)  # the seed distill builds the student under (init=config draws random weights)
    load_options = {"dtype": cfg.target.dtype}
    student = build_student(teacher, cfg.draft, teacher_tokenizer=tokenizer, load_options=load_options).float()
    cache = cfg.distill.teacher == "cache"
    columns = ["input_ids", "prompt_len"] + (["topk_ids", "topk_logprobs"] if cache else [])
    validation_ds = load_teacher_data(teacher_data.validation).select_columns(columns)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    accelerator = Accelerator(cpu=device == "cpu")
    return validate(student, None if cache else teacher, validation_ds, accelerator, cfg.distill, cfg.train, pad_id)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("overrides", nargs="*", help="section.key=value overrides of the config")
    parser.add_argument("--config", type=Path, default=Path("configs/bench-objectives.yaml"))
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args()
    start = time.perf_counter()
    cfg = load_config(args.config, args.overrides)
    dist = dist_state(cfg.target.device)
    teacher, tokenizer, teacher_id = load_target(cfg, dist)
    teacher_data = stage_data(cfg, dist, (teacher, tokenizer, teacher_id))
    data_s = time.perf_counter() - start

    results, before = [], {}
    for name, resolved in cfg.candidate_configs.items():
        # Candidates that share a draft (and the way it is scored) share the "before" numbers.
        key = json.dumps([to_dict(resolved.draft), resolved.distill.teacher], sort_keys=True)
        if key not in before:
            before[key] = untrained_metrics(resolved, teacher, tokenizer, teacher_data, dist.device)
        tick = time.perf_counter()
        cand = distill(resolved, name, teacher_data, teacher=teacher, tokenizer=tokenizer)
        after = json.loads((cand / "best" / "metrics.json").read_text())
        results.append(
            {
                "candidate": name,
                "objective": resolved.distill.objective,
                "before": {k.removeprefix("eval/"): before[key][k] for k in METRICS},
                "after": {k.removeprefix("eval/"): after[k] for k in METRICS},
                "best_step": after["step"],
                "wall_s": time.perf_counter() - tick,
            }
        )

    train_cfg, data_cfg = cfg.train, cfg.data
    print(
        f"\ntarget {cfg.target.model}; {train_cfg.max_steps} steps x batch {train_cfg.batch_size} x grad_accum "
        f"{train_cfg.grad_accum}, lr {train_cfg.lr:g} (warm-up {train_cfg.warmup_steps}, cosine); data: "
        f"{data_cfg.max_prompts} prompts x {data_cfg.num_samples} teacher samples of <= {data_cfg.max_new_tokens} "
        f"tokens; validation: {data_cfg.max_validation_prompts} prompts"
    )
    print(
        "\n| candidate | objective | expected_acceptance before | after | greedy_match before | after | best step "
        "| wall s |"
    )
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in results:
        objective = " + ".join(f"{w:g} {term}" if w != 1 else term for term, w in r["objective"].items())
        print(
            f"| {r['candidate']} | {objective} | {r['before']['expected_acceptance']:.4f} | "
            f"{r['after']['expected_acceptance']:.4f} | {r['before']['greedy_match']:.4f} | "
            f"{r['after']['greedy_match']:.4f} | {r['best_step']} | {r['wall_s']:.0f} |"
        )
    total_s = time.perf_counter() - start
    print(f"\nteacher data {data_s:.0f} s (cached on reruns); total wall {total_s:.0f} s")
    if args.json:
        summary = {"config": to_dict(cfg), "data_s": data_s, "wall_s": total_s, "candidates": results}
        args.json.write_text(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
