"""`kvrepro triage` on real reports from vLLM's tracker: right first, unknown kept unknown, false matches, refusals.

Judges every report of a corpus (a folder of pasted logs with a manifest.yaml, as
tests/data/triage/real/; kvrepro/triage/corpus.py says how) against the catalogue, and prints the
table docs/triage.md quotes and one line per report. Goals (issue 45): of the reports whose text
supports a catalogue entry, at least 90% named first; of the others, at least 90% unknown; no false
match; no vLLM text refused.

    python benchmarks/triage_real_reports.py [--corpus DIR] [--catalogue DIR] [--json]

``--catalogue`` judges against another defects/ folder (a branch that adds entries): reports
that cite an entry by its upstream links then expect it.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kvrepro.suite.run import load  # noqa: E402
from kvrepro.triage import corpus  # noqa: E402

GOAL_RIGHT = 0.9
GOAL_UNKNOWN = 0.9


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--corpus", type=Path, default=ROOT / "tests" / "data" / "triage" / "real")
    parser.add_argument("--catalogue", type=Path, default=None, help="a defects/ folder (default: the repository's)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    catalogue = load(args.catalogue)
    t0 = time.perf_counter()
    summary = corpus.judge(args.corpus, catalogue)
    took = time.perf_counter() - t0
    table = summary.table()
    entry, unknown = table["expecting an entry"], table["expecting unknown"]
    right = table["right first"] / entry if entry else 1.0
    kept = table["unknown kept unknown"] / unknown if unknown else 1.0
    ok = right >= GOAL_RIGHT and kept >= GOAL_UNKNOWN and table["false matches"] == 0 and table["refusals"] == 0
    if args.json:
        print(json.dumps({**table, "seconds": round(took, 2), "goals_met": ok,
                          "reports_judged": [{"file": j.report.file, "expected": j.expected, "pending": j.pending,
                                              "got": j.got, "tied": list(j.tied), "verdict": j.verdict}
                                             for j in summary.judged]}, indent=2))
        return 0 if ok else 1
    print(f"corpus {args.corpus} ({table['reports']} reports), catalogue {args.catalogue or 'defects/'}, "
          f"{took:.1f} s")
    for j in summary.judged:
        want = j.expected or ("unknown (awaits an entry)" if j.pending else "unknown")
        got = j.got or "unknown"
        tie = f" (tied with {', '.join(t for t in j.tied if t != j.got)})" if j.tied else ""
        print(f"  {j.report.file:24} {j.report.area:17} want {want:27} got {got}{tie}: {j.verdict}")
    print()
    print("| reports | expecting an entry | right first | expecting unknown | kept unknown | false matches | refusals |")
    print("|---|---|---|---|---|---|---|")
    print(f"| {table['reports']} | {entry} | {table['right first']} ({right:.0%}) | {unknown} "
          f"({table['of them awaiting a catalogue entry']} await an entry) | {table['unknown kept unknown']} "
          f"({kept:.0%}) | {table['false matches']} | {table['refusals']} |")
    if table["tie holding the right entry"]:
        print(f"ties holding the right entry (not counted right): {table['tie holding the right entry']}")
    print(f"goals (right first >= {GOAL_RIGHT:.0%}, unknown >= {GOAL_UNKNOWN:.0%}, 0 false matches, "
          f"0 refusals): {'met' if ok else 'NOT met'}")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
