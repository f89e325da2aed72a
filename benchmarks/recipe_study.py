"""The recipe study of docs/benchmarks.md (issue 15): what moves acceptance on `builtin:test` at a CPU budget.

    specdistill data configs/embedded-best.yaml                           # the teacher data, once (cached)
    python benchmarks/recipe_study.py data --config configs/embedded-best.yaml --fractions 0.25 0.5 1 \\
        --out runs/recipe/data                                            # acceptance vs teacher tokens
    python benchmarks/recipe_study.py layers --config configs/embedded-best.yaml --out runs/recipe/layers
    python benchmarks/recipe_study.py objectives --config configs/embedded-best.yaml --seeds 0 1 \\
        --out runs/recipe/objectives
    python benchmarks/recipe_study.py onpolicy --config configs/embedded-best.yaml --steps 40 --seeds 0 1 \\
        --out runs/recipe/onpolicy

Every study trains its variants on the teacher data of --config (a `data` study on the first fraction of its
training sequences: fewer prompts, the same answers), each for the same number of optimizer steps (`--steps`), into
<out>/candidates/<name>/, then decodes the first `--prompts` prompts of `builtin:test` with each draft through the
speculative runtime (chains, greedy drafting, T = 0, gamma `--gamma`; the fast CPU path as eval uses it) and
reports per variant the acceptance_rate and mean_accepted_length over those prompts with a 95 % bootstrap interval
over prompts (a prompt's counts are resampled whole), the training wall time and the teacher response tokens it
trained on. Acceptance at T = 0 is deterministic per prompt, so no repeats are needed; speed is not measured here
(the eval sweep's paired A/B does that for the presets). Results: <out>/study.json and, for `data`, <out>/curve.png.

Variants are fixed per study (edit `VARIANTS` to add some):
  data        the EAGLE-3 recipe of configs/quickstart.yaml on 25 / 50 / 100 % of the teacher sequences
  layers      4-layer truncations keeping evenly spaced layers (the default), the first 3 + the last, the first 4
  objectives  4-layer truncations with forward_kl, reverse_kl, jsd, tv, ce (`--seeds`: several seeds each)
  onpolicy    4-layer truncations: sequence-level KD (ce), forward KL off- and on-policy (lmbda 0.5), TV on-policy
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

EAGLE3 = [  # the quickstart's head (run it with --batch-size 4 as the quickstart does)
    "draft.init=eagle3",
    "draft.draft_vocab_size=8192",
    "draft.ttt_depth=3",
    "draft.freeze_lm_head=true",
    "train.lr=1e-3",
]
VARIANTS = {
    "data": {"eagle3": EAGLE3},
    "layers": {
        "evenly-spaced": ["draft.layers=null", "draft.num_layers=4"],
        "first3-last": ["draft.layers=[0,1,2,29]"],
        "first4": ["draft.layers=[0,1,2,3]"],
    },
    "objectives": {
        name: [f"distill.objective={{{name}: 1.0}}"] for name in ("forward_kl", "reverse_kl", "jsd", "tv", "ce")
    },
    # DistillSpec's claim: a divergence matched to the decoding mode, on the draft's own (on-policy) samples, beats
    # plain sequence-level KD (cross-entropy on the teacher's samples). The KL rows run the teacher online, so that
    # on-policy data (`distill.lmbda`, which needs it) is the only difference between them.
    "onpolicy": {
        "seqkd": ["distill.objective={ce: 1.0}"],
        "fkl": ["distill.objective={forward_kl: 1.0}", "distill.teacher=online"],
        "fkl-onpolicy": ["distill.objective={forward_kl: 1.0}", "distill.teacher=online", "distill.lmbda=0.5"],
        "tv-onpolicy": ["distill.objective={tv: 1.0}", "distill.teacher=online", "distill.lmbda=0.5"],
    },
}


def bootstrap(per_prompt: list[tuple[int, int]], ratio, *, draws: int = 2000, seed: int = 0) -> list[float]:
    """95 % percentile interval of ratio(sum num, sum den) over prompts resampled with replacement."""
    rng = random.Random(seed)
    stats = []
    for _ in range(draws):
        sample = [per_prompt[rng.randrange(len(per_prompt))] for _ in per_prompt]
        stats.append(ratio(sum(a for a, _ in sample), sum(b for _, b in sample)))
    stats.sort()
    return [stats[int(0.025 * draws)], stats[int(0.975 * draws) - 1]]


def measure(target, tokenizer, draft_dir: Path, prompts, *, gamma: int, max_new_tokens: int) -> dict:
    """Greedy chains at T = 0 over `prompts`, one at a time: acceptance and tau with intervals over prompts."""
    from specdec_runtime.bench import fast_model
    from specdec_runtime.engine import generate
    from specdec_runtime.loading import load_draft_model, stop_token_ids

    draft, _ = load_draft_model(str(draft_dir), dtype="float32", device="cpu")
    draft = fast_model(draft, draft=True)
    stops = stop_token_ids(target, tokenizer)
    accepted, judged, steps = [], [], []
    for p in prompts:
        result = generate(
            target, draft, [p.ids], num_draft_tokens=gamma, max_new_tokens=max_new_tokens, stop_token_ids=stops
        )
        (req,) = result.stats.requests
        accepted.append(req.accepted)
        judged.append(sum(req.position_reached))
        steps.append(req.verify_steps)
    acc, tau = list(zip(accepted, judged)), list(zip([a + s for a, s in zip(accepted, steps)], steps))
    rate = lambda a, b: a / b if b else 0.0  # noqa: E731
    return {
        "acceptance_rate": rate(sum(accepted), sum(judged)),
        "acceptance_rate_ci": bootstrap(acc, rate),
        "mean_accepted_length": rate(sum(accepted) + sum(steps), sum(steps)),
        "mean_accepted_length_ci": bootstrap(tau, rate),
        "prompts": len(prompts),
    }


def subset(train: Path, fraction: float, out: Path) -> tuple[Path, int]:
    """The first `fraction` of the training sequences, saved once under `out`, and their response tokens."""
    from distill.data import COMPLETE, load_teacher_data

    ds = load_teacher_data(train)
    n = max(1, math.ceil(fraction * len(ds)))
    path = out / f"train-{fraction:g}"
    if not (path / COMPLETE).is_file():
        ds.select(range(n)).save_to_disk(str(path))
        # the marker `load_teacher_data` asks of a finished dataset, with the summary (its aux layers) of the whole
        (path / COMPLETE).write_text((Path(train) / COMPLETE).read_text())
    part = load_teacher_data(path)
    tokens = sum(len(ids) - p for ids, p in zip(part["input_ids"], part["prompt_len"]))
    return path, tokens


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("study", choices=sorted(VARIANTS))
    ap.add_argument("--config", default="configs/embedded-best.yaml")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--steps", type=int, default=100, help="optimizer steps per variant")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--fractions", type=float, nargs="+", default=[0.25, 0.5, 1.0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0])
    ap.add_argument("--prompts", type=int, default=20, help="first N builtin:test prompts (all categories)")
    ap.add_argument("--gamma", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--only", nargs="+", default=None, help="run only these variants of the study")
    ap.add_argument("overrides", nargs="*", help="extra dotted overrides for every variant (e.g. target.model=...)")
    args = ap.parse_intermixed_args(argv)
    unknown = sorted(set(args.only or []) - set(VARIANTS[args.study]))
    if unknown:
        ap.error(f"--only {unknown}: not variants of {args.study} ({', '.join(VARIANTS[args.study])})")

    from distill.data import TeacherData
    from specdec_runtime.bench import fast_model
    from specdistill.config import load_config
    from specdistill.pipeline import dist_state, distill_candidate, eval_prompts, load_target, stage_data

    base = [
        f"output_dir={args.out}",
        f"train.max_steps={args.steps}",
        f"train.batch_size={args.batch_size}",
        f"train.eval_every={args.steps}",
        f"train.save_every={args.steps}",
        "train.warmup_steps=6",
        "tracking=none",
        "candidates=[]",
        *args.overrides,
    ]
    data_cfg = load_config(args.config, [o for o in args.overrides])
    dist = dist_state(data_cfg.target.device)
    loaded = load_target(data_cfg, dist)
    target, tokenizer, _ = loaded
    data = stage_data(data_cfg, dist, loaded)  # cached: generated by `specdistill data CONFIG`
    prompts = eval_prompts("builtin:test", tokenizer, args.prompts, trained_on=data_cfg.data)
    fast_target = fast_model(target)

    runs = []
    points = [(f, s) for f in (args.fractions if args.study == "data" else [1.0]) for s in args.seeds]
    variants = {k: v for k, v in VARIANTS[args.study].items() if args.only is None or k in args.only}
    for name, overrides in variants.items():
        for fraction, seed in points:
            label = name + (f"-{fraction:g}" if args.study == "data" else "") + f"-seed{seed}"
            train, tokens = subset(data.train, fraction, args.out / "data") if fraction < 1 else (data.train, None)
            if tokens is None:
                tokens = subset(data.train, 1.0, args.out / "data")[1]
            cfg = load_config(args.config, [*base, f"seed={seed}", *overrides])
            start = time.perf_counter()
            cand = distill_candidate(cfg, label, TeacherData(train, data.eval), teacher=target, tokenizer=tokenizer)
            minutes = (time.perf_counter() - start) / 60
            row = {
                "variant": name,
                "seed": seed,
                "fraction": fraction,
                "teacher_tokens": tokens,
                "train_minutes": minutes,
                "steps": args.steps,
                "batch_size": args.batch_size,
                "overrides": overrides,
            }
            row |= measure(
                fast_target, tokenizer, cand / "best", prompts, gamma=args.gamma, max_new_tokens=args.max_new_tokens
            )
            print(json.dumps(row), flush=True)
            runs.append(row)

    settings = {
        "study": args.study,
        "config": args.config,
        "gamma": args.gamma,
        "temperature": 0.0,
        "draft_rule": "greedy",
        "prompts": "builtin:test",
        "num_prompts": len(prompts),
        "max_new_tokens": args.max_new_tokens,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
    }
    (args.out / "study.json").write_text(json.dumps({"settings": settings, "runs": runs}, indent=2) + "\n")
    if args.study == "data":
        plot_curve(runs, args.out / "curve.png")
    print(f"wrote {args.out / 'study.json'}")
    return 0


def plot_curve(runs: list[dict], path: Path) -> None:
    """acceptance_rate (with its interval) against teacher response tokens."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = sorted(runs, key=lambda r: r["teacher_tokens"])
    x = [r["teacher_tokens"] for r in runs]
    y = [r["acceptance_rate"] for r in runs]
    err = [
        [r["acceptance_rate"] - r["acceptance_rate_ci"][0] for r in runs],
        [r["acceptance_rate_ci"][1] - r["acceptance_rate"] for r in runs],
    ]
    fig, ax = plt.subplots(figsize=(5, 3.5))
    ax.errorbar(x, y, yerr=err, marker="o", capsize=3)
    for r in runs:
        ax.annotate(
            f"{r['train_minutes']:.1f} min",
            (r["teacher_tokens"], r["acceptance_rate"]),
            fontsize=7,
            textcoords="offset points",
            xytext=(4, -10),
        )
    ax.set_xlabel("teacher response tokens trained on")
    ax.set_ylabel("acceptance_rate (builtin:test, T=0, greedy)")
    ax.set_title("EAGLE-3 head: acceptance vs teacher data")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    raise SystemExit(main())
