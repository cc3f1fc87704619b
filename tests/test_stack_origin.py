"""A build's failures its base does not show are introduced by its stack (issue 51;
kvrepro/report/stack.py): keyed as explore keys them (a stall by where the engine waits), judged
against the base build's runs of the same load, a base run cut short by another failure not
counted. Recorded runs only, no engine."""

from __future__ import annotations

import pytest

from kvrepro.records import LoadSummary, Outcome, RunResult, Signature, Verdict
from kvrepro.report import stack

X = "refused:WAITING|blocks-held-by-no-request"
Y = "refused:WAITING+self-reserved+async-load/reserved-by-self"


def _r(verdict: Verdict, rep: int = 0, where: str | None = None, **fields) -> RunResult:
    stopped = {Verdict.STALL: "stall", Verdict.CRASH: "engine_dead"}.get(verdict, "budget")
    return RunResult(build="b", rep=rep, verdict=verdict, outcome=Outcome.TARGET if verdict is Verdict.CRASH
                     else Outcome.NONE, title="t", trigger_count=1, external_hit_calls=1, requests=10, seconds=1.0,
                     stall_where=where, load=LoadSummary(10, 10, 0, 1.0, stopped), kv_check="ok", **fields)


CRASH = dict(signature=Signature("AssertionError", "update_state_after_alloc", "vllm/x.py", 829, "x"))


@pytest.mark.parametrize("name, mine, base, want", [
    ("a stall the base never shows", [_r(Verdict.STALL, i, X) for i in range(3)],
     [_r(Verdict.SURVIVED, i) for i in range(3)], [(f"stall:{X}", stack.INTRODUCED, 3, 3, 0, 3)]),
    ("the base's stall at the same place", [_r(Verdict.STALL, 0, Y)], [_r(Verdict.STALL, 0, Y)],
     [(f"stall:{Y}", stack.IN_BASE, 1, 1, 1, 1)]),
    # the base stalls elsewhere first: it never got to show this one
    ("another stall of the base", [_r(Verdict.STALL, 0, X)], [_r(Verdict.STALL, 0, Y)],
     [(f"stall:{X}", stack.UNDECIDED, 1, 1, 0, 0)]),
    ("wrong KV a fix exposes behind the base's crash", [_r(Verdict.CORRUPT, 0, kv_defects={"fa-hole": 2})],
     [_r(Verdict.CRASH, 0, **CRASH)], [("corruption:fa-hole", stack.UNDECIDED, 1, 1, 0, 0)]),
    ("an invariant the base keeps", [_r(Verdict.UNREACHED, i, invariants_broken={"block-leak": 2}) for i in (0, 1)],
     [_r(Verdict.UNREACHED, 0)], [("invariant:block-leak", stack.INTRODUCED, 2, 2, 0, 1)]),
    ("seen once with the stack", [_r(Verdict.UNREACHED, 0, invariants_broken={"block-leak": 2}),
                                  _r(Verdict.UNREACHED, 1)],
     [_r(Verdict.UNREACHED, 0), _r(Verdict.UNREACHED, 1)], [("invariant:block-leak", stack.UNDECIDED, 1, 2, 0, 2)]),
])
def test_each_failure_against_the_base_builds_runs(name, mine, base, want):
    got = stack.compare("P", mine, "A", base)
    assert [(f.key, f.origin, f.with_failed, f.with_runs, f.without_failed, f.without_runs) for f in got] == want, name


def test_three_of_three_against_none_of_three_is_significant_and_no_base_build_is_undecided():
    (f,) = stack.compare("P", [_r(Verdict.STALL, i, X) for i in range(3)], "A", [_r(Verdict.SURVIVED, i)
                                                                                 for i in range(3)])
    assert f.significant and f.p_value == pytest.approx(0.05)
    assert "3/3 with the stack, 0/3 on A, p = 0.05" in f.counts()
    (g,) = stack.compare("P", [_r(Verdict.STALL, 0, X)], None, [])
    assert g.origin == stack.UNDECIDED and g.p_value is None and "not run" in g.counts()
    lines = stack.lines([f, g])
    assert lines[0].startswith(f"P against A: introduced by its stack: stall:{X} (3/3 with the stack")


def test_the_base_build_is_the_stack_every_other_contains():
    stacks = {"A": ["pr-49146"], "B": ["pr-49146", "pr-52807"], "D": ["pr-49146", "pr-52771", "pr-52807"]}
    assert stack.base_of(stacks) == "A"
    assert stack.base_of({"B": ["pr-52807"], "C": ["pr-52771"]}) is None


def test_the_matrix_report_has_the_section_and_the_json(tmp_path):
    from test_report import DEFAULT, EXPECT, make_run

    from kvrepro.report import pages
    from kvrepro.report.render import matrix_json
    from kvrepro.report.sections import SectionContext, introduced

    run = make_run(tmp_path, DEFAULT, EXPECT)
    md = pages.to_markdown(introduced.blocks(run, SectionContext()))
    assert "## Introduced by each build's stack" in md and "| C | A | `crash:" in md
    rows = matrix_json(run)["introduced"]
    # C crashes as A does: already in the base; B and D survive: nothing to say
    assert [(r["build"], r["base_build"], r["origin"], r["with"], r["without"]) for r in rows] == [
        ("C", "A", "in the base", [3, 3], [3, 3])]


def _record(root, build: str, base: str, patches: list[str], runs: list[RunResult]) -> str:
    """A one-build matrix run written as the runner writes one (the suite's runs/<id>/)."""
    from conftest import planned_run

    from kvrepro.deploy.records import BuildRecord
    from kvrepro.results.records import HostInfo
    from kvrepro.results import store as results

    folder = results.create_run(root, "base: x\n", planned_run(**{
        "target": "sim", "base": base, "repetitions": len(runs), "build_order": [build],
        "builds": {build: {"patches": patches, "base": base}}, "expect": {}, "kvrepro_version": "0.1.0",
        "host": HostInfo("box", "Linux", "3.11", 2)}))
    results.write_json(folder.build_dir(build) / "build.json", BuildRecord(ok=True, ref="/overlays/x"))
    for rep, r in enumerate(runs):
        run_dir = folder.rep_dir(build, rep)
        results.write_json(run_dir / "verdict.json", RunResult(**{**r.__dict__, "build": build, "rep": rep,
                                                                  "run_dir": str(run_dir), "base": base}))
    folder.update(status="complete")
    return folder.run_id


def test_a_suite_on_a_stack_says_what_the_stack_introduced_from_its_entries_base_runs(tmp_path):
    """suite.json's base_run: the entry's runs on the release alone. The stack's stall at another place
    than the release's is introduced; the release's own stall is in the base."""
    from kvrepro.suite.records import SuiteBuildRecord, SuiteEntryRecord, SuiteRecord
    from kvrepro.results import store as results
    from kvrepro.suite import report as suite_report
    from kvrepro.suite.run import SUITE_FILE, load as load_catalogue, load_suite

    folder = tmp_path / "suite-1"
    runs = folder / "runs"
    runs.mkdir(parents=True)
    name = "recompute-failed-load-stall"
    stacked = _record(runs, name, "0.30.0", ["decoy-docstring"],
                      [_r(Verdict.STALL, 0, X, invariants_broken={"block-leak": 1}), _r(Verdict.STALL, 1, Y)])
    bare = _record(runs, name, "0.30.0", [], [_r(Verdict.STALL, 0, Y), _r(Verdict.STALL, 1, Y)])
    results.write_json(folder / SUITE_FILE, SuiteRecord(
        suite_id="suite-1", status="complete", started=1.0, finished=2.0, catalogue="c", command="",
        kvrepro_version="0.1.0", builds=(SuiteBuildRecord("0.30.0", ("decoy-docstring",)),),
        entries={name: SuiteEntryRecord(run=stacked, base_run=bare)}))
    suite = load_suite(folder, load_catalogue())
    got = {(f.key, f.origin, f.with_failed, f.without_failed, f.without_runs) for f in suite.introduced}
    # repetition 0: the base stalled at the release's place, before the stack's leak and stall could
    # show; repetition 1 of both stalled there: it counts for the base (0 of 1), the stack showed them once
    assert got == {(f"stall:{X}", stack.UNDECIDED, 1, 0, 1), (f"stall:{Y}", stack.IN_BASE, 1, 2, 2),
                   ("invariant:block-leak", stack.UNDECIDED, 1, 0, 1)}
    assert {f.build for f in suite.introduced} == {f"{name} on 0.30.0+decoy-docstring"}
    assert suite_report.as_json(suite)["introduced"][0]["base_build"] == "0.30.0"
