"""Verdicts and exit codes: INFRA against expect:, unknown offload metrics, failed requests against the
shadow KV, a too-small max_model_len, an API key sent or refused (issue 8's faults, injected for real:
tests/reliability.py says how).
"""

from __future__ import annotations

import json

import pytest
import yaml

from reliability import closed_port, kvrepro, show, small_matrix


def test_infra_wins_over_expect_when_nothing_else_differs(tmp_path):
    """expect: says CRASH(target) for A, but A's Docker host does not answer (a real refused TCP
    connection): the run is INFRA and the exit code is 3, not 1."""
    matrix = small_matrix(tmp_path, target="docker", base_image="kvrepro/vllm-openai-cpu:v0.26.0",
                          hosts=[{"name": "gone", "docker": f"tcp://127.0.0.1:{closed_port()}"}],
                          builds={"A": []}, expect={"A": "CRASH(target)"})
    proc = kvrepro("matrix", "run", "-m", str(matrix), "--reps", "1", "--json", "--results", str(tmp_path / "r"))
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert proc.returncode == 3, proc.stderr[-3000:]
    assert json.loads(proc.stdout)["builds"]["A"]["runs"][0]["verdict"] == "INFRA"
    assert "verdicts differ" not in proc.stderr


def test_infra_is_not_a_difference_from_expect():
    """The rule behind exit 3: INFRA (and INTERRUPTED / INCOMPLETE) never counts as "differs from
    expect:"; a real different verdict does; INFRA meets an `expect: INFRA`."""
    from kvrepro.records import Outcome, RunResult, Verdict
    from kvrepro.report.render import meets_expectation

    def result(verdict, outcome=Outcome.NONE):
        return RunResult(build="A", rep=0, verdict=verdict, outcome=outcome, title="t", trigger_count=0,
                         external_hit_calls=0, requests=0, seconds=0.0)
    assert meets_expectation(result(Verdict.INFRA), "CRASH(target)")
    assert meets_expectation(result(Verdict.INCOMPLETE), "SURVIVED")
    assert meets_expectation(result(Verdict.INFRA), "INFRA")
    assert not meets_expectation(result(Verdict.SURVIVED), "CRASH(target)")
    assert not meets_expectation(result(Verdict.CRASH, Outcome.TARGET), "INFRA")


def test_offload_loads_unknown_when_metrics_unknown():
    from kvrepro.report import render as report
    from kvrepro.records import Outcome, RunResult, Verdict

    def result(loads):
        return RunResult(build="A", rep=0, verdict=Verdict.CRASH, outcome=Outcome.TARGET, title="t",
                         trigger_count=1, external_hit_calls=1, requests=3, seconds=1.0, offload_load_jobs=loads)
    assert report.offload_loads_text(result(None)) == "unknown"
    assert report.offload_loads_text(result(0)) == "0"
    from kvrepro.classify.metrics import parse_prometheus, total_or_none

    assert total_or_none(parse_prometheus(""), "kvrepro_offload_load_jobs_total") is None


def test_failed_requests_win_over_the_shadow_kv_only_when_the_load_did_not_test():
    """The order in verdict.decide: more than 5% failed with the engine up is INFRA even with
    shadow-KV violations; a real corruption with a few failures stays CORRUPT."""
    from kvrepro.classify.records import Classification, Exposure
    from kvrepro.records import LoadSummary, Outcome, Verdict
    from kvrepro.classify.verdict import decide, title

    none = Classification(Outcome.NONE, "")
    seen = Exposure(trigger_calls=5, state_calls=2, kv_violations=4, kv_first_violation="step=3 ...")

    def load(failed, sent=600, why="budget"):
        return LoadSummary(requests_sent=sent, requests_ok=sent - failed, requests_failed=failed, seconds=1.0,
                           stopped_because=why)
    assert decide(none, seen, load(59), None) is Verdict.INFRA
    assert "59 of 600 requests failed" in title(Verdict.INFRA, seen, load(59))
    assert "shadow KV also flagged 4" in title(Verdict.INFRA, seen, load(59))
    assert decide(none, seen, load(3), None) is Verdict.CORRUPT
    assert decide(none, seen, load(30), None) is Verdict.CORRUPT  # exactly 5%: still counted
    assert decide(none, seen, load(0), None) is Verdict.CORRUPT
    assert decide(none, seen, load(59, why="stall"), None) is Verdict.CORRUPT  # the engine's own doing
    assert decide(none, Exposure(trigger_calls=5), load(59), None) is Verdict.INFRA


@pytest.mark.slow
def test_max_model_len_too_small_is_infra_not_corrupt(tmp_path, overlays, shared_zygotes_here):
    """max_model_len 64: the engine refuses most prompts (HTTP 400) while B's shadow KV flags
    reads in the few that ran; the verdict is INFRA with the reason, exit 3."""
    matrix = small_matrix(tmp_path, builds={"B": ["pr-52807"]}, expect={"B": "CORRUPT"})
    data = yaml.safe_load(matrix.read_text())
    data["engine"]["max_model_len"] = 64
    data["runs"].update(repetitions=1, requests=200)
    matrix.write_text(yaml.safe_dump(data, sort_keys=False))
    proc = kvrepro("matrix", "run", "-m", str(matrix), "--json", "--results", str(tmp_path / "r"))
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert proc.returncode == 3, proc.stderr[-3000:]
    run = json.loads(proc.stdout)["builds"]["B"]["runs"][0]
    assert run["verdict"] == "INFRA", run
    assert "requests failed with the engine up" in run["title"], run["title"]


@pytest.mark.slow
def test_api_key_in_extra_args_is_sent_by_the_runner(tmp_path, overlays, shared_zygotes_here):
    """`--api-key K` in extra_args: vLLM then answers 401 to /v1/* without the key; the runner's
    /v1/models call and every request carry it, so the run tests the engine (A: CRASH(target), run
    complete, exit 0), where it used to end "interrupted". (The `--api_key=K` spelling is sent by
    test_secret_in_any_spelling_reaches_no_file_and_no_output, whose run crashes on the target.)"""
    for args in (["--api-key", "k-one-4711"],):
        matrix = small_matrix(tmp_path / args[0].strip("-")[:7], builds={"A": []}, expect={"A": "CRASH(target)"})
        data = yaml.safe_load(matrix.read_text())
        data["engine"]["extra_args"] = args
        data["runs"].update(repetitions=1, requests=30)
        matrix.write_text(yaml.safe_dump(data, sort_keys=False))
        results = matrix.parent / "r"
        proc = kvrepro("matrix", "run", "-m", str(matrix), "--json", "--results", str(results))
        assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
        assert json.loads(proc.stdout)["builds"]["A"]["runs"][0]["label"] == "CRASH(target)"
        assert show(results)["status"] == "complete"


def test_api_key_refused_is_infra_with_a_reason(tmp_path):
    """A server that answers 401 to /v1/models (as vLLM does without the key): the load stage
    ends with an InfraError naming the key, which run_one records as INFRA (not interrupted)."""
    import http.server
    import threading

    from kvrepro.errors import InfraError
    from kvrepro.loadgen.runner import run_load
    from kvrepro.spec.matrix import LoadSpec, RunsSpec

    class Refuse(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(401)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Refuse)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        with pytest.raises(InfraError, match="401 Unauthorized: the engine requires an API key"):
            run_load(f"http://127.0.0.1:{server.server_port}", LoadSpec(), RunsSpec(requests=1),
                     tmp_path / "load.jsonl", seed=0, alive=lambda: True)
    finally:
        server.shutdown()
