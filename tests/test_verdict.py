"""From observations to verdicts: SURVIVED needs evidence that the trigger path ran."""

import pytest

from kvrepro.records import Classification, Exposure, LoadSummary, Outcome, Verdict
from kvrepro.verdict import decide

NONE = Classification(Outcome.NONE, "")


def load(stopped="budget", ok=100):
    return LoadSummary(requests_sent=ok, requests_ok=ok, requests_failed=0, seconds=1.0, stopped_because=stopped)


@pytest.mark.parametrize("classification,exposure,summary,exit_code,expected", [
    (Classification(Outcome.TARGET, "t"), Exposure(), load("engine_dead"), None, Verdict.CRASH),
    (Classification(Outcome.OTHER_CRASH, "t"), Exposure(), load("engine_dead"), None, Verdict.CRASH),
    (Classification(Outcome.INFRA, "t"), Exposure(), None, 1, Verdict.INFRA),
    (NONE, Exposure(trigger_calls=5), load(), None, Verdict.SURVIVED),
    (NONE, Exposure(trigger_calls=0, external_hit_calls=9), load(), None, Verdict.VACUOUS),
    (NONE, Exposure(trigger_calls=5), load("duration"), None, Verdict.SURVIVED),
    (NONE, Exposure(trigger_calls=5), load("stall"), None, Verdict.STALL),
    (NONE, Exposure(trigger_calls=5), load("interrupted"), None, Verdict.INTERRUPTED),
    (NONE, Exposure(trigger_calls=5), load("engine_dead"), -9, Verdict.CRASH),
    (NONE, Exposure(trigger_calls=5), load(ok=0), None, Verdict.INFRA),
])
def test_decide(classification, exposure, summary, exit_code, expected):
    assert decide(classification, exposure, summary, exit_code) is expected
