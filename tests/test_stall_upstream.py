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


def test_the_stall_test_fails_on_the_release_and_passes_with_the_proposed_fix(scheduler_source, tmp_path):
    """vLLM's pytest from the 0.33.0 sdist: one request over half the pool stalls, and so do two under
    half (the messages have the numbers); one under half passes unfixed (the precondition); all pass
    with the patch."""
    from kvrepro.builds.patching import read_header
    from kvrepro.builds.standalone_test import run_standalone
    from kvrepro.records import PatchRef

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
