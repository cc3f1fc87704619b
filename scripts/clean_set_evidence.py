"""Is build E clean beyond the default load? Runs it over load profiles x geometries, prints a table.

Why: the default matrix shows E (D + the backports of vllm#48425 and #50344) clean on one load
and one geometry. A fix "works" only if the crash and the silent corruption stay away under
other traffic shapes and on the production-like engine too. This script derives one throwaway
matrix per (profile, geometry) cell from ``matrix.yaml`` -- only the chosen build (default E), its
patches, the cell's engine and load -- writes it under ``results/clean-set-evidence-<stamp>/``
(next to a ``builds`` link, so the patch pins of ``matrix.yaml`` are checked as usual), runs it
with ``kvrepro matrix run`` and prints one row per cell: runs, verdicts, trigger and bug-state
counts per run, shadow-KV violations, offload loads.

Geometries: ``default`` (``matrix.yaml``'s engine) and ``production`` (the engine, runs and
``dp_routing: affinity`` of ``examples/production-geometry.yaml``: block = offload chunk = 2,128
tokens, 3 Mamba + 1 full-attention groups, MTP, DP4). Profiles: ``partial-prefix`` (the
geometry's own load), ``multi-turn`` and ``shared_prefix``, sized for the geometry (below).

    python scripts/clean_set_evidence.py                        # E, 3 profiles x 2 geometries x 2 reps
    python scripts/clean_set_evidence.py --reps 1 --profile multi-turn --geometry default
    python scripts/clean_set_evidence.py --build D --json       # the same cells on another build

Exit code: 0 when every run of the build is SURVIVED or UNREACHED with the KV check ok, 1 when
one is not (a finding: the table says which), 2 on bad arguments, 3 when a run gave no result.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
PROFILES = ("partial-prefix", "multi-turn", "shared_prefix")
GEOMETRIES = ("default", "production")
CLEAN = ("SURVIVED", "UNREACHED")

# The common load fields every cell keeps from its geometry's load (the rest is the profile's own).
COMMON_LOAD = ("concurrency", "max_tokens", "seed", "dp_routing")

# Profile settings per geometry. The default geometry (block 16, max_model_len 1024) takes each
# profile's own defaults. The production-like one has 2,128-token blocks and chunks and a
# 19,152-token max_model_len: the defaults (400-token documents, 900-token conversations) would
# never fill a block, so the sizes are scaled to chunks (prefixes of 1-6 chunks, conversations up
# to 8 chunks) to let prefix and offload hits happen at all.
PROFILE_SETTINGS: dict[str, dict[str, dict]] = {
    "multi-turn": {
        "default": {},
        "production": {"system_prompt_tokens": 2128, "user_tokens": [256, 2500], "reply_tokens": [64, 1024],
                       "max_turns": 8, "max_context_tokens": 17000},
    },
    "shared_prefix": {
        # concurrency 4: the load that crashed 0.25.1 (README, vLLM releases); other requests in
        # flight also reach the scheduler's preemption and waiting paths
        "default": {"concurrency": 4},
        "production": {"concurrency": 4, "documents": 6, "document_tokens": 12768, "min_prefix_tokens": 2128},
    },
}


def load_yaml(path: Path) -> dict:
    return yaml.safe_load(path.read_text())


def cell_matrix(default: dict, production: dict, build: str, profile: str, geometry: str,
                reps: int, requests: int | None) -> dict:
    """The matrix of one cell: ``build`` of ``matrix.yaml`` alone (or, for ``+a+b``, the patches
    a, b on top of ``common``, as build ``only-a-b``), on the cell's engine and load."""
    builds = dict(default["builds"])
    if build.startswith("+"):  # a stack given with --patch: "+pr-48425" (on top of common)
        names = [n for n in build[1:].split("+") if n]
        unknown = [n for n in names if n not in default["patches"]]
        if unknown:
            raise SystemExit(f"--patch {', '.join(unknown)}: not declared under patches: in matrix.yaml")
        builds[build] = names
    if build not in builds:
        raise SystemExit(f"--build {build}: matrix.yaml defines {', '.join(default['builds'])}")
    source = default if geometry == "default" else production
    stack = list(default.get("common", [])) + list(builds[build])
    name = build if not build.startswith("+") else "only-" + "-".join(builds[build])
    load = dict(source["load"])
    if profile != "partial-prefix":
        load = {k: v for k, v in load.items() if k in COMMON_LOAD}
        load["profile"] = profile
        load.update(PROFILE_SETTINGS[profile][geometry])
    runs = dict(source["runs"], repetitions=reps)
    if requests is not None:
        runs["requests"] = requests
    return {
        "base": default["base"],
        "target": default["target"],
        "patches": {name: spec for name, spec in default["patches"].items() if name in stack},
        "common": list(default.get("common", [])),
        "builds": {name: list(builds[build])},
        "target_signature": default["target_signature"],
        "engine": source["engine"],
        "load": load,
        "runs": runs,
        "expect": {name: "SURVIVED|UNREACHED"},
    }


def run_cell(folder: Path, name: str, matrix: dict, results: Path, jobs: int | None) -> dict:
    path = folder / f"{name}.yaml"
    path.write_text(f"# derived from {ROOT / 'matrix.yaml'} by scripts/clean_set_evidence.py\n"
                    + yaml.safe_dump(matrix, sort_keys=False))
    cmd = [sys.executable, "-m", "kvrepro.cli", "matrix", "run", "-m", str(path), "--results", str(results),
           "--json"] + (["--jobs", str(jobs)] if jobs else [])
    started = time.monotonic()
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    seconds = time.monotonic() - started
    if not proc.stdout.strip():
        return {"error": f"kvrepro matrix run exited {proc.returncode} without a result: "
                         f"{proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else ''}",
                "seconds": seconds}
    run = json.loads(proc.stdout)
    runs = []
    for build in run["builds"].values():
        for r in build["runs"]:
            verdict = {}
            if r.get("run_dir") and (Path(r["run_dir"]) / "verdict.json").is_file():
                verdict = json.loads((Path(r["run_dir"]) / "verdict.json").read_text())
            label = r["verdict"] if r["verdict"] != "CRASH" else (
                "CRASH(target)" if r["outcome"] == "target" else "CRASH(other)")
            runs.append({"label": label, "trigger_count": r["trigger_count"], "state_count": r.get("state_count", 0),
                         "kv_check": r.get("kv_check"), "kv_checks": verdict.get("kv_checks"),
                         "kv_violations": verdict.get("kv_violations"), "requests": r["requests"],
                         "offload_load_jobs": r.get("offload_load_jobs"), "title": r["title"],
                         "run_dir": r.get("run_dir")})
    return {"run_id": run["run_id"], "runs": runs, "seconds": round(seconds, 1), "returncode": proc.returncode}


def clean(run: dict) -> bool:
    return run["label"] in CLEAN and run["kv_check"] == "ok"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--build", default="E", help="build of matrix.yaml to run (default E)")
    parser.add_argument("--patch", action="append",
                        help="run these declared patches on top of common: instead of --build (repeatable; "
                             "e.g. the answer of `bisect patches`)")
    parser.add_argument("--profile", action="append", choices=PROFILES, help="repeatable; default: all three")
    parser.add_argument("--geometry", action="append", choices=GEOMETRIES, help="repeatable; default: both")
    parser.add_argument("--reps", type=int, default=2, help="repetitions per cell (default 2: 12 runs)")
    parser.add_argument("--requests", type=int, default=None, help="runs.requests (default: the geometry's)")
    parser.add_argument("--results", default=str(ROOT / "results"))
    parser.add_argument("--jobs", type=int, default=None,
                        help="engines at once (default: one per core; 1 for the production geometry, whose "
                             "engine is 4 EngineCores already)")
    parser.add_argument("--start-timeout", type=float, default=None,
                        help="runs.start_timeout_s (default: the geometry's; 600 for production: 4 ranks start "
                             "slowly on 2 shared cores)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if args.reps < 1:
        parser.error("--reps must be at least 1")

    default = load_yaml(ROOT / "matrix.yaml")
    production = load_yaml(ROOT / "examples" / "production-geometry.yaml")
    if args.patch:
        args.build = "+" + "+".join(args.patch)
    results = Path(args.results).resolve()
    folder = results / f"clean-set-evidence-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}"
    folder.mkdir(parents=True)
    (folder / "builds").symlink_to(ROOT / "builds")
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())

    rows = []
    for geometry in args.geometry or GEOMETRIES:
        for profile in args.profile or PROFILES:
            matrix = cell_matrix(default, production, args.build, profile, geometry, args.reps, args.requests)
            start_timeout = args.start_timeout or (600.0 if geometry == "production" else None)
            if start_timeout:
                matrix["runs"]["start_timeout_s"] = start_timeout
            jobs = args.jobs or (1 if geometry == "production" else None)
            outcome = run_cell(folder, f"{next(iter(matrix['builds']))}-{profile}-{geometry}", matrix, results, jobs)
            rows.append({"profile": profile, "geometry": geometry, **outcome})
            if not args.json:
                print(f"... {profile} / {geometry}: "
                      + (outcome.get("error") or " ".join(r["label"] for r in outcome["runs"]))
                      + f" ({outcome['seconds']:.0f} s)", file=sys.stderr)

    all_runs = [r for row in rows for r in row.get("runs", [])]
    summary = {"build": args.build, "date": started, "folder": str(folder), "rows": rows,
               "runs": len(all_runs), "clean": sum(clean(r) for r in all_runs)}
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        print(f"build {args.build}, {started}; matrices under {folder}")
        print("| profile | geometry | runs | verdicts | trigger | state | KV check | contexts checked | violations "
              "| offload loads | run |")
        print("|---|---|---|---|---|---|---|---|---|---|---|")
        for row in rows:
            if "error" in row:
                print(f"| {row['profile']} | {row['geometry']} | 0 | {row['error']} | | | | | | | |")
                continue
            runs = row["runs"]
            verdicts = ", ".join(f"{sum(r['label'] == label for r in runs)}x {label}"
                                 for label in sorted({r["label"] for r in runs}))
            fmt = lambda key: " / ".join("?" if r.get(key) is None else str(r[key]) for r in runs)  # noqa: E731
            checks = ", ".join(f"{sum(r['kv_check'] == k for r in runs)}x {k}" for k in sorted({str(r['kv_check']) for r in runs}))
            print(f"| {row['profile']} | {row['geometry']} | {len(runs)} | {verdicts} | {fmt('trigger_count')} | "
                  f"{fmt('state_count')} | {checks} | {fmt('kv_checks')} | {fmt('kv_violations')} | "
                  f"{fmt('offload_load_jobs')} | "
                  f"{row['run_id']} |")
        print(f"clean (SURVIVED or UNREACHED, KV check ok): {summary['clean']} of {summary['runs']} runs")
    if any("error" in row for row in rows):
        return 3
    return 0 if summary["clean"] == summary["runs"] else 1


if __name__ == "__main__":
    sys.exit(main())
