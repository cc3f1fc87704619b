"""Load events (``load.events``): each one against vLLM's own `vllm serve`, GPU-free, over real HTTP.

One engine serves every test here (build D of the default matrix, one request running at a time,
20 ms per engine step, vLLM's priority scheduler, request logging on): what each test proves comes
from the engine -- its log (``--enable-log-requests``: "Request ... aborted", the probe's
``finished_unscheduled``) or its /metrics -- not from what the client believes it did. Faked, as in
every sim run, because this machine has no GPU: the model executor and the offload data movement.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT

from kvrepro.spec.records import RequestEvents
from kvrepro.spec.matrix import LoadEventSpec, LoadSpec, RunsSpec

pytestmark = pytest.mark.shares_zygotes  # one engine zygote per runtime for the session (conftest.shares_zygotes)

BAD_EVENTS = [
    ("- {at: 1, abort: queued, priority: 3}", "exactly one of abort, priority"),
    ("- {at: 1, abort: tokens}", "abort: tokens needs after_tokens"),
    ("- {at: 0, abort: queued}", "cannot be request 0"),
    ("- {at: 1, abort: later}", "abort"),
    ("- {at: 1, reset_prefix_cache: all}", "reset_prefix_cache"),
    ("- {at: -1, pause_s: 1}", "at"),
]


@pytest.mark.parametrize("event,message", BAD_EVENTS)
def test_a_bad_event_is_one_file_line_error_exit_2(tmp_path, event, message):
    text = (ROOT / "matrix.yaml").read_text()
    assert "\nload:\n" in text
    text = text.replace("\nload:\n", "\nload:\n  events:\n    " + event + "\n", 1)
    (tmp_path / "matrix.yaml").write_text(text)
    line = text.splitlines().index("    " + event) + 1
    proc = subprocess.run([sys.executable, "-m", "kvrepro.cli", "matrix", "validate", "--matrix",
                           str(tmp_path / "matrix.yaml")], capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    out = (proc.stdout + proc.stderr).strip()
    assert f"matrix.yaml:{line}" in out and message in out, out
    assert "Traceback" not in out


def test_events_resolve_per_request_and_priority_turns_the_scheduler_on():
    from kvrepro.spec.matrix import Matrix

    load = LoadSpec(events=[LoadEventSpec(at=1, every=3, abort="queued"), LoadEventSpec(at=4, priority=-2),
                            LoadEventSpec(at=2, reset_prefix_cache="external"), LoadEventSpec(at=2, pause_s=0.5)])
    assert load.events_for(0) == RequestEvents()
    assert load.events_for(1) == RequestEvents(abort="queued", abort_after_s=0.1)
    assert load.events_for(4) == RequestEvents(abort="queued", abort_after_s=0.1, priority=-2)
    assert load.events_for(2) == RequestEvents(reset_prefix_cache="external", pause_s=0.5)
    matrix = Matrix.model_validate({"builds": {"A": []}, "load": {"events": [{"at": 1, "priority": 1}]}})
    assert matrix.engine.extra_args[-2:] == ["--scheduling-policy", "priority"]
    assert "--scheduling-policy" not in Matrix.model_validate({"builds": {"A": []}}).engine.extra_args


def test_events_are_in_the_trace_and_read_back(tmp_path):
    from kvrepro.loadgen.profiles import Prompt
    from kvrepro.loadgen.trace import ReplayProfile, TraceHeader, open_writer, read_trace

    writer = open_writer(tmp_path / "t.jsonl", TraceHeader(load={}))
    writer.request(Prompt(0, (1, 2), 4), slot=0, sent_s=0.0, in_flight=1)
    writer.request(Prompt(1, (1, 3), 4, events=RequestEvents(abort="tokens", abort_after_tokens=2)), slot=0,
                   sent_s=0.1, in_flight=1)
    writer.close()
    trace = read_trace(tmp_path / "t.jsonl")
    assert trace.requests[0].events is None
    assert trace.requests[1].events == RequestEvents(abort="tokens", abort_after_tokens=2)
    replay = ReplayProfile(trace, trace.load_spec())
    assert replay.prompt(1).events == RequestEvents(abort="tokens", abort_after_tokens=2)
    assert replay.prompt(0).events == RequestEvents()  # never load.events again
    bad = (tmp_path / "t.jsonl").read_text().replace('"abort":"tokens"', '"abort":"soon"')
    (tmp_path / "bad.jsonl").write_text(bad)
    from kvrepro.errors import SpecError

    with pytest.raises(SpecError, match=r"bad.jsonl:3: .*abort 'soon'"):
        read_trace(tmp_path / "bad.jsonl")


# ---------------------------------------------------------------- against the real engine

@pytest.fixture(scope="module")
def engine(default_matrix, overlays, tmp_path_factory):
    """Build D, one request at a time, 20 ms steps, priority scheduling, requests logged."""
    from kvrepro.deploy.sim import SimTarget
    from kvrepro.spec.matrix import LoadedMatrix

    m = default_matrix.matrix
    eng = m.engine.model_copy(update={
        "max_num_seqs": 1, "sim": m.engine.sim.model_copy(update={"step_delay_ms": 20.0}),
        "extra_args": [*m.engine.extra_args, "--scheduling-policy", "priority", "--enable-log-requests"]})
    target = SimTarget(LoadedMatrix(m.model_copy(update={"engine": eng}), default_matrix.path, default_matrix.text))
    plan = next(p for p in target.loaded.plans() if p.name == "D")
    artifact = target.prepare(plan)
    assert artifact.ok, artifact.error
    run_dir = tmp_path_factory.mktemp("events-engine")
    handle = target.start(artifact, run_dir, 0)
    yield handle, run_dir
    handle.stop()
    target.close()


def _run(engine, tmp_path, events, *, requests=6, concurrency=1, **profile):
    from kvrepro.loadgen.runner import run_load

    handle, _ = engine
    load = LoadSpec.model_validate({"profile": "shared_prefix", "concurrency": concurrency, "max_tokens": 16,
                                    "documents": 2, "document_tokens": 128, "suffix_tokens": [0, 15],
                                    **profile, "events": events})
    summary = run_load(handle.base_url, load, RunsSpec(requests=requests, duration_s=60), tmp_path / "load.jsonl",
                       seed=1, alive=lambda: True, trace_path=tmp_path / "trace.jsonl")
    lines = [json.loads(x) for x in (tmp_path / "load.jsonl").read_text().splitlines()]
    return summary, lines


def _log(engine) -> str:
    return "".join(p.read_text(errors="replace") for p in engine[1].glob("*.log"))


def _probe(engine, name: str) -> int:
    """The EngineCore's latest count of probe counter ``name``."""
    values = [int(v) for v in re.findall(rf"{name}=(\d+)", _log(engine))]
    return max(values or [0])


def _metric(engine, name: str) -> float:
    import requests

    text = requests.get(engine[0].base_url + "/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name) and not line.startswith("#"))


def test_queued_abort_finishes_a_request_that_was_never_scheduled(engine, tmp_path):
    before = _probe(engine, "finished_unscheduled")
    summary, lines = _run(engine, tmp_path, [{"at": 1, "every": 2, "abort": "queued"}], requests=6)
    assert summary.stopped_because == "budget"
    aborted = [r for r in lines if r.get("aborted") is not None]
    assert [r["index"] for r in aborted] == [1, 3, 5], lines
    import time

    time.sleep(2.5)  # the probe writes its counts every 2 s
    assert _probe(engine, "finished_unscheduled") - before == 3, _log(engine)[-3000:]
    for index in (1, 3, 5):
        assert re.search(rf"Request cmpl-kvrepro-{index}-\S* aborted|aborted.*kvrepro-{index}-", _log(engine))


def test_token_aborts_close_the_stream_after_their_tokens_and_the_engine_aborts(engine, tmp_path):
    summary, lines = _run(engine, tmp_path, [{"at": 0, "abort": "first_token"},
                                             {"at": 1, "abort": "tokens", "after_tokens": 4}], requests=3)
    assert summary.stopped_because == "budget"
    by = {r["index"]: r for r in lines}
    assert by[0]["aborted"] == 1 and by[1]["aborted"] == 4 and by[2]["completion_tokens"] == 16
    log = _log(engine)
    for index in (0, 1):  # vLLM's own words: the server aborted it when the client left
        assert re.search(rf"Request cmpl-kvrepro-{index}-\S* aborted", log), log[-2000:]
    assert not re.search(r"Request cmpl-kvrepro-2-\S* aborted", log)


def test_priority_reaches_vllms_priority_scheduler(engine, tmp_path):
    """Three at once, one running at a time: request 2 (priority -5, sent 0.2 s late) is scheduled
    before whichever of 0 and 1 (priority 5) was still waiting, so it is not the last to finish."""
    summary, lines = _run(engine, tmp_path, [{"at": 1, "priority": 5}, {"at": 2, "priority": -5},
                                             {"at": 2, "pause_s": 0.2}], requests=3, concurrency=3)
    assert summary.stopped_because == "budget" and all(r["status"] == 200 for r in lines), lines
    finished = sorted(lines, key=lambda r: r["started_at"] + r["latency_s"])
    assert finished[-1]["index"] != 2, [(r["index"], r["started_at"], r["latency_s"]) for r in lines]
    assert by_index(lines)[2]["events"] == {"priority": -5, "pause_s": 0.2}


def by_index(lines):
    return {r["index"]: r for r in lines if "index" in r}


def test_reset_prefix_cache_between_phases_empties_the_local_cache(engine, tmp_path):
    """The same prompt three times, the prefix cache reset before the third: the second hits, the
    third does not (vllm:prefix_cache_hits_total, read between the phases)."""
    profile = {"documents": 1, "document_tokens": 160, "min_prefix_tokens": 160, "suffix_tokens": [0, 0],
               "seed": 7}
    hits0 = _metric(engine, "vllm:prefix_cache_hits_total")
    _run(engine, tmp_path / "a", [], requests=2, **profile)
    hits1 = _metric(engine, "vllm:prefix_cache_hits_total")
    assert hits1 - hits0 >= 128  # the second use hit the first's blocks
    summary, lines = _run(engine, tmp_path / "b", [{"at": 0, "reset_prefix_cache": "external"}], requests=1,
                          **profile)
    hits2 = _metric(engine, "vllm:prefix_cache_hits_total")
    reset = [r for r in lines if r.get("event") == "reset_prefix_cache"]
    assert reset and reset[0]["success"] is True and reset[0]["external"] is True, lines
    assert hits2 == hits1, (hits0, hits1, hits2)
    assert "Resetting prefix cache" in _log(engine)


def test_a_pause_is_a_gap_in_the_trace_and_replay_repeats_every_event(engine, tmp_path):
    from kvrepro.loadgen.runner import replay_load
    from kvrepro.loadgen.trace import read_trace

    import time

    time.sleep(2.5)  # the probe writes its counts every 2 s: the earlier tests' are in
    before = _probe(engine, "finished_unscheduled")
    events = [{"at": 2, "pause_s": 1.0}, {"at": 3, "abort": "queued"}]
    _run(engine, tmp_path / "run", events, requests=4)
    trace = read_trace(tmp_path / "run" / "trace.jsonl")
    sent = [r.sent_s for r in trace.requests]
    assert sent[2] - sent[1] >= 1.0
    assert trace.requests[3].events == RequestEvents(abort="queued", abort_after_s=0.1)
    summary = replay_load(engine[0].base_url, trace, RunsSpec(requests=None, duration_s=60),
                          tmp_path / "replay" / "load.jsonl", alive=lambda: True,
                          trace_path=tmp_path / "replay" / "trace.jsonl")
    assert summary.stopped_because == "budget" and summary.requests_sent == 4
    again = read_trace(tmp_path / "replay" / "trace.jsonl")
    assert [r.events for r in again.requests] == [r.events for r in trace.requests]
    time.sleep(2.5)
    assert _probe(engine, "finished_unscheduled") == before + 2  # the run's queued abort and the replay's


def test_a_burst_sends_earlier_prompts_again_all_at_once(engine, tmp_path):
    """Requests 2 and 3 repeat prompts 0 and 1 and leave together: both are in flight at once (the
    trace), and the engine serves them from its prefix cache (vllm:prefix_cache_hits_total)."""
    hits0 = _metric(engine, "vllm:prefix_cache_hits_total")
    summary, lines = _run(engine, tmp_path, [{"at": 2, "burst": 2, "replay_from": 0}], requests=4,
                          document_tokens=96, min_prefix_tokens=96, suffix_tokens=[0, 0], documents=2)
    from kvrepro.loadgen.trace import read_trace

    assert summary.stopped_because == "budget"
    trace = read_trace(tmp_path / "trace.jsonl")
    assert trace.requests[2].tokens == trace.requests[0].tokens and trace.requests[3].tokens == trace.requests[1].tokens
    assert trace.requests[2].events == RequestEvents(burst=2, replay_of=0)
    assert trace.requests[3].events == RequestEvents(replay_of=1)
    assert trace.requests[3].in_flight == 2  # sent while request 2 was in flight
    assert trace.requests[3].sent_s - trace.requests[2].sent_s < 0.05
    assert _metric(engine, "vllm:prefix_cache_hits_total") - hits0 >= 2 * 80


def test_burst_values_are_checked():
    with pytest.raises(ValueError, match="must all come before request 2"):
        LoadEventSpec(at=2, burst=3, replay_from=0)
    with pytest.raises(ValueError, match="burst needs replay_from"):
        LoadEventSpec(at=2, burst=2)
    load = LoadSpec(events=[LoadEventSpec(at=4, every=6, burst=2, replay_from=0)])
    assert [load.events_for(i).replay_of for i in range(4, 12)] == [0, 1, None, None, None, None, 6, 7]
    assert load.events_for(10).burst == 2 and load.events_for(11).burst is None


def test_at_concurrency_2_a_burst_behind_a_reset_leaves_together_after_the_reset(engine, tmp_path):
    """The burst claims its requests before its reset waits: the other slot must not take request 3
    and send it alone, before the reset (it did, until the claim moved; parked-load-stranded needs the
    replays to park together). With max_num_seqs 1 the reset waits for the other slot's request."""
    from kvrepro.loadgen.trace import read_trace

    events = [{"at": 2, "reset_prefix_cache": "local"}, {"at": 2, "burst": 2, "replay_from": 0}]
    summary, lines = _run(engine, tmp_path, events, requests=5, concurrency=2, max_tokens=8,
                          document_tokens=96, min_prefix_tokens=96, suffix_tokens=[0, 0], documents=2)
    assert summary.stopped_because == "budget", lines
    reset = next(r for r in lines if r.get("event") == "reset_prefix_cache")
    started = {r["index"]: r["started_at"] for r in lines if "index" in r}
    assert reset["success"] is True and started[2] >= reset["at"] and started[3] >= reset["at"], lines
    trace = read_trace(tmp_path / "trace.jsonl")
    by = {r.index: r for r in trace.requests}
    assert by[3].events == RequestEvents(replay_of=1) and by[3].tokens == by[1].tokens
    assert abs(by[3].sent_s - by[2].sent_s) < 0.05
