"""Per prompt category and candidate: acceptance, tau, cost ratio and paired speedup (95 % interval) of one eval report,
as a markdown table (issue 26: is the distilled draft worth it next to the free ones?).

    python benchmarks/report_by_category.py runs/quickstart/eval/report.json            # every chain setting
    python benchmarks/report_by_category.py runs/quickstart/eval/report.json --best     # each candidate's best chain

Each row is one candidate at one chain length (`--best`: per category, the candidate's most surely fast chain there,
ranked as `eval.recommend.surest_speedup` ranks settings); the numbers are the report's own `by_category` entries
(the selection split), measured over that category's prompts alone.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from eval.recommend import surest_speedup  # noqa: E402


def _num(v, digits: int = 3) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def rows(report: dict, best: bool) -> list[list[str]]:
    out = []
    categories = sorted({cat for c in report["candidates"] for s in c["settings"] for cat in s.get("by_category", {})})
    for cat in categories:
        for c in report["candidates"]:
            chains = [s for s in c["settings"] if s.get("tree") is None and cat in s.get("by_category", {})]
            if best:
                chains = [max(chains, key=lambda s, cat=cat: surest_speedup(s["by_category"][cat]))] if chains else []
            for s in sorted(chains, key=lambda s: s["num_draft_tokens"]):
                stats = s["by_category"][cat]
                ci = stats.get("speedup_ci")
                speed = _num(stats.get("speedup"), 2)  # one prompt in the category: a point, no interval
                speed += f" [{_num(ci[0], 2)}, {_num(ci[1], 2)}]" if ci else " (no interval: 1 unit)"
                out.append(
                    [
                        cat,
                        c["name"],
                        c.get("kind", "standalone"),
                        str(s["num_draft_tokens"]),
                        _num(stats.get("acceptance_rate")),
                        _num(stats.get("mean_accepted_length"), 2),
                        _num(stats.get("cost_ratio")),
                        speed,
                    ]
                )
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("report", type=Path)
    p.add_argument("--best", action="store_true", help="each candidate's most surely fast chain per category")
    args = p.parse_args(argv)
    report = json.loads(args.report.read_text())
    columns = ["category", "candidate", "kind", "gamma", "acceptance_rate", "tau", "cost_ratio", "speedup (95 % CI)"]
    print("| " + " | ".join(columns) + " |")
    print("| " + " | ".join("---" for _ in columns) + " |")
    for row in rows(report, args.best):
        print("| " + " | ".join(row) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
