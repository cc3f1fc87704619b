"""Disks: read-only and full file systems (real tmpfs mounts in a private mount namespace) are one line and
a documented exit code; a full disk mid-run is `failed`, never exit 0 (issue 8's faults, injected for
real: tests/reliability.py says how).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from conftest import ROOT, require
from reliability import kvrepro, one_clear_line, small_matrix


def in_namespace(script: str, timeout: float = 900) -> subprocess.CompletedProcess:
    """Run a shell script in a private mount namespace (its mounts vanish with it)."""
    require(shutil.which("unshare") is not None and os.geteuid() == 0,
            "needs root and unshare(1) for private tmpfs mounts")
    return subprocess.run(["unshare", "-m", "sh", "-ec", script], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)


def test_read_only_results_folder():
    proc = in_namespace("""
        mkdir -p /tmp/kvrepro-ro && mount -t tmpfs -o size=1m,ro tmpfs /tmp/kvrepro-ro
        exec "$0" -m kvrepro.cli matrix run --results /tmp/kvrepro-ro/results
    """.replace('"$0"', sys.executable))
    one_clear_line(proc, 3, "Read-only file system", "writable folder")


def test_full_results_folder():
    proc = in_namespace("""
        mkdir -p /tmp/kvrepro-full && mount -t tmpfs -o size=64k tmpfs /tmp/kvrepro-full
        dd if=/dev/zero of=/tmp/kvrepro-full/filler bs=4k 2>/dev/null || true
        PY -m kvrepro.cli matrix run --results /tmp/kvrepro-full/results && exit 99 || code=$?
        ls -A /tmp/kvrepro-full/results
        exit $code
    """.replace("PY", sys.executable))
    one_clear_line(proc, 3, "No space left on device", "free some space")
    assert proc.stdout.strip() == ""  # no half-made run folder left behind


def test_read_only_cache_with_a_stack_not_built_yet(tmp_path, runtime_python):
    """$KVREPRO_HOME read-only (a read-only bind mount of the real cache): a build whose overlay
    does not exist yet is INFRA naming the cache and what to do; exit 3."""
    from kvrepro import paths

    matrix = small_matrix(tmp_path, builds={"N": ["pr-52771"]}, common=[], expect={})
    home = paths.home()
    proc = in_namespace(f"""
        mount --bind {home} {home} && mount -o remount,bind,ro {home}
        exec {sys.executable} -m kvrepro.cli matrix run -m {matrix} --reps 1 --results {tmp_path}/r
    """)
    one_clear_line(proc, 3, "cannot write the build cache", "Read-only file system")


def test_results_pointing_at_a_file(tmp_path):
    (tmp_path / "afile").write_text("x")
    one_clear_line(kvrepro("matrix", "run", "--results", str(tmp_path / "afile")), 2, "is a file, not a folder")
    one_clear_line(kvrepro("results", "show", "--results", str(tmp_path / "afile")), 2, "is a file")
    one_clear_line(kvrepro("results", "list", "--results", str(tmp_path / "afile")), 2, "is a file")


def test_junit_to_a_folder_or_a_read_only_place(tmp_path):
    """--junit DIR: bad input (2) naming the folder; --junit on a read-only mount: 3, one line
    naming the path meant (no temporary name); both before anything runs."""
    (tmp_path / "out").mkdir()
    flat = one_clear_line(kvrepro("matrix", "run", "--junit", str(tmp_path / "out"), "--results", str(tmp_path / "r")),
                          2, f"--junit {tmp_path / 'out'}: is a folder")
    assert not (tmp_path / "r").exists()
    one_clear_line(kvrepro("report", "--junit", str(tmp_path / "out"), "--results", str(tmp_path / "r")), 2,
                   "is a folder")
    proc = in_namespace(f"""
        mkdir -p /tmp/kvrepro-ro-junit && mount -t tmpfs -o size=1m,ro tmpfs /tmp/kvrepro-ro-junit
        exec {sys.executable} -m kvrepro.cli matrix run --junit /tmp/kvrepro-ro-junit/junit.xml --results {tmp_path}/r
    """)
    flat = one_clear_line(proc, 3, "--junit /tmp/kvrepro-ro-junit/junit.xml: cannot write it", "Read-only file system")
    assert ".junit.xml." not in flat and "tmp" not in flat.replace("/tmp/kvrepro-ro-junit", "")
    assert not (tmp_path / "r").exists()


def _inode_budget_script(results: str, inodes: int, matrix: Path) -> str:
    return f"""
        mkdir -p {results} && mount -t tmpfs -o size=64m,nr_inodes={inodes} tmpfs {results}
        {sys.executable} -m kvrepro.cli matrix run -m {matrix} --results {results}/r --ci && code=0 || code=$?
        echo "STATUS $(grep -o '"status": "[a-z]*"' {results}/r/*/run.json)"
        echo "FILES $(find {results}/r | wc -l)"
        exit $code
    """


@pytest.mark.slow
def test_disk_full_is_failed_not_interrupted_and_never_exit_0(tmp_path, overlays):
    """A real tmpfs with a fixed number of inodes: first measured (how many files a whole run
    makes), then one short of the report (the run completes, report.md cannot be made: exit 3,
    never 0), then far too few (the run dies mid-way: run.json says failed with the reason, not
    interrupted; exit 3)."""
    matrix = small_matrix(tmp_path, builds={"A": []}, expect={"A": "CRASH(target)"})
    data = yaml.safe_load(matrix.read_text())
    data["engine"]["extra_args"] = []
    data["runs"].update(repetitions=1, requests=30)
    matrix.write_text(yaml.safe_dump(data, sort_keys=False))
    roomy = in_namespace(_inode_budget_script("/tmp/kvrepro-inodes", 1000, matrix))
    assert roomy.returncode == 0 and "Traceback" not in roomy.stderr, roomy.stderr[-3000:]
    made = int(roomy.stdout.split("FILES ")[1].split()[0])
    # the tmpfs' own root takes one inode: `made` leaves room for every file of the roomy run but its
    # last, report.html (one repetition: the report is report.md and report.html, no survival.png)
    tight = in_namespace(_inode_budget_script("/tmp/kvrepro-inodes", made, matrix))
    flat = one_clear_line(tight, 3, "report not written", "No space left on device")
    assert '"status": "complete"' in tight.stdout  # the verdicts are recorded; only the report is missing
    full = in_namespace(_inode_budget_script("/tmp/kvrepro-inodes", 8, matrix))
    assert "Traceback" not in full.stderr and full.returncode == 3, full.stderr[-3000:]
    assert "No space left on device" in full.stderr
    assert '"status": "interrupted"' not in full.stdout, full.stdout
    del flat
