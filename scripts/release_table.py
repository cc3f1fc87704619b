"""The release table (issue 18 item 4): every catalogue entry on every supported release, one command.

    python scripts/release_table.py [--reps N] [--jobs N] [--out docs/suite-release-table.md]
    python scripts/release_table.py --from results/suite-...   # render a recorded suite run again
    python scripts/release_table.py --from results/suite-A --from results/suite-B   # B's entries replace A's

Runs `kvrepro suite run --base <each release> --json` (one suite run, recorded under results/) and
writes a Markdown table: one row per entry, one column per release; each cell is the row
(PRESENT / ABSENT / UNREACHED / OTHER / INFRA; NOT TESTABLE entries are listed once below) and a
mark when it differs from the catalogue (`!`), with the suite run's id and wall time.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kvrepro.versions import SUPPORTED_RELEASES as SUPPORTED  # noqa: E402

SHORT = {"PRESENT": "PRESENT", "ABSENT": "absent", "UNREACHED": "UNREACHED", "OTHER": "other", "INFRA": "INFRA",
         "NOT TESTABLE": "n/t", "MASKED": "masked"}


def render(suite: dict, wall: float | None) -> str:
    releases = suite["builds"]
    rows: dict[str, dict[str, dict]] = {}
    untestable: dict[str, str] = {}
    refused: dict[str, str] = {}  # entry -> why some release refused its engine (cells "n/t")
    tested = {r["entry"] for r in suite["rows"] if r["state"] != "NOT TESTABLE"}
    for r in suite["rows"]:
        if r["state"] == "NOT TESTABLE" and r["entry"] not in tested:
            untestable[r["entry"]] = r["detail"]
            continue
        if r["state"] == "NOT TESTABLE":
            refused.setdefault(r["entry"], r["detail"])
        rows.setdefault(r["entry"], {})[r["build"]] = r
    out = [f"Suite run `{suite['suite_id']}` ({suite['status']}); "
           + (f"wall time {wall:.0f} s; " if wall else "")
           + "`!` = differs from the catalogue's expectation, `-` = no expectation for that release.", "",
           "| entry | " + " | ".join(releases) + " |", "|---|" + "---|" * len(releases)]
    for entry, cells in rows.items():
        shown = []
        for release in releases:
            r = cells.get(release)
            if r is None:
                shown.append("")
                continue
            mark = "!" if r["failed"] else ("" if r["matches"] else (" -" if r["expected"] is None else ""))
            shown.append(SHORT.get(r["state"], r["state"]) + mark)
        out.append(f"| `{entry}` | " + " | ".join(shown) + " |")
    for entry, why in refused.items():
        out += ["", f"`n/t` for `{entry}`: {why}."]
    if untestable:
        out += ["", "Not testable here: " + "; ".join(f"`{e}` ({why})" for e, why in untestable.items())]
    return "\n".join(out) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=1)
    ap.add_argument("--jobs", type=int, default=None)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--from", dest="recorded", action="append", default=None,
                    help="a recorded suite run to render; again: a later run's entries replace an earlier one's "
                         "(an entry re-measured after a fix)")
    args = ap.parse_args()
    started = time.monotonic()
    if args.recorded:
        suite = None
        for recorded in args.recorded:
            proc = subprocess.run([sys.executable, "-m", "kvrepro.cli", "suite", "report", recorded, "--json"],
                                  cwd=ROOT, stdout=subprocess.PIPE, text=True)
            if not proc.stdout.strip():
                raise SystemExit(f"no suite output for {recorded} (exit {proc.returncode})")
            later = json.loads(proc.stdout)
            if suite is None:
                suite = later
                continue
            replaced = {r["entry"] for r in later["rows"]}
            suite["rows"] = [r for r in suite["rows"] if r["entry"] not in replaced] + later["rows"]
            suite["suite_id"] += f"` + `{later['suite_id']}"
            suite["seconds"] = (suite.get("seconds") or 0) + (later.get("seconds") or 0)
    else:
        cmd = [sys.executable, "-m", "kvrepro.cli", "suite", "run", "--json", "--ci", "--reps", str(args.reps)]
        for release in SUPPORTED:
            cmd += ["--base", release]
        if args.jobs:
            cmd += ["--jobs", str(args.jobs)]
        proc = subprocess.run(cmd, cwd=ROOT, stdout=subprocess.PIPE, text=True)
        if not proc.stdout.strip():
            raise SystemExit(f"no suite output (exit {proc.returncode})")
        suite = json.loads(proc.stdout)
    table = render(suite, suite.get("seconds") or (None if args.recorded else time.monotonic() - started))
    if args.out:
        args.out.write_text(table)
    sys.stdout.write(table)


if __name__ == "__main__":
    main()
