"""Render an eval report (the `report.json` eval/results.py assembles) as report.md and a self-contained report.html.

    paths = write_reports(json.loads(Path("runs/quickstart/eval/report.json").read_text()),
                          Path("runs/quickstart/eval"), tracker=tracker)

Chain settings (`tree` null) make the per-gamma plots and tables; token-tree settings (`tree` a spec such as
"4,2,2,1" or "dynamic:16", num_draft_tokens = the tree's depth) get their own table and a tree-vs-chain plot, so a
tree never shows up as a point on a gamma curve. Every speedup is shown with its 95 % bootstrap interval
(`speedup_ci`): a [lo, hi] cell in the tables, error bars in the plots. The confirmation block (the chosen setting
measured again on prompts the choice never saw, at every batch size) gets its own table and concurrency plot. A
setting's prompt-length buckets (`by_prompt_length`) get a table and a plot at the focus setting, a `machine` block a
table; reports written before those keys render without them.

The HTML has no external resources: inline CSS, every plot a PNG embedded as a base64 `data:` URI, so it can be
mailed, attached to a W&B run or opened offline. The same plots are also written to `<out_dir>/plots/*.png`, which
report.md links to. Plots are drawn with matplotlib's Agg canvas on `Figure` objects (no pyplot global state).
"""

from __future__ import annotations

import base64
import html
import io
import json
import math
from collections.abc import Callable
from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from eval.recommend import surest_speedup
from specdec_runtime import atomic

SETTING_COLUMNS = [
    "candidate",
    "num_draft_tokens",
    "temperature",
    "draft_rule",
    "acceptance_rate",
    "mean_accepted_length",
    "expected_acceptance",
    "cost_ratio",
    "verify_cost_ratio",
    "predicted_speedup",
    "speedup",
    "speedup_ci",
    "efficiency",
    "overhead_fraction",
    "tokens_per_s",
    "ttft_s",
    "tpot_s",
    "peak_memory_bytes",
    "target peak_memory_bytes",
]
TREE_COLUMNS = [
    "candidate",
    "tree",
    "temperature",
    "draft_rule",
    "mean_accepted_length",
    "nodes_per_step",
    "speedup",
    "speedup_ci",
    "peak_memory_bytes",
    "speedup vs best chain",
]
TRACKER_COLUMNS = [*SETTING_COLUMNS, "tree", "nodes_per_step"]
TARGET_PREFIX = "target "  # a column "target X" shows the row's target_only[X] (the paired target-only arm)
TARGET_ONLY_COLUMNS = ["temperature", "tokens_per_s", "ttft_s", "tpot_s", "decode_s", "calls", "peak_memory_bytes"]
CONFIRMATION_COLUMNS = [
    "batch_size",
    "acceptance_rate",
    "mean_accepted_length",
    "speedup",
    "speedup_ci",
    "tokens_per_s",
    "target_tokens_per_s",
    "ttft_s",
    "tpot_s",
    "target ttft_s",
    "target tpot_s",
    "peak_memory_bytes",
    "target peak_memory_bytes",
    "units",
]
PROMPT_LENGTH_COLUMNS = [
    "candidate",
    "prompt tokens",
    "prompt_tokens",
    "units",
    "acceptance_rate",
    "speedup",
    "speedup_ci",
    "ttft_s",
    "target ttft_s",
    "tpot_s",
    "target tpot_s",
]
# what train/loop.py writes to metrics.jsonl: train rows, and validation rows under eval/
TRAINING_KEYS = (("train/loss", "eval/loss"), ("eval/expected_acceptance", "eval/greedy_match"))
CSS = """
body { font-family: system-ui, -apple-system, "Segoe UI", sans-serif; margin: 2rem auto; max-width: 1200px;
       color: #1f2328; padding: 0 1rem; }
h1 { font-size: 1.6rem; } h2 { margin-top: 2rem; border-bottom: 1px solid #d0d7de; padding-bottom: .3rem; }
table { border-collapse: collapse; margin: .5rem 0 1rem; font-size: .85rem; }
th, td { border: 1px solid #d0d7de; padding: .25rem .5rem; text-align: right; }
th { background: #f6f8fa; } td:first-child, th:first-child { text-align: left; }
.rec { padding: .8rem 1rem; border-radius: 6px; border: 1px solid; }
.on { background: #dafbe1; border-color: #4ac26b; } .off { background: #fff8c5; border-color: #d4a72c; }
figure { margin: 1rem 0; } img { max-width: 100%; border: 1px solid #d0d7de; }
figcaption { font-size: .85rem; color: #59636e; }
.meta { color: #59636e; font-size: .9rem; }
"""


# ----------------------------------------------------------------------------------------------------------------
# Selecting settings


def _is_chain(setting: dict) -> bool:
    """Reports written before token trees have no `tree` key: every setting there is a chain."""
    return setting.get("tree") is None


def _settings(candidate: dict, temperature: float, draft_rule: str) -> list[dict]:
    """The candidate's chain settings at one (temperature, draft_rule), ordered by num_draft_tokens."""
    rows = [
        s
        for s in candidate["settings"]
        if _is_chain(s) and s["temperature"] == temperature and s["draft_rule"] == draft_rule
    ]
    return sorted(rows, key=lambda s: s["num_draft_tokens"])


def _groups(report: dict) -> list[tuple[float, str]]:
    """Every (temperature, draft_rule) that some candidate was measured at with a chain."""
    return sorted(
        {(s["temperature"], s["draft_rule"]) for c in report["candidates"] for s in c["settings"] if _is_chain(s)}
    )


def _tree_settings(candidate: dict, temperature: float, draft_rule: str) -> list[dict]:
    """The candidate's tree settings at one (temperature, draft_rule), in sweep order."""
    return [
        s
        for s in candidate["settings"]
        if not _is_chain(s) and s["temperature"] == temperature and s["draft_rule"] == draft_rule
    ]


def _tree_groups(report: dict) -> list[tuple[float, str]]:
    """Every (temperature, draft_rule) that some candidate was measured at with a tree."""
    return sorted(
        {(s["temperature"], s["draft_rule"]) for c in report["candidates"] for s in c["settings"] if not _is_chain(s)}
    )


def best_chain(candidate: dict, temperature: float, draft_rule: str) -> dict | None:
    """The candidate's chain setting at (temperature, draft_rule) that is most surely fast: the highest lower end of
    its speedup interval, then the highest median (`eval.recommend.surest_speedup`, the ranking `choose` uses)."""
    rows = [s for s in _settings(candidate, temperature, draft_rule) if s.get("speedup") is not None]
    return max(rows, key=surest_speedup, default=None)


def _speedup_vs_best_chain(candidate: dict, tree_setting: dict) -> float | None:
    chain = best_chain(candidate, tree_setting["temperature"], tree_setting["draft_rule"])
    if chain is None or not chain["speedup"] or tree_setting.get("speedup") is None:
        return None
    return tree_setting["speedup"] / chain["speedup"]


def focus_setting(report: dict) -> tuple[int, float, str] | None:
    """(num_draft_tokens, temperature, draft_rule) that the detail plots show: the recommendation's, else the
    largest gamma at the first measured (temperature, draft_rule)."""
    rec = report.get("recommendation") or {}
    if all(rec.get(k) is not None for k in ("num_draft_tokens", "temperature", "draft_rule")):
        return rec["num_draft_tokens"], rec["temperature"], rec["draft_rule"]
    groups = _groups(report)
    if not groups:
        return None
    temperature, rule = groups[0]
    gamma = max(s["num_draft_tokens"] for c in report["candidates"] for s in _settings(c, temperature, rule))
    return gamma, temperature, rule


def _num(value) -> float:
    """None (a ratio over zero events, e.g. a draft position never reached) plots as a gap."""
    return math.nan if value is None else float(value)


def _column(rows: list[dict], key: str) -> list[float]:
    return [_num(s.get(key)) for s in rows]


def _yerr(rows: list[dict]) -> list[list[float]]:
    """Error bars (2, N) from each row's speedup_ci: distance below and above the speedup (NaN: no interval)."""
    below, above = [], []
    for s in rows:
        ci, mid = s.get("speedup_ci"), s.get("speedup")
        below.append(mid - ci[0] if ci and mid is not None else math.nan)
        above.append(ci[1] - mid if ci and mid is not None else math.nan)
    return [below, above]


def _setting_at(candidate: dict, focus: tuple[int, float, str]) -> dict | None:
    gamma, temperature, rule = focus
    return next((s for s in _settings(candidate, temperature, rule) if s["num_draft_tokens"] == gamma), None)


def _target_only_at(report: dict, temperature: float) -> dict | None:
    return next((t for t in report.get("target_only", []) if t["temperature"] == temperature), None)


def _prompt_length_buckets(report: dict, focus: tuple[int, float, str]) -> tuple[list[str], list[tuple[str, dict]]]:
    """(bucket names from the shortest prompts up, [(candidate, its `by_prompt_length`)]) at the focus setting, for
    the candidates that have one (reports from before issue 28 have none)."""
    per_cand = [(c["name"], (_setting_at(c, focus) or {}).get("by_prompt_length")) for c in report["candidates"]]
    per_cand = [(name, buckets) for name, buckets in per_cand if buckets]
    shortest = {name: b["prompt_tokens"][0] for _, buckets in per_cand for name, b in buckets.items()}
    return sorted(shortest, key=shortest.get), per_cand


def read_metrics(run_dir: str | Path | None) -> list[dict]:
    """Rows of `<run_dir>/metrics.jsonl`; a torn last line (a run killed mid-write) is skipped."""
    path = Path(run_dir) / "metrics.jsonl" if run_dir else None
    if path is None or not path.is_file():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return [r for r in rows if isinstance(r, dict) and "step" in r]


# ----------------------------------------------------------------------------------------------------------------
# Plots: each returns a Figure, or None when the report has nothing to show for it


def _figure(ncols: int, width: float = 4.2, height: float = 3.2) -> tuple[Figure, list]:
    fig = Figure(figsize=(width * ncols, height), layout="constrained")
    FigureCanvasAgg(fig)
    axes = [fig.add_subplot(1, ncols, i + 1) for i in range(ncols)]
    for ax in axes:  # gammas, positions and steps are integers
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    return fig, axes


def _legend(ax, fontsize: float) -> None:
    """A legend only over labelled artists: an empty one makes matplotlib warn "No artists with labels found"."""
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=fontsize)


def plot_acceptance_vs_gamma(report: dict) -> Figure | None:
    groups = _groups(report)
    if not groups:
        return None
    fig, axes = _figure(len(groups))
    for ax, (temperature, rule) in zip(axes, groups):
        for cand in report["candidates"]:
            rows = _settings(cand, temperature, rule)
            ax.plot([s["num_draft_tokens"] for s in rows], _column(rows, "acceptance_rate"), "o-", label=cand["name"])
        ax.set(title=f"T={temperature:g}, {rule}", xlabel="num_draft_tokens", ylabel="acceptance_rate", ylim=(0, 1.02))
        ax.grid(alpha=0.3)
    _legend(axes[0], 8)
    return fig


def plot_speedup_vs_gamma(report: dict) -> Figure | None:
    groups = _groups(report)
    if not groups:
        return None
    fig, axes = _figure(len(groups))
    for ax, (temperature, rule) in zip(axes, groups):
        for i, cand in enumerate(report["candidates"]):
            rows = _settings(cand, temperature, rule)
            gammas, color = [s["num_draft_tokens"] for s in rows], f"C{i}"
            ax.errorbar(
                gammas,
                _column(rows, "speedup"),
                yerr=_yerr(rows),
                fmt="o-",
                color=color,
                capsize=3,
                label=f"{cand['name']} measured (95% CI)",
            )
            ax.plot(gammas, _column(rows, "predicted_speedup"), "x--", color=color, label=f"{cand['name']} predicted")
        ax.axhline(1.0, color="gray", lw=1, ls=":")  # target-only decoding
        ax.set(title=f"T={temperature:g}, {rule}", xlabel="num_draft_tokens", ylabel="speedup vs target-only")
        ax.grid(alpha=0.3)
    _legend(axes[0], 7)
    return fig


def plot_per_position(report: dict) -> Figure | None:
    focus = focus_setting(report)
    if focus is None:
        return None
    rows = [(c["name"], _setting_at(c, focus)) for c in report["candidates"]]
    rows = [(name, s["per_position_acceptance"]) for name, s in rows if s and s.get("per_position_acceptance")]
    if not rows:
        return None
    fig, (ax,) = _figure(1, width=6)
    for name, values in rows:
        ax.plot(range(1, len(values) + 1), [_num(v) for v in values], "o-", label=name)
    gamma, temperature, rule = focus
    ax.set(
        title=f"per-position acceptance, num_draft_tokens={gamma}, T={temperature:g}, {rule}",
        xlabel="draft position",
        ylabel="P(accepted | previous accepted)",
        ylim=(0, 1.02),
    )
    ax.grid(alpha=0.3)
    _legend(ax, 8)
    return fig


def plot_by_category(report: dict) -> Figure | None:
    focus = focus_setting(report)
    if focus is None:
        return None
    per_cand = [(c["name"], (_setting_at(c, focus) or {}).get("by_category") or {}) for c in report["candidates"]]
    per_cand = [(name, cats) for name, cats in per_cand if cats]
    if not per_cand:
        return None
    categories = sorted({cat for _, cats in per_cand for cat in cats})
    fig, (ax,) = _figure(1, width=max(6, 0.9 * len(categories) * len(per_cand)))
    width = 0.8 / len(per_cand)
    for i, (name, cats) in enumerate(per_cand):
        xs = [j + i * width for j in range(len(categories))]
        ax.bar(xs, [(cats.get(cat) or {}).get("acceptance_rate") or 0.0 for cat in categories], width, label=name)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(categories))], categories, rotation=30, ha="right")
    gamma, temperature, rule = focus
    ax.set(
        title=f"acceptance_rate by category, num_draft_tokens={gamma}, T={temperature:g}, {rule}",
        ylabel="acceptance_rate",
        ylim=(0, 1.02),
    )
    _legend(ax, 8)
    return fig


def plot_by_prompt_length(report: dict) -> Figure | None:
    """Per prompt-length bucket at the focus setting: each candidate's paired speedup with its interval, and TTFT and
    TPOT next to the paired target-only arm's (gray, dashed; the settings at one temperature share it, so the
    candidates' target-only lines coincide)."""
    focus = focus_setting(report)
    if focus is None:
        return None
    names, per_cand = _prompt_length_buckets(report, focus)
    if not per_cand:
        return None
    fig, axes = _figure(3, width=3.8)
    xs = list(range(len(names)))
    for i, (cand, buckets) in enumerate(per_cand):
        rows = [buckets.get(name) or {} for name in names]
        axes[0].errorbar(xs, _column(rows, "speedup"), yerr=_yerr(rows), fmt="o-", color=f"C{i}", capsize=3, label=cand)
        for ax, key in zip(axes[1:], ("ttft_s", "tpot_s")):
            ax.plot(xs, [1e3 * _num(r.get(key)) for r in rows], "o-", color=f"C{i}", label=cand)
            base = [1e3 * _num((r.get("target_only") or {}).get(key)) for r in rows]
            ax.plot(xs, base, "s--", color="gray", label="target-only" if i == 0 else "_nolegend_")
    axes[0].axhline(1.0, color="gray", lw=1, ls=":")  # target-only decoding
    for ax, title in zip(axes, ("speedup vs target-only (95% CI)", "TTFT (ms)", "TPOT (ms)")):
        ax.set_xticks(xs, names)
        ax.set(title=title, xlabel="prompt tokens", xlim=(-0.5, len(names) - 0.5))
        ax.grid(alpha=0.3)
    gamma, temperature, rule = focus
    fig.suptitle(f"by prompt length: num_draft_tokens={gamma}, T={temperature:g}, {rule}", fontsize=9)
    _legend(axes[2], 7)
    return fig


def plot_latency(report: dict) -> Figure | None:
    focus = focus_setting(report)
    if focus is None:
        return None
    _, temperature, rule = focus
    fig, axes = _figure(2)
    base = _target_only_at(report, temperature) or {}
    for ax, key in zip(axes, ("ttft_s", "tpot_s")):
        for cand in report["candidates"]:
            rows = [s for s in _settings(cand, temperature, rule) if s.get(key) is not None]
            ax.plot([s["num_draft_tokens"] for s in rows], [1e3 * _num(s[key]) for s in rows], "o-", label=cand["name"])
        if base.get(key) is not None:
            ax.axhline(1e3 * base[key], color="gray", ls="--", lw=1, label="target-only")
        ax.set(title=f"{key} (T={temperature:g}, {rule})", xlabel="num_draft_tokens", ylabel=f"{key[:-2]} (ms)")
        ax.grid(alpha=0.3)
    _legend(axes[0], 8)
    return fig


def plot_training(report: dict) -> Figure | None:
    curves = [(c["name"], read_metrics(c.get("run_dir"))) for c in report["candidates"]]
    curves = [(name, rows) for name, rows in curves if rows]
    if not curves:
        return None
    fig, axes = _figure(len(TRAINING_KEYS))
    for ax, keys in zip(axes, TRAINING_KEYS):
        for i, (name, rows) in enumerate(curves):
            for key, style in zip(keys, ("-", "--")):
                points = [(r["step"], r[key]) for r in rows if r.get(key) is not None]
                if points:
                    ax.plot(*zip(*points), style, color=f"C{i}", label=f"{name} {key}")
        ax.set(xlabel="step", title=" / ".join(keys))
        ax.grid(alpha=0.3)
        _legend(ax, 7)
    return fig


def plot_tree_vs_chain(report: dict) -> Figure | None:
    """Bars per candidate: its fastest chain next to each tree, at the recommended (temperature, draft_rule) when
    trees were measured there, else at the first one they were."""
    groups = _tree_groups(report)
    if not groups:
        return None
    focus = focus_setting(report)
    temperature, rule = focus[1:] if focus and focus[1:] in groups else groups[0]
    specs = list(dict.fromkeys(s["tree"] for c in report["candidates"] for s in _tree_settings(c, temperature, rule)))
    fig, axes = _figure(2, width=max(4.2, 0.7 * (len(specs) + 1) * len(report["candidates"])), height=3.4)
    width = 0.8 / len(report["candidates"])
    for i, cand in enumerate(report["candidates"]):
        chain = best_chain(cand, temperature, rule)
        trees = {s["tree"]: s for s in _tree_settings(cand, temperature, rule)}
        bars = [chain or {}, *(trees.get(spec, {}) for spec in specs)]
        label = f"{cand['name']} (best chain: num_draft_tokens={chain['num_draft_tokens']})" if chain else cand["name"]
        for ax, key in zip(axes, ("mean_accepted_length", "speedup")):
            xs = [j + i * width for j in range(len(bars))]
            yerr = _yerr(bars) if key == "speedup" else None
            ax.bar(xs, [_num(s.get(key)) for s in bars], width, yerr=yerr, capsize=3, color=f"C{i}", label=label)
    for ax, key in zip(axes, ("mean_accepted_length", "speedup")):
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(specs) + 1)], ["best chain", *specs], rotation=20)
        ax.set(title=f"{key} (T={temperature:g}, {rule})", ylabel=key)
        ax.grid(alpha=0.3, axis="y")
    axes[1].axhline(1.0, color="gray", lw=1, ls=":")  # target-only decoding
    _legend(axes[0], 7)
    return fig


def plot_concurrency(report: dict) -> Figure | None:
    """The confirmed setting at each batch size: paired speedup with its interval, throughput over the batch, and
    per-request TTFT / TPOT, speculative next to target-only at the same concurrency."""
    conf = report.get("confirmation") or {}
    rows = sorted(conf.get("by_batch_size") or [], key=lambda r: r["batch_size"])
    if not rows:
        return None
    fig, axes = _figure(4, width=3.6)
    sizes = [r["batch_size"] for r in rows]
    axes[0].errorbar(sizes, _column(rows, "speedup"), yerr=_yerr(rows), fmt="o-", capsize=3, label="speculative")
    axes[0].axhline(1.0, color="gray", lw=1, ls=":")  # target-only decoding
    axes[0].set(title="speedup (95% CI)", ylabel="speedup vs target-only")
    panels = (
        ("tokens_per_s", 1.0, "tokens/s over the batch"),
        ("ttft_s", 1e3, "TTFT (ms)"),
        ("tpot_s", 1e3, "TPOT (ms)"),
    )
    for ax, (key, scale, title) in zip(axes[1:], panels):
        ax.plot(sizes, [scale * _num(r.get(key)) for r in rows], "o-", label="speculative")
        ax.plot(sizes, [scale * _num((r.get("target_only") or {}).get(key)) for r in rows], "s--", label="target-only")
        ax.set(title=title)
    for ax in axes:
        ax.set(xlabel="batch size (concurrency)")
        ax.grid(alpha=0.3)
    fig.suptitle(
        f"confirmation split: {conf['name']}, num_draft_tokens={conf['num_draft_tokens']}, "
        f"T={conf['temperature']:g}, {conf['draft_rule']}",
        fontsize=9,
    )
    _legend(axes[1], 7)
    return fig


PLOTS: list[tuple[str, str, Callable[[dict], Figure | None]]] = [
    ("acceptance_vs_gamma", "Measured acceptance_rate vs num_draft_tokens (chains)", plot_acceptance_vs_gamma),
    (
        "speedup_vs_gamma",
        "Measured (solid, 95% bootstrap interval) and predicted (dashed) speedup vs num_draft_tokens (chains)",
        plot_speedup_vs_gamma,
    ),
    (
        "concurrency",
        "Confirmation split: the chosen setting at each batch size, paired with target-only at the same batch size",
        plot_concurrency,
    ),
    (
        "tree_vs_chain",
        "tree vs chain: mean_accepted_length and speedup, each candidate's fastest chain next to each token tree",
        plot_tree_vs_chain,
    ),
    ("per_position_acceptance", "Per-position acceptance at the recommended setting", plot_per_position),
    ("acceptance_by_category", "acceptance_rate per prompt category at the recommended setting", plot_by_category),
    (
        "speedup_by_prompt_length",
        "Paired speedup (95% bootstrap interval), TTFT and TPOT by prompt length at the recommended setting "
        "(gray, dashed: target-only)",
        plot_by_prompt_length,
    ),
    ("latency", "Time to first token and time per output token (dashed: target-only)", plot_latency),
    ("training_curves", "Distillation curves from each candidate's metrics.jsonl", plot_training),
]


def _png(fig: Figure) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    return buf.getvalue()


# ----------------------------------------------------------------------------------------------------------------
# Tables: (title, columns, rows of display strings), shared by the Markdown and the HTML


def _fmt(value, column: str = "") -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if column.endswith("peak_memory_bytes"):
        return f"{value / 2**20:.1f} MiB"
    if isinstance(value, (list, tuple)) and len(value) == 2 and column.endswith("_ci"):
        return f"[{value[0]:.3g}, {value[1]:.3g}]"
    if isinstance(value, float):
        return f"{value:.0f}" if abs(value) >= 1000 else f"{value:.4g}"
    return str(value)


def _value(row: dict, column: str):
    """A table cell's raw value: row[column], or for "target X" the paired target-only arm's X."""
    if column.startswith(TARGET_PREFIX):
        return (row.get("target_only") or {}).get(column.removeprefix(TARGET_PREFIX))
    return row.get(column)


def tables(report: dict) -> list[tuple[str, list[str], list[list[str]]]]:
    out = []
    if report.get("machine"):
        out.append(("Machine", ["key", "value"], machine_rows(report["machine"])))
    target_only = report.get("target_only") or []
    out.append(
        (
            "Target-only baseline",
            TARGET_ONLY_COLUMNS,
            [[_fmt(t.get(k), k) for k in TARGET_ONLY_COLUMNS] for t in target_only],
        )
    )
    temps = {c.get("expected_acceptance_temperature", 1.0) for c in report["candidates"]}
    label = f"expected_acceptance (T={temps.pop():g})" if len(temps) == 1 else "expected_acceptance"
    cand_cols = ["candidate", "kind", "draft", "num_parameters", label, "best chain speedup", "its speedup_ci"]
    cand_rows = []
    for c in report["candidates"]:
        chains = [s for s in c["settings"] if _is_chain(s) and s.get("speedup") is not None]
        best = max(chains, key=surest_speedup, default={})
        cand_rows.append(
            [
                c["name"],
                c.get("kind", "standalone"),  # standalone LM or eagle3 head (shared/EAGLE3.md)
                c["draft"],
                _fmt(c.get("num_parameters")),
                _fmt(c.get("expected_acceptance")),
                _fmt(best.get("speedup")),
                _fmt(best.get("speedup_ci"), "speedup_ci"),
            ]
        )
    out.append(("Candidates", cand_cols, cand_rows))
    rows = []
    for c in report["candidates"]:
        for temperature, rule in _groups(report):
            rows += [
                [c["name"]] + [_fmt(_value(s, k), k) for k in SETTING_COLUMNS[1:]]
                for s in _settings(c, temperature, rule)
            ]
    out.append(
        (
            "Chain settings (one row per candidate x num_draft_tokens x temperature x draft_rule; selection split, "
            "expected_acceptance at the row's temperature)",
            SETTING_COLUMNS,
            rows,
        )
    )
    conf = report.get("confirmation")
    if conf:
        out.append(
            (
                f"Confirmation split ({conf['name']}, num_draft_tokens={conf['num_draft_tokens']}, "
                f"T={conf['temperature']:g}, {conf['draft_rule']}; {conf['prompts']} prompts the choice never saw)",
                CONFIRMATION_COLUMNS,
                confirmation_rows(conf),
            )
        )
    if _tree_groups(report):
        out.append(
            (
                "Token-tree settings (one row per candidate x tree x temperature x draft_rule)",
                TREE_COLUMNS,
                tree_rows(report),
            )
        )
    focus = focus_setting(report)
    if focus:
        by_cat = {c["name"]: (_setting_at(c, focus) or {}).get("by_category") or {} for c in report["candidates"]}
        categories = sorted({cat for cats in by_cat.values() for cat in cats})
        gamma, temperature, rule = focus
        out.append(
            (
                f"acceptance_rate / mean_accepted_length by category (num_draft_tokens={gamma}, "
                f"T={temperature:g}, {rule})",
                ["category", *by_cat],
                [[cat] + [_category_cell(by_cat[name].get(cat)) for name in by_cat] for cat in categories],
            )
        )
        length_rows = prompt_length_rows(report, focus)
        if length_rows:
            out.append(
                (
                    "Latency by prompt length (paired over the units whose prompts all fall in the bucket; "
                    f"num_draft_tokens={gamma}, T={temperature:g}, {rule})",
                    PROMPT_LENGTH_COLUMNS,
                    length_rows,
                )
            )
    wins = kind_wins(report)
    if wins:
        temperature, rule, kinds, rows = wins
        out.append(
            (
                f"Which kind wins, per category (each kind's most surely fast chain in that category, by the "
                f"category's paired speedup; T={temperature:g}, {rule})",
                ["category", "wins", "its speedup", *(f"best {k}" for k in kinds), "by how much"],
                rows,
            )
        )
    return out


def kind_wins(report: dict) -> tuple[float, str, list[str], list[list[str]]] | None:
    """Per prompt category: which kind of draft (standalone, eagle3, ngram, suffix) is fastest, and by how much.

    Each kind is represented by its candidate and chain length with the most surely fast speedup in that category
    (`surest_speedup` of the category's paired speedup and interval, measured over the units of that category alone)
    at the focus temperature and draft rule; the kinds are then ordered by that median speedup, and "by how much" is
    the winner's over the runner-up kind's, flagged where their intervals overlap.
    None when the report has a single kind or no per-category speedups (reports from before issue 26)."""
    focus = focus_setting(report)
    if not focus:
        return None
    _, temperature, rule = focus
    best: dict[str, dict[str, tuple]] = {}  # category -> kind -> (rank, stats, label)
    for c in report["candidates"]:
        kind = c.get("kind", "standalone")
        for s in _settings(c, temperature, rule):
            for category, stats in (s.get("by_category") or {}).items():
                if stats.get("speedup") is None:
                    continue
                n = f", {stats['units']} unit(s)" if stats.get("units") is not None else ""
                rank, label = surest_speedup(stats), f"{c['name']} (num_draft_tokens={s['num_draft_tokens']}{n})"
                if kind not in best.setdefault(category, {}) or rank > best[category][kind][0]:
                    best[category][kind] = (rank, stats, label)
    kinds = sorted({k for per_kind in best.values() for k in per_kind})
    if len(kinds) < 2:
        return None
    rows = []
    for category, per_kind in sorted(best.items()):
        ranked = sorted(per_kind.items(), key=lambda item: item[1][1]["speedup"], reverse=True)
        (kind, (_, stats, label)), runner_up = ranked[0], ranked[1] if len(ranked) > 1 else None
        by = stats["speedup"] / runner_up[1][1]["speedup"] if runner_up and runner_up[1][1]["speedup"] else None
        ci, other = stats.get("speedup_ci"), runner_up[1][1].get("speedup_ci") if runner_up else None
        overlap = " (intervals overlap)" if ci and other and ci[0] <= other[1] else ""
        cells = [
            f"{_fmt(per_kind[k][1]['speedup'])} ({_fmt(per_kind[k][1].get('speedup_ci'), 'speedup_ci')})"
            if k in per_kind
            else "-"
            for k in kinds
        ]
        versus = f"{_fmt(by)}x over {runner_up[0]}{overlap}" if by else "-"
        speed = f"{_fmt(stats['speedup'])} ({_fmt(stats.get('speedup_ci'), 'speedup_ci')})"
        rows.append([category, f"{kind}: {label}", speed, *cells, versus])
    return temperature, rule, kinds, rows


def prompt_length_rows(report: dict, focus: tuple[int, float, str]) -> list[list[str]]:
    """Rows of the prompt-length table: per candidate, its buckets at the focus setting from the shortest prompts up
    ("prompt tokens" names the bucket, `prompt_tokens` the shortest and longest prompt measured in it)."""
    names, per_cand = _prompt_length_buckets(report, focus)
    rows = []
    for cand, buckets in per_cand:
        for name in (n for n in names if n in buckets):
            rows.append([cand, name, *(_fmt(_value(buckets[name], k), k) for k in PROMPT_LENGTH_COLUMNS[2:])])
    return rows


def machine_rows(machine: dict, prefix: str = "") -> list[list[str]]:
    """The report's `machine` block as (key, value) rows, in its own order: a list joined by spaces (the CPU flags),
    nested dicts flattened into "layouts target qkv"-style keys, a {rows: layout} plan as one cell (`_layout_cell`)."""
    rows = []
    for key, value in machine.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value and all(isinstance(v, str) for v in value.values()):
            rows.append([name, _layout_cell(value)])
        elif isinstance(value, dict):
            rows += machine_rows(value, f"{name} ") or [[name, "-"]]
        elif isinstance(value, list):
            rows.append([name, " ".join(map(str, value)) or "-"])
        else:
            rows.append([name, _fmt(value, key)])
    return rows


def _layout_cell(per_rows: dict) -> str:
    """{rows: layout} -> "rows 1-4: kn, 5-32: packed": consecutive planned row counts with one layout merged."""
    runs: list[list] = []  # [first rows, last rows, layout]
    for n, layout in per_rows.items():
        if runs and runs[-1][2] == layout:
            runs[-1][1] = n
        else:
            runs.append([n, n, layout])
    return "rows " + ", ".join(f"{a}: {lay}" if a == b else f"{a}-{b}: {lay}" for a, b, lay in runs)


def tree_rows(report: dict) -> list[list[str]]:
    """Rows of the token-tree table; "speedup vs best chain" divides by the same candidate's fastest chain at the
    same temperature and draft_rule (above 1: the tree beats every chain length measured)."""
    rows = []
    for c in report["candidates"]:
        for temperature, rule in _tree_groups(report):
            for s in _tree_settings(c, temperature, rule):
                values = [c["name"], *(s.get(k) for k in TREE_COLUMNS[1:-1]), _speedup_vs_best_chain(c, s)]
                rows.append([_fmt(v, k) for v, k in zip(values, TREE_COLUMNS)])
    return rows


def confirmation_rows(conf: dict) -> list[list[str]]:
    rows = []
    for r in sorted(conf["by_batch_size"], key=lambda r: r["batch_size"]):
        rows.append([_fmt(_value(r, k), k) for k in CONFIRMATION_COLUMNS])
    return rows


def _category_cell(stats: dict | None) -> str:
    if not stats:
        return "-"
    return f"{_fmt(stats.get('acceptance_rate'))} / {_fmt(stats.get('mean_accepted_length'))} (n={stats.get('count')})"


def recommendation_text(report: dict) -> str:
    rec = report.get("recommendation")
    if not rec:
        return "No recommendation in this report (run `specdistill promote` after a full eval)."
    if not rec.get("enabled"):
        return f"Speculative decoding is not recommended: {rec.get('reason', 'no reason given')}."
    m = rec.get("confirmation") or {}
    limit, measured = m.get("max_concurrency"), m.get("measured_concurrency") or []
    beyond = f", worth it up to batch size {limit} of the measured {measured}" if limit and len(measured) > 1 else ""
    return (
        f"Recommended draft: {rec['name']} ({rec['draft']}) with num_draft_tokens={rec['num_draft_tokens']}, "
        f"draft_rule={rec['draft_rule']}, temperature={rec['temperature']:g}: on the confirmation split speedup "
        f"{_fmt(m.get('speedup'))}x (95% CI {_fmt(m.get('speedup_ci'), 'speedup_ci')}), acceptance_rate "
        f"{_fmt(m.get('acceptance_rate'))}, mean_accepted_length {_fmt(m.get('mean_accepted_length'))}"
        + beyond
        + f". Reason: {rec.get('reason', '-')}."
    )


def _meta(report: dict) -> str:
    prompts, settings = report.get("prompts") or {}, report.get("settings") or {}
    return (
        f"target {report.get('target')} (fingerprint {report.get('target_fingerprint', '-')}), "
        f"device {report.get('device', '-')}, backend {settings.get('backend', '-')}, {prompts.get('count', '?')} "
        f"prompts from {prompts.get('source', '?')} (selection {prompts.get('selection', '?')}, confirmation "
        f"{prompts.get('confirmation', '?')}), {settings.get('repeats', '?')} paired ABBA repeats, created "
        f"{report.get('created_at', '-')}"
    )


# ----------------------------------------------------------------------------------------------------------------
# Markdown and HTML


def _md_table(columns: list[str], rows: list[list[str]]) -> str:
    def line(cells):
        return "| " + " | ".join(str(c).replace("|", "\\|") for c in cells) + " |"

    return "\n".join([line(columns), line(["---"] * len(columns)), *map(line, rows)])


def render_markdown(report: dict, plots: dict[str, str]) -> str:
    """report.md: `plots` maps a plot name to its caption (the PNG is at plots/<name>.png)."""
    parts = [
        "# Speculative decoding eval report",
        "",
        _meta(report),
        "",
        "## Recommendation",
        "",
        recommendation_text(report),
        "",
    ]
    for title, columns, rows in tables(report):
        parts += [f"## {title}", "", _md_table(columns, rows) if rows else "(none)", ""]
    parts += ["## Plots", ""]
    parts += [f"![{caption}](plots/{name}.png)\n" for name, caption in plots.items()]
    return "\n".join(parts)


def _html_table(columns: list[str], rows: list[list[str]]) -> str:
    head = "".join(f"<th>{html.escape(c)}</th>" for c in columns)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(str(v))}</td>" for v in row) + "</tr>" for row in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def render_html(report: dict, images: dict[str, tuple[str, bytes]]) -> str:
    """report.html: `images` maps a plot name to (caption, PNG bytes), embedded as data: URIs."""
    rec = report.get("recommendation") or {}
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        "<title>Speculative decoding eval report</title>",
        f"<style>{CSS}</style></head><body>",
        "<h1>Speculative decoding eval report</h1>",
        f'<p class="meta">{html.escape(_meta(report))}</p>',
        "<h2>Recommendation</h2>",
        f'<p class="rec {"on" if rec.get("enabled") else "off"}">{html.escape(recommendation_text(report))}</p>',
    ]
    for title, columns, rows in tables(report):
        parts += [f"<h2>{html.escape(title)}</h2>", _html_table(columns, rows) if rows else "<p>(none)</p>"]
    parts.append("<h2>Plots</h2>")
    for name, (caption, png) in images.items():
        data = base64.b64encode(png).decode("ascii")
        parts.append(
            f'<figure id="{name}"><img src="data:image/png;base64,{data}" alt="{html.escape(caption)}">'
            f"<figcaption>{html.escape(caption)}</figcaption></figure>"
        )
    parts.append("</body></html>")
    return "\n".join(parts)


def write_reports(report: dict, out_dir: Path, *, tracker=None) -> dict[str, Path]:
    """Write report.md, report.html and plots/<name>.png under `out_dir`; returns {"md", "html", <plot name>: path}.

    `tracker` (train.tracking's `WandbTracker` or `NoOpTracker`, or anything with `.log_table(name, columns, rows)`
    and `.log_artifact(path, name, type)`) receives the settings table and the report folder as an artifact.
    """
    out_dir = Path(out_dir)
    (out_dir / "plots").mkdir(parents=True, exist_ok=True)
    images: dict[str, tuple[str, bytes]] = {}
    paths: dict[str, Path] = {}
    for name, caption, plot in PLOTS:
        fig = plot(report)
        if fig is None:
            continue
        images[name] = (caption, _png(fig))
        paths[name] = out_dir / "plots" / f"{name}.png"
        atomic.write_bytes(paths[name], images[name][1])
    paths["md"] = out_dir / "report.md"
    atomic.write_text(paths["md"], render_markdown(report, {name: caption for name, (caption, _) in images.items()}))
    paths["html"] = out_dir / "report.html"
    atomic.write_text(paths["html"], render_html(report, images))
    if tracker is not None:
        log_to_tracker(report, out_dir, tracker)
    return paths


def log_to_tracker(report: dict, out_dir: Path, tracker) -> None:
    """The settings table (one row per candidate x setting, chains and trees, raw values) and the report folder as
    an artifact."""
    rows = [
        [c["name"]] + [_value(s, k) for k in TRACKER_COLUMNS[1:]] for c in report["candidates"] for s in c["settings"]
    ]
    tracker.log_table("eval/settings", TRACKER_COLUMNS, rows)
    tracker.log_artifact(out_dir, "eval-report", "eval-report")
