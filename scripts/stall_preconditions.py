"""Measure the preconditions of ``recompute-failed-load-stall``: the connector, and the footprint.

Why: the stall (defects/recompute-failed-load-stall.yaml) needs a connector that reports a failed
load and answers the retry with an asynchronous hit again, and it is permanent only when the
retried request's own remaining blocks (its stale reservation) plus the blocks its retry needs
exceed the free pool: about one request over half the KV cache. This script runs the entry's
matrix (merged over matrix.yaml as the suite merges it) with each connector and with the largest
request's footprint above and below half the pool (``engine.max_model_len``: the load generator
caps every prompt to it), on each release, with ``kvrepro matrix run`` (the base axis), and prints
one row per (connector, footprint, release): verdict per repetition, requests sent, injected load
faults. The table in docs/faults.md is its output.

    python scripts/stall_preconditions.py                          # 0.30.0-0.33.0 (+0.34.0 when supported)
    python scripts/stall_preconditions.py --release 0.33.0 --case mooncake-store-like:1024 --json

``--upstream-test RELEASE --fix PATCH`` instead renders the upstream regression test (the case of
tests/test_stall_upstream.py: 881 tokens, 96 blocks of 16) with RELEASE's scheduler lines and runs
it with vLLM's pytest in RELEASE's sdist tests/, on the release and on the release + PATCH (a patch
declared in matrix.yaml): the table of docs/faults.md "The report upstream".
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kvrepro import versions  # noqa: E402
from kvrepro.suite.catalogue import load_catalogue  # noqa: E402

ENTRY = "recompute-failed-load-stall"
# connector:max_model_len[:at=K]: 1024 tokens = 64 blocks of 16 (+1 MTP lookahead) of the 96-block
# pool, over half; 640 tokens = 40 (+1), under half (47.5 of the 95 free). at=K: only the K-th load
# fails (one failed request), instead of the entry's load_fail_rate (several may fail at once)
CASES = ("mooncake-store-like:1024", "mooncake-store-like:640", "mooncake-store-like:1024:at=3",
         "mooncake-store-like:640:at=3", "nixl-like:1024", "offloading:1024")


def _merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for key, value in over.items():
        out[key] = _merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--release", action="append", help="release (default: 0.30.0 and every later supported one)")
    parser.add_argument("--case", action="append", help=f"connector:max_model_len (default: {', '.join(CASES)})")
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--jobs", type=int, default=1)
    parser.add_argument("--results", default=str(ROOT / "results"))
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--upstream-test", metavar="RELEASE", help="run the upstream test on RELEASE instead")
    parser.add_argument("--fix", default="fix-recompute-failed-load-reservation", help="with --upstream-test")
    args = parser.parse_args()
    if args.upstream_test:
        return upstream_test(args.upstream_test, args.fix, args.json)
    releases = args.release or [r for r in versions.SUPPORTED_RELEASES if versions.reports_failed_loads(r)]
    (entry,) = load_catalogue().select([ENTRY])
    default = yaml.safe_load((ROOT / "matrix.yaml").read_text())
    rows = []
    for case in args.case or CASES:
        connector, model_len, *rest = case.split(":")
        fragment = _merge(entry.fragment, {"engine": {"connector": connector, "max_model_len": int(model_len)}})
        at = next((int(r.removeprefix("at=")) for r in rest if r.startswith("at=")), None)
        if at is not None:
            fragment["engine"]["sim"]["offload_faults"] = {"load_fail_at": [at]}
        matrix = _merge(default, fragment)
        matrix.update(base=releases, builds={"plain": []}, common=[], expect={}, target="sim")
        matrix["runs"] = {**matrix.get("runs", {}), "repetitions": args.reps, "requests": args.requests,
                          "start_timeout_s": 300}
        with tempfile.TemporaryDirectory(prefix="kvrepro-stall-") as tmp:
            path = Path(tmp) / "matrix.yaml"
            path.write_text(yaml.safe_dump(matrix, sort_keys=False))
            cmd = [sys.executable, "-m", "kvrepro.cli", "matrix", "run", "-m", str(path), "--results", args.results,
                   "--json", "--jobs", str(args.jobs)]
            proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, cwd=ROOT)
        if not proc.stdout.strip():
            print(f"{case}: kvrepro matrix run exited {proc.returncode} without a result", file=sys.stderr)
            return proc.returncode or 1
        run = json.loads(proc.stdout)
        by_release: dict[str, list[dict]] = {}
        for build in run["builds"].values():
            for r in build["runs"]:
                by_release.setdefault(r.get("base") or build.get("base"), []).append(r)
        for release, runs in by_release.items():
            faults = []
            for r in runs:
                verdict = Path(r["run_dir"]) / "verdict.json" if r.get("run_dir") else None
                data = json.loads(verdict.read_text()) if verdict is not None and verdict.is_file() else {}
                faults.append(data.get("injected_load_faults"))
            rows.append({"connector": connector, "max_model_len": int(model_len), "release": release,
                         "faults": f"load #{at}" if at is not None else "entry's rate",
                         "verdicts": [r["verdict"] for r in runs], "requests": [r["requests"] for r in runs],
                         "load_faults": faults, "titles": sorted({r["title"][:90] for r in runs}),
                         "run_id": run["run_id"]})
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    print(f"{'connector':<20} {'max_len':>7} {'injected':<13} {'release':<8} {'verdicts':<22} {'requests':<12} "
          f"{'faults':<8} title")
    for row in rows:
        print(f"{row['connector']:<20} {row['max_model_len']:>7} {row['faults']:<13} {row['release']:<8} "
              f"{'/'.join(row['verdicts']):<22} "
              f"{'/'.join(map(str, row['requests'])):<12} {'/'.join(map(str, row['load_faults'])):<8} "
              f"{'; '.join(row['titles'])[:80]}  ({row['run_id']})")
    return 0


def upstream_test(release: str, fix: str, as_json: bool) -> int:
    import time

    from kvrepro.builds.overlay import pristine_tree
    from kvrepro.builds.standalone_test import run_standalone
    from kvrepro.matrix import load_matrix
    from kvrepro.minimize import upstream_emit

    loaded = load_matrix(ROOT / "matrix.yaml")
    _, root, _ = pristine_tree(release)
    case = upstream_emit.StallCase("scripts/stall_preconditions.py", release, 16, 96, 881, 880, 0,
                                   upstream_emit.mechanism_lines((root / upstream_emit.SCHEDULER).read_text()))
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="kvrepro-stall-test-") as tmp:
        path = Path(tmp) / "test_recompute_failed_load_stall.py"
        upstream_emit.emit_stall_test(path, case)
        runs = run_standalone(release, path, upstream_emit.UPSTREAM_PATH,
                              [(f"vLLM {release}", []), (f"vLLM {release} + {fix}", [loaded.patch_ref(fix)])],
                              Path(tmp) / "work")
    rows = [{"tree": run.label, "case": nodeid.rsplit("[", 1)[-1].rstrip("]"), "outcome": o.outcome,
             "message": o.message} for run in runs for nodeid, o in sorted(run.outcomes.items())]
    if as_json:
        print(json.dumps({"seconds": round(time.monotonic() - started), "rows": rows}, indent=2))
        return 0
    for row in rows:
        print(f"{row['tree']:<50} {row['case']:<36} {row['outcome']:<7} {row['message'][:160]}")
    print(f"{time.monotonic() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
