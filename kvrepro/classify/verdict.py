"""From what was observed in one run to what it proves.

The rules that matter:

* a run that finishes its budget only counts as SURVIVED when the bug's own state occurred (the
  probe's ``state_calls``: a group holding a real, unhashed block below the local boundary in a
  call with both a local prefix hit and an offload hit) and the code handled it. When the trigger
  path ran but the state never did, the run is UNREACHED (on that code and load the crash's
  precondition may be unreachable: a different claim from "fixed"); when the trigger path never
  ran it is VACUOUS;
* a run in which more than ``MAX_FAILED_SHARE`` of the requests failed while the engine stayed up
  (refused prompts, HTTP errors) did not test the engine under the intended load: INFRA, even if
  the shadow KV flagged a read in the requests that did run (the build was not judged on its load);
* otherwise a run in which the shadow KV caught a forward reading wrong KV is CORRUPT (a few
  failed requests do not change that): silent corruption ranks with a crash;
* a probe that logs another source hash than the build holds means other code ran: INFRA;
* a request that an injected offload fault ended on purpose (a failed load under vLLM's
  ``kv_load_failure_policy: fail``; the engine log's ``kvrepro-fault:`` lines) is the fault's
  expected consequence, not a failed request: it does not count towards ``MAX_FAILED_SHARE``.
"""

from __future__ import annotations

from collections.abc import Mapping

from .corruption import UNKNOWN, title_of
from .records import Classification, Exposure
from ..records import LoadSummary, Outcome, Verdict

# share of requests that may fail, with the engine alive, in a run that still counts
MAX_FAILED_SHARE = 0.05


def wrong_code(exposure: Exposure, expected_probe_sha256: str | None) -> bool:
    """The probe logged a hash of the wrapped method that differs from the build's."""
    return bool(expected_probe_sha256 and exposure.probe_source_sha256
                and exposure.probe_source_sha256 != expected_probe_sha256)


def too_many_failed(load: LoadSummary, failed_on_purpose: int = 0) -> bool:
    """More than MAX_FAILED_SHARE of the requests failed, not counting those an injected fault
    ended on purpose (they failed as the fault said they would)."""
    unexpected = max(0, load.requests_failed - failed_on_purpose)
    return unexpected > MAX_FAILED_SHARE * max(1, load.requests_sent - failed_on_purpose)


def load_untested(load: LoadSummary, failed_on_purpose: int = 0) -> bool:
    """No request succeeded, or more than MAX_FAILED_SHARE failed with the engine up."""
    return load.requests_ok == 0 or too_many_failed(load, failed_on_purpose)


def decide(classification: Classification, exposure: Exposure, load: LoadSummary | None,
           engine_exit: int | None, expected_probe_sha256: str | None = None,
           other_engine: str | None = None) -> Verdict:
    """The run's verdict: the one rule (kvrepro.classify.judge asks it for every run).

    ``engine_exit`` is the engine's exit code when it exited before we stopped it, else None;
    ``expected_probe_sha256`` what the build's manifest says the probe must log (None: unknown);
    ``other_engine`` why the engine that ran is not the one the matrix describes (its geometry):
    INFRA, unless the run was interrupted.
    """
    verdict = _observed(classification, exposure, load, engine_exit, expected_probe_sha256)
    return Verdict.INFRA if other_engine and verdict is not Verdict.INTERRUPTED else verdict


def _observed(classification: Classification, exposure: Exposure, load: LoadSummary | None,
              engine_exit: int | None, expected_probe_sha256: str | None) -> Verdict:
    if wrong_code(exposure, expected_probe_sha256):
        return Verdict.INFRA
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
    if load.stopped_because != "stall" and load_untested(load, exposure.injected_failed_requests):
        # the load did not test the engine (e.g. max_model_len refused the prompts): whatever the
        # shadow KV saw in the few requests that ran is not the verdict of this build. A stall is
        # the engine's own doing and is judged below; so is a corruption with a few failures.
        return Verdict.INFRA
    if exposure.kv_violations:
        return Verdict.CORRUPT
    if load.stopped_because == "stall":
        return Verdict.STALL
    if load.requests_ok == 0:
        return Verdict.INFRA
    if exposure.state_calls > 0:
        return Verdict.SURVIVED
    return Verdict.UNREACHED if exposure.trigger_calls > 0 else Verdict.VACUOUS


def corruption_title(defects: Mapping[str, int], first_violation: str | None = None) -> str:
    """A CORRUPT run's title: the defects it showed, by name, in words (stable across runs of the
    same defects, so that a build's repetitions group under one title); a run whose violations no
    signature knows quotes its first violation."""
    if not defects or set(defects) == {UNKNOWN}:
        return f"silent KV corruption: {first_violation or 'see kvrepro-shadow lines in engine.log'}"
    names = sorted(defects, key=lambda name: (name == UNKNOWN, name))
    return "silent KV corruption: " + "; ".join(f"{title_of(name)} [{name}]" for name in names)


def title(verdict: Verdict, exposure: Exposure, load: LoadSummary | None,
          expected_probe_sha256: str | None = None, defects: Mapping[str, int] | None = None) -> str | None:
    """The words for a verdict that no traceback names (None: keep the classifier's title)."""
    if verdict is Verdict.INFRA and wrong_code(exposure, expected_probe_sha256):
        return (f"wrong code ran: the probe hashed update_state_after_alloc as "
                f"{exposure.probe_source_sha256[:12]}, the build holds {expected_probe_sha256[:12]}")
    if verdict is Verdict.CORRUPT:
        return corruption_title(defects or {}, exposure.kv_first_violation)
    if verdict is Verdict.INFRA and load is not None and load.requests_ok and too_many_failed(load, exposure.injected_failed_requests):
        also = (f"; the shadow KV also flagged {exposure.kv_violations} read(s), not judged on this load"
                if exposure.kv_violations else "")
        return (f"{load.requests_failed} of {load.requests_sent} requests failed with the engine up (more than "
                f"{MAX_FAILED_SHARE:.0%}): the load did not test the engine; see load.jsonl{also}")
    broken = invariants_note(exposure)
    if verdict is Verdict.UNREACHED:
        return broken + ("trigger path ran but the bug's state never occurred: on this code the crash's precondition "
                         "did not arise (a fix at the crash site was not exercised)")
    if verdict is Verdict.VACUOUS:
        return broken + "budget spent but the trigger path never ran: proves nothing"
    if verdict is Verdict.SURVIVED and broken:
        return broken + "the target crash's state was handled"
    return None


def invariants_note(exposure: Exposure) -> str:
    """What a run that neither crashed nor read wrong KV still broke at rest (the probe's invariants,
    kvrepro/classify/invariants.py): said first in its title, so a clean-looking verdict does not
    hide a leak or a stranded request ("" when none broke)."""
    broken = getattr(exposure, "invariants_broken", None) or {}
    if not broken:
        return ""
    names = ", ".join(f"{name} at {n} quiescent point(s)" for name, n in sorted(broken.items()))
    first = f" (first: {exposure.first_broken[:160]})" if getattr(exposure, "first_broken", None) else ""
    return f"engine invariants broken at rest: {names}{first}; "


def died_without_traceback_title(engine_exit: int | None) -> str:
    if engine_exit is None:
        return "engine stopped answering without a fatal traceback in its log"
    if engine_exit < 0:
        return f"engine killed by signal {-engine_exit} without a fatal traceback"
    return f"engine exited with code {engine_exit} without a fatal traceback"
