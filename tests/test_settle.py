"""The sequential stopping rule (kvrepro/classify/settle.py, docs/statistics.md): its bound, that a
build whose first state crashes can never pass it, and how it reaches a run's load.

The rule is driven by real recorded engine logs (tests/data/logs/) written line by line into a
file that a :class:`LogFollower` reads as the load generator does while an engine runs; the load
itself goes to the stand-in engine of tests/test_loadgen.py (a real HTTP server)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from kvrepro.classify.settle import CONFIDENCE, EVENTS, RATE_BOUND, LogFollower, count, events_needed, settled, upper_bound
from kvrepro.loadgen import run_load
from kvrepro.matrix.runner import MatrixOptions, stop_rule_for
from kvrepro.classify.records import Exposure, StopRule

from test_loadgen import LOAD, StandInEngine, runs

LOGS = Path(__file__).parent / "data" / "logs"


# --------------------------------------------------------------------------- the bound


def test_events_needed_is_the_smallest_count_whose_bound_is_below_the_rate():
    assert events_needed() == EVENTS == 29
    assert upper_bound(EVENTS) < RATE_BOUND <= upper_bound(EVENTS - 1)
    assert StopRule().events == EVENTS  # records.py's default is the derived number, not another one
    # the error bound: a build whose rate per event is RATE_BOUND passes the rule's EVENTS trials
    # without the failure at most 1 - CONFIDENCE of the time; a higher rate even less often
    for rate in (RATE_BOUND, 0.2, 0.5, 1.0):
        assert (1 - rate) ** EVENTS <= 1 - CONFIDENCE
    assert events_needed(0.05) == 59 and upper_bound(59) < 0.05
    assert upper_bound(0) == 1.0


def test_counter_names_are_runresult_names():
    e = Exposure(trigger_calls=7, state_calls=3, kv_hit_reads={"mamba": 5}, loads_behind_deferred=2)
    assert (count(e, "trigger_count"), count(e, "state_count"), count(e, "kv_hit_reads.mamba"),
            count(e, "kv_hit_reads.full_attention"), count(e, "loads_behind_deferred")) == (7, 3, 5, 0, 2)


# --------------------------------------------------------------------------- what settles a run


def test_state_survived_and_no_violation_settles_as_clean():
    rule = StopRule()
    assert settled(Exposure(trigger_calls=80, state_calls=28, shadow_seen=True, kv_checks=500), rule) is None
    words = settled(Exposure(trigger_calls=80, state_calls=29, shadow_seen=True, kv_checks=500), rule)
    assert words is not None
    assert "state_count 29 with the engine alive: crash rate per event < 9.8% (95%)" in words
    assert "no KV violation in 29 state_count" in words


def test_trigger_path_without_the_state_settles_as_unreached():
    rule = StopRule()
    assert settled(Exposure(trigger_calls=28, shadow_seen=True), rule) is None
    words = settled(Exposure(trigger_calls=29, shadow_seen=True), rule)
    assert words is not None and "trigger_count 29 with state_count 0" in words
    # a state that arose a few times is not "never arose": that run goes on
    assert settled(Exposure(trigger_calls=200, state_calls=3, shadow_seen=True), rule) is None
    # no path counter: no unreached claim
    assert settled(Exposure(trigger_calls=200, shadow_seen=True), StopRule(path_counter=None)) is None


def test_a_named_corruption_still_needs_the_crash_question_settled():
    corrupt = dict(shadow_seen=True, kv_violations=3, kv_violations_by={"full_attention+offload/foreign/hit": 3},
                   kv_first_violation_class="full_attention+offload/foreign/hit",
                   kv_groups=("mamba", "full_attention"))
    assert settled(Exposure(trigger_calls=20, state_calls=5, **corrupt), StopRule()) is None
    words = settled(Exposure(trigger_calls=90, state_calls=40, **corrupt), StopRule())
    assert words is not None and "corruption seen: fa-hole-below-boundary" in words


def test_without_a_shadow_kv_only_the_crash_question_counts():
    words = settled(Exposure(trigger_calls=90, state_calls=40), StopRule())
    assert words is not None and words.endswith("no shadow KV on this engine")


def _grow(path: Path, lines: list[str], follower: LogFollower, rule: StopRule) -> list[str | None]:
    """Write ``lines`` one at a time (the last without its newline first, as a log grows) and ask
    the rule after each, as the load generator does."""
    answers = []
    with open(path, "w") as fh:
        for line in lines:
            head, tail = line[: len(line) // 2], line[len(line) // 2:]
            fh.write(head)
            fh.flush()
            answers.append(settled(follower.exposure(), rule))
            fh.write(tail)
            fh.flush()
            answers.append(settled(follower.exposure(), rule))
    return answers


def test_a_build_whose_first_state_crashes_never_passes(tmp_path):
    """Build A's shape, from a recorded 0.26.0 engine log: the probe writes the counts with
    state_calls=1 right before the assertion re-raises, then the traceback. At no point of that
    log can the rule settle; and in general an engine whose first state crashes reports at most one
    state while it lives, while the rule needs EVENTS (29) of them, or the state never arising."""
    lines = (LOGS / "suite-offload-boundary-assert.log").read_text().splitlines(keepends=True)
    assert any("state_calls=1" in line for line in lines) and any("AssertionError" in line for line in lines)
    follower = LogFollower(tmp_path / "engine.log")
    answers = _grow(tmp_path / "engine.log", lines, follower, StopRule())
    assert answers and all(a is None for a in answers)
    assert follower.exposure().state_calls == 1
    # every rule of this shape needs more than the one state a crashing engine can report
    for events in range(2, 200):
        assert settled(Exposure(trigger_calls=10_000, state_calls=1, shadow_seen=True), StopRule(events=events)) is None


def test_follower_reads_a_recorded_corrupt_log_like_the_classifier(tmp_path):
    from kvrepro.classify import read_exposure

    text = (LOGS / "shadow-fa-hole.log").read_text()
    follower = LogFollower(tmp_path / "engine.log")
    _grow(tmp_path / "engine.log", text.splitlines(keepends=True), follower, StopRule())
    live, whole = follower.exposure(), read_exposure(text)
    assert (live.kv_violations, live.kv_violations_by, live.kv_first_violation_class, live.state_calls,
            live.trigger_calls) == (whole.kv_violations, whole.kv_violations_by, whole.kv_first_violation_class,
                                    whole.state_calls, whole.trigger_calls)
    assert live.kv_violations > 0


def test_a_missing_log_is_no_evidence(tmp_path):
    assert settled(LogFollower(tmp_path / "nothing.log").exposure(), StopRule()) is None


# --------------------------------------------------------------------------- which runs get the rule


def test_full_load_replay_and_expected_stalls_run_their_whole_load():
    assert stop_rule_for(MatrixOptions(), "CORRUPT(fa-hole-below-boundary)") == StopRule()
    assert stop_rule_for(MatrixOptions(), None) == StopRule()
    assert stop_rule_for(MatrixOptions(full_load=True), "CRASH(target)") is None
    assert stop_rule_for(MatrixOptions(replay=object()), None) is None
    assert stop_rule_for(MatrixOptions(), "STALL") is None
    assert stop_rule_for(MatrixOptions(), "SURVIVED|stall") is None
    custom = StopRule(counter="kv_hit_reads.mamba", path_counter=None)
    assert stop_rule_for(MatrixOptions(stop_rule=custom), "SURVIVED") == custom


def test_suite_entries_are_settled_on_their_own_path_counter():
    from kvrepro.suite.run import load, stop_rule_of

    entries = {e.name: e for e in load().entries}
    assert stop_rule_of(entries["offload-boundary-assert"]) == StopRule()
    assert stop_rule_of(entries["mamba-null-state"]) == StopRule(counter=entries["mamba-null-state"].path_counter,
                                                                 path_counter=None)
    assert entries["skipped-waiting-deadlock"].kind == "stall"  # run_suite gives stall entries full_load


# --------------------------------------------------------------------------- the load generator


@pytest.fixture
def engine():
    e = StandInEngine()
    yield e
    e.close()


def test_a_settled_run_ends_before_its_budget_and_says_why(engine, tmp_path):
    engine.delay_s = 0.01
    asked = []

    def is_settled():
        asked.append(len(engine.bodies))
        return "state_count 29 ...; corruption seen: x" if len(engine.bodies) >= 20 else None

    summary = run_load(engine.url, LOAD, runs(requests=100_000), tmp_path / "r.jsonl", seed=0, alive=engine.alive,
                       settled=is_settled)
    assert summary.stopped_because == "settled"
    assert summary.settled_by == "state_count 29 ...; corruption seen: x"
    assert 20 <= summary.requests_sent < 1_000
    assert asked and asked[-1] >= 20


def test_the_budget_stays_the_cap_and_a_budget_run_has_no_settled_words(engine, tmp_path):
    summary = run_load(engine.url, LOAD, runs(requests=12), tmp_path / "r.jsonl", seed=0, alive=engine.alive,
                       settled=lambda: None)
    assert (summary.stopped_because, summary.settled_by, summary.requests_sent) == ("budget", None, 12)


def test_a_dead_engine_is_never_settled(engine, tmp_path):
    engine.die_after = 0  # the first request kills it, long before the rule is first asked
    summary = run_load(engine.url, LOAD, runs(requests=10_000), tmp_path / "r.jsonl", seed=0, alive=engine.alive,
                       settled=lambda: "would settle")
    assert summary.stopped_because == "engine_dead"
    assert summary.settled_by is None


def test_a_stall_is_not_settled_away(engine, tmp_path):
    """A stall has no early end: nothing counts while no request is answered, and the stall rule fires."""
    engine.hang = True
    start = time.monotonic()
    summary = run_load(engine.url, LOAD, runs(requests=100, stall_timeout_s=0.8), tmp_path / "r.jsonl", seed=0,
                       alive=engine.alive, settled=lambda: None)
    assert summary.stopped_because == "stall"
    assert time.monotonic() - start >= 0.8


def test_the_suite_runs_stall_entries_whole_and_settles_the_others(tmp_path, monkeypatch):
    """What `kvrepro suite run` hands the matrix runner per entry: a stall entry's runs send their
    whole load (no count settles a stall); a crash or corruption entry's are settled on its counter."""
    import kvrepro.suite.run as suite_run
    from kvrepro.errors import KvreproError

    catalogue = suite_run.load()
    chosen = [e for e in catalogue.entries
              if e.name in ("skipped-waiting-deadlock", "offload-boundary-assert", "mamba-null-state")]
    handed: dict[str, MatrixOptions] = {}

    def record_options(loaded, options, progress, stop, target=None):
        handed[next(iter(loaded.matrix.builds))] = options
        raise KvreproError("not run here")

    monkeypatch.setattr(suite_run, "run_matrix", record_options)
    suite_run.run_suite(catalogue, chosen, suite_run.parse_builds(["0.30.0"], []), tmp_path, jobs=1)
    by_entry = {name: next(o for build, o in handed.items() if build.startswith(name)) for name in
                ("skipped-waiting-deadlock", "offload-boundary-assert", "mamba-null-state")}
    assert by_entry["skipped-waiting-deadlock"].full_load is True
    assert stop_rule_for(by_entry["skipped-waiting-deadlock"], None) is None
    assert by_entry["offload-boundary-assert"].full_load is False
    assert stop_rule_for(by_entry["offload-boundary-assert"], None) == StopRule()
    assert stop_rule_for(by_entry["mamba-null-state"], None).counter.startswith("kv_hit_reads.")
    # --full-load: every entry whole
    handed.clear()
    suite_run.run_suite(catalogue, chosen, suite_run.parse_builds(["0.30.0"], []), tmp_path, jobs=1,
                        full_load=True)
    assert all(o.full_load for o in handed.values()) and len(handed) == 3


def test_requests_in_flight_when_settled_are_answered_and_recorded(engine, tmp_path):
    """Settling stops new requests, not the ones sent: every request sent has its line."""
    from test_loadgen import lines

    engine.delay_s = 0.3  # four requests always in flight (concurrency 4)
    summary = run_load(engine.url, LOAD, runs(requests=100_000), tmp_path / "r.jsonl", seed=0, alive=engine.alive,
                       settled=lambda: "settled" if len(engine.bodies) >= 8 else None)
    assert summary.stopped_because == "settled"
    records = lines(tmp_path / "r.jsonl")
    assert len(records) == summary.requests_sent == summary.requests_ok == len(engine.bodies)
    assert all(r["ok"] for r in records)
