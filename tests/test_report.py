"""Eval report rendering: report.md tables, a self-contained report.html with embedded plots, W&B calls; token-tree
settings kept out of the per-gamma chain plots and shown in their own table and plot."""

from __future__ import annotations

import base64
import json
import shutil
import struct
import subprocess
import warnings
import zlib
from html.parser import HTMLParser

import pytest

from eval.report import (
    SETTING_COLUMNS,
    TRACKER_COLUMNS,
    TREE_COLUMNS,
    focus_setting,
    plot_acceptance_vs_gamma,
    plot_by_category,
    plot_latency,
    plot_per_position,
    plot_speedup_vs_gamma,
    plot_tree_vs_chain,
    read_metrics,
    render_markdown,
    write_json_atomic,
    write_reports,
)
from specdec_runtime.tree import parse_tree, tree_size

# Any warning (matplotlib's "No artists with labels found to put in legend" included) fails the test: users see them.
pytestmark = pytest.mark.filterwarnings("error")

CATEGORIES = {"coding": 2, "math": 1, "writing": 3}


def make_setting(
    gamma: int, temperature: float, rule: str, alpha: float, tree: str | None = None, nodes: int | None = None
) -> dict:
    """One setting as eval/sweep.py writes it; a tree setting has `tree` set and num_draft_tokens = its depth."""
    c, v = 0.2, 1.3
    tau = (1 - alpha ** (gamma + 1)) / (1 - alpha)
    predicted = tau / (gamma * c + v)
    return {
        "num_draft_tokens": gamma,
        "temperature": temperature,
        "draft_rule": rule,
        "tree": tree,
        "acceptance_rate": alpha,
        "mean_accepted_length": tau,
        "nodes_per_step": float(gamma if nodes is None else nodes),
        "per_position_acceptance": [round(alpha + 0.05 * (gamma - i) / gamma, 4) for i in range(gamma)],
        "expected_acceptance": alpha + 0.01,
        "cost_ratio": c,
        "verify_cost_ratio": v,
        "analytic_speedup": predicted * 1.1,
        "predicted_speedup": predicted,
        "speedup": predicted * 0.9,
        "efficiency": 0.9,
        "ttft_s": 0.05,
        "tpot_s": 0.01 / (1 + alpha),
        "tokens_per_s": 90.0 * alpha,
        "target_tokens_per_s": 56.0,
        "wall_s": 3.2,
        "new_tokens": 768,
        "target_forwards": 250,
        "draft_forwards": 1000,
        "peak_memory_bytes": 123456789,
        "by_category": {
            cat: {"acceptance_rate": alpha - 0.1 * i, "mean_accepted_length": tau, "count": n}
            for i, (cat, n) in enumerate(CATEGORIES.items())
        },
        "by_length": {
            b: {"acceptance_rate": alpha, "mean_accepted_length": tau, "count": 2} for b in ("short", "medium", "long")
        },
    }


TREE_ALPHA = 0.97  # no chain setting has it, so a tree leaking into a chain plot or table is visible


def make_report(tmp_path, *, enabled: bool = True, trees: tuple[str, ...] = ()) -> dict:
    """A report following the report.json contract: 2 candidates, gamma in {1, 2, 4} x (T=0 greedy, T=1 sample),
    plus one setting per tree spec x (T, draft_rule) when `trees` is given; the first candidate with a run_dir
    holding a small metrics.jsonl (and a torn last line, as a killed run leaves)."""
    run_dir = tmp_path / "candidates" / "trunc2-fkl"
    run_dir.mkdir(parents=True)
    rows = [{"step": s, "train/loss": 3.0 / s, "lr": 1e-3} for s in range(1, 9)]
    rows += [
        {"step": s, "val/loss": 2.5 / s, "val/expected_acceptance": 0.4 + 0.05 * s, "val/greedy_match": 0.3}
        for s in (4, 8)
    ]
    (run_dir / "metrics.jsonl").write_text("\n".join(map(json.dumps, rows)) + '\n{"step": 9, "train/lo')
    candidates = []
    for name, alpha, rd in (("trunc2-fkl", 0.7, str(run_dir)), ("config1-tv", 0.5, None)):
        settings = [
            make_setting(g, t, r, alpha - 0.1 * t) for t, r in ((0.0, "greedy"), (1.0, "sample")) for g in (1, 2, 4)
        ]
        for t, r in ((0.0, "greedy"), (1.0, "sample")):  # interleaved as the sweep writes them: chains, then trees
            for spec in trees:
                depth, nodes = tree_size(parse_tree(spec))
                tree_alpha = TREE_ALPHA - 0.1 * t - 0.01 * nodes / 16 - 0.05 * (0.7 - alpha)
                settings.append(make_setting(depth, t, r, tree_alpha, spec, nodes))
        candidates.append(
            {
                "name": name,
                "draft": str(tmp_path / name / "best"),
                "run_dir": rd,
                "num_parameters": 12345,
                "expected_acceptance": alpha,
                "settings": settings,
            }
        )
    best = candidates[0]["settings"][2]
    return {
        "schema_version": 1,
        "created_at": "2026-11-29T12:00:00Z",
        "target": "random:tiny-llama",
        "target_fingerprint": "0123456789abcdef",
        "device": "cpu",
        "prompts": {"source": "builtin:eval", "count": 6, "categories": CATEGORIES},
        "sweep": {
            "num_draft_tokens": [1, 2, 4],
            "temperatures": [0.0, 1.0],
            "draft_rules": ["greedy", "sample"],
            "trees": list(trees),
            "max_new_tokens": 64,
            "batch_size": 1,
        },
        "target_only": [
            {
                "temperature": t,
                "tokens_per_s": 56.0,
                "wall_s": 5.0,
                "new_tokens": 768,
                "ttft_s": 0.04,
                "tpot_s": 0.018,
                "peak_memory_bytes": 100000000,
            }
            for t in (0.0, 1.0)
        ],
        "candidates": candidates,
        "recommendation": {
            "name": "trunc2-fkl",
            "draft": candidates[0]["draft"],
            "num_draft_tokens": 4,
            "draft_rule": "greedy",
            "temperature": 0.0,
            "enabled": enabled,
            "reason": "best measured speedup 1.23x by trunc2-fkl" if enabled else "no candidate beats target-only",
            "measured": {k: best[k] for k in ("acceptance_rate", "mean_accepted_length", "speedup")},
        },
    }


class Collector(HTMLParser):
    """Every tag's attributes, every text chunk; raises on nothing, so we also check balance of key tags."""

    def __init__(self):
        super().__init__()
        self.starts: list[tuple[str, dict]] = []
        self.ends: list[str] = []
        self.text: list[str] = []

    def handle_starttag(self, tag, attrs):
        self.starts.append((tag, dict(attrs)))

    def handle_endtag(self, tag):
        self.ends.append(tag)

    def handle_data(self, data):
        self.text.append(data)


def png_size(data: bytes) -> tuple[int, int]:
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    return struct.unpack(">II", data[16:24])


class RecordingTracker:
    """Duck-typed tracker that records its calls."""

    def __init__(self):
        self.calls: list[tuple] = []

    def log_table(self, name, columns, rows):
        self.calls.append(("table", name, columns, rows))

    def log_artifact(self, path, name, type):
        self.calls.append(("artifact", path, name, type))


@pytest.fixture(scope="module")
def rendered(tmp_path_factory) -> dict:
    """The default synthetic report rendered once (with a tracker) for the read-only checks: write_reports' paths
    plus "report" and "tracker_calls"."""
    tmp_path = tmp_path_factory.mktemp("rendered")
    report, tracker = make_report(tmp_path), RecordingTracker()
    paths = write_reports(report, tmp_path / "eval", tracker=tracker)
    return {**paths, "report": report, "tracker_calls": tracker.calls}


def test_reports_are_self_contained(rendered):
    paths = rendered
    page = paths["html"].read_text()
    parser = Collector()
    parser.feed(page)
    parser.close()
    images = [attrs["src"] for tag, attrs in parser.starts if tag == "img"]
    embedded = [src for src in images if src.startswith("data:image/png;base64,")]
    assert len(embedded) >= 5 and len(embedded) == len(images)
    assert page.count('<img src="data:image/png;base64,') == len(embedded)
    for src in embedded:  # each is a real, decodable, non-trivial PNG
        width, height = png_size(base64.b64decode(src.split(",", 1)[1]))
        assert width > 200 and height > 150
    # nothing fetched from elsewhere: no http(s) sources, stylesheets, scripts or links
    assert 'src="http' not in page and "href=" not in page and "<script" not in page and "<link" not in page
    assert "url(" not in page and "@import" not in page
    for tag in ("table", "figure", "html", "body"):
        assert parser.ends.count(tag) == sum(1 for t, _ in parser.starts if t == tag) > 0
    text = " ".join(parser.text)
    assert "Recommended draft: trunc2-fkl" in text and "num_draft_tokens=4" in text
    assert "training_curves" in paths and "training_curves" in page  # the run_dir's metrics.jsonl was plotted
    for name, path in paths.items():
        if name not in ("md", "html", "report", "tracker_calls"):
            assert path.parent.name == "plots" and png_size(path.read_bytes())[0] > 200


def test_markdown_holds_tables_and_recommendation(rendered):
    md = rendered["md"].read_text()
    assert "Recommended draft: trunc2-fkl" in md and "speedup" in md
    lines = md.splitlines()
    # one row per candidate x setting in the settings table
    setting_rows = [ln for ln in lines if ln.startswith("| trunc2-fkl | ") or ln.startswith("| config1-tv | ")]
    assert len(setting_rows) == 2 * 6 + 2  # settings + the candidates summary table
    assert "| coding |" in md and "| writing |" in md  # per-category table
    assert "Target-only baseline" in md and "| 0 | 56 |" in md
    assert "![" in md and "(plots/acceptance_vs_gamma.png)" in md
    for ln in lines:
        if ln.startswith("|"):  # tables are well formed
            assert ln.endswith("|")


def test_disabled_recommendation_and_no_training_curves(tmp_path):
    report = make_report(tmp_path, enabled=False)
    for cand in report["candidates"]:
        cand["run_dir"] = None
    paths = write_reports(report, tmp_path / "eval")
    md = paths["md"].read_text()
    assert "Speculative decoding is not recommended: no candidate beats target-only" in md
    assert "training_curves" not in paths
    assert paths["html"].read_text().count("data:image/png;base64,") == 5


def test_focus_setting_without_recommendation(tmp_path):
    report = make_report(tmp_path)
    assert focus_setting(report) == (4, 0.0, "greedy")
    del report["recommendation"]
    assert focus_setting(report) == (4, 0.0, "greedy")  # largest gamma at the first measured group
    md = render_markdown(report, {})
    assert "No recommendation in this report" in md and "(num_draft_tokens=4, T=0, greedy)" in md


def test_read_metrics_skips_torn_line(tmp_path):
    report = make_report(tmp_path)
    rows = read_metrics(report["candidates"][0]["run_dir"])
    assert len(rows) == 10 and rows[-1]["step"] == 8
    assert read_metrics(None) == [] and read_metrics(tmp_path / "missing") == []


def test_tracker_gets_table_and_artifact(rendered):
    calls, report = rendered["tracker_calls"], rendered["report"]
    kinds = [c[0] for c in calls]
    assert kinds.count("table") == 1 and kinds.count("artifact") == 1
    _, name, columns, rows = next(c for c in calls if c[0] == "table")
    assert columns == TRACKER_COLUMNS and "acceptance_rate" in columns and "tree" in columns
    assert len(rows) == 12 and all(len(r) == len(columns) for r in rows)
    assert {r[columns.index("tree")] for r in rows} == {None}
    trunc2 = [r for r in rows if r[0] == "trunc2-fkl"]
    speedups = sorted(r[columns.index("speedup")] for r in trunc2)
    assert speedups == sorted(s["speedup"] for s in report["candidates"][0]["settings"])
    artifact = next(c for c in calls if c[0] == "artifact")
    assert artifact[1] == rendered["html"].parent and (artifact[1] / "report.html").is_file()


def test_write_json_atomic_replaces_and_leaves_no_temp(tmp_path, monkeypatch):
    path = tmp_path / "r" / "report.json"
    write_json_atomic({"a": 1}, path)
    assert json.loads(path.read_text()) == {"a": 1}

    def crash(*args):
        raise OSError("disk full")

    monkeypatch.setattr("eval.promote.os.replace", crash)
    with pytest.raises(OSError, match="disk full"):
        write_json_atomic({"a": 2}, path)
    assert json.loads(path.read_text()) == {"a": 1}
    assert sorted(p.name for p in path.parent.iterdir()) == ["report.json"]


def distinct_rows(data: bytes) -> int:
    """How many different scanlines a (non-interlaced) PNG has: 1 for a blank page, hundreds for a rendered one."""
    _, height = png_size(data)
    chunks, pos = [], 8
    while pos < len(data):
        length, kind = struct.unpack(">I4s", data[pos : pos + 8])
        if kind == b"IDAT":
            chunks.append(data[pos + 8 : pos + 8 + length])
        pos += 12 + length
    raw = zlib.decompress(b"".join(chunks))
    stride = len(raw) // height  # filter byte + pixels
    return len({raw[i * stride : (i + 1) * stride] for i in range(height)})


@pytest.mark.chromium
@pytest.mark.skipif(shutil.which("chromium") is None, reason="needs headless Chromium: apt-get install chromium")
def test_html_renders_in_headless_chromium(tmp_path):
    report = make_report(tmp_path)
    html_path = write_reports(report, tmp_path / "eval")["html"]
    shot = tmp_path / "shot.png"
    subprocess.run(
        [
            shutil.which("chromium"),
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-background-networking",
            "--disable-component-update",
            "--no-first-run",
            f"--user-data-dir={tmp_path / 'chrome-profile'}",
            "--window-size=1280,2400",
            f"--screenshot={shot}",
            html_path.as_uri(),
        ],
        check=True,
        capture_output=True,
        timeout=120,
    )
    data = shot.read_bytes()
    width, height = png_size(data)
    assert width >= 1280 and height >= 2400 and len(data) > 20_000
    assert distinct_rows(data) > 100  # text, tables and plots, not a blank or error page


def test_missing_values_render(tmp_path):
    """Ratios over zero events are None in the sweep (a position never reached, a setting with no speedup)."""
    report = make_report(tmp_path)
    setting = report["candidates"][1]["settings"][2]
    setting.update(speedup=None, efficiency=None, per_position_acceptance=[0.5, 0.4, None, None], tpot_s=None)
    report["candidates"][1]["settings"][0]["by_category"] = {}
    paths = write_reports(report, tmp_path / "eval")
    assert paths["html"].read_text().count("data:image/png;base64,") == 6
    row = next(ln for ln in paths["md"].read_text().splitlines() if ln.startswith("| config1-tv | 4 | 0 | greedy"))
    cells = dict(zip(SETTING_COLUMNS, (c.strip() for c in row.strip("|").split("|"))))
    assert cells["speedup"] == cells["efficiency"] == cells["tpot_s"] == "-" and cells["acceptance_rate"] == "0.5"


TREES = ("4,2,2,1", "dynamic:16")


def line_data(fig) -> list[list[tuple]]:
    """Per axes, every plotted line as (label, x values, y values)."""
    return [
        [(ln.get_label(), [float(x) for x in ln.get_xdata()], [float(y) for y in ln.get_ydata()]) for ln in ax.lines]
        for ax in fig.axes
    ]


def md_table(md: str, title: str) -> list[dict]:
    """The rows of the Markdown table under `## {title}...` as {column: cell} dicts."""
    lines = md.splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.startswith(f"## {title}"))
    table = []
    for ln in lines[start + 2 :]:
        if not ln.startswith("|"):
            break
        table.append([c.strip() for c in ln.strip("|").split("|")])
    columns, _, *rows = table
    return [dict(zip(columns, row)) for row in rows]


def test_chain_plots_exclude_tree_settings(tmp_path):
    """A tree of depth 4 has num_draft_tokens=4 like the gamma=4 chain; it must not move any chain curve."""
    chains, with_trees = make_report(tmp_path / "a"), make_report(tmp_path / "b", trees=TREES)
    for plot in (plot_acceptance_vs_gamma, plot_speedup_vs_gamma, plot_per_position, plot_latency):
        assert line_data(plot(with_trees)) == line_data(plot(chains)), plot.__name__
    lines = [ln for ax in line_data(plot_acceptance_vs_gamma(with_trees)) for ln in ax]
    assert len(lines) == 2 * 2 and all(xs == [1, 2, 4] for _, xs, _ in lines)
    assert not any(y >= TREE_ALPHA - 0.2 for _, _, ys in lines for y in ys)  # tree alphas are 0.83..0.97
    by_category = [[p.get_height() for p in ax.patches] for ax in plot_by_category(with_trees).axes]
    assert by_category == [[p.get_height() for p in ax.patches] for ax in plot_by_category(chains).axes]
    assert focus_setting(with_trees) == focus_setting(chains) == (4, 0.0, "greedy")
    assert plot_tree_vs_chain(chains) is None


def test_tree_table_and_plot(tmp_path):
    report = make_report(tmp_path, trees=TREES)
    tree_setting = report["candidates"][1]["settings"][-1]  # config1-tv, dynamic:16 at T=1 sample
    tree_setting["speedup"] = None
    tracker = RecordingTracker()
    paths = write_reports(report, tmp_path / "eval", tracker=tracker)
    md, page = paths["md"].read_text(), paths["html"].read_text()

    chain_rows = md_table(md, "Chain settings")
    assert len(chain_rows) == 12 and float(max(r["acceptance_rate"] for r in chain_rows)) < TREE_ALPHA - 0.2
    tree_rows = md_table(md, "Token-tree settings")
    assert list(tree_rows[0]) == TREE_COLUMNS and len(tree_rows) == 2 * 2 * len(TREES)
    for cand in report["candidates"]:
        for s in cand["settings"]:
            if s["tree"] is None:
                continue
            (row,) = [
                r
                for r in tree_rows
                if (r["candidate"], r["tree"], r["draft_rule"]) == (cand["name"], s["tree"], s["draft_rule"])
                and float(r["temperature"]) == s["temperature"]
            ]
            assert float(row["nodes_per_step"]) == tree_size(parse_tree(s["tree"]))[1]
            assert float(row["mean_accepted_length"]) == pytest.approx(s["mean_accepted_length"], rel=1e-3)
            chains = [c for c in cand["settings"] if c["tree"] is None and c["temperature"] == s["temperature"]]
            best = max(c["speedup"] for c in chains)
            if s["speedup"] is None:
                assert row["speedup"] == row["speedup vs best chain"] == "-"
            else:
                assert float(row["speedup vs best chain"]) == pytest.approx(s["speedup"] / best, rel=1e-3)
                assert float(row["speedup vs best chain"]) > 1  # the synthetic trees accept far more
    assert "Token-tree settings" in page and "<td>dynamic:16</td>" in page and "<td>4,2,2,1</td>" in page

    assert "tree_vs_chain" in paths and png_size(paths["tree_vs_chain"].read_bytes())[0] > 200
    assert "(plots/tree_vs_chain.png)" in md and 'id="tree_vs_chain"' in page
    assert page.count("data:image/png;base64,") == 7  # the 6 chain / training plots + tree vs chain
    # bars at T=0 greedy (the recommendation): each candidate's fastest chain, then each tree in sweep order
    tau_ax, speedup_ax = plot_tree_vs_chain(report).axes
    for cand, taus, speedups in zip(report["candidates"], tau_ax.containers, speedup_ax.containers):
        at = [s for s in cand["settings"] if s["temperature"] == 0.0]
        best = max((s for s in at if s["tree"] is None), key=lambda s: s["speedup"])
        expected = [best, *(s for s in at if s["tree"] is not None)]
        assert [b.get_height() for b in taus] == pytest.approx([s["mean_accepted_length"] for s in expected])
        assert [b.get_height() for b in speedups] == pytest.approx([s["speedup"] for s in expected])

    (_, _, columns, rows) = next(c for c in tracker.calls if c[0] == "table")
    assert len(rows) == 12 + 2 * 2 * len(TREES)
    assert sorted({r[columns.index("tree")] for r in rows}, key=str) == sorted([None, *TREES], key=str)
    nodes = {r[columns.index("tree")]: r[columns.index("nodes_per_step")] for r in rows}
    assert nodes["4,2,2,1"] == 44 and nodes["dynamic:16"] == 16


def test_training_curves_without_validation_render_without_warnings(tmp_path):
    """A run with no validation rows leaves the second training panel empty: no legend there, and no warning."""
    report = make_report(tmp_path)
    rows = [{"step": s, "train/loss": 3.0 / s} for s in range(1, 5)]
    (tmp_path / "candidates" / "trunc2-fkl" / "metrics.jsonl").write_text("\n".join(map(json.dumps, rows)))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        paths = write_reports(report, tmp_path / "eval")
    assert "training_curves" in paths and png_size(paths["training_curves"].read_bytes())[0] > 200
