"""How often one matrix run opens and reads each repetition's engine.log, and how many bytes it
reads against the log's size (issue 49: "the engine log is read once per run").

Runs `kvrepro matrix run` in this process with every ``open`` of a file named ``engine.log``
for reading counted (``builtins.open`` and ``io.open``, which ``Path.read_text`` goes through),
and the bytes each read returned; the engines run in their own processes (they write the log,
never read it here). Works on any kvrepro tree: run it with that tree's interpreter::

    .venv/bin/python benchmarks/log_reads.py --reps 1 -b A -b E --results /tmp/reads

It prints one line per repetition (opens, bytes read, log size, ratio) and, with ``--json``,
the same as data. The kvrepro command's own output goes to stderr.
"""

from __future__ import annotations

import builtins
import contextlib
import io
import json
import sys
import threading
from collections import defaultdict
from pathlib import Path

_lock = threading.Lock()
opens: dict[str, int] = defaultdict(int)
bytes_read: dict[str, int] = defaultdict(int)
_real_open = builtins.open


class _Counted:
    """A file object whose reads are counted (everything else passes through)."""

    def __init__(self, fh, key: str):
        self._fh, self._key = fh, key

    def read(self, *args):
        data = self._fh.read(*args)
        with _lock:
            bytes_read[self._key] += len(data.encode() if isinstance(data, str) else data)
        return data

    def __iter__(self):
        for line in self._fh:
            with _lock:
                bytes_read[self._key] += len(line.encode() if isinstance(line, str) else line)
            yield line

    def __enter__(self):
        self._fh.__enter__()
        return self

    def __exit__(self, *exc):
        return self._fh.__exit__(*exc)

    def __getattr__(self, name):
        return getattr(self._fh, name)


def _open(file, mode="r", *args, **kwargs):
    fh = _real_open(file, mode, *args, **kwargs)
    name = str(file) if isinstance(file, (str, Path)) else ""
    if name.endswith("engine.log") and not any(c in mode for c in "wax+"):
        key = str(Path(name).resolve())
        with _lock:
            opens[key] += 1
        return _Counted(fh, key)
    return fh


def main() -> int:
    as_json = "--json" in sys.argv
    argv = [a for a in sys.argv[1:] if a != "--json"]
    builtins.open = _open
    io.open = _open
    from kvrepro.cli import main as kvrepro_main

    sys.argv = ["kvrepro", "matrix", "run", *argv]
    with contextlib.redirect_stdout(sys.stderr):
        try:
            kvrepro_main()
        except SystemExit:
            pass
    rows = []
    for key in sorted(opens):
        size = Path(key).stat().st_size if Path(key).exists() else 0
        run = "/".join(Path(key).parts[-3:-1])
        rows.append({"run": run, "opens": opens[key], "bytes_read": bytes_read[key], "log_bytes": size,
                     "read_ratio": round(bytes_read[key] / size, 2) if size else None})
    if as_json:
        print(json.dumps(rows, indent=2))
    else:
        for r in rows:
            print(f"{r['run']}: {r['opens']} opens, {r['bytes_read']} bytes read of {r['log_bytes']} "
                  f"({r['read_ratio']}x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
