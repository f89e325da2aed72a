"""The recommendation (eval/recommend.py) on synthetic reports: chosen by interval on the selection split, enabled
only on the confirmation split's numbers, each refusal naming its gate; the largest confirmed concurrency."""

from __future__ import annotations

import pytest

from eval.config import ServingConfig
from eval.recommend import choose, max_concurrency, recommend


def setting(gamma: int, speedup: float, ci: tuple[float, float], alpha: float = 0.7, tree: str | None = None) -> dict:
    return {
        "num_draft_tokens": gamma,
        "temperature": 0.0,
        "draft_rule": "greedy",
        "tree": tree,
        "batch_size": 1,
        "acceptance_rate": alpha,
        "mean_accepted_length": 1 + 2 * alpha,
        "speedup": speedup,
        "speedup_ci": list(ci),
    }


def confirmed(batch: int, speedup: float, ci: tuple[float, float], alpha: float = 0.7) -> dict:
    return {
        "batch_size": batch,
        "acceptance_rate": alpha,
        "mean_accepted_length": 1 + 2 * alpha,
        "speedup": speedup,
        "speedup_ci": list(ci),
        "units": 8,
    }


def report(confirmation_rows: list[dict], name: str = "steady", gamma: int = 3) -> dict:
    """Two candidates: `lucky` has the highest single speedup (a wide interval), `steady` the highest lower end."""
    return {
        "candidates": [
            {
                "name": "lucky",
                "draft": "/d/lucky",
                "settings": [
                    setting(2, 1.9, (0.9, 2.6)),
                    setting(3, 1.2, (1.0, 1.4)),
                    setting(4, 3.0, (1.4, 4.0), tree="2,1,1,1"),
                ],
            },
            {"name": "steady", "draft": "/d/steady", "settings": [setting(3, 1.5, (1.35, 1.6))]},
        ],
        "confirmation": {
            "name": name,
            "draft": f"/d/{name}",
            "num_draft_tokens": gamma,
            "draft_rule": "greedy",
            "temperature": 0.0,
            "split": "confirmation",
            "prompts": 16,
            "by_batch_size": confirmation_rows,
        },
    }


SERVING = ServingConfig(min_acceptance=0.5, min_speedup_margin=0.05)


def test_choose_by_the_interval_not_the_luckiest_number():
    cand, best = choose(report([]), 0.0, "greedy")
    assert (cand["name"], best["num_draft_tokens"]) == ("steady", 3)
    # the broken rule (the single highest speedup, trees included) would pick another setting
    options = [(c["name"], s) for c in report([])["candidates"] for s in c["settings"]]
    assert max(options, key=lambda o: o[1]["speedup"])[0] == "lucky"
    with pytest.raises(ValueError, match="no setting at temperature=1.0"):
        choose(report([]), 1.0, "sample")


def test_enabled_on_the_confirmation_numbers():
    rec = recommend(report([confirmed(1, 1.31, (1.2, 1.4))]), SERVING)
    assert rec["enabled"] is True and rec["gate"] == "passed" and rec["name"] == "steady"
    assert rec["confirmation"]["speedup"] == 1.31 and rec["confirmation"]["speedup_ci"] == [1.2, 1.4]
    assert rec["confirmation"]["split"] == "confirmation" and rec["selection"]["speedup"] == 1.5
    assert "both gates passed" in rec["reason"] and "[1.20, 1.40] on the confirmation split" in rec["reason"]


def test_refuses_an_interval_that_crosses_one_plus_margin():
    """The selection split said 1.5x [1.35, 1.6]; the confirmation split does not clear 1.05: off."""
    rec = recommend(report([confirmed(1, 1.2, (1.04, 1.35))]), SERVING)
    assert rec["enabled"] is False and rec["gate"] == "speedup_ci"
    assert "speedup gate" in rec["reason"] and "1 + min_speedup_margin = 1.05" in rec["reason"]
    assert rec["confirmation"]["speedup"] == 1.2  # what serving.yaml records: the confirmation, not 1.5
    looser = ServingConfig(min_acceptance=0.5, min_speedup_margin=0.02)
    assert recommend(report([confirmed(1, 1.2, (1.04, 1.35))]), looser)["enabled"] is True


def test_refuses_low_acceptance_on_the_confirmation_split():
    rec = recommend(report([confirmed(1, 1.3, (1.2, 1.4), alpha=0.4)]), SERVING)
    assert rec["enabled"] is False and rec["gate"] == "min_acceptance"
    assert "acceptance gate" in rec["reason"] and "0.40" in rec["reason"]


def test_largest_confirmed_concurrency():
    rows = [confirmed(1, 1.5, (1.4, 1.6)), confirmed(4, 1.2, (1.1, 1.3)), confirmed(16, 0.95, (0.9, 1.0))]
    rec = recommend(report(rows), SERVING)
    assert rec["enabled"] and rec["max_concurrency"] == 4 and rec["confirmation"]["measured_concurrency"] == [1, 4, 16]
    assert "up to concurrency 4 of the measured [1, 4, 16]" in rec["reason"]
    # a noisy pass at 16 after a failure at 4 does not extend the range
    assert max_concurrency([rows[0], confirmed(4, 1.0, (0.9, 1.1)), confirmed(16, 1.3, (1.2, 1.4))], 1.05) == 1


def test_confirmation_must_measure_the_chosen_setting():
    with pytest.raises(ValueError, match="another setting"):
        recommend(report([confirmed(1, 1.3, (1.2, 1.4))], name="lucky", gamma=2), SERVING)
    no_conf = report([])
    del no_conf["confirmation"]
    with pytest.raises(ValueError, match="no confirmation"):
        recommend(no_conf, SERVING)


def test_choose_skips_a_setting_the_acceptance_gate_would_refuse():
    """The setting with the best interval has alpha below serving.min_acceptance: choosing it would confirm a
    setting that is sure to be refused and hide `lucky`'s gamma 3, which passes both gates."""
    rep = report([])
    steady = rep["candidates"][1]["settings"][0]
    steady["acceptance_rate"] = 0.3
    cand, best = choose(rep, 0.0, "greedy", min_acceptance=0.5)
    assert (cand["name"], best["num_draft_tokens"]) == ("lucky", 3)
    assert choose(rep, 0.0, "greedy")[0]["name"] == "steady"  # no gate: the interval alone decides
    # nothing reaches the gate: still a choice, so the refusal can name the acceptance gate
    for c in rep["candidates"]:
        for s in c["settings"]:
            s["acceptance_rate"] = 0.1
    assert choose(rep, 0.0, "greedy", min_acceptance=0.5)[0]["name"] == "steady"
