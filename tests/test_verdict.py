"""From observations to verdicts: SURVIVED needs evidence that the bug's state occurred."""

import pytest

from kvrepro.classify.records import Classification, Exposure
from kvrepro.records import LoadSummary, Outcome, Verdict
from kvrepro.classify.verdict import MAX_FAILED_SHARE, decide, title

NONE = Classification(Outcome.NONE, "")


def load(stopped="budget", ok=100):
    return LoadSummary(requests_sent=ok, requests_ok=ok, requests_failed=0, seconds=1.0, stopped_because=stopped)


@pytest.mark.parametrize("classification,exposure,summary,exit_code,expected", [
    (Classification(Outcome.TARGET, "t"), Exposure(), load("engine_dead"), None, Verdict.CRASH),
    (Classification(Outcome.OTHER_CRASH, "t"), Exposure(), load("engine_dead"), None, Verdict.CRASH),
    (Classification(Outcome.INFRA, "t"), Exposure(), None, 1, Verdict.INFRA),
    (NONE, Exposure(trigger_calls=5, state_calls=2), load(), None, Verdict.SURVIVED),
    (NONE, Exposure(trigger_calls=5), load(), None, Verdict.UNREACHED),
    (NONE, Exposure(trigger_calls=0, external_hit_calls=9), load(), None, Verdict.VACUOUS),
    (NONE, Exposure(trigger_calls=5, state_calls=1), load("duration"), None, Verdict.SURVIVED),
    (NONE, Exposure(trigger_calls=5, state_calls=1, kv_violations=1), load(), None, Verdict.CORRUPT),
    (NONE, Exposure(kv_violations=3), load("stall"), None, Verdict.CORRUPT),  # ranks with CRASH
    (Classification(Outcome.TARGET, "t"), Exposure(kv_violations=3), load("engine_dead"), None, Verdict.CRASH),
    (NONE, Exposure(trigger_calls=5), load("stall"), None, Verdict.STALL),
    (NONE, Exposure(trigger_calls=5), load("interrupted"), None, Verdict.INTERRUPTED),
    (NONE, Exposure(trigger_calls=5), load("engine_dead"), -9, Verdict.CRASH),
    (NONE, Exposure(trigger_calls=5), load(ok=0), None, Verdict.INFRA),
])
def test_decide(classification, exposure, summary, exit_code, expected):
    assert decide(classification, exposure, summary, exit_code) is expected


def refused(failed: int, sent: int = 600) -> LoadSummary:
    return LoadSummary(requests_sent=sent, requests_ok=sent - failed, requests_failed=failed, seconds=1.0,
                       stopped_because="budget")


def test_a_run_whose_requests_were_mostly_refused_is_never_survived():
    """Measured: engine.max_model_len 100 made build A SURVIVED with 498 of 600 requests refused
    (HTTP 400, engine alive). Such a run did not test the engine: INFRA, and the title says why."""
    evidence = Exposure(trigger_calls=5, state_calls=3)
    assert decide(NONE, evidence, refused(498), None) is Verdict.INFRA
    assert title(Verdict.INFRA, evidence, refused(498)) == (
        "498 of 600 requests failed with the engine up (more than 5%): the load did not test the engine; "
        "see load.jsonl")
    # the documented share is tolerated, one more is not
    allowed = int(MAX_FAILED_SHARE * 600)
    assert decide(NONE, evidence, refused(allowed), None) is Verdict.SURVIVED
    assert decide(NONE, evidence, refused(allowed + 1), None) is Verdict.INFRA


def test_a_probe_hash_other_than_the_builds_is_infra():
    """The probe hashes the method it wrapped; the build manifest says what that must be."""
    built = "a" * 64
    ran = Exposure(trigger_calls=5, state_calls=1, probe_source_sha256="b" * 64, probe_seen=True)
    assert decide(NONE, ran, load(), None, expected_probe_sha256=built) is Verdict.INFRA
    assert decide(Classification(Outcome.TARGET, "t"), ran, load("engine_dead"), None, built) is Verdict.INFRA
    assert title(Verdict.INFRA, ran, load(), built) == (
        "wrong code ran: the probe hashed update_state_after_alloc as bbbbbbbbbbbb, the build holds aaaaaaaaaaaa")
    same = Exposure(trigger_calls=5, state_calls=1, probe_source_sha256=built, probe_seen=True)
    assert decide(NONE, same, load(), None, expected_probe_sha256=built) is Verdict.SURVIVED
    # unknown expectation (docker images, old manifests): nothing to compare
    assert decide(NONE, ran, load(), None, expected_probe_sha256=None) is Verdict.SURVIVED


def test_corrupt_title_names_the_first_violation():
    seen = Exposure(kv_violations=2, kv_first_violation="step=7 request r group 0 ...", shadow_seen=True)
    assert title(Verdict.CORRUPT, seen, load()) == "silent KV corruption: step=7 request r group 0 ..."
    assert seen.kv_check == "corrupt"
    assert Exposure(kv_checks=10, shadow_seen=True).kv_check == "ok"
    assert Exposure().kv_check == "off"


@pytest.mark.parametrize("exposure, verdict", [
    (Exposure(trigger_calls=5, state_calls=2), Verdict.SURVIVED),
    (Exposure(trigger_calls=5), Verdict.UNREACHED),
    (Exposure(trigger_calls=0), Verdict.VACUOUS),
])
def test_a_clean_verdict_says_first_what_broke_at_rest(exposure, verdict):
    """A run that neither crashed nor read wrong KV but left a leaked block or a stranded request
    at rest (the probe's invariants, issue 48) says so first in its title: the verdict stays what the
    crash and the KV say, and the table's words no longer hide the leak."""
    clean = title(verdict, exposure, load())
    import dataclasses

    broken = dataclasses.replace(exposure, invariants_broken={"block-leak": 2, "request-stranded": 1},
                                 first_broken="block-leak: 2 of 7 blocks still referenced with no request in the engine")
    said = title(verdict, broken, load())
    assert said.startswith("engine invariants broken at rest: block-leak at 2 quiescent point(s), "
                           "request-stranded at 1 quiescent point(s) (first: block-leak: 2 of 7 blocks")
    assert clean is None if verdict is Verdict.SURVIVED else said.endswith(clean)
