"""Cut a catalogue entry's test log from the engine.log of the run that measured it.

    python scripts/suite_log_excerpt.py results/suite-.../runs/<run>/<entry>@0.26.0/0/engine.log \
        defects/<entry>.yaml > tests/data/logs/suite-<entry>.log

Keeps what shows the entry's signature: for a crash, the probe's lines and the EngineCore's fatal
traceback; for a corruption, the shadow KV's `installed` line, the violations of the defect's
classes and the last counts line; for a stall, the injected faults (if any, with the connector's `installed` line) and the scheduler's
last status lines. Machine paths under the home folder become `~`.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kvrepro.classify.corruption import match_class  # noqa: E402
from kvrepro.suite.catalogue import load_entry  # noqa: E402


def excerpt(log: str, kind: str, signature: str) -> list[str]:
    lines = log.splitlines()
    if kind == "crash":
        keep = [line for line in lines if "kvrepro-probe: installed" in line][:1]
        start = next((i for i, line in enumerate(lines) if "EngineCore" in line and "Traceback" in line), None)
        if start is None:
            raise SystemExit("no EngineCore traceback in this log")
        before = [line for line in lines[:start] if "kvrepro-probe: counts" in line and "EngineCore" in line]
        keep += before[-1:]
        end = next((i for i in range(start + 1, len(lines))
                    if re.search(r"\] (\w+\.)*\w*(Error|Exception)\b", lines[i])), len(lines) - 1)
        keep += [line for line in lines[max(0, start - 1):end + 1] if "kvrepro-" not in line]
        return keep
    if kind == "corruption":
        keep = [line for line in lines if "kvrepro-shadow: installed" in line][:1]
        groups = re.findall(r"\d+:(\w+)/", keep[0]) if keep else []
        for line in lines:
            m = re.search(r"kvrepro-shadow: violation step=\d+ class=(\S+)", line)
            if m:
                found = match_class(m.group(1), groups)
                if found is not None and found.name == signature:
                    keep.append(line)
        counts = [line for line in lines if "kvrepro-shadow: counts" in line]
        return keep + counts[-1:]
    status = [line for line in lines if "Running:" in line and "Waiting:" in line]
    # injected offload faults (engine.sim.offload_faults): the failed loads and the last totals, the
    # stall's path for an entry that counts them
    # (and the `installed` line: which connector reported them, and what it does with one)
    installed = [line for line in lines if "kvrepro-fault: installed" in line][:1]
    faults = [line for line in lines if "kvrepro-fault:" in line and "failed on purpose" in line][:3]
    totals = [line for line in lines if "kvrepro-fault: counts" in line][-1:]
    return installed + faults + totals + status[-6:]


def main() -> None:
    log_path, entry_path = Path(sys.argv[1]), Path(sys.argv[2])
    entry = load_entry(entry_path)
    home = str(Path.home())
    for line in excerpt(log_path.read_text(errors="replace"), entry.kind, entry.signature):
        print(line.replace(home, "~"))


if __name__ == "__main__":
    main()
