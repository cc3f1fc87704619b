"""One place from an engine log to a verdict (kvrepro.classify.judge) and the record built from it."""

from __future__ import annotations

import dataclasses

from kvrepro.classify.judge import judge, run_result
from kvrepro.classify.records import EngineCounters, Exposure, Judgement
from kvrepro.records import LoadSummary, Outcome, RunResult, Verdict


def _distinct(field: dataclasses.Field, i: int):
    """A value for ``field`` unlike its default, different for every field."""
    kind = str(field.type)
    if "dict" in kind:
        return {f"k{i}": i}
    if "tuple" in kind:
        return (f"g{i}",)
    if "bool" in kind:
        return True
    if "str" in kind:
        return f"s{i}"
    return 1000 + i


def test_a_run_result_holds_every_exposure_field_it_names_without_a_copy_list():
    """A new probe counter is a field of Exposure and RunResult: RunResult.judged copies it by name."""
    exposure = Exposure(**{f.name: _distinct(f, i) for i, f in enumerate(dataclasses.fields(Exposure))})
    judgement = Judgement(classification=judge("").classification, exposure=exposure,
                          counters=EngineCounters(steps=7, offload_load_jobs=8, offload_store_jobs=9),
                          defects={"fa-hole-below-boundary": 3}, verdict=Verdict.CORRUPT, title="t",
                          external_prefix_cache_hits=5, prefix_cache_hits=6)
    result = run_result(judgement, build="A", rep=0, requests=10, seconds=1.0)
    shared = {f.name for f in dataclasses.fields(Exposure)} & {f.name for f in dataclasses.fields(RunResult)}
    assert len(shared) >= 15
    for name in shared:
        assert getattr(result, name) == getattr(exposure, name), name
    assert (result.trigger_count, result.state_count) == (exposure.trigger_calls, exposure.state_calls)
    assert (result.engine_steps, result.offload_load_jobs, result.offload_store_jobs) == (7, 8, 9)
    assert (result.verdict, result.title, result.kv_defects, result.prefix_cache_hits) == (
        Verdict.CORRUPT, "t", {"fa-hole-below-boundary": 3}, 6)
    assert result.kv_violations_by is not exposure.kv_violations_by  # its own copy


def test_a_log_alone_has_no_verdict_and_a_run_without_traceback_is_a_crash_by_exit_code():
    alone = judge("INFO nothing happened\n", judge_run=False)
    assert alone.verdict is None and alone.classification.outcome is Outcome.NONE
    load = LoadSummary(requests_sent=3, requests_ok=3, requests_failed=0, seconds=1.0, stopped_because="engine_dead")
    died = judge("INFO nothing happened\n", load=load, engine_exit=-9)
    assert died.verdict is Verdict.CRASH and died.title == "engine killed by signal 9 without a fatal traceback"
    other = judge("INFO nothing happened\n", load=load, engine_exit=-9, other_engine="geometry differs")
    assert (other.verdict, other.title) == (Verdict.INFRA, "geometry differs")
