"""Requests to the first failure, per release and known defect: kvrepro's default load vs generic tools.

Issue 18 item 5: a load tuned on one release that goes blind on another answers the wrong question,
so this sweep measures, for every ``--base`` release and every catalogue entry (``defects/``) that the
catalogue says is present there, how many requests each load needs before the entry's failure shows:

* crash entries: the request the engine died on, when it died on the entry's signature;
* corruption entries: the first request a shadow-KV violation of the entry's defect was about.
  Every request carries ``X-Request-Id: kvrepro-<n>`` (kvrepro's load sets it; for the generic tools
  the counting proxy does), vLLM builds its request id from it, and the shadow KV's violation lines
  name the request, so the number is exact at any concurrency. The shadow KV describes the first
  ``KVREPRO_SIM_SHADOW_DESCRIBE`` violations only; this script raises it to 1000.

Stall entries are left out: a stall is reached by the entry's own load (concurrency, KV pressure),
so there is no second load to compare it with.

Each release runs as released (no patch, no `common:`), one engine configuration per group of
entries (an entry's `matrix.engine` fragment, seeds left out: `offload-boundary-assert-all-mode` runs
`--mamba-cache-mode all`), every load on the same GPU-free engine: kvrepro's default
(`partial-prefix` revisit with pass-through, through `kvrepro matrix run`) and the generic tools of
requests_to_crash.py (through its counting proxy, one request at a time). A run that shows no
failure within the budget counts as the budget (the median is then a lower bound, shown ``>=``).

    python benchmarks/release_sweep.py --base 0.25.1 --base 0.26.0 --seeds 5 --budget 1000 --only "vllm bench"
    python benchmarks/release_sweep.py --json ...      # the numbers as JSON
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import tempfile
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import requests_to_crash as rtc  # noqa: E402
from kvrepro.classify.corruption import first_request  # noqa: E402
from kvrepro.suite.catalogue import Entry, expected_state, load_catalogue  # noqa: E402


def _engine_key(entry: Entry) -> str:
    """The entry's engine fragment without seeds: entries with the same key share their runs."""
    engine = copy.deepcopy(entry.fragment.get("engine") or {})
    engine.get("sim", {}).pop("seed", None)
    if "sim" in engine and not engine["sim"]:
        del engine["sim"]
    return json.dumps(engine, sort_keys=True)


def _merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for key, value in over.items():
        out[key] = _merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def release_matrix(release: str, engine_fragment: dict) -> dict:
    """The shipped matrix.yaml on ``release`` as released: one build A without patches."""
    matrix = yaml.safe_load((ROOT / "matrix.yaml").read_text())
    matrix.update(base=release, common=[], builds={"A": []}, expect={})
    matrix["engine"] = _merge(matrix["engine"], engine_fragment)
    # a loaded machine starts engines slowly; a start that times out says nothing about the load
    matrix["runs"] = {**matrix.get("runs", {}), "start_timeout_s": 600}
    return matrix


def failure_at(entry: Entry, run: rtc.Run) -> int | None:
    """The request at which ``run`` showed ``entry``'s failure, or None."""
    if entry.kind == "crash":
        return run.requests if run.signature == entry.signature else None
    return first_request(entry.signature, run.kv_first_request_by_class or {}, run.kv_groups or ())


median = rtc.censored_median  # runs that showed nothing count as the budget; True: a lower bound


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", action="append", help="a vLLM release (repeatable; default 0.25.1 and 0.26.0)")
    parser.add_argument("--entry", action="append", help="only these catalogue entries (repeatable)")
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--budget", type=int, default=1000, help="requests per run")
    parser.add_argument("--only", action="append",
                        help="generic loads whose name starts with this (repeatable; default: all of "
                             "requests_to_crash.py's)")
    parser.add_argument("--jobs", type=int, default=2, help="generic runs at once (one engine each)")
    parser.add_argument("--keep", type=Path, help="keep every run's folder here")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--from", dest="recorded", type=Path, help="print the table of a --json output again")
    args = parser.parse_args()
    if args.recorded:
        print_table(json.loads(args.recorded.read_text()))
        return 0
    bases = args.base or ["0.25.1", "0.26.0"]
    generic = [n for n in rtc.GENERIC if not args.only or any(n.startswith(o) for o in args.only)]
    os.environ.setdefault("KVREPRO_SIM_SHADOW_DESCRIBE", "1000")  # every violation names its request
    catalogue = load_catalogue()
    chosen = catalogue.select(args.entry)

    def log(text: str) -> None:
        print(text, file=sys.stderr, flush=True)

    rows: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="kvrepro-sweep-") as tmp:
        workdir = args.keep or Path(tmp)
        for release in bases:
            present = [e for e in chosen if e.testable and e.kind in ("crash", "corruption")
                       and expected_state(e, release, ()) == "present"]
            groups: dict[str, list[Entry]] = {}
            for e in present:
                groups.setdefault(_engine_key(e), []).append(e)
            for number, (key, entries) in enumerate(groups.items()):
                folder = workdir / f"{release}-{number}"
                folder.mkdir(parents=True, exist_ok=True)
                matrix = release_matrix(release, json.loads(key))
                path = folder / "matrix.yaml"
                path.write_text(yaml.safe_dump(matrix, sort_keys=False))
                if not (folder / "builds").exists():
                    (folder / "builds").symlink_to(ROOT / "builds")
                log(f"{release}: {', '.join(e.name for e in entries)} (engine {key})")
                runs = {rtc.DEFAULT: rtc.run_ours(rtc.DEFAULT, None, args.seeds, args.budget, folder, matrix)}
                if generic:
                    engine = rtc.Engine(path)
                    try:
                        for name in generic:
                            log(f"  {name} ...")
                            runs[name] = rtc.run_generic(engine, name, args.seeds, args.budget, folder, args.jobs,
                                                         log)
                    finally:
                        engine.close()
                for entry in entries:
                    loads = {}
                    for name, load_runs in runs.items():
                        at = [failure_at(entry, r) for r in load_runs]
                        value, censored = median(at, args.budget)
                        loads[name] = {"per_seed": at, "median": value, "lower_bound": censored,
                                       "labels": [r.label for r in load_runs]}
                    best = min((n for n in loads if n != rtc.DEFAULT), key=lambda n: loads[n]["median"], default=None)
                    ours = loads[rtc.DEFAULT]["median"]
                    rows.append({"release": release, "entry": entry.name, "kind": entry.kind, "loads": loads,
                                 "best_generic": best,
                                 "ratio": round(loads[best]["median"] / ours, 2) if best and ours else None})
    summary = {"bases": bases, "seeds": args.seeds, "budget": args.budget, "generic": generic, "rows": rows}
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        print_table(summary)
    return 0


def print_table(summary: dict) -> None:
    seeds, budget = summary["seeds"], summary["budget"]
    print(f"requests until each entry's failure ({seeds} seeds, budget {budget}; '-' = not within the budget, "
          f"counted as {budget}; '>=' = the median is a lower bound; x = best generic median / ours)")
    print(f"generic loads: {', '.join(summary['generic']) or 'none'}")
    print(f"{'release':8} {'entry':34} {'kvrepro default':>22} {'best generic (median)':>38} {'x':>7}")
    for row in summary["rows"]:
        ours = row["loads"][rtc.DEFAULT]
        cells = " ".join(str(v) if v is not None else "-" for v in ours["per_seed"])
        mine = f"{'>=' if ours['lower_bound'] else ''}{ours['median']:g} [{cells}]"
        best = row["best_generic"]
        shown, ratio = "-", "-"
        if best:
            b = row["loads"][best]
            bound = ">=" if b["lower_bound"] else ""
            shown = f"{best} ({bound}{b['median']:g})"
            ratio = "-" if row["ratio"] is None else f"{bound}{row['ratio']:g}"
        print(f"{row['release']:8} {row['entry']:34} {mine:>22} {shown:>38} {ratio:>7}")


if __name__ == "__main__":
    raise SystemExit(main())
