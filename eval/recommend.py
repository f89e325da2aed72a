"""The recommendation: choose a setting on the selection split, decide on the confirmation split it never saw.

    cand, setting = choose(report, temperature=0.0, draft_rule="greedy")    # eval/sweep.py confirms this one
    report["recommendation"] = recommend(report, serving_config)            # after report["confirmation"] exists

`choose` ranks the chains at the serving temperature and draft rule by the lower end of their speedup interval
(`speedup_ci[0]`, then the median): the setting most surely faster, not the luckiest single number. The maximum
over many noisy settings overstates its own speedup (the winner's curse), so `recommend` enables speculative
decoding only on numbers measured again on the confirmation split: its `speedup_ci[0]` must exceed
1 + serving.min_speedup_margin and its acceptance_rate must reach serving.min_acceptance (`gate`, which `promote`
calls again on the report's numbers, so an edited report cannot claim another decision; the gates are recorded in
the recommendation). Tree settings are reported, never promoted: the serving engines' draft-model speculation (vLLM,
SGLang, TensorRT-LLM) drafts chains.
"""

from __future__ import annotations

import dataclasses

from eval.config import ServingConfig

MEASURED_KEYS = ("acceptance_rate", "mean_accepted_length", "speedup", "speedup_ci")


def surest_speedup(setting: dict) -> tuple[float, float]:
    """The key settings are ranked by: the lower end of the speedup interval, then the median (missing: lowest)."""
    ci = setting.get("speedup_ci")
    return (ci[0] if ci else float("-inf"), setting.get("speedup") or float("-inf"))


def choose(report: dict, temperature: float, draft_rule: str, min_acceptance: float = 0.0) -> tuple[dict, dict]:
    """(candidate, setting): the chain at (temperature, draft_rule) whose selection-split speedup interval has the
    highest lower end (ties: the higher median), among the chains whose acceptance_rate reaches `min_acceptance`
    (all chains when none does, so the refusal names that gate). ValueError when the report has no such chain."""
    rule = "greedy" if temperature == 0 else draft_rule  # the sweep runs only greedy at T=0 (identical there)
    options = [
        (c, s)
        for c in report["candidates"]
        for s in c["settings"]
        if s["temperature"] == temperature and s["draft_rule"] == rule and s.get("tree") is None
    ]
    if not options:
        raise ValueError(
            f"the report has no setting at temperature={temperature}, draft_rule={rule}; add them to "
            "eval.temperatures / eval.draft_rules or change serving.temperature / serving.draft_rule"
        )
    # A fast-looking setting the acceptance gate would refuse must not hide one that passes both gates.
    accepted = [cs for cs in options if (cs[1].get("acceptance_rate") or 0.0) >= min_acceptance]
    return max(accepted or options, key=lambda cs: surest_speedup(cs[1]))


def max_concurrency(rows: list[dict], threshold: float) -> int | None:
    """The largest batch size up to which every measured one (from the smallest) has speedup_ci[0] > threshold."""
    best = None
    for row in sorted(rows, key=lambda r: r["batch_size"]):
        if not row.get("speedup_ci") or row["speedup_ci"][0] <= threshold:
            break
        best = row["batch_size"]
    return best


def gate(row: dict, serving: ServingConfig) -> str:
    """The gate that decides a confirmed setting from its numbers (`row`: acceptance_rate and speedup_ci at the
    smallest measured batch size): `speedup_ci` or `min_acceptance` when it fails that one, else `passed`."""
    ci, alpha = row.get("speedup_ci"), row.get("acceptance_rate") or 0.0
    if not ci or ci[0] <= 1 + serving.min_speedup_margin:
        return "speedup_ci"
    return "min_acceptance" if alpha < serving.min_acceptance else "passed"


def recorded_gates(serving: ServingConfig) -> dict:
    """The serving section's gates as the recommendation records them (`gates`): what `promote` checks it against
    when no run config is next to the report."""
    return {k: v for k, v in dataclasses.asdict(serving).items() if k != "path"}


def _fmt_ci(ci) -> str:
    return f"[{ci[0]:.2f}, {ci[1]:.2f}]" if ci else "[-]"


def recommend(report: dict, serving: ServingConfig) -> dict:
    """The recommendation block of the report: the chosen setting, its selection and confirmation numbers, and
    whether it is enabled, with the gate that decided (`gate`: speedup_ci, min_acceptance, or passed)."""
    cand, best = choose(report, serving.temperature, serving.draft_rule, serving.min_acceptance)
    conf = report.get("confirmation")
    if conf is None:
        raise ValueError("the report has no confirmation measurement; run `specdistill eval` (it confirms the choice)")
    chosen = (cand["name"], best["num_draft_tokens"], best["draft_rule"], best["temperature"])
    if (conf["name"], conf["num_draft_tokens"], conf["draft_rule"], conf["temperature"]) != chosen:
        raise ValueError(f"the report's confirmation measured another setting than the selection split picks {chosen}")
    rows = sorted(conf["by_batch_size"], key=lambda r: r["batch_size"])
    first, threshold = rows[0], 1 + serving.min_speedup_margin
    limit = max_concurrency(rows, threshold)
    measured_at = [r["batch_size"] for r in rows]
    confirmation = {k: first.get(k) for k in MEASURED_KEYS} | {
        "split": "confirmation",
        "batch_size": first["batch_size"],
        "prompts": conf["prompts"],
        "max_concurrency": limit,
        "measured_concurrency": measured_at,
    }
    rec = {
        "name": cand["name"],
        "draft": cand["draft"],
        "kind": cand.get("kind", "standalone"),
        "num_draft_tokens": best["num_draft_tokens"],
        "draft_rule": best["draft_rule"],
        "temperature": best["temperature"],
        "selection": {k: best.get(k) for k in MEASURED_KEYS} | {"split": "selection"},
        "confirmation": confirmation,
        "by_batch_size": rows,
        "max_concurrency": limit,
        "gates": recorded_gates(serving),
    }
    setting = (
        f"{cand['name']} at num_draft_tokens={best['num_draft_tokens']} (T={best['temperature']:g}, "
        f"{best['draft_rule']})"
    )
    sel = f"{_num(best.get('speedup'))}x {_fmt_ci(best.get('speedup_ci'))} on the selection split"
    conf_text = f"{_num(first.get('speedup'))}x {_fmt_ci(first.get('speedup_ci'))} on the confirmation split"
    decided, alpha = gate(first, serving), first.get("acceptance_rate") or 0.0
    if decided == "speedup_ci":
        return rec | {
            "enabled": False,
            "gate": "speedup_ci",
            "reason": (
                f"speedup gate: {setting}, chosen with {sel}, measured {conf_text} at batch size "
                f"{first['batch_size']}; the interval's lower end does not clear 1 + min_speedup_margin = "
                f"{threshold:.2f}"
            ),
        }
    if decided == "min_acceptance":
        return rec | {
            "enabled": False,
            "gate": "min_acceptance",
            "reason": (
                f"acceptance gate: {setting} measured {conf_text}, but its acceptance_rate {alpha:.2f} on the "
                f"confirmation split is below min_acceptance {serving.min_acceptance}"
            ),
        }
    beyond = f"; it clears the margin up to concurrency {limit} of the measured {measured_at}" if len(rows) > 1 else ""
    return rec | {
        "enabled": True,
        "gate": "passed",
        "reason": (
            f"both gates passed: {setting}, chosen with {sel}, measured {conf_text} (lower end > {threshold:.2f}) with "
            f"acceptance_rate {alpha:.2f} >= {serving.min_acceptance}{beyond}"
        ),
    }


def _num(value) -> str:
    return "-" if value is None else f"{value:.2f}"
