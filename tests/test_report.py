"""Eval report rendering: report.md tables, a self-contained report.html with embedded plots, W&B calls; token-tree
settings kept out of the per-gamma chain plots and shown in their own table and plot."""

from __future__ import annotations

import base64
import json
import shutil
import statistics
import struct
import subprocess
import warnings
import zlib
from html.parser import HTMLParser

import pytest
from helpers.models import perturbed, tiny_llama
from helpers.reports import TREE_ALPHA, make_report
from matplotlib.container import BarContainer, ErrorbarContainer

from eval import sweep
from eval.config import EvalConfig
from eval.report import (
    PLOTS,
    SETTING_COLUMNS,
    TRACKER_COLUMNS,
    TREE_COLUMNS,
    best_chain,
    focus_setting,
    plot_acceptance_vs_gamma,
    plot_by_category,
    plot_by_prompt_length,
    plot_concurrency,
    plot_latency,
    plot_per_position,
    plot_speedup_vs_gamma,
    plot_training,
    plot_tree_vs_chain,
    read_metrics,
    render_markdown,
    write_reports,
)
from eval.results import (
    PROMPT_LENGTH_EDGES,
    Candidate,
    Setting,
    _setting,
    group_requests,
    length_bucket,
    length_keys,
    prompt_length_bucket,
    write_json_atomic,
)
from eval.sweep import Bench, EvalPrompt, measure
from specdec_runtime.ab import paired_metrics
from specdec_runtime.backends import fast_model
from specdec_runtime.metrics import RequestStats
from specdec_runtime.tree import parse_tree, tree_size

# Any warning (matplotlib's "No artists with labels found to put in legend" included) fails the test: users see them.
pytestmark = pytest.mark.filterwarnings("error")


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
    assert "Speculative decoding is not recommended: speedup gate: no candidate beats target-only" in md
    assert "training_curves" not in paths
    assert paths["html"].read_text().count("data:image/png;base64,") == 6  # 5 chain plots + concurrency


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

    monkeypatch.setattr("specdec_runtime.atomic.os.replace", crash)
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


# Appended to a copy of the page (the report itself has no scripts): after load, every <img>'s decoded width.
PROBE = """<script>window.addEventListener("load", () => { document.body.setAttribute("data-img-widths",
  JSON.stringify(Array.from(document.images, (img) => img.complete ? img.naturalWidth : 0))); });</script>"""


def chromium(tmp_path, url: str, *args: str) -> str:
    """Headless Chromium (the distribution's package) on `url` -> its stdout."""
    r = subprocess.run(
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
            *args,
            url,
        ],
        check=True,
        capture_output=True,
        text=True,
        timeout=120,
    )
    return r.stdout


def img_widths(tmp_path, page: str) -> list[int]:
    probe = tmp_path / "probe.html"
    probe.write_text(page.replace("</body>", PROBE + "</body>"))
    dom = chromium(tmp_path, probe.as_uri(), "--virtual-time-budget=10000", "--dump-dom")
    parser = Collector()
    parser.feed(dom)
    (body,) = [attrs for tag, attrs in parser.starts if tag == "body"]
    return json.loads(body["data-img-widths"])


@pytest.mark.chromium
def test_html_renders_in_headless_chromium(tmp_path):
    report = make_report(tmp_path)
    html_path = write_reports(report, tmp_path / "eval")["html"]
    page = html_path.read_text()
    widths = img_widths(tmp_path, page)
    assert len(widths) == page.count("<img ") >= 7 and all(w > 200 for w in widths), widths
    # the same probe sees a broken image: a truncated PNG decodes to nothing
    broken = page.replace('src="data:image/png;base64,', 'src="data:image/png;base64,AAAA', 1)
    assert img_widths(tmp_path, broken)[0] == 0
    shot = tmp_path / "shot.png"
    chromium(tmp_path, html_path.as_uri(), f"--screenshot={shot}")
    data = shot.read_bytes()
    width, height = png_size(data)
    assert width >= 1280 and height >= 2400 and len(data) > 20_000
    assert distinct_rows(data) > 100  # text, tables and plots, not a blank or error page
    blank = tmp_path / "blank.html"
    blank.write_text("<!DOCTYPE html><html><body></body></html>")
    chromium(tmp_path, blank.as_uri(), f"--screenshot={shot}")
    assert distinct_rows(shot.read_bytes()) < 5  # the check tells a blank page apart


def test_missing_values_render(tmp_path):
    """Ratios over zero events are None in the sweep (a position never reached, a setting with no speedup)."""
    report = make_report(tmp_path)
    setting = report["candidates"][1]["settings"][2]
    setting.update(
        speedup=None, speedup_ci=None, efficiency=None, per_position_acceptance=[0.5, 0.4, None, None], tpot_s=None
    )
    report["candidates"][1]["settings"][0]["by_category"] = {}
    paths = write_reports(report, tmp_path / "eval")
    assert paths["html"].read_text().count("data:image/png;base64,") == 7
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
    tree_setting["speedup"] = tree_setting["speedup_ci"] = None
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
    assert page.count("data:image/png;base64,") == 8  # 6 chain / training plots + concurrency + tree vs chain
    # bars at T=0 greedy (the recommendation): each candidate's fastest chain, then each tree in sweep order
    tau_ax, speedup_ax = plot_tree_vs_chain(report).axes
    bars = [[c for c in ax.containers if isinstance(c, BarContainer)] for ax in (tau_ax, speedup_ax)]
    for cand, taus, speedups in zip(report["candidates"], *bars, strict=True):
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


def test_speedup_intervals_in_tables_and_plots(rendered):
    """Every speedup sits next to its interval: the Markdown cells and the plots' error bars."""
    report, md = rendered["report"], rendered["md"].read_text()
    chain_rows = md_table(md, "Chain settings")
    for cand in report["candidates"]:
        for s in cand["settings"]:
            (row,) = [
                r
                for r in chain_rows
                if (r["candidate"], int(r["num_draft_tokens"]), r["draft_rule"])
                == (cand["name"], s["num_draft_tokens"], s["draft_rule"])
                and float(r["temperature"]) == s["temperature"]
            ]
            lo, hi = (float(x) for x in row["speedup_ci"].strip("[]").split(","))
            assert (lo, hi) == pytest.approx(tuple(s["speedup_ci"]), rel=1e-2)
    fig = plot_speedup_vs_gamma(report)
    for ax, temperature in zip(fig.axes, [0.0, 1.0]):  # (T=0, greedy), (T=1, sample)
        bars = [c for c in ax.containers if isinstance(c, ErrorbarContainer)]
        assert len(bars) == len(report["candidates"])
        for cand, bar in zip(report["candidates"], bars):
            rows = sorted(
                (s for s in cand["settings"] if s["temperature"] == temperature), key=lambda s: s["num_draft_tokens"]
            )
            (segments,) = [seg.get_segments() for seg in bar.lines[2]]
            got = [float(y) for a, b in segments for y in (a[1], b[1])]
            assert got == pytest.approx([y for s in rows for y in s["speedup_ci"]])
    conf_rows = md_table(md, "Confirmation split")
    assert [int(r["batch_size"]) for r in conf_rows] == [1, 4]
    for row, want in zip(conf_rows, report["confirmation"]["by_batch_size"]):
        assert float(row["speedup"]) == pytest.approx(want["speedup"], rel=1e-3)
        assert row["speedup_ci"] == f"[{want['speedup_ci'][0]:.3g}, {want['speedup_ci'][1]:.3g}]"
    assert "95% CI [" in md and "worth it up to batch size 1" in md  # the recommendation quotes the interval
    speedup_ax, throughput_ax, *_ = plot_concurrency(report).axes
    (bar,) = [c for c in speedup_ax.containers if isinstance(c, ErrorbarContainer)]
    assert [float(x) for x in bar.lines[0].get_xdata()] == [1, 4]
    assert {ln.get_label() for ln in throughput_ax.lines} == {"speculative", "target-only"}


def series_of(fig) -> dict[str, list[float]]:
    """Every data series of a figure, per axes title: line y values, bar heights."""
    out: dict[str, list[float]] = {}
    for i, ax in enumerate(fig.axes):
        values = [float(y) for ln in ax.lines for y in ln.get_ydata()] + [p.get_height() for p in ax.patches]
        out[f"{i}: {ax.get_title()}"] = [v for v in values if v == v]  # NaN-free
    return out


def test_every_plot_of_a_real_training_run_has_data(tmp_path_factory, tmp_path):
    """A real (tiny) distillation run's metrics.jsonl feeds the training plot: its validation panel too."""
    from helpers.runs import reference_run

    _, _, cand = reference_run(tmp_path_factory, "report-run")
    report = make_report(tmp_path)
    report["candidates"][0]["run_dir"] = str(cand)
    keys = {k for row in read_metrics(cand) for k in row}
    assert {"train/loss", "eval/loss", "eval/expected_acceptance", "eval/greedy_match"} <= keys
    for name, _, plot in PLOTS:
        fig = plot(report)
        if name in ("tree_vs_chain", "speedup_by_prompt_length"):
            assert fig is None  # no trees, and no prompt-length buckets (a report from before issue 28)
            continue
        for title, values in series_of(fig).items():
            assert values, f"{name} panel {title} has no data"
    (train_ax, val_ax) = plot_training(report).axes
    labels = {ln.get_label() for ln in val_ax.lines}
    assert {"trunc2-fkl eval/expected_acceptance", "trunc2-fkl eval/greedy_match"} <= labels
    assert "trunc2-fkl eval/loss" in {ln.get_label() for ln in train_ax.lines}


def test_best_chain_is_ranked_by_the_interval_lower_end(tmp_path):
    """A lucky chain (highest median, interval reaching below 1) must not be the "best chain": the candidates table and
    the tree table rank chains by speedup_ci[0], as eval/recommend.py's choose does."""
    report = make_report(tmp_path, trees=("4,2,2,1",))
    cand = report["candidates"][0]
    chains = [s for s in cand["settings"] if s["tree"] is None and s["temperature"] == 0.0]
    lucky, sure = chains[0], chains[1]  # num_draft_tokens 1 and 2
    lucky.update(speedup=9.0, speedup_ci=[0.5, 12.0])
    top_lower = max(s["speedup_ci"][0] for s in cand["settings"] if s["tree"] is None)
    sure.update(speedup=2.0, speedup_ci=[top_lower + 0.5, 2.5])
    assert best_chain(cand, 0.0, "greedy") is sure
    md = write_reports(report, tmp_path / "eval")["md"].read_text()
    (row,) = [r for r in md_table(md, "Candidates") if r["candidate"] == cand["name"]]
    assert float(row["best chain speedup"]) == 2.0 and row["its speedup_ci"] == f"[{top_lower + 0.5:.3g}, 2.5]"
    tree = next(s for s in cand["settings"] if s["tree"] == "4,2,2,1" and s["temperature"] == 0.0)
    (tree_row,) = [
        r for r in md_table(md, "Token-tree settings") if r["candidate"] == cand["name"] and r["temperature"] == "0"
    ]
    assert float(tree_row["speedup vs best chain"]) == pytest.approx(tree["speedup"] / 2.0, rel=1e-3)


def test_each_arms_peak_memory_in_the_tables(tmp_path):
    """Per setting and per confirmed batch size: the speculative arm's peak and the target-only arm's, apart."""
    report = make_report(tmp_path)
    for cand in report["candidates"]:
        for s in cand["settings"]:
            s["target_only"] = {"peak_memory_bytes": 50 * 2**20}
    for row in report["confirmation"]["by_batch_size"]:
        row["peak_memory_bytes"] = 80 * 2**20 * row["batch_size"]
        row["target_only"]["peak_memory_bytes"] = 60 * 2**20 * row["batch_size"]
    tracker = RecordingTracker()
    paths = write_reports(report, tmp_path / "eval", tracker=tracker)
    md, page = paths["md"].read_text(), paths["html"].read_text()
    chain_rows = md_table(md, "Chain settings")
    assert {(r["peak_memory_bytes"], r["target peak_memory_bytes"]) for r in chain_rows} == {("117.7 MiB", "50.0 MiB")}
    conf_rows = md_table(md, "Confirmation split")
    assert [(r["peak_memory_bytes"], r["target peak_memory_bytes"]) for r in conf_rows] == [
        ("80.0 MiB", "60.0 MiB"),
        ("320.0 MiB", "240.0 MiB"),
    ]
    assert "<th>target peak_memory_bytes</th>" in page and "<td>320.0 MiB</td>" in page
    (_, _, columns, rows), _ = tracker.calls
    assert {row[columns.index("target peak_memory_bytes")] for row in rows} == {50 * 2**20}


def _request(new_tokens: int, accepted: int = 1) -> RequestStats:
    return RequestStats(
        new_tokens=new_tokens,
        verify_steps=2,
        drafted=4,
        accepted=accepted,
        position_reached=[2, 1],
        position_accepted=[1, 0],
        target_forwards=3,
        draft_forwards=5,
        ttft_s=0.1,
        wall_s=1.0,
    )


def test_by_length_counts_each_prompt_once_whatever_its_repeats_emitted():
    """At T > 0 a prompt's repeats differ in length: prompt a emits 2, 30, 31 tokens over 3 repeats (median long),
    b emits 3 each time (short). Each prompt lands in one bucket with all its repeats; counts are prompts."""
    ids = ["a", "b", "a", "b", "a", "b"]  # unit by unit, each unit's repeats in turn
    requests = [_request(n) for n in (2, 3, 30, 3, 31, 3)]
    keys = length_keys(requests, ids, max_new_tokens=32)
    assert keys == ["long", "short"] * 3
    groups = group_requests(requests, keys, ids)
    assert {k: g["count"] for k, g in groups.items()} == {"long": 1, "short": 1}
    # the old rule (each request's own bucket, count = requests // repeats) loses prompt a from the counts
    raw = [length_bucket(r.new_tokens, 32) for r in requests]
    old = {k: len([x for x in raw if x == k]) // 3 for k in set(raw)}
    assert sum(old.values()) != 2


def test_sweep_setting_reports_each_arms_peak_and_prompt_counts():
    """A real paired measurement at T = 1 with a likely stop token (lengths vary by repeat): by_length and
    by_category count prompts once, and each arm's peak memory is its own (CPU RSS sampled per call)."""
    target = tiny_llama(seed=0)
    draft = perturbed(target, 0.003, seed=1)
    stop = tuple(range(2, 10))  # 8 of 64 tokens stop: output lengths differ between repeats
    bench = Bench(fast_model(target), 24, stop, 0, 3, 1)
    prompts = [EvalPrompt(f"p{i}", "coding" if i % 2 else "math", [5 + i, 17, 3, 40 + i]) for i in range(6)]
    cfg = EvalConfig(num_draft_tokens=[3], temperatures=[1.0], draft_rules=["sample"], max_new_tokens=24, repeats=3)
    row = measure(bench, fast_model(draft, draft=True), prompts, Setting(1.0, "sample", 3, None, 2))
    assert set(row["peak"]) == {"target_only", "speculative"} and min(row["peak"].values()) > 0
    setting = _setting(Setting(1.0, "sample", 3, None, 2), [row], 0.5, cfg)
    assert setting["peak_memory_bytes"] == row["peak"]["speculative"]
    assert setting["target_only"]["peak_memory_bytes"] == row["peak"]["target_only"]
    assert sum(g["count"] for g in setting["by_length"].values()) == 6
    assert {k: g["count"] for k, g in setting["by_category"].items()} == {"coding": 3, "math": 3}
    # per prompt (unit, row): its output length in each repeat; some prompt's repeats fall into different buckets
    per_prompt = [[call.requests[j].new_tokens for call in unit] for unit in row["runs"]["speculative"] for j in (0, 1)]
    assert any(len({length_bucket(n, 24) for n in ns}) > 1 for ns in per_prompt), per_prompt


# --------------------------------------------------------------------------------------- by prompt length, machine


def test_prompt_length_buckets_have_inclusive_upper_edges():
    """64 and 256 are inclusive upper edges: an edge off by one either way moves a prompt of 64, 65, 256 or 257
    tokens to the neighbouring bucket."""
    cases = {1: "<=64", 20: "<=64", 64: "<=64", 65: "65-256", 256: "65-256", 257: ">256", 370: ">256"}
    assert PROMPT_LENGTH_EDGES == (64, 256)
    assert {n: prompt_length_bucket(n) for n in cases} == cases
    names = [prompt_length_bucket(n, (4, 8, 16)) for n in (4, 5, 8, 9, 16, 17)]
    assert names == ["<=4", "5-8", "5-8", "9-16", "9-16", ">16"]


PROMPT_LENGTHS = (20, 20, 20, 20, 100, 100, 300, 300, 300, 300)  # selection (every other one): 20, 20, 100, 300, 300


@pytest.fixture(scope="module")
def prompt_length_sweep(tmp_path_factory) -> dict:
    """A real sweep (tiny random target, itself as the draft, T = 0, gamma 2, 8 new tokens) on prompts of 20, 100 and
    300 tokens, with every paired run `measure_arms` returned: {"report", "row": {"prompts", "runs", "peak"}}."""
    from specdec_runtime.loading import load_model
    from specdec_runtime.tiny import build_tiny_model

    folder = build_tiny_model("tiny-llama", tmp_path_factory.mktemp("tiny") / "tiny")
    target, tokenizer = load_model(str(folder), device="cpu")
    prompts = [
        EvalPrompt(f"p{i}", "chat", [(31 * i + 7 * j) % 256 for j in range(n)]) for i, n in enumerate(PROMPT_LENGTHS)
    ]
    cfg = EvalConfig(num_draft_tokens=[2], temperatures=[0.0], draft_rules=["greedy"], max_new_tokens=8, warmup=0)
    measured, measure_arms = {}, sweep.measure_arms

    def spy(*args, **kwargs):
        rows = measure_arms(*args, **kwargs)
        measured.update(rows)
        return rows

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(sweep, "measure_arms", spy)
        report = sweep.run_sweep(
            target, tokenizer, [Candidate("self", folder)], prompts, cfg, target_spec=str(folder), progress=False
        )
    return {"report": report, "row": measured[(0, 0)]}


def test_by_prompt_length_is_the_paired_speedup_of_its_units(prompt_length_sweep):
    """Each bucket holds the units of its prompts' lengths (not their outputs' lengths: every output has at most 8
    tokens), with `paired_metrics` over exactly those units, no interval from one unit, and both arms' TTFT / TPOT
    over the bucket's requests."""
    (setting,) = prompt_length_sweep["report"]["candidates"][0]["settings"]
    row = prompt_length_sweep["row"]
    buckets = setting["by_prompt_length"]
    assert list(buckets) == ["<=64", "65-256", ">256"]
    expected = [(2, [20, 20]), (1, [100, 100]), (2, [300, 300])]  # 1 unit: the medium bucket
    assert [(b["units"], b["prompt_tokens"]) for b in buckets.values()] == expected
    for name, stats in buckets.items():
        idx = [i for i, p in enumerate(row["prompts"]) if prompt_length_bucket(len(p.ids)) == name]
        base, spec = ([row["runs"][arm][i] for i in idx] for arm in ("target_only", "speculative"))
        want = paired_metrics(base, spec, 2)
        assert stats["units"] == want["units"] == len(idx)
        assert stats["speedup"] == want["speedup"] and stats["acceptance_rate"] == want["acceptance_rate"]
        assert stats["speedup_ci"] == (want["speedup_ci"] if len(idx) > 1 else None)
        for arm, got in ((spec, stats), (base, stats["target_only"])):
            requests = [r for unit in arm for call in unit for r in call.requests]
            assert got["ttft_s"] == pytest.approx(statistics.fmean(r.ttft_s for r in requests))
            assert got["tpot_s"] == pytest.approx(statistics.fmean(r.tpot_s for r in requests if r.tpot_s is not None))


def test_prompt_length_table_and_plot(prompt_length_sweep, tmp_path):
    """report.md has one row per bucket (shortest first) with the speedup next to its interval and both arms'
    latency; report.html embeds the plot, whose points are the buckets' numbers."""
    report = prompt_length_sweep["report"]
    buckets = report["candidates"][0]["settings"][0]["by_prompt_length"]
    paths = write_reports(report, tmp_path / "eval")
    rows = md_table(paths["md"].read_text(), "Latency by prompt length")
    assert [(r["candidate"], r["prompt tokens"], r["units"]) for r in rows] == [
        ("self", "<=64", "2"),
        ("self", "65-256", "1"),
        ("self", ">256", "2"),
    ]
    for r, b in zip(rows, buckets.values()):
        assert float(r["speedup"]) == pytest.approx(b["speedup"], rel=1e-3)
        assert r["speedup_ci"] == ("-" if b["speedup_ci"] is None else "[{:.3g}, {:.3g}]".format(*b["speedup_ci"]))
        assert float(r["target tpot_s"]) == pytest.approx(b["target_only"]["tpot_s"], rel=1e-3)
        assert float(r["ttft_s"]) == pytest.approx(b["ttft_s"], rel=1e-3)
    page = paths["html"].read_text()
    assert '<figure id="speedup_by_prompt_length"><img src="data:image/png;base64,' in page
    assert png_size(paths["speedup_by_prompt_length"].read_bytes())[0] > 200
    assert "(plots/speedup_by_prompt_length.png)" in paths["md"].read_text()
    speedup_ax, _, tpot_ax = plot_by_prompt_length(report).axes
    (bar,) = [c for c in speedup_ax.containers if isinstance(c, ErrorbarContainer)]
    assert [float(y) for y in bar.lines[0].get_ydata()] == pytest.approx([b["speedup"] for b in buckets.values()])
    assert [t.get_text() for t in speedup_ax.get_xticklabels()] == list(buckets)
    spec_line, base_line = tpot_ax.lines
    assert [float(y) for y in spec_line.get_ydata()] == pytest.approx([1e3 * b["tpot_s"] for b in buckets.values()])
    want = [1e3 * b["target_only"]["tpot_s"] for b in buckets.values()]
    assert base_line.get_label() == "target-only" and [float(y) for y in base_line.get_ydata()] == pytest.approx(want)


def test_report_without_prompt_lengths_or_machine_still_renders(tmp_path):
    """A report.json written before issue 28 (no `by_prompt_length`, no `machine`) renders as before; one candidate
    without buckets next to one with them gets no rows."""
    old = json.loads(json.dumps(make_report(tmp_path)))
    assert plot_by_prompt_length(old) is None
    paths = write_reports(old, tmp_path / "old")
    md, page = paths["md"].read_text(), paths["html"].read_text()
    assert "Latency by prompt length" not in md and "## Machine" not in md and "<h2>Machine</h2>" not in page
    assert "speedup_by_prompt_length" not in paths and 'id="speedup_by_prompt_length"' not in page
    setting = next(s for s in old["candidates"][1]["settings"] if (s["num_draft_tokens"], s["temperature"]) == (4, 0))
    setting["by_prompt_length"] = {
        ">256": {"prompt_tokens": [370, 380], "units": 1, "speedup": 1.2, "speedup_ci": None, "ttft_s": 0.2},
    }
    rows = md_table(write_reports(old, tmp_path / "mixed")["md"].read_text(), "Latency by prompt length")
    assert [(r["candidate"], r["prompt tokens"], r["speedup_ci"], r["tpot_s"]) for r in rows] == [
        ("config1-tv", ">256", "-", "-")
    ]


def test_machine_block_renders_what_is_there(tmp_path):
    """Every key of `machine` in its order: lists joined, None as "-", one row per layout shape, an empty dict "-"."""
    report = make_report(tmp_path)
    report["machine"] = {
        "cpu": "AMD EPYC 7B13",
        "flags": ["avx2", "fma", "avx512f"],
        "cores": 2,
        "torch_threads": 2,
        "torch": "2.13.0",
        "bandwidth_gb_s": 11.3456,
        "decode_floor_s": None,
        "decode_step_over_floor": 1.4,
        "layouts": {"target": {"qkv": {"1": "kn", "2": "kn", "3": "packed", "8": "packed"}}, "draft": {}},
        "layout_tuning": {"target": {"layouts": "auto", "tune_s": 5.1}, "draft": None},
    }
    paths = write_reports(report, tmp_path / "eval")
    cells = {r["key"]: r["value"] for r in md_table(paths["md"].read_text(), "Machine")}
    assert cells == {
        "cpu": "AMD EPYC 7B13",
        "flags": "avx2 fma avx512f",
        "cores": "2",
        "torch_threads": "2",
        "torch": "2.13.0",
        "bandwidth_gb_s": "11.35",
        "decode_floor_s": "-",
        "decode_step_over_floor": "1.4",
        "layouts target qkv": "rows 1-2: kn, 3-8: packed",  # consecutive row counts with one layout merged
        "layouts draft": "-",
        "layout_tuning target layouts": "auto",
        "layout_tuning target tune_s": "5.1",
        "layout_tuning draft": "-",
    }
    assert "<h2>Machine</h2>" in paths["html"].read_text() and "<td>avx2 fma avx512f</td>" in paths["html"].read_text()
    report["machine"] = {"cpu": "x", "layouts": {}}
    md = write_reports(report, tmp_path / "bare")["md"].read_text()
    assert {r["key"]: r["value"] for r in md_table(md, "Machine")} == {"cpu": "x", "layouts": "-"}
