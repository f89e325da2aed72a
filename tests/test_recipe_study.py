"""The recipe study's paired comparison (benchmarks/recipe_study.py compare): it must separate two drafts that
differ consistently on the same prompts even where their own intervals overlap, and must not separate two drafts
that differ only by noise."""

import random
from pathlib import Path

import pytest
from helpers.runs import load_benchmark

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def study():
    return load_benchmark("recipe_study")


def drafts(shift: float, seed: int = 0, prompts: int = 20) -> tuple[list, list]:
    """(accepted, judged) per prompt for a base draft and another: prompt difficulty varies widely (what both share),
    the other draft is accepted `shift` more often on every prompt, plus a little noise of its own."""
    rng = random.Random(seed)
    base, other = [], []
    for _ in range(prompts):
        judged = rng.randrange(30, 60)
        p = rng.uniform(0.05, 0.45)
        noise = rng.uniform(-0.01, 0.01)
        base.append((round(p * judged), judged))
        other.append((round(min(1.0, p + shift + noise) * judged), judged))
    return base, other


def unpaired_difference(base, other, *, draws: int = 2000, seed: int = 0):
    """The broken variant: each draft's prompts resampled on their own, as if they had been measured on different
    prompts; the prompts' shared difficulty stays in the interval."""
    rng = random.Random(seed)
    n = len(base)

    def pooled(rows):
        sample = [rows[rng.randrange(n)] for _ in range(n)]
        return sum(a for a, _ in sample) / sum(b for _, b in sample)

    stats = sorted(pooled(other) - pooled(base) for _ in range(draws))
    return [stats[int(0.025 * draws)], stats[int(0.975 * draws) - 1]]


def test_paired_difference_separates_a_consistent_gain_that_the_own_intervals_do_not(study):
    base, other = drafts(shift=0.03)
    own_base, own_other = study.bootstrap(base), study.bootstrap(other)
    assert own_other[0] < own_base[1], "the drafts' own intervals must overlap for this test to mean anything"
    diff, ci = study.paired_difference(base, other)
    assert 0.02 < diff < 0.04
    assert ci[0] > 0, f"a +0.03 gain on every prompt must be separated by the paired interval, got {ci}"
    # the broken (unpaired) variant keeps the prompts' difficulty in the interval and cannot separate them
    assert unpaired_difference(base, other)[0] < 0


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_paired_difference_does_not_separate_noise(study, seed):
    base, other = drafts(shift=0.0, seed=seed)
    diff, ci = study.paired_difference(base, other)
    assert ci[0] < diff < ci[1]
    assert ci[0] < 0 < ci[1], f"no shift, yet the paired interval excludes 0: {ci}"


def test_a_study_and_its_compare_run_end_to_end(study, tmp_path, monkeypatch):
    """The script's real path on the smoke target: a trained variant, then `compare` of that draft with itself,
    which must measure the same rate twice and a paired difference of exactly 0."""
    import json

    monkeypatch.chdir(ROOT)
    common = ["--config", "configs/smoke.yaml", "--prompts", "2", "--max-new-tokens", "8", "--gamma", "2"]
    out = tmp_path / "objectives"
    # output_dir: the teacher data goes under the test's folder too, not the config's runs/smoke
    argv = ["objectives", *common, "--steps", "2", "--only", "ce", "--out", str(out), f"output_dir={out}"]
    assert study.main(argv) == 0
    (run,) = json.loads((out / "study.json").read_text())["runs"]
    assert run["variant"] == "ce" and run["teacher_tokens"] > 0 and len(run["per_prompt"]) == 2
    assert not (out / "data" / "train-1").exists(), "the whole teacher set must not be copied"
    best = out / "candidates" / "ce-seed0" / "best"
    argv = [
        "compare",
        *common,
        "--drafts",
        f"a={best}",
        f"b={best}",
        "--out",
        str(tmp_path / "cmp"),
        f"output_dir={out}",
    ]
    assert study.main(argv) == 0
    a, b = json.loads((tmp_path / "cmp" / "study.json").read_text())["runs"]
    assert a["acceptance_rate"] == b["acceptance_rate"] == run["acceptance_rate"]
    assert b["difference"] == 0 and b["difference_ci"] == [0, 0]
    with pytest.raises(SystemExit, match="distinct names"):
        study.main(["compare", *common, "--drafts", f"a={best}", f"a={best}", "--out", str(tmp_path / "bad")])


def test_the_prompt_loss_study_trains_on_prompt_positions(study, tmp_path, monkeypatch):
    """Issue 27's experiment on the smoke target: each pair differs by `distill.loss_on_prompt` alone, and the
    variant with it trains (teacher online, no cache with prompt rows needed)."""
    import json

    import yaml

    pairs = study.VARIANTS["prompt-loss"]
    for name in ("eagle3", "truncation", "eagle3-cache", "truncation-cache"):
        assert pairs[f"{name}-prompt"] == [*pairs[name], "distill.loss_on_prompt=true"]
    monkeypatch.chdir(ROOT)
    out = tmp_path / "prompt-loss"
    argv = ["prompt-loss", "--config", "configs/smoke.yaml", "--prompts", "2", "--max-new-tokens", "8", "--gamma", "2",
            "--steps", "2", "--only", "truncation", "truncation-prompt", "--out", str(out),
            f"output_dir={out}"]  # fmt: skip
    assert study.main(argv) == 0
    report = json.loads((out / "study.json").read_text())
    assert [r["variant"] for r in report["runs"]] == ["truncation", "truncation-prompt"]
    assert all(len(r["per_prompt"]) == 2 for r in report["runs"])
    assert [(p["base"], p["other"], p["seed"]) for p in report["paired"]] == [("truncation", "truncation-prompt", 0)]
    # the base variant trains on response tokens only although the default is the loss on prompt tokens too
    resolved = {r["variant"]: yaml.safe_load((out / "candidates" / f"{r['variant']}-seed0" / "config.yaml").read_text())
                for r in report["runs"]}  # fmt: skip
    assert {k: v["distill"]["loss_on_prompt"] for k, v in resolved.items()} == {
        "truncation": False,
        "truncation-prompt": True,
    }


def test_the_study_pairs_its_variants_on_their_own_per_prompt_counts(study):
    """A study's PAIRED variants get other - base per seed from the runs' per-prompt counts (no re-measurement);
    a pair whose base is missing is skipped, and the difference has the sign of the gain."""
    base, other = drafts(shift=0.03)
    runs = [
        {"variant": "truncation", "seed": 0, "per_prompt": base},
        {"variant": "truncation-prompt", "seed": 0, "per_prompt": other},
        {"variant": "eagle3-prompt", "seed": 0, "per_prompt": other},  # no eagle3 run: skipped
    ]
    (pair,) = study.pair_variants("prompt-loss", runs)
    assert (pair["base"], pair["other"], pair["seed"]) == ("truncation", "truncation-prompt", 0)
    assert (pair["acceptance_rate_diff"], pair["ci"]) == study.paired_difference(base, other)
    assert pair["ci"][0] > 0
    swapped = study.pair_variants("prompt-loss", [{**r, "per_prompt": p} for r, p in zip(runs[:2], [other, base])])
    assert swapped[0]["ci"][1] < 0  # the broken order (base and other swapped) must read as a loss
    assert study.pair_variants("objectives", runs) == []

    # Two seeds: each seed's difference, then one over both, every (prompt, seed) a unit.
    base1, other1 = drafts(shift=0.03, seed=1)
    runs += [{"variant": "truncation", "seed": 1, "per_prompt": base1},
             {"variant": "truncation-prompt", "seed": 1, "per_prompt": other1}]  # fmt: skip
    pairs = study.pair_variants("prompt-loss", runs)
    assert [p["seed"] for p in pairs] == [0, 1, "all"]
    assert (pairs[2]["acceptance_rate_diff"], pairs[2]["ci"]) == study.paired_difference(base + base1, other + other1)
    assert pairs[2]["ci"][1] - pairs[2]["ci"][0] < pairs[0]["ci"][1] - pairs[0]["ci"][0]  # twice the units


def test_the_prompt_loss_study_trains_on_cached_prompt_rows(study, tmp_path, monkeypatch):
    """The head trained on the prompt from the offline cache (the quickstart's teacher): the study's data stage
    stores the prompt rows and the aux states its variants read, and the variant trains from them."""
    import json

    from distill.data import AUX_HIDDEN, TOPK_START, load_teacher_data

    pairs = study.VARIANTS["prompt-loss"]
    assert pairs["eagle3-cache-prompt"] == [*pairs["eagle3-cache"], "distill.loss_on_prompt=true"]
    assert not any("teacher=online" in o for o in pairs["eagle3-cache-prompt"])
    monkeypatch.chdir(ROOT)
    out = tmp_path / "prompt-loss-cache"
    argv = ["prompt-loss", "--config", "configs/smoke.yaml", "--prompts", "2", "--max-new-tokens", "8", "--gamma", "2",
            "--steps", "2", "--batch-size", "2", "--only", "eagle3-cache-prompt", "--out", str(out),
            f"output_dir={out}", "distill.teacher=cache", "data.teacher_cache=true"]  # fmt: skip
    assert study.main(argv) == 0
    (run,) = json.loads((out / "study.json").read_text())["runs"]
    assert run["variant"] == "eagle3-cache-prompt" and len(run["per_prompt"]) == 2
    (folder,) = (p for p in (out / "data").glob("teacher-*") if not p.name.startswith("teacher-eval"))
    train = load_teacher_data(folder)
    assert TOPK_START in train.column_names and set(train[TOPK_START]) == {1}
    assert AUX_HIDDEN in train.column_names
