"""Random stop signals to kvrepro's long commands: each must end with exit 130, no traceback, and
nothing of its session left running (docs/signals-and-cleanup.md). `load replay` and `minimize`
work on a run of build A that the script records first.

The tests send signals at a few chosen moments; this sends them at random ones, which is how the two
lost-stop bugs of 2026-12-04 were found (a handler run inside importlib's weakref callback, and one
inside pydantic-core's validator building). A run takes a few seconds a signal.

    python scripts/signal_stress.py                       # 20 signals over every command, seed 1
    python scripts/signal_stress.py --seed 7 --count 40 --commands matrix,suite --max-delay 1.2

Exit 0 when every signal was handled by the rule, 1 otherwise (each bad case printed with its stderr).
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TRIAGE_LOG = ROOT / "tests" / "data" / "triage" / "seed-0.26-dp4-offload-mtp.log"
SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def recorded_run(results: str) -> tuple[str, str]:
    """A run of build A (it crashes) to replay and minimize: (its run id, its trace)."""
    subprocess.run([sys.executable, "-m", "kvrepro.cli", "matrix", "run", "--reps", "1", "--build", "A",
                    "--results", results], cwd=ROOT, capture_output=True, check=True)
    (trace,) = Path(results).glob("*/A/0/trace.jsonl")
    return trace.parents[2].name, str(trace)


def commands(results: str, run_id: str, trace: str) -> dict[str, list[str]]:
    kvrepro = [sys.executable, "-m", "kvrepro.cli"]
    return {
        "replay": [*kvrepro, "load", "replay", trace, "--build", "A", "--results", results],
        "minimize": [*kvrepro, "minimize", run_id, "--build", "A", "--fixed", "E", "--results", results],
        "matrix": [*kvrepro, "matrix", "run", "--reps", "1", "--build", "A", "--build", "E", "--results", results],
        "suite": [*kvrepro, "suite", "run", "--base", "0.26.0", "--entry", "offload-boundary-assert", "--reps", "1",
                  "--results", results],
        "explore": [*kvrepro, "explore", "--base", "0.26.0", "--budget", "4", "--results", results],
        "triage": [*kvrepro, "triage", str(TRIAGE_LOG), "--run", "--results", results],
        "bisect": [*kvrepro, "bisect", "patches", "--results", results],
    }


def session_left(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def one(argv: list[str], sig: signal.Signals, delay: float) -> tuple[int, str, bool]:
    """Start ``argv`` in its own session, send ``sig`` after ``delay``: (exit code, stderr, whether
    any process of its session is left). Its session is killed whatever happens here."""
    proc = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        time.sleep(delay)
        proc.send_signal(sig)
        try:
            _, err = proc.communicate(timeout=180)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            _, err = proc.communicate()
            err += "\n(no exit within 180 s of the signal)"
        time.sleep(1.0)  # what it stopped has a moment to go (the rule's bound is seconds)
        return proc.returncode, err, session_left(proc.pid)
    finally:  # this script stopped (Ctrl-C, SIGTERM) or a command left something: nothing stays
        if session_left(proc.pid):
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--count", type=int, default=20)
    parser.add_argument("--commands", default="matrix,suite,explore,triage,bisect,replay,minimize")
    parser.add_argument("--min-delay", type=float, default=0.05)
    parser.add_argument("--max-delay", type=float, default=6.0)
    args = parser.parse_args()
    names = args.commands.split(",")
    unknown = sorted(set(names) - set(commands("", "", "")))
    if unknown:
        parser.error(f"--commands: unknown {', '.join(unknown)}; known: {', '.join(commands('', '', ''))}")
    for sig in (signal.SIGTERM, signal.SIGHUP):  # stopped like Ctrl-C: the command under test is killed
        signal.signal(sig, signal.default_int_handler)
    rng = random.Random(args.seed)
    bad = 0
    with tempfile.TemporaryDirectory(prefix="kvrepro-signal-stress-") as results:
        needs_run = {"replay", "minimize"} & set(names)
        table = commands(results, *(recorded_run(results) if needs_run else ("", "")))
        for i in range(args.count):
            name, sig = rng.choice(names), rng.choice(SIGNALS)
            delay = rng.uniform(args.min_delay, args.max_delay)
            code, err, left = one(table[name], sig, delay)
            ok = code == 130 and "Traceback" not in err and "Exception ignored" not in err and not left
            last = err.strip().splitlines()[-1][:80] if err.strip() else ""
            print(f"{i:3d} {name:8s} {sig.name:7s} at {delay:4.2f} s: exit {code}, "
                  f"{'processes left' if left else 'nothing left'}  {'ok' if ok else 'BAD'}  {last}", flush=True)
            if not ok:
                bad += 1
                print("    " + err[-1500:].replace("\n", "\n    "), flush=True)
    print(f"{args.count - bad} of {args.count} signals handled by the rule (seed {args.seed})")
    return 1 if bad else 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:  # the command under test is killed already (one())
        print("interrupted", file=sys.stderr)
        sys.exit(130)
