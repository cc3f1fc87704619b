"""The upstream report of recompute-failed-load-stall (kvrepro/minimize/upstream_emit.py).

The emitted test is a regression test for vLLM's own suite: a mock store connector (every lookup
an async hit, as Mooncake store's re-lookup answers the retry) and vLLM's test helpers, no kvrepro
import. Here it is rendered from a stall case with vLLM 0.33.0's real scheduler source, and the
expensive test runs it the way upstream would: vLLM's own pytest inside the 0.33.0 sdist's
``tests/`` (kvrepro/builds/standalone_test.py), on the pristine release -- where it must fail with
the reserved and free block counts -- and on the release with builds/fix-recompute-failed-load-
reservation.patch, where it must pass. Nothing is faked but the connector, which no machine here
has (a remote KV store).
"""

from __future__ import annotations

import ast
import hashlib
import re

import pytest

from conftest import ROOT

from kvrepro.minimize import upstream_emit

RELEASE = "0.33.0"
FIX = ROOT / "builds" / "fix-recompute-failed-load-reservation.patch"


@pytest.fixture(scope="module")
def scheduler_source() -> str:
    from kvrepro.builds.overlay import pristine_tree

    _, root, _ = pristine_tree(RELEASE)
    return (root / upstream_emit.SCHEDULER).read_text()


def _case(source: str, prompt: int = 881) -> upstream_emit.StallCase:
    return upstream_emit.StallCase("results/run/build/0", RELEASE, 16, 96, prompt, prompt // 16 * 16, 9,
                                   upstream_emit.mechanism_lines(source))


def test_the_mechanism_is_read_from_the_release_source(scheduler_source):
    lines = [line for _, line in upstream_emit.mechanism_lines(scheduler_source)]
    # what the catalogue entry cites for 0.33.0 (defects/recompute-failed-load-stall.yaml)
    assert lines == [1542, 3688, 3495, 3432, 1428, 1454]
    with pytest.raises(Exception, match="not where kvrepro looks"):
        upstream_emit.mechanism_lines(scheduler_source.replace("self._inflight_prefills.add(request)", "pass"))


def test_the_emitted_test_is_the_skeleton_with_the_runs_numbers_and_no_kvrepro_import(scheduler_source):
    text = upstream_emit.render_stall_test(_case(scheduler_source))
    tree = ast.parse(text)
    constants = {n.targets[0].id: n.value.value for n in tree.body
                 if isinstance(n, ast.Assign) and isinstance(n.targets[0], ast.Name) and isinstance(n.value, ast.Constant)}
    assert (constants["PROMPT_TOKENS"], constants["HIT_TOKENS"], constants["NUM_BLOCKS"]) == (881, 880, 96)
    assert "scheduler.py:3495" in constants["MECHANISM"] and constants["MECHANISM_RELEASE"] == RELEASE
    imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)} | {
        a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    assert not any("kvrepro" in (m or "") for m in imported), imported
    assert "utils" in imported and "vllm.v1.request" in imported  # vLLM's own helpers, as its neighbours
    doc = ast.get_docstring(tree)
    assert "3. its blocks are freed" in doc and "nothing removes it from _inflight_prefills (:3495)" in doc
    assert "request 9 of the load (881 prompt tokens" in doc
    # a value that would be code if pasted into a template stays a value
    hostile = upstream_emit.StallCase('x"""\nimport os\n', RELEASE, 16, 96, 881, 880, 9,
                                      upstream_emit.mechanism_lines(scheduler_source))
    again = ast.parse(upstream_emit.render_stall_test(hostile))
    assert not any(isinstance(n, ast.Import) and n.names[0].name == "os" for n in again.body)


def test_a_stall_repetition_is_found_and_its_stuck_request_read_from_the_log_and_trace(scheduler_source, tmp_path):
    """kvrepro minimize's stall path on a run folder written as the runner writes one: the STALL
    repetition (not when another repetition crashed with the target), the recomputed failed load with
    the longest prompt (the log's kvrepro-fault lines, the trace's prompts)."""
    from kvrepro.loadgen.trace import Trace, TraceHeader, TraceRequest, write_trace
    from kvrepro.minimize.shrink import _stalled_repetition
    from kvrepro.records import Verdict
    from test_report import make_run

    stalled = make_run(tmp_path / "a", {"A": [Verdict.SURVIVED, Verdict.STALL]})
    rep_dir = _stalled_repetition(tmp_path / "a", stalled.run_id, "A", None)
    assert rep_dir is not None and rep_dir.name == "1"
    assert _stalled_repetition(tmp_path / "a", stalled.run_id, "A", 0) is None
    crashed = make_run(tmp_path / "b", {"A": [Verdict.CRASH, Verdict.STALL]})
    assert _stalled_repetition(tmp_path / "b", crashed.run_id, "A", None) is None  # the crash is minimized
    with pytest.raises(Exception, match="no injected load failure"):
        upstream_emit.stall_case(rep_dir, RELEASE, scheduler_source, 16, 96)
    prefix = "(EngineCore pid=7) INFO 12-04 18:10:22 [executor.py:127] kvrepro-fault: load job {job} failed on purpose "
    (rep_dir / "engine.log").write_text(
        prefix.format(job=4) + "(load #1, request cmpl-kvrepro-1-0-aa, policy recompute, 3 GPU blocks not filled: 1,2,3)\n"
        + prefix.format(job=9) + "(load #2, request cmpl-kvrepro-2-0-bb, policy recompute, 9 GPU blocks not filled: 4)\n"
        + prefix.format(job=12) + "(load #3, request cmpl-kvrepro-3-0-cc, policy fail, 9 GPU blocks not filled: 5)\n")
    prompts = [[1] * 1000, [2] * 300, [3] * 800, [4] * 900]  # 0 never failed, 3 failed under `fail`
    write_trace(rep_dir / "trace.jsonl", Trace(rep_dir / "trace.jsonl", TraceHeader(build="A", rep=1),
                                               [TraceRequest(i, tuple(p), 8) for i, p in enumerate(prompts)]))
    case = upstream_emit.stall_case(rep_dir, RELEASE, scheduler_source, 16, 96)
    assert (case.request_index, case.prompt_tokens, case.hit_tokens) == (2, 800, 784)


def test_the_stall_test_fails_on_the_release_and_passes_with_the_proposed_fix(scheduler_source, tmp_path):
    """vLLM's pytest from the 0.33.0 sdist: one request over half the pool stalls, and so do two under
    half (the messages have the numbers); one under half passes unfixed (the precondition); all pass
    with the patch."""
    from kvrepro.builds.patching import read_header
    from kvrepro.builds.standalone_test import run_standalone
    from kvrepro.spec.records import PatchRef

    path = tmp_path / "test_stall.py"
    upstream_emit.emit_stall_test(path, _case(scheduler_source))
    fix = PatchRef("fix-recompute-failed-load-reservation", FIX, read_header(FIX).upstream,
                   hashlib.sha256(FIX.read_bytes()).hexdigest())
    release, fixed = run_standalone(RELEASE, path, upstream_emit.UPSTREAM_PATH,
                                    [("vLLM 0.33.0", []), ("vLLM 0.33.0 + fix", [fix])], tmp_path / "work")
    by_case = {nodeid.rsplit("[", 1)[-1].rstrip("]"): o for nodeid, o in release.outcomes.items()}
    assert set(by_case) == {"one-request-over-half-the-pool", "one-request-under-half-the-pool",
                            "two-requests-under-half-the-pool"}, release.outcomes

    def numbers(case: str) -> tuple[int, int, int]:
        outcome = by_case[case]
        assert outcome.outcome == "failed", outcome
        found = re.search(r"(\d+) blocks reserved for in-flight prefills, (\d+) of them request \S+'s own \(it holds "
                          r"no blocks, yet its whole sequence is still counted\); its retry needs about \d+ more of "
                          r"(\d+) free blocks", outcome.message)
        assert found, outcome.message
        return tuple(map(int, found.groups()))  # type: ignore[return-value]

    assert numbers("one-request-over-half-the-pool") == (56, 56, 95)  # 881 tokens: 56 blocks, twice > 95 free
    # 736 tokens (46 blocks) each: the first's stale 46 (+1 of the second's) + 46 > the 50 the second's unpromoted
    # failed load leaves free
    assert numbers("two-requests-under-half-the-pool") == (47, 46, 50)
    assert by_case["one-request-under-half-the-pool"].outcome == "passed", by_case["one-request-under-half-the-pool"]
    assert len(fixed.outcomes) == 3 and not fixed.failed, fixed.outcomes
