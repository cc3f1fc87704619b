"""Memory of `classify` and `triage` on logs with huge lines (issue 44): flat, whatever the input.

Side by side in one run, each the whole command (``python -m kvrepro.cli ...``, start-up included,
peak RSS from ``wait4``, which counts the command's reaped children too: the greps triage feeds):

* the seed log (tests/data/triage/seed-0.26-dp4-offload-mtp.log) as it is: the baseline;
* the seed log with one line of ``--line-mib`` MiB (default 256) before its traceback, gzipped (a
  bomb: 256 MiB in ~260 KB); the issue's case was 3 GB in 13 MB (``--line-mib 3072``);
* the same, as a plain file (the plain path fed GNU grep the file directly before: grep holds a
  line whole, twice over).

Before (main 91cd488, 2026-12-04, the issue's numbers): `classify` of the 3 GB line reached
17.6 GB RSS in 60 s, `triage` 4.8 GB. Goal: peak RSS within 1.5x of the baseline's, whatever
the line's length (every line is cut to kvrepro.untrusted.LINE_LIMIT, 1 MiB).

``--compare DIR`` also runs each command from another checkout (``PYTHONPATH=DIR``, e.g. the
main branch before this change) on the same files, side by side.

    python benchmarks/hostile_logs.py [--line-mib 256] [--timeout 600] [--compare /work/main]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import zlib
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from hostile_files import ROOT, timed  # noqa: E402  (one way of measuring a whole command)

SEED = ROOT / "tests" / "data" / "triage" / "seed-0.26-dp4-offload-mtp.log"
GOAL_RATIO = 1.5


def write_bomb(path: Path, mib: int, packed: bool) -> None:
    """The seed log with one ``mib`` MiB line after its 18th line (before the traceback)."""
    lines = SEED.read_bytes().split(b"\n")
    head = b"\n".join(lines[:18]) + b"\n(APIServer pid=1) ERROR "
    tail = b"\n" + b"\n".join(lines[18:])
    block = b"A" * (1 << 20)
    packer = zlib.compressobj(6, zlib.DEFLATED, 31) if packed else None
    with open(path, "wb") as fh:
        for part in (head, *(block for _ in range(mib)), tail):
            fh.write(packer.compress(part) if packer else part)
        if packer:
            fh.write(packer.flush())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--line-mib", type=int, default=256)
    parser.add_argument("--timeout", type=float, default=600.0)
    parser.add_argument("--compare", type=Path, help="another kvrepro checkout to run side by side (before)")
    opts = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="kvrepro-bench-hostile-logs-"))
    rows = []
    try:
        gz, plain = work / "bomb.log.gz", work / "bomb.log"
        write_bomb(gz, opts.line_mib, packed=True)
        write_bomb(plain, opts.line_mib, packed=False)
        checkouts = [("this", ROOT)] + ([(opts.compare.name, opts.compare.resolve())] if opts.compare else [])
        env = dict(os.environ)
        for label, checkout in checkouts:
            for command in ("classify", "triage"):
                base = timed([command, str(SEED)], env, opts.timeout, checkout)
                for name, path in ((f"{opts.line_mib} MiB line, gzip ({gz.stat().st_size / 1e6:.1f} MB)", gz),
                                   (f"{opts.line_mib} MiB line, plain", plain)):
                    rows.append((f"{command} ({label})", name, base,
                                 timed([command, str(path)], env, opts.timeout, checkout)))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"{'command':22} {'log':32} {'seed s':>7} {'seed MiB':>8} {'bomb s':>7} {'bomb MiB':>8} {'ratio':>6} "
          f"{'exit':>4}")
    for command, name, (b_s, b_mb, _), (h_s, h_mb, code) in rows:
        print(f"{command:22} {name:32} {b_s:7.1f} {b_mb:8.0f} {h_s:7.1f} {h_mb:8.0f} {h_mb / b_mb:6.2f} {code:4d}")
    print(json.dumps({"goal": f"peak RSS at most {GOAL_RATIO}x the seed log's", "load": os.getloadavg(), "rows": [
        {"command": c, "log": n, "seed_s": round(b[0], 2), "seed_mib": round(b[1]), "bomb_s": round(h[0], 2),
         "bomb_mib": round(h[1]), "ratio": round(h[1] / b[1], 2), "exit": h[2]} for c, n, b, h in rows]}))


if __name__ == "__main__":
    main()
