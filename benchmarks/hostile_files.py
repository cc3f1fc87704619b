"""A FIFO, a link to /dev/zero and a 1 GiB file where kvrepro reads files it does not own (issue 30).

For each surface, side by side in one run: the command on a clean folder (baseline) and on the
same folder with the three hostile files added, each the whole command (``python -m
kvrepro.cli ...``, start-up included), best of ``--repeat``; wall time and the child's peak RSS
(``wait4``). Goal (issue 30, "Done when"): at most a second more each, and no memory growth
(the 1 GiB file is sparse: only a read of it would cost memory).

* ``clean --temp-only --dry-run``: three ``kvrepro-<n>-<hex>/owner.json`` in $TMPDIR;
* ``suite list``: each of the three as ``x.yaml`` in a copy of defects/ (one at a time: the first
  bad file stops the loader, as it should), measured alternately with the clean copy;
* ``results list``: three run folders whose run.json is each of them.

A hang shows as the timeout (``--timeout``, default 60 s), never as a stuck benchmark.

    python benchmarks/hostile_files.py [--repeat 3]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GIB = 1 << 30


KINDS = ("fifo", "zero", "big")


def make(kind: str, path: Path) -> Path:
    """``path`` as a FIFO, a link to /dev/zero or a sparse 1 GiB file (no disk used)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "zero":
        path.symlink_to("/dev/zero")
    else:
        with open(path, "wb") as fh:
            fh.truncate(GIB)
    return path


def timed(args: list[str], env: dict[str, str], timeout: float, cwd: Path = ROOT) -> tuple[float, float, int]:
    """(seconds, peak RSS in MiB, exit code) of one `kvrepro` command run from the checkout ``cwd``
    (``python -m`` imports the package there); a hang is killed at ``timeout``."""
    started = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "kvrepro.cli", *args], cwd=cwd, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = started + timeout
    while True:
        pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
        if pid:
            proc.returncode = os.waitstatus_to_exitcode(status)
            return time.monotonic() - started, usage.ru_maxrss / 1024, proc.returncode
        if time.monotonic() > deadline:
            proc.kill()
            _, status, usage = os.wait4(proc.pid, 0)
            return float("inf"), usage.ru_maxrss / 1024, -9
        time.sleep(0.01)


def _best(runs: list[tuple[float, float, int]]) -> tuple[float, float, int]:
    """Fastest time, highest peak memory, last exit code."""
    return min(r[0] for r in runs), max(r[1] for r in runs), runs[-1][2]


def best(args: list[str], env: dict[str, str], repeat: int, timeout: float) -> tuple[float, float, int]:
    return _best([timed(args, env, timeout) for _ in range(repeat)])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=60.0)
    opts = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="kvrepro-bench-hostile-"))
    rows = []
    try:
        # clean: the temp folder
        temp = work / "tmp"
        temp.mkdir()
        env = dict(os.environ, TMPDIR=str(temp))
        args = ["clean", "--temp-only", "--dry-run", "--json"]
        base = best(args, env, opts.repeat, opts.timeout)
        for i, kind in enumerate(KINDS):
            make(kind, temp / f"kvrepro-{4100000 + i}-{i:06x}" / "owner.json")
        rows.append(("clean --temp-only --dry-run", base, best(args, env, opts.repeat, opts.timeout)))

        # suite list: one hostile file at a time in a copy of defects/, measured alternately with
        # the clean copy (the machine's load moves between runs; alternating keeps the pair fair)
        catalogue = work / "defects"
        shutil.copytree(ROOT / "defects", catalogue)
        args = ["suite", "list", "--json", "--catalogue", str(catalogue)]
        for kind in KINDS:
            clean_runs, hostile_runs = [], []
            for _ in range(opts.repeat):
                clean_runs.append(timed(args, dict(os.environ), opts.timeout))
                make(kind, catalogue / "x.yaml")
                hostile_runs.append(timed(args, dict(os.environ), opts.timeout))
                (catalogue / "x.yaml").unlink()
            rows.append((f"suite list ({kind})", _best(clean_runs), _best(hostile_runs)))

        # results list: run folders whose run.json is hostile
        results = work / "results"
        results.mkdir()
        args = ["results", "list", "--json", "--results", str(results)]
        env = dict(os.environ, KVREPRO_RESULTS_INDEX="0")
        base = best(args, env, opts.repeat, opts.timeout)
        for kind in KINDS:
            make(kind, results / f"20261202-000000-{kind}" / "run.json")
        rows.append(("results list", base, best(args, env, opts.repeat, opts.timeout)))
    finally:
        shutil.rmtree(work, ignore_errors=True)

    print(f"{'command':34} {'clean s':>8} {'hostile s':>9} {'+s':>6} {'clean MiB':>9} {'hostile MiB':>11} {'exit':>4}")
    for name, (b_s, b_mb, _), (h_s, h_mb, code) in rows:
        print(f"{name:34} {b_s:8.2f} {h_s:9.2f} {h_s - b_s:6.2f} {b_mb:9.0f} {h_mb:11.0f} {code:4d}")
    print(json.dumps({"goal": "at most +1 s and no memory growth", "rows": [
        {"command": n, "clean_s": round(b[0], 3), "hostile_s": round(h[0], 3), "clean_mib": round(b[1]),
         "hostile_mib": round(h[1]), "exit": h[2]} for n, b, h in rows]}))


if __name__ == "__main__":
    main()
