"""The recipe study of docs/benchmarks.md (issue 15): what moves acceptance on `builtin:test` at a CPU budget.

    specdistill data configs/embedded-best.yaml                           # the teacher data, once (cached)
    python benchmarks/recipe_study.py data --config configs/embedded-best.yaml --fractions 0.25 0.5 1 \\
        --out runs/recipe/data                                            # acceptance vs teacher tokens
    python benchmarks/recipe_study.py layers --config configs/embedded-best.yaml --out runs/recipe/layers
    python benchmarks/recipe_study.py objectives --config configs/embedded-best.yaml --seeds 0 1 \\
        --out runs/recipe/objectives
    python benchmarks/recipe_study.py onpolicy --config configs/embedded-best.yaml --steps 40 --seeds 0 1 \\
        --out runs/recipe/onpolicy
    python benchmarks/recipe_study.py compare --drafts fkl=runs/recipe/onpolicy/candidates/fkl-seed0/best \\
        seqkd=runs/recipe/onpolicy/candidates/seqkd-seed0/best --out runs/recipe/compare   # paired differences

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
  samples     the same on the first 1 / 2 answers of every prompt (`--answers`): against the `data` points of the
              same token count, more prompts with fewer answers each vs fewer prompts with more answers
  head-lr     the same on all the data at learning rates 1e-3 (the quickstart's), 2e-3 and 4e-3
  layers      4-layer truncations keeping evenly spaced layers (the default), the first 3 + the last, the first 4
  objectives  4-layer truncations with forward_kl, reverse_kl, jsd, tv, ce (`--seeds`: several seeds each)
  onpolicy    4-layer truncations: sequence-level KD (ce), forward KL off- and on-policy (lmbda 0.5), TV on-policy
  prompt-loss the EAGLE-3 head and the config's truncation, each trained on response tokens only and with
              `distill.loss_on_prompt` (the teacher online, or from the cache: the `-cache` variants), at the same
              steps; the study reports each pair's paired difference itself (`PAIRED`)
Every variant trains on response tokens only (`STUDY_DEFAULTS`) unless it says otherwise, as these studies were
measured before the loss on prompt tokens became the default.
`compare` trains nothing: it measures the trained drafts given with --drafts on the same prompts and pairs each
against the first, reporting the difference in acceptance_rate with a paired bootstrap interval (the prompts are
resampled once for both), which is what separates two variants whose own intervals overlap.
"""

from __future__ import annotations

import argparse
import dataclasses
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
# Under every variant (its own overrides come after): the studies of issue 15 measured response tokens only, before
# issue 27 made the loss on prompt tokens the default; the prompt-loss study's `-prompt` variants set it back on.
STUDY_DEFAULTS = ["distill.loss_on_prompt=false"]
VARIANTS = {
    "data": {"eagle3": EAGLE3},
    "samples": {"eagle3": EAGLE3},
    # the head's learning rate: the quickstart's loss is still falling steeply at its last step
    "head-lr": {f"eagle3-lr{lr}": [*EAGLE3[:-1], f"train.lr={lr}"] for lr in ("1e-3", "2e-3", "4e-3")},
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
    # Issue 27: the scoring pass has the teacher's distribution at every prompt position (the long-input prompts are
    # ~370 tokens before a 40-token answer); EAGLE-1 trained on fixed text. Each pair differs by the flag only; the
    # teacher runs online, so no cache with prompt rows is needed.
    "prompt-loss": {
        "eagle3": [*EAGLE3, "distill.teacher=online"],
        "eagle3-prompt": [*EAGLE3, "distill.teacher=online", "distill.loss_on_prompt=true"],
        "truncation": ["distill.teacher=online"],
        "truncation-prompt": ["distill.teacher=online", "distill.loss_on_prompt=true"],
        # the head as the quickstart trains it, from the offline cache (its prompt rows stored for the second)
        "eagle3-cache": [*EAGLE3],
        "eagle3-cache-prompt": [*EAGLE3, "distill.loss_on_prompt=true"],
        # the config's truncation likewise, from the offline cache (the teacher's top-k at the prompt rows too)
        "truncation-cache": [],
        "truncation-cache-prompt": ["distill.loss_on_prompt=true"],
    },
}

# Variant pairs a study reports the paired difference of (the second minus the first, per seed), as `compare` would
# but from the study's own measurement of the same prompts.
PAIRED = {
    "prompt-loss": [
        ("eagle3", "eagle3-prompt"),
        ("truncation", "truncation-prompt"),
        ("eagle3-cache", "eagle3-cache-prompt"),
        ("truncation-cache", "truncation-cache-prompt"),
    ]
}


def rate(num: float, den: float) -> float:
    return num / den if den else 0.0


def pooled(per_prompt: list[tuple[int, int]], idx) -> float:
    """rate(sum num, sum den) over the prompts `idx` (with repeats: a bootstrap sample)."""
    return rate(sum(per_prompt[i][0] for i in idx), sum(per_prompt[i][1] for i in idx))


def percentile_interval(stat, n: int, *, draws: int = 2000, seed: int = 0) -> list[float]:
    """95 % percentile interval of stat(indices) over `draws` resamples of n prompts with replacement (fixed seed)."""
    rng = random.Random(seed)
    stats = sorted(stat([rng.randrange(n) for _ in range(n)]) for _ in range(draws))
    return [stats[int(0.025 * draws)], stats[int(0.975 * draws) - 1]]


def bootstrap(per_prompt: list[tuple[int, int]], **kw) -> list[float]:
    """95 % interval of the pooled rate sum(num) / sum(den), a prompt's counts resampled whole."""
    return percentile_interval(lambda idx: pooled(per_prompt, idx), len(per_prompt), **kw)


def paired_difference(base: list[tuple[int, int]], other: list[tuple[int, int]], **kw) -> tuple[float, list[float]]:
    """other's acceptance_rate minus base's on the same prompts, and its 95 % interval: the prompts are resampled
    once for both drafts, so what the two share (an easy prompt is easy for both) cancels out of the difference and
    the interval is far narrower than the two drafts' own intervals side by side."""
    assert len(base) == len(other), "paired drafts must be measured on the same prompts"
    diff = lambda idx: pooled(other, idx) - pooled(base, idx)  # noqa: E731
    return diff(range(len(base))), percentile_interval(diff, len(base), **kw)


def measure(target, tokenizer, draft_dir: Path, prompts, *, gamma: int, max_new_tokens: int) -> dict:
    """Greedy chains at T = 0 over `prompts`, one at a time: acceptance and tau with intervals over prompts."""
    from specdec_runtime.backends import fast_model
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
    return {
        "acceptance_rate": rate(sum(accepted), sum(judged)),
        "acceptance_rate_ci": bootstrap(acc),
        "mean_accepted_length": rate(sum(accepted) + sum(steps), sum(steps)),
        "mean_accepted_length_ci": bootstrap(tau),
        "prompts": len(prompts),
        "per_prompt": [list(x) for x in acc],  # (accepted, judged) per prompt: what `compare` pairs
    }


def subset(train: Path, out: Path, *, fraction: float = 1.0, answers: int | None = None) -> tuple[Path, int]:
    """The first `fraction` of the training sequences (whole prompts with all their answers), or the first `answers`
    answers of every prompt, saved once under `out`, and their response tokens."""
    from distill.data import COMPLETE, load_teacher_data

    ds = load_teacher_data(train)
    if fraction >= 1 and answers is None:  # the whole set: only its token count is needed, not a copy
        return Path(train), sum(len(ids) - p for ids, p in zip(ds["input_ids"], ds["prompt_len"]))
    if answers is None:
        keep, path = range(max(1, math.ceil(fraction * len(ds)))), out / f"train-{fraction:g}"
    else:  # row ids are "<prompt id>#<answer index>"
        keep = [i for i, rid in enumerate(ds["id"]) if int(rid.rsplit("#", 1)[1]) < answers]
        path = out / f"train-answers{answers}"
    if not (path / COMPLETE).is_file():
        ds.select(keep).save_to_disk(str(path))
        # the marker `load_teacher_data` asks of a finished dataset, with the summary (its aux layers) of the whole
        (path / COMPLETE).write_text((Path(train) / COMPLETE).read_text())
    part = load_teacher_data(path)
    tokens = sum(len(ids) - p for ids, p in zip(part["input_ids"], part["prompt_len"]))
    return path, tokens


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("study", choices=[*sorted(VARIANTS), "compare"])
    ap.add_argument("--config", default="configs/embedded-best.yaml")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--steps", type=int, default=100, help="optimizer steps per variant")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--fractions", type=float, nargs="+", default=[0.25, 0.5, 1.0])
    ap.add_argument("--answers", type=int, nargs="+", default=[1, 2], help="samples: answers kept per prompt")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0])
    ap.add_argument("--prompts", type=int, default=20, help="first N builtin:test prompts (all categories)")
    ap.add_argument("--gamma", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--only", nargs="+", default=None, help="run only these variants of the study")
    ap.add_argument(
        "--drafts",
        nargs="+",
        default=[],
        metavar="NAME=DIR",
        help="compare: trained drafts to measure on the same prompts, each paired against the first",
    )
    ap.add_argument("overrides", nargs="*", help="extra dotted overrides for every variant (e.g. target.model=...)")
    args = ap.parse_intermixed_args(argv)
    if args.study == "compare":
        return compare(args)
    unknown = sorted(set(args.only or []) - set(VARIANTS[args.study]))
    if unknown:
        ap.error(f"--only {unknown}: not variants of {args.study} ({', '.join(VARIANTS[args.study])})")

    from distill.data import TeacherData
    from specdec_runtime.backends import fast_model
    from specdistill.config import CandidateConfig, load_config, parse_override
    from specdistill.pipeline import dist_state, distill_candidate, eval_prompts, load_target, stage_data

    base = [
        *STUDY_DEFAULTS,
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
    variants = {k: v for k, v in VARIANTS[args.study].items() if args.only is None or k in args.only}
    # The data stage stores what the candidates of its config read from the offline cache (an EAGLE-3 head's aux
    # states, the prompt rows of one with distill.loss_on_prompt: `stage_data`): the study's variants are its
    # candidates, with the config's own (they share its data folder).
    data_cfg = load_config(args.config, args.overrides)
    studied = [
        CandidateConfig(f"study-{name}", dict(map(parse_override, [*STUDY_DEFAULTS, *overrides])))
        for name, overrides in variants.items()
    ]
    data_cfg = dataclasses.replace(data_cfg, candidates=[*data_cfg.candidates, *studied])
    dist = dist_state(data_cfg.target.device)
    loaded = load_target(data_cfg, dist)
    target, tokenizer, _ = loaded
    data = stage_data(data_cfg, dist, loaded)  # cached: generated by `specdistill data CONFIG`
    prompts = eval_prompts("builtin:test", tokenizer, args.prompts, trained_on=data_cfg.data)
    fast_target = fast_model(target)

    runs = []
    # (data fraction, answers per prompt, tag) per point: a `data` study varies the first, `samples` the second
    points = {
        "data": [(f, None, f"-{f:g}") for f in args.fractions],
        "samples": [(1.0, k, f"-{k}answers") for k in args.answers],
    }.get(args.study, [(1.0, None, "")])
    for name, overrides in variants.items():
        for (fraction, answers, tag), seed in [(p, s) for p in points for s in args.seeds]:
            label = f"{name}{tag}-seed{seed}"
            train, tokens = subset(data.train, args.out / "data", fraction=fraction, answers=answers)
            cfg = load_config(args.config, [*base, f"seed={seed}", *overrides])
            start = time.perf_counter()
            teacher_data = TeacherData(train, data.validation)
            cand = distill_candidate(cfg, label, teacher_data, teacher=target, tokenizer=tokenizer)
            minutes = (time.perf_counter() - start) / 60
            row = {
                "variant": name,
                "seed": seed,
                "fraction": fraction,
                "answers_per_prompt": answers,
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

    paired = pair_variants(args.study, runs)
    write_study(args, runs, len(prompts), paired)
    if args.study == "data":
        plot_curve(runs, args.out / "curve.png")
    return 0


def pair_variants(study: str, runs: list[dict]) -> list[dict]:
    """The study's paired differences (`PAIRED`), per seed: `other` minus `base` in acceptance_rate on the same
    prompts, from the runs' own per-prompt counts (no second measurement), printed and returned."""
    by_key = {(r["variant"], r["seed"]): r for r in runs}
    out = []
    for base, other in PAIRED.get(study, []):
        for seed in sorted({r["seed"] for r in runs}):
            if (base, seed) not in by_key or (other, seed) not in by_key:
                continue  # --only left one of the pair out
            b, o = by_key[base, seed], by_key[other, seed]
            diff, ci = paired_difference(b["per_prompt"], o["per_prompt"])
            out.append({"base": base, "other": other, "seed": seed, "acceptance_rate_diff": diff, "ci": ci})
            print(f"{other} - {base} (seed {seed}): acceptance_rate {diff:+.3f} [{ci[0]:+.3f}, {ci[1]:+.3f}]")
        seeds = [p["seed"] for p in out if (p["base"], p["other"]) == (base, other)]
        if len(seeds) > 1:  # and over the seeds: each (prompt, seed) a unit, both arms resampled together
            b = [u for seed in seeds for u in by_key[base, seed]["per_prompt"]]
            o = [u for seed in seeds for u in by_key[other, seed]["per_prompt"]]
            diff, ci = paired_difference(b, o)
            out.append({"base": base, "other": other, "seed": "all", "acceptance_rate_diff": diff, "ci": ci})
            print(f"{other} - {base} (seeds {seeds}): acceptance_rate {diff:+.3f} [{ci[0]:+.3f}, {ci[1]:+.3f}]")
    return out


def write_study(args, runs: list[dict], num_prompts: int, paired: list[dict] | None = None) -> None:
    """<out>/study.json: the runs and the settings they were measured under."""
    settings = {
        "study": args.study,
        "config": args.config,
        "gamma": args.gamma,
        "temperature": 0.0,
        "draft_rule": "greedy",
        "prompts": "builtin:test",
        "num_prompts": num_prompts,
        "max_new_tokens": args.max_new_tokens,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    study = {"settings": settings, "runs": runs, "paired": paired or []}
    (args.out / "study.json").write_text(json.dumps(study, indent=2) + "\n")
    print(f"wrote {args.out / 'study.json'}")


def compare(args) -> int:
    """Measure already trained drafts on the same prompts and pair each against the first: the difference in
    acceptance_rate with a paired interval, which separates variants whose own intervals overlap."""
    from specdec_runtime.backends import fast_model
    from specdistill.config import load_config
    from specdistill.pipeline import dist_state, eval_prompts, load_target

    drafts = dict(d.split("=", 1) for d in args.drafts if "=" in d)
    if len(drafts) < 2 or len(drafts) != len(args.drafts):
        raise SystemExit(
            "compare: give two or more --drafts as NAME=DIR with distinct names (e.g. fkl=runs/x/candidates/fkl/best)"
        )
    missing = [d for d in drafts.values() if not (Path(d) / "config.json").is_file()]
    if missing:
        raise SystemExit(f"compare: {missing} hold no draft (config.json): pass a candidate's best/ folder")
    cfg = load_config(args.config, list(args.overrides))
    target, tokenizer, _ = load_target(cfg, dist_state(cfg.target.device))
    prompts = eval_prompts("builtin:test", tokenizer, args.prompts, trained_on=cfg.data)
    fast_target = fast_model(target)
    runs = []
    for name, path in drafts.items():
        row = {"variant": name, "draft": path}
        row |= measure(
            fast_target, tokenizer, Path(path), prompts, gamma=args.gamma, max_new_tokens=args.max_new_tokens
        )
        if runs:
            base = runs[0]
            row["baseline"] = base["variant"]
            row["difference"], row["difference_ci"] = paired_difference(base["per_prompt"], row["per_prompt"])
        print(json.dumps({k: v for k, v in row.items() if k != "per_prompt"}), flush=True)
        runs.append(row)
    write_study(args, runs, len(prompts))
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
