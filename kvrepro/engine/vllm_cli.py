"""Run vLLM's own command line (``vllm serve ...``) in this process.

The runtime env has no ``vllm`` console script (vLLM is not installed there: each build's
overlay is on ``PYTHONPATH``), so this does what that script does: call
``vllm.entrypoints.cli.main.main()`` with ``sys.argv`` set to ``["vllm", *argv]``.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable


def run(argv: list[str], on_settled: Callable[[], None] | None = None) -> int:
    """vLLM's CLI with ``argv``; its exit code. ``on_settled`` runs once the imports settle."""
    if on_settled is not None:
        threading.Thread(target=_call_when_settled, args=(on_settled,), daemon=True,
                         name="kvrepro-imports-settled").start()
    sys.argv = ["vllm", *argv]
    from vllm.entrypoints.cli.main import main

    try:
        main()
    except SystemExit as exc:
        if exc.code is None:
            return 0
        return exc.code if isinstance(exc.code, int) else 1
    except KeyboardInterrupt:
        return 130
    return 0


def _call_when_settled(callback: Callable[[], None], quiet_s: float = 3.0, limit_s: float = 120.0) -> None:
    """Call ``callback`` when no module was imported for ``quiet_s`` (the server is up by then)."""
    started = time.monotonic()
    count, since = len(sys.modules), time.monotonic()
    while time.monotonic() - started < limit_s:
        time.sleep(0.5)
        now = len(sys.modules)
        if now != count:
            count, since = now, time.monotonic()
        elif time.monotonic() - since >= quiet_s and "vllm.entrypoints.openai.api_server" in sys.modules:
            break
    try:
        callback()
    except Exception:
        pass
