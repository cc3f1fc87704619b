"""`kvrepro minimize` on a CORRUPT run: what "still fails" means, which build is "fixed", and the real thing.

The first tests need no vLLM: the violation kind read from a shadow-KV line, the oracle's
predicate over offline results, and how ``--build``/``--fixed`` name builds (also on another
release). The last ones use vLLM 0.26.0 through the runtime env: a served replay of a shipped
minimized trace on build B records a real CORRUPT run, and ``minimize`` shrinks it on the offline
engine; with build E (the backports of #48425/#50344) in ``matrix.yaml`` the result must also be
clean on E. They need the runtime env and the overlays, which the fixtures build.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kvrepro.errors import SpecError
from kvrepro.minimize.shrink import Failure, OfflineResult, corruption_matches, kind_count, resolve_plan, violation_kind
from kvrepro.spec.matrix import TargetSignature

from conftest import require

pytestmark = pytest.mark.shares_zygotes  # one engine zygote per runtime for the session (conftest.shares_zygotes)

ROOT = Path(__file__).resolve().parents[1]
TRACE = ROOT / "tests" / "data" / "traces" / "minimized-B-corrupt.trace.jsonl"

FA_OFFLOAD = ("request req-4 group 2 (full_attention) block index 26 (GPU block 7): positions 416-431 expected "
              "with this request's tokens; stale KV: it holds positions 416-431 of request req-1, 16 of 16 positions "
              "computed from other tokens; the request got this block with its prefix hit (local cache or offload); "
              "its content: computed by request req-1 at step 40 (request had offload hit)")
MAMBA = ("step=16 request cmpl-a82c-0-9e0bd31d group 0 (mamba) block index 40: the state after 656 tokens must be "
         "read from a block the request does not have (null block) (request had no offload hit)")
SIG = TargetSignature(exception="AssertionError", function="update_state_after_alloc",
                      file="vllm/distributed/kv_transfer/kv_connector/v1/offloading/scheduler.py")


def test_the_kind_of_a_violation_is_its_group_kind_and_offload_flag():
    assert violation_kind(FA_OFFLOAD) == "full_attention+offload"
    assert violation_kind(MAMBA) == "mamba"
    assert violation_kind("request r group 1 (sliding_window) block index 3: ... (request had no offload hit)") \
        == "sliding_window"
    assert violation_kind("see kvrepro-shadow lines in engine.log") is None
    assert violation_kind(None) is None


def _record(i: int, kind: str) -> dict:
    return {"request_index": i, "kind": kind, "text": f"request req-{i} ..."}


def _result(records, crashed=False, crash_at=None, violations=None, checks=100) -> OfflineResult:
    return OfflineResult.from_json({"crashed": crashed, "crash_at": crash_at, "exception": "AssertionError" if crashed else None,
            "function": "update_state_after_alloc" if crashed else None,
            "file": "vllm/distributed/kv_transfer/kv_connector/v1/offloading/scheduler.py" if crashed else None,
            "statement": None, "trigger_calls": 3, "kv_checks": checks,
            "kv_violations": len(records) if violations is None else violations,
            "kv_violations_by": {}, "kv_records": records})


def test_a_corruption_still_fails_at_its_first_violation_of_the_same_kind():
    failure = Failure(SIG, "full_attention+offload")
    assert failure.label == "CORRUPT"
    # another kind earlier does not count; the candidate is cut at the first one of this kind
    assert failure.at(_result([_record(1, "mamba"), _record(3, "full_attention+offload"),
                               _record(5, "full_attention+offload")])) == 3
    assert failure.at(_result([_record(1, "mamba"), _record(2, "full_attention")])) is None
    assert failure.at(_result([])) is None
    # a violation at or after a crash does not count (the cut candidate must not crash)
    assert failure.at(_result([_record(4, "full_attention+offload")], crashed=True, crash_at=4)) is None
    assert failure.at(_result([_record(2, "full_attention+offload")], crashed=True, crash_at=4)) == 2
    assert corruption_matches({"kind": "mamba"}, "mamba") and not corruption_matches({"kind": "mamba"}, "mamba+offload")


def test_clean_means_no_crash_no_violation_and_a_shadow_that_checked():
    failure = Failure(SIG, "full_attention+offload")
    assert failure.clean(_result([]))
    assert not failure.clean(_result([_record(1, "mamba")]))  # any kind of violation
    assert not failure.clean(_result([], crashed=True, crash_at=2))
    assert not failure.clean(_result([], checks=None))  # no shadow KV: nothing was checked
    assert failure.describe(_result([])).startswith("clean (no crash, no KV violation in 100 checked contexts")


def test_a_crash_still_fails_as_before():
    failure = Failure(SIG)
    assert failure.label == "CRASH(target)"
    assert failure.at(_result([_record(0, "mamba")], crashed=True, crash_at=5)) == 5
    assert failure.at(_result([_record(0, "full_attention+offload")])) is None
    assert failure.clean(_result([_record(0, "mamba")]))  # a crash's fixed build may read wrong KV
    assert failure.describe(_result([], crashed=True, crash_at=5)) == "CRASH(target)"


def test_builds_are_named_as_in_the_matrix_or_on_another_release(default_matrix):
    b = resolve_plan(default_matrix, "B")
    assert (b.name, b.base, [p.name for p in b.patches]) == ("B", "0.26.0", ["pr-49146", "pr-52807"])
    other = resolve_plan(default_matrix, "B@0.30.0")
    assert (other.base, other.build_name, [p.name for p in other.patches]) == ("0.30.0", "B", ["pr-49146", "pr-52807"])
    with pytest.raises(SpecError, match=r"unknown build 'Z'; .* defines A, B, C, D"):
        resolve_plan(default_matrix, "Z")
    with pytest.raises(SpecError, match="'B@latest': 'latest' must be a vLLM release version"):
        resolve_plan(default_matrix, "B@latest")


# --------------------------------------------------------------------------- with vLLM


@pytest.fixture(scope="module")
def corrupt_run(default_matrix, overlays, tmp_path_factory):
    """A real CORRUPT run of build B: the served engine (`vllm serve`, GPU-free) replaying the
    shipped trace with filler requests in front of it, recorded as every run is."""
    from kvrepro.loadgen.trace import Trace, TraceRequest, read_trace
    from kvrepro.matrix.runner import MatrixOptions, run_matrix

    shipped = read_trace(TRACE)
    # requests that change nothing the corruption needs: distinct short prompts
    filler = [TraceRequest(index=0, tokens=tuple(range(900 - 20 * k, 917 - 20 * k)), max_tokens=2) for k in range(4)]
    requests = filler[:2] + list(shipped.requests[:1]) + filler[2:] + list(shipped.requests[1:])
    trace = Trace(TRACE, shipped.header.updated(rep=0),
                  [TraceRequest(**{**r.__dict__, "index": i}) for i, r in enumerate(requests)])
    root = tmp_path_factory.mktemp("results")
    options = MatrixOptions(target="sim", builds=["B"], repetitions=1, results_root=root, jobs=1, replay=trace)
    run = run_matrix(default_matrix, options)
    r = run.build("B").runs[0]
    assert r.label == "CORRUPT" and kind_count(r.kv_violations_by, "full_attention+offload"), (r.label, r.kv_violations_by)
    assert "fa-hole-below-boundary" in r.kv_defects, r.kv_defects  # and the defect it is, named
    return root, run.run_id, len(requests), len(shipped.requests)


def test_minimize_shrinks_a_corrupt_run_to_the_requests_that_read_wrong_kv(default_matrix, corrupt_run):
    from kvrepro.minimize.shrink import minimize

    root, run_id, before, shipped = corrupt_run
    fixed = "E" if "E" in default_matrix.matrix.builds else None
    summary = minimize(default_matrix, root, run_id, "B", fixed=fixed, violation="full_attention+offload",
                       confirm=False)
    assert summary.failure == "CORRUPT" and summary.violation == "full_attention+offload"
    assert summary.requests_before == before
    assert summary.requests <= shipped < before  # the filler is gone
    assert summary.deterministic is True
    assert summary.violation_at == summary.requests - 1  # cut at the violating request
    assert "(full_attention)" in summary.first_violation and "(request had offload hit)" in summary.first_violation
    assert Path(summary.trace).name == "minimized.trace.jsonl"
    if fixed:
        assert summary.fixed_result.startswith("clean (no crash, no KV violation"), summary.fixed_result
    assert summary.ok is True, summary


def test_minimize_without_violation_takes_the_defect_expect_names(default_matrix, corrupt_run):
    """B's first violation is usually the Mamba null-state read every 0.26.0 build shares; the
    default is the defect B's `expect:` names, the boundary fix's hole."""
    from kvrepro.minimize.shrink import minimize
    from kvrepro.results import store as results

    root, run_id, _, _ = corrupt_run
    run = results.load_run(root, run_id).build("B").runs[0]
    assert default_matrix.matrix.expect["B"] == "CORRUPT(fa-hole-below-boundary)"
    summary = minimize(default_matrix, root, run_id, "B", confirm=False)
    assert summary.violation == "fa-hole-below-boundary" and run.kv_defects.get("fa-hole-below-boundary"), run.kv_defects
    assert summary.deterministic is True


def test_a_kind_the_run_never_had_is_one_line(default_matrix, corrupt_run):
    from kvrepro.minimize.shrink import minimize

    root, run_id, _, _ = corrupt_run
    with pytest.raises(SpecError, match=r"no repetition of build B in run .* had a sliding_window\+offload violation"):
        minimize(default_matrix, root, run_id, "B", violation="sliding_window+offload", confirm=False)
    with pytest.raises(SpecError, match="--violation 'stale'"):
        minimize(default_matrix, root, run_id, "B", violation="stale", confirm=False)


def test_e_is_required_under_ci_for_the_clean_side(default_matrix):
    """The clean build of the corruption's reproducer is E (matrix.yaml); without it the
    minimizer can only show the failing side."""
    require("E" in default_matrix.matrix.builds, "matrix.yaml has no build E (the backports of #48425/#50344)")


def test_a_defect_name_matches_the_classes_attributed_to_it():
    """`--violation fa-hole-below-boundary` (kvrepro signatures): a record counts when its class is
    that defect's, whatever words the kind has."""
    from kvrepro.minimize.shrink import kind_count

    hole = {"kind": "full_attention+offload", "class": "full_attention+offload/foreign/hit"}
    null = {"kind": "mamba", "class": "mamba/null/hit"}
    assert corruption_matches(hole, "fa-hole-below-boundary")
    assert not corruption_matches(null, "fa-hole-below-boundary")
    assert corruption_matches(hole, "full_attention+offload")  # kinds work as before
    failure = Failure(SIG, "fa-hole-below-boundary")
    assert failure.at(_result([{**null, "request_index": 1}, {**hole, "request_index": 3}])) == 3
    counts = {"full_attention+offload/foreign/hit": 4, "mamba/null/hit": 2}
    assert kind_count(counts, "fa-hole-below-boundary") == 4 and kind_count(counts, "full_attention+offload") == 4


def test_minimize_by_defect_name(default_matrix, corrupt_run):
    from kvrepro.minimize.shrink import minimize

    root, run_id, before, shipped = corrupt_run
    summary = minimize(default_matrix, root, run_id, "B", violation="fa-hole-below-boundary", confirm=False)
    assert summary.violation == "fa-hole-below-boundary"
    # the defect's own read (full_attention+offload) or a later request inheriting the hashed hole
    assert summary.violation_kind in ("full_attention+offload", "full_attention")
    assert corruption_matches({"kind": summary.violation_kind, "class": summary.violation_class},
                              "fa-hole-below-boundary")
    assert summary.requests <= shipped < before and summary.deterministic is True
