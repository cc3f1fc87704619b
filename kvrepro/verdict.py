"""From what was observed in one run to what it proves.

The rule that matters: a run that finishes its budget only counts as SURVIVED when the probe saw
the trigger path run (a request with both a local prefix hit and an offload hit). A clean run
that never exercised the path is VACUOUS: it proves nothing about the fix.
"""

from __future__ import annotations

from .records import Classification, Exposure, LoadSummary, Outcome, Verdict


def decide(classification: Classification, exposure: Exposure, load: LoadSummary | None,
           engine_exit: int | None) -> Verdict:
    """The run's verdict.

    ``engine_exit`` is the engine's exit code when it exited before we stopped it, else None.
    """
    if classification.outcome in (Outcome.TARGET, Outcome.OTHER_CRASH):
        return Verdict.CRASH
    if classification.outcome is Outcome.INFRA:
        return Verdict.INFRA
    if load is None:
        return Verdict.INFRA
    if load.stopped_because == "interrupted":
        return Verdict.INTERRUPTED
    if load.stopped_because == "engine_dead" or engine_exit is not None:
        # died without a fatal traceback in its log (killed, OOM, segfault): still a crash
        return Verdict.CRASH
    if load.stopped_because == "stall":
        return Verdict.STALL
    if load.requests_ok == 0:
        return Verdict.INFRA
    return Verdict.SURVIVED if exposure.trigger_calls > 0 else Verdict.VACUOUS


def died_without_traceback_title(engine_exit: int | None) -> str:
    if engine_exit is None:
        return "engine stopped answering without a fatal traceback in its log"
    if engine_exit < 0:
        return f"engine killed by signal {-engine_exit} without a fatal traceback"
    return f"engine exited with code {engine_exit} without a fatal traceback"
