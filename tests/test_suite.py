"""The known-defect suite: defects/ loads (file:line errors), each entry's expectation per build,
rows judged from runs, and one real `kvrepro suite run` on 0.26.0 re-judged with one expectation
flipped (exactly that JUnit test case fails)."""

from __future__ import annotations

import dataclasses

import json
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from kvrepro.errors import SpecError
from kvrepro.records import LoadSummary, Outcome, RunResult, Signature, Verdict
from kvrepro.suite.catalogue import counter_value, expected_state
from kvrepro.suite.judge import judge
from kvrepro.suite.run import load

pytestmark = pytest.mark.shares_zygotes  # one engine zygote per runtime for the session (conftest.shares_zygotes)

ROOT = Path(__file__).resolve().parents[1]
CATALOGUE = ROOT / "defects"


def kvrepro(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvrepro.cli", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=900)


def entry(name: str, folder: Path = CATALOGUE):
    return next(e for e in load(folder).entries if e.name == name)


# --- the catalogue ------------------------------------------------------------------------------

def test_catalogue_loads_and_covers_every_kind():
    cat = load()
    names = [e.name for e in cat.entries]
    assert names == sorted(names) and len(names) >= 6
    assert {e.kind for e in cat.entries if e.testable} == {"crash", "corruption", "stall"}
    for e in cat.entries:
        assert e.file.name == f"{e.name}.yaml"
        assert e.testable or e.not_testable, e.name
    # every testable entry records the runs that measured it, and each names its test log
    logs = (ROOT / "tests" / "data" / "logs" / "README.md").read_text()
    for e in cat.entries:
        if e.testable:
            assert e.reproduced, f"{e.name}: no reproduced: run recorded"
            assert f"suite-{e.name}.log" in logs, e.name
            assert (ROOT / "tests" / "data" / "logs" / f"suite-{e.name}.log").is_file()


def test_each_entry_log_shows_its_signature():
    """tests/data/logs/suite-<entry>.log is an excerpt of the run that measured the entry: the
    classifier finds the crash signature in it, the shadow KV's lines attribute to the defect."""
    from kvrepro.classify import classify_file, read_exposure
    from kvrepro.classify.corruption import defects_of
    from kvrepro.classify.patterns import match_pattern

    for e in load().entries:
        if not e.testable:
            continue
        log = ROOT / "tests" / "data" / "logs" / f"suite-{e.name}.log"
        if e.kind == "crash":
            sig = classify_file(log).signature
            assert sig is not None and match_pattern(sig).name == e.signature, e.name
        elif e.kind == "corruption" and not e.present_in:
            # measured present nowhere (capable-connector-mamba-state): its log shows the path ran clean
            x = read_exposure(log.read_text())
            assert counter_value(x, e.path_counter) >= e.path_at_least and x.kv_violations == 0, e.name
        elif e.kind == "corruption":
            x = read_exposure(log.read_text())
            assert e.signature in defects_of(x.kv_violations, x.kv_violations_by, x.kv_first_violation_class,
                                             x.kv_groups), e.name
        else:
            last = log.read_text().splitlines()[-1]
            assert "Running: 0 reqs" in last and "Avg prompt throughput: 0.0" in last, e.name
            # the probe's counts before the stall show the entry's path (a counter the probe prints)
            x = read_exposure(log.read_text())
            if e.path_counter in ("deferred_lookups", "loads_behind_deferred", "injected_load_faults"):
                assert getattr(x, e.path_counter) >= e.path_at_least, e.name


def _bad(tmp_path: Path, name: str, text: str) -> str:
    folder = tmp_path / "cat"
    folder.mkdir(exist_ok=True)
    (folder / f"{name}.yaml").write_text(text)
    with pytest.raises(SpecError) as info:
        load(folder)
    return str(info.value)


GOOD = """name: x
kind: crash
title: t
signature: offload_update_state_after_alloc
matrix:
  runs: {requests: 10}
present_in: ["0.26.0"]
path: {counter: trigger_count}
"""


@pytest.mark.parametrize("change, line, field, words", [
    (("kind: crash", "kind: hang"), 2, "kind", "'crash', 'corruption', 'stall' or 'invariant'"),
    (("signature: offload_update_state_after_alloc", "signature: nope"), 4, "signature", "not a crash signature"),
    (("path: {counter: trigger_count}", "path: {counter: bogus}"), 8, "path.counter", "not a counter"),
    (("present_in: [\"0.26.0\"]", "present_in: [\"0.26\"]"), 7, "present_in", "must start with a release"),
    (("title: t", "title: t\ncolour: red"), 4, "colour", "unknown field"),
    (("  runs: {requests: 10}", "  runs: {requests: 0}"), 6, "matrix.runs.requests", "greater than or equal to 1"),
    (("  runs: {requests: 10}", "  builds: {A: []}"), 5, "matrix", "the suite chooses builds"),
    (("name: x", "name: y"), 1, "name", "name the file y.yaml"),
    (("path: {counter: trigger_count}", ""), 1, "path", "a testable entry needs path"),
    (("path: {counter: trigger_count}", "path: {counter: kv_hit_reads.mamba+cpu}"), 8, "path.counter", "not a counter"),
    (("runs: {requests: 10}\npresent_in: [\"0.26.0\"]\npath: {counter: trigger_count}",
      "runs: {requests: 10, repetitions: 2}\npresent_in: [\"0.26.0\"]\npath: {counter: trigger_count, absent_after: 3}"),
     8, "path.absent_after", "raise runs.repetitions"),
])
def test_a_bad_entry_is_one_line_naming_file_line_and_field(tmp_path, change, line, field, words):
    message = _bad(tmp_path, "x", GOOD.replace(*change))
    assert "\n" not in message
    assert message.startswith(f"{tmp_path / 'cat' / 'x.yaml'}:{line}: {field}: "), message
    assert words in message, message


def test_not_testable_needs_its_reason(tmp_path):
    message = _bad(tmp_path, "x", GOOD + "testable: false\n")
    assert message.startswith(f"{tmp_path / 'cat' / 'x.yaml'}:") and "not_testable: testable: false needs" in message


def test_a_release_that_refuses_an_entry_is_a_not_testable_row_not_bad_input():
    """recompute-failed-load-stall injects offload load faults through a connector that reports them per
    request, which kvrepro refuses before 0.30.0 (no per-request failure report in the scheduler): on
    0.29.0 the entry is NOT TESTABLE with that reason, its
    matrix runs on the other bases only, and a run on 0.29.0 alone runs nothing (no exit 2)."""
    from kvrepro.suite.judge import NOT_TESTABLE, not_testable_row
    from kvrepro.suite.run import SuiteBuild, check_entries, refused_builds

    e = entry("recompute-failed-load-stall")
    builds = [SuiteBuild("0.29.0"), SuiteBuild("0.30.0"), SuiteBuild("0.33.0")]
    refused = refused_builds(e, builds)
    assert list(refused) == ["0.29.0"] and "use base 0.30.0 or later" in refused["0.29.0"], refused
    assert check_entries([e], builds)[e.name].matrix.bases == ["0.30.0", "0.33.0"]
    assert check_entries([e], builds[:1]) == {}
    row = not_testable_row(e, "0.29.0", "0.29.0", (), refused["0.29.0"])
    assert row.state == NOT_TESTABLE and "0.30.0" in row.detail and row.matches is None
    # an entry no release refuses keeps every build
    assert refused_builds(entry("skipped-waiting-deadlock"), builds) == {}


def test_the_shipped_good_template_loads(tmp_path):
    (tmp_path / "x.yaml").write_text(GOOD)
    (only,) = load(tmp_path).entries
    assert only.fragment == {"runs": {"requests": 10}}


# --- expectations per build -----------------------------------------------------------------------

@pytest.mark.parametrize("name, release, patches, expected", [
    ("offload-boundary-assert", "0.25.1", (), "present"),
    ("offload-boundary-assert", "0.26.0", (), "present"),
    ("offload-boundary-assert", "0.26.0", ("pr-49146",), "present"),  # an unrelated patch changes nothing
    ("offload-boundary-assert", "0.26.0", ("pr-49146", "pr-52807"), "fixed"),
    ("offload-boundary-assert", "0.27.0", (), "fixed"),
    ("offload-boundary-assert", "0.30.0", (), "fixed"),  # "fixed in 0.27.0" holds for every later release
    ("offload-boundary-assert", "0.24.0", (), None),  # before anything the entry knows: no claim
    ("fa-hole-below-boundary", "0.26.0", (), None),  # code absent without pr-52807
    ("fa-hole-below-boundary", "0.26.0", ("pr-49146", "pr-52807"), "present"),
    ("fa-hole-below-boundary", "0.26.0", ("pr-49146", "pr-52807", "pr-48425"), "fixed"),  # more patches win
    ("fa-hole-below-boundary", "0.30.0", (), "fixed"),
    ("mamba-null-state", "0.26.0", ("pr-49146", "pr-52807"), "present"),
    ("mamba-null-state", "0.26.0", ("pr-48425",), "fixed"),
    ("skipped-waiting-deadlock", "0.30.0", (), "present"),
    ("skipped-waiting-deadlock", "0.26.0", (), None),  # masked by the target crash: no claim
    ("skipped-waiting-deadlock", "0.31.0", (), "fixed"),
    # masked_in names builds exactly and overrides there; another stack keeps its claim
    ("queued-abort-store-assert", "0.26.0", ("pr-49146",), "masked"),
    ("queued-abort-store-assert", "0.26.0", ("pr-49146", "pr-48425"), "fixed"),
    ("queued-abort-store-assert", "0.26.0", (), "present"),
    ("offload-boundary-assert", "0.26.0", ("pr-52807",), "masked"),
    ("offload-boundary-assert", "0.26.0", ("pr-52807", "pr-48425"), "fixed"),
    ("apply-cow-mamba-deeper", "0.27.0", (), "masked"),  # beats "fixed from 0.27.0 on"
    ("apply-cow-mamba-deeper", "0.28.0", (), "fixed"),
    ("cross-group-eviction-assert", "0.25.1", ("revert-pr-44409",), "present"),
    ("mamba-align-external-hit-assert", "0.25.1", (), "unreached"),  # its load goes blind there
    ("mamba-align-external-hit-assert", "0.26.0", (), "fixed"),
])
def test_expected_state_per_build(name, release, patches, expected):
    assert expected_state(entry(name), release, patches) == expected


# --- rows from runs -------------------------------------------------------------------------------

def _run(verdict=Verdict.SURVIVED, rep=0, **kw) -> RunResult:
    fields = dict(build="x", rep=rep, verdict=verdict, outcome=Outcome.NONE, title="t", trigger_count=5,
                  external_hit_calls=5, requests=200, seconds=1.0, prefix_cache_hits=100,
                  load=LoadSummary(200, 200, 0, 1.0, "budget"))
    fields.update(kw)
    return RunResult(**fields)


TARGET = Signature("AssertionError", "update_state_after_alloc",
                   "vllm/distributed/kv_transfer/kv_connector/v1/offloading/scheduler.py", 815,
                   "num_locally_computed_tokens <= num_locally_computed_gpu_blocks * tokens_per_block")


def test_rows():
    crash = entry("offload-boundary-assert")
    hit = _run(Verdict.CRASH, outcome=Outcome.TARGET, signature=TARGET, load=LoadSummary(4, 3, 1, 1.0, "engine_dead", 3))
    row = judge(crash, "0.26.0", "0.26.0", (), [hit])
    assert (row.state, row.expected, row.matches) == ("PRESENT", "present", True)
    assert "rep 0, request 4" in row.detail
    row = judge(crash, "0.30.0", "0.30.0", (), [_run(), _run(rep=1)])
    assert (row.state, row.matches, row.detail) == ("ABSENT", True, "path ran: trigger_count 5/5")
    row = judge(crash, "0.30.0", "0.30.0", (), [_run(), _run(rep=1, trigger_count=0)])
    assert (row.state, row.matches) == ("UNREACHED", False)  # the path must run in every repetition
    row = judge(crash, "0.26.0", "0.26.0", (), [_run(Verdict.INFRA, title="engine did not start")])
    assert (row.state, row.matches) == ("INFRA", None)
    refused = _run(Verdict.INFRA, title="engine exited with code 2 before it became healthy: argument error: "
                   "argument --mamba-cache-mode: invalid choice: 'all' (choose from 'align', 'none')",
                   refused_arguments="argument --mamba-cache-mode: invalid choice: 'all' (choose from 'align', 'none')")
    row = judge(crash, "0.32.0", "0.32.0", (), [refused])
    assert (row.state, row.matches) == ("NOT TESTABLE", None)
    assert row.detail.startswith("this release's vllm serve refuses the entry's engine: argument --mamba-cache-mode")
    # the typed field decides, not the words: a title that merely quotes "argument error: " is INFRA
    worded = _run(Verdict.INFRA, title="engine exited with code 2: argument error: unrecognized arguments")
    assert judge(crash, "0.32.0", "0.32.0", (), [worded]).state == "INFRA"
    null = entry("mamba-null-state")
    row = judge(null, "0.26.0", "0.26.0", (), [hit])  # crashed, but the corruption came first
    assert row.state == "ABSENT" or row.state == "OTHER"
    row = judge(null, "0.26.0", "0.26.0", (), [_run(Verdict.CRASH, kv_defects={"mamba-null-state": 2})])
    assert (row.state, row.matches) == ("PRESENT", True)
    row = judge(null, "0.26.0", "0.26.0", (), [_run(Verdict.CRASH, outcome=Outcome.TARGET, signature=TARGET)])
    assert row.state == "OTHER" and row.matches is False  # another failure ended the run: not evidence
    stall = entry("skipped-waiting-deadlock")
    four = [_run(Verdict.SURVIVED, rep=i, loads_behind_deferred=80 + i) for i in range(4)]
    row = judge(stall, "0.31.0", "0.31.0", (), four)
    assert (row.state, row.expected, row.matches) == ("ABSENT", "fixed", True)  # the budget ran, 4 times
    assert row.detail == "path ran: loads_behind_deferred 80/81/82/83"
    # offload hits alone are not the stall's path: no load was admitted behind a deferred lookup once
    blind = [dataclasses.replace(run, loads_behind_deferred=0 if run.rep == 2 else 5) for run in four]
    row = judge(stall, "0.31.0", "0.31.0", (), blind)
    assert (row.state, row.matches) == ("UNREACHED", False)
    row = judge(stall, "0.31.0", "0.31.0", (), four[:1])
    # one clean run of a defect that shows in some runs only says little: absent_after 4
    assert (row.state, row.matches) == ("UNREACHED", False) and "1 of the 4 repetitions" in row.detail
    # the same budget with wrong KV in one repetition: another failure, named, never ABSENT
    corrupt = [*four[:3], _run(Verdict.CORRUPT, rep=3, loads_behind_deferred=83, kv_violations=7,
                                kv_defects={"mamba-null-state": 5, "unknown": 2})]
    row = judge(stall, "0.31.0", "0.31.0", (), corrupt)
    assert (row.state, row.matches) == ("OTHER", False)
    assert row.detail == "CORRUPT in 1/4 reps (rep 3: 7 KV violations, mamba-null-state x5, unknown x2)"
    # a corruption entry whose own defect is in the corrupt run stays PRESENT
    assert judge(null, "0.26.0", "0.26.0", (), corrupt).state == "PRESENT"
    # a corruption entry's path is the shadow KV's count of requests resumed from a hit, per group kind
    clean = _run(Verdict.SURVIVED, kv_hit_reads={"mamba": 3, "mamba+offload": 3})
    assert judge(null, "0.30.0", "0.30.0", (), [clean]).detail == "path ran: kv_hit_reads.mamba 3"
    blind = _run(Verdict.SURVIVED, kv_checks=9, kv_stored={"full_attention": 40})
    row = judge(null, "0.30.0", "0.30.0", (), [blind])
    assert row.state == "UNREACHED" and row.detail.endswith("kv_hit_reads.mamba 0; stored full_attention:40")


def test_a_crash_entrys_corrupt_run_is_other_naming_the_corruption_not_absent():
    """Issue 25: truncate-lagging-mamba's runs on 0.32.0/0.33.0 were CORRUPT (the shadow KV's then
    missing copy-on-write model) and their rows said ABSENT: the crash path ran, the wrong KV went unseen."""
    crash = entry("truncate-lagging-mamba")
    seen = _run(Verdict.CORRUPT, truncate_calls=48, kv_checks=491, kv_violations=73,
                kv_defects={"unknown": 54, "mamba-chunk-store-gap": 14, "fa-hole-below-mamba-hit": 5})
    row = judge(crash, "0.33.0", "0.33.0", (), [seen])
    assert (row.state, row.expected, row.matches) == ("OTHER", "fixed", False)
    assert row.detail == ("CORRUPT in 1/1 reps (rep 0: 73 KV violations, unknown x54, mamba-chunk-store-gap x14, "
                          "fa-hole-below-mamba-hit x5)")
    # also when the path stayed below at_least: wrong KV is named before "the load went blind"
    assert judge(crash, "0.33.0", "0.33.0", (), [dataclasses.replace(seen, truncate_calls=0)]).state == "OTHER"
    clean = dataclasses.replace(seen, verdict=Verdict.UNREACHED, kv_violations=0, kv_defects={})
    row = judge(crash, "0.33.0", "0.33.0", (), [clean])
    assert (row.state, row.matches, row.detail) == ("ABSENT", True, "path ran: truncate_calls 48")


def test_a_masked_build_is_masked_only_by_another_catalogued_defect():
    """Issue 50: `suite run --base 0.26.0 --patch pr-49146 --entry queued-abort-store-assert` exited 1,
    'expected fixed, got OTHER (CORRUPT in 2/2 reps, mamba-null-state x24)': the fix's own build reads
    another catalogued defect's wrong KV first. masked_in says so, and the row is MASKED, not a mismatch."""
    from kvrepro.suite.judge import others_of

    catalogue = load(CATALOGUE)
    queued = entry("queued-abort-store-assert")
    others = others_of(catalogue, queued)
    assert "mamba-null-state" in others
    corrupt = [_run(Verdict.CORRUPT, rep=i, finished_unscheduled=8, kv_violations=24,
                    kv_defects={"mamba-null-state": 24}) for i in range(2)]
    row = judge(queued, "0.26.0+pr-49146", "0.26.0", ("pr-49146",), corrupt, others=others)
    assert (row.state, row.expected, row.matches, row.measured, row.ended_by) == (
        "MASKED", "masked", True, "OTHER", "mamba-null-state")
    assert row.detail.startswith("masked by mamba-null-state")
    # wrong KV of no known defect is a finding, never masked
    unknown = [dataclasses.replace(r, kv_defects={"mamba-null-state": 20, "unknown": 4}) for r in corrupt]
    row = judge(queued, "0.26.0+pr-49146", "0.26.0", ("pr-49146",), unknown, others=others)
    assert (row.state, row.matches, row.ended_by) == ("OTHER", False, None)
    # the load ran clean: the masking the catalogue claims did not happen, which is a disagreement too
    clean = [_run(rep=i, finished_unscheduled=8) for i in range(2)]
    row = judge(queued, "0.26.0+pr-49146", "0.26.0", ("pr-49146",), clean, others=others)
    assert (row.state, row.matches) == ("ABSENT", False)
    # without the catalogue's other entries nothing can mask: OTHER, a mismatch, as before issue 50
    assert judge(queued, "0.26.0+pr-49146", "0.26.0", ("pr-49146",), corrupt).state == "OTHER"
    # a crash with the entry's own signature where another entry shares it (the boundary assertion on
    # 0.25.1 for cross-group-eviction-assert): the suite cannot tell them apart, masked_in says which
    cross = entry("cross-group-eviction-assert")
    hit = _run(Verdict.CRASH, outcome=Outcome.TARGET, signature=TARGET, load=LoadSummary(8, 7, 1, 1.0, "engine_dead", 7))
    row = judge(cross, "0.25.1", "0.25.1", (), [hit], others=others_of(catalogue, cross))
    assert (row.state, row.matches) == ("MASKED", True)
    # a crash nobody catalogues ends the run: OTHER, a mismatch on a masked build
    strange = _run(Verdict.CRASH, outcome=Outcome.OTHER_CRASH, signature=Signature("KeyError", "f", "vllm/x.py", 1, "k"))
    row = judge(cross, "0.25.1", "0.25.1", (), [strange], others=others_of(catalogue, cross))
    assert (row.state, row.matches, row.ended_by) == ("OTHER", False, None)


# --- a real suite run, re-judged ------------------------------------------------------------------

def test_suite_run_on_0_26_0_and_a_flipped_expectation_fails_exactly_that_case(tmp_path, runtime_python):
    """One quick entry on vLLM 0.26.0 (the target crash within a few requests), two entries that are
    not testable, one that 0.26.0 refuses (offload load faults need 0.30.0: a row, not exit 2); then the recorded run judged against a catalogue copy that says 0.26.0 is fixed."""
    junit = tmp_path / "suite.xml"
    proc = kvrepro("suite", "run", "--base", "0.26.0", "--entry", "offload-boundary-assert",
                   "--entry", "mamba-hash-before-write", "--entry", "offload-unrecorded-alloc-stale-store",
                   "--entry", "recompute-failed-load-stall", "--reps", "1",
                   "--results", str(tmp_path / "results"), "--junit", str(junit), "--json", "--ci")
    assert proc.returncode == 0, proc.stderr[-3000:]
    suite = json.loads(proc.stdout)
    rows = {r["entry"]: r for r in suite["rows"]}
    assert rows["offload-boundary-assert"]["state"] == "PRESENT", rows
    assert rows["offload-boundary-assert"]["expected"] == "present" and rows["offload-boundary-assert"]["matches"]
    assert "offload_update_state_after_alloc" in rows["offload-boundary-assert"]["detail"]
    assert rows["mamba-hash-before-write"]["state"] == "NOT TESTABLE"
    assert rows["offload-unrecorded-alloc-stale-store"]["state"] == "NOT TESTABLE"
    refused = rows["recompute-failed-load-stall"]
    assert refused["state"] == "NOT TESTABLE" and "use base 0.30.0 or later" in refused["detail"] and not refused["run_dirs"]
    cases = ET.parse(junit).getroot().findall(".//testcase")
    assert len(cases) == 4
    assert not ET.parse(junit).getroot().findall(".//failure")
    assert len(ET.parse(junit).getroot().findall(".//skipped")) == 3
    run_dir = Path(rows["offload-boundary-assert"]["run_dirs"][0])
    assert (run_dir / "engine.log").is_file() and (run_dir / "verdict.json").is_file()

    flipped = tmp_path / "defects"
    shutil.copytree(CATALOGUE, flipped)
    path = flipped / "offload-boundary-assert.yaml"
    text = path.read_text()
    assert 'present_in: ["0.25.1", "0.26.0"]' in text
    path.write_text(text.replace('present_in: ["0.25.1", "0.26.0"]', 'present_in: ["0.25.1"]')
                    .replace('fixed_in: ["0.27.0",', 'fixed_in: ["0.26.0", "0.27.0",'))
    junit2 = tmp_path / "flipped.xml"
    proc = kvrepro("suite", "report", suite["path"], "--catalogue", str(flipped), "--junit", str(junit2), "--ci")
    assert proc.returncode == 1, proc.stderr[-3000:]
    import xmlschema

    schema = xmlschema.XMLSchema(ROOT / "tests" / "data" / "junit" / "junit.xsd")
    schema.validate(junit.read_text())  # as kvrepro's matrix JUnit: what Jenkins, GitLab and GitHub read
    schema.validate(junit2.read_text())
    root = ET.parse(junit2).getroot()
    failed = [(c.get("classname"), c.get("name")) for c in root.findall(".//testcase") if c.find("failure") is not None]
    assert failed == [("kvrepro.suite.offload-boundary-assert", "0.26.0")]
    assert root.get("failures") == "1" and root.get("tests") == "4"
    assert "expected fixed, got PRESENT" in ET.tostring(root, encoding="unicode")


def test_the_table_fits_80_columns():
    from rich.console import Console

    from kvrepro.suite.report import table
    from kvrepro.suite.run import SuiteBuild, SuiteResult

    crash = entry("offload-boundary-assert")
    rows = (judge(crash, "0.26.0+pr-49146+pr-52807+pr-48425", "0.26.0", ("pr-49146", "pr-52807", "pr-48425"),
                  [_run(), _run(rep=1)]),
            judge(entry("fa-hole-below-mamba-hit"), "0.26.0", "0.26.0", (),
                  [_run(Verdict.CRASH, outcome=Outcome.TARGET, signature=TARGET, title="AssertionError in "
                        "update_state_after_alloc: num_locally_computed_tokens <= num_locally_computed_gpu_blocks")]))
    suite = SuiteResult("suite-x", Path("results/suite-x"), "complete", "defects",
                        (SuiteBuild("0.26.0", ("pr-49146", "pr-52807", "pr-48425")),), rows, 123.0)
    console = Console(width=80, record=True, color_system=None)
    console.print(table(suite))
    text = console.export_text()
    assert max(len(line) for line in text.splitlines()) <= 80, text
    assert "ABSENT" in text and "OTHER" in text and "FAIL" in text


def test_suite_list_json():
    proc = kvrepro("suite", "list", "--json")
    assert proc.returncode == 0, proc.stderr[-2000:]
    listed = {e["name"]: e for e in json.loads(proc.stdout)}
    assert set(listed) == {e.name for e in load().entries}
    # the reason travels with every entry that is not testable, and only with those
    assert all(bool(listed[e.name]["not_testable"]) == (not e.testable) for e in load().entries)
    assert listed["offload-boundary-assert"]["reproduced"][0]["builds"] == {"0.26.0": "PRESENT", "0.30.0": "ABSENT"}


def test_revert_and_hash_unit_entries_load_with_what_they_need():
    """cross-group-eviction-assert is present only on revert stacks (a patch matrix.yaml applies in
    reverse); truncate-lagging-mamba's fragment sets a prefix-match unit below the block, which its
    matrix turns into `--prefix-match-unit`. Both are testable and have path counters."""
    from kvrepro.spec.matrix import load_matrix
    from kvrepro.suite.catalogue import parse_build_key
    from kvrepro.suite.run import SuiteBuild, entry_matrix

    entries = {e.name: e for e in load().entries}
    cross = entries["cross-group-eviction-assert"]
    assert cross.testable and cross.path_counter == "trigger_count"
    reverts = {p for key in cross.present_in for p in parse_build_key(key)[1]}
    assert reverts == {"revert-pr-44409"} and load_matrix(ROOT / "matrix.yaml").patch_ref("revert-pr-44409").reverse
    assert expected_state(cross, "0.27.0", ("revert-pr-44409",)) == "present"
    assert expected_state(cross, "0.27.0") == "fixed"
    # #44409 is in every release (fixed_in 0.25.1, which triage reports); where the boundary assertion,
    # same signature, crashes first the suite expects MASKED, except on the revert stack
    assert expected_state(cross, "0.25.1") == "masked" and expected_state(cross, "0.26.0") == "masked"
    assert expected_state(cross, "0.25.1", ("revert-pr-44409",)) == "present"
    assert cross.fixed_in == ("0.25.1",) and expected_state(cross, "0.28.0") == "fixed"
    trunc = entries["truncate-lagging-mamba"]
    assert trunc.testable and trunc.path_counter
    engine = entry_matrix(trunc, [SuiteBuild("0.27.0")]).matrix.engine
    args = engine.serve_args("m", include_sim=False)
    assert args[args.index("--prefix-match-unit") + 1] == "16" and engine.block_size == 32
