"""report.md / report.html, JUnit, `results compare` and the typed read-back, on result folders
made with the results API (real files; no engine runs here -- test_report_e2e.py runs one)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import xmlschema
from markdown_it import MarkdownIt

from kvrepro.report import junit, pages, render as report
from kvrepro.report import document
from kvrepro.results import store as results
from kvrepro.report.compare import compare
from kvrepro.builds.records import BuildManifest
from kvrepro.deploy.records import BuildRecord
from kvrepro.records import LoadSummary, Outcome, RunResult, Signature, Verdict
from kvrepro.results.records import HostInfo
from kvrepro.results.store import ResultsSchemaError
from conftest import planned_run

ROOT = Path(__file__).resolve().parents[1]
XSD = ROOT / "tests" / "data" / "junit" / "junit.xsd"
ASSERTION = "AssertionError in update_state_after_alloc: num_locally_computed_tokens <= x"
# a fatal traceback as the GPU-free engine logs it (lines trimmed)
ENGINE_LOG = """\
INFO 11-30 13:46:40 [server.py:1] Application startup complete.
ERROR 11-30 13:46:45 [loop.py:163] EngineCore encountered a fatal error.
ERROR 11-30 13:46:45 [loop.py:163] Traceback (most recent call last):
ERROR 11-30 13:46:45 [loop.py:163]   File "/o/vllm/v1/core/sched/scheduler.py", line 963, in schedule
ERROR 11-30 13:46:45 [loop.py:163]     self.connector.update_state_after_alloc(
ERROR 11-30 13:46:45 [loop.py:163]   File "/o/kvrepro_probe.py", line 156, in update_state_after_alloc
ERROR 11-30 13:46:45 [loop.py:163]     return original(*args, **kwargs)
ERROR 11-30 13:46:45 [loop.py:163]   File "/o/vllm/distributed/kv_transfer/kv_connector/v1/offloading/scheduler.py", line 829, in update_state_after_alloc
ERROR 11-30 13:46:45 [loop.py:163]     num_locally_computed_tokens
ERROR 11-30 13:46:45 [loop.py:163] AssertionError
"""


def _run(build: str, rep: int, verdict: Verdict, requests: int, run_dir: Path, state: int = 0) -> RunResult:
    crashed = verdict is Verdict.CRASH
    return RunResult(
        build=build, rep=rep, verdict=verdict, outcome=Outcome.TARGET if crashed else Outcome.NONE,
        title=ASSERTION if crashed else "no crash", trigger_count=5 + rep, external_hit_calls=9, requests=requests,
        seconds=4.0 + rep, run_dir=str(run_dir), base="0.26.0", state_count=state,
        state_groups={"full_attention": state} if state else {}, kv_check="ok",
        load=LoadSummary(requests, requests, 0, 1.5 + rep, "engine_dead" if crashed else "budget"),
        signature=Signature("AssertionError", "update_state_after_alloc", "vllm/x.py", 829, "x") if crashed else None,
        offload_load_jobs=11)


def make_run(root: Path, verdicts: dict[str, list[Verdict]], expect: dict[str, str] | None = None,
             base: str = "0.26.0") -> results.MatrixRun:
    """A recorded 2x2-style run written exactly as the runner writes one."""
    stacks = {"A": ["pr-49146"], "B": ["pr-49146", "pr-52807"], "C": ["pr-49146", "pr-52771"],
              "D": ["pr-49146", "pr-52771", "pr-52807"]}
    names = list(verdicts)
    folder = results.create_run(root, "base: x\n", planned_run(**{
        "target": "sim", "base": base, "repetitions": 3, "build_order": names,
        "builds": {n: {"patches": stacks[n], "base": base} for n in names},
        "expect": expect or {}, "kvrepro_version": "0.1.0",
        "host": HostInfo("box", "Linux", "3.11", 2),
    }))
    for name in names:
        results.write_json(folder.build_dir(name) / "build.json", BuildRecord(
            ok=True, ref="/overlays/x", manifest=BuildManifest(wheel="vllm-0.26.0.whl", wheel_sha256="ab" * 32,
                                                           probe_sha256="cd" * 32)))
        for rep, verdict in enumerate(verdicts[name]):
            run_dir = folder.rep_dir(name, rep)
            results.write_json(run_dir / "manifest.json", {
                "build": name, "rep": rep, "base": base, "target": "sim",
                "patches": [{"name": p, "upstream": "u", "sha256": "ef" * 32} for p in stacks[name]],
                "engine_args": ["qwen3-next-tiny", "--block-size", "16"], "kvrepro_version": "0.1.0"})
            if verdict is Verdict.CRASH:
                (run_dir / "engine.log").write_text(ENGINE_LOG)
            requests = 40 + 30 * rep if verdict is Verdict.CRASH else 600
            results.write_json(run_dir / "verdict.json",
                               _run(name, rep, verdict, requests, run_dir, state=3 if name in "BD" else 1))
    folder.update(status="complete")
    return results.load_run(root, folder.run_id)


C, S = Verdict.CRASH, Verdict.SURVIVED
DEFAULT = {"A": [C, C, C], "B": [S, S, S], "C": [C, C, C], "D": [S, S, S]}
EXPECT = {"A": "CRASH(target)", "B": "SURVIVED", "C": "CRASH(target)", "D": "SURVIVED"}


def test_results_read_back_as_the_records_written(tmp_path):
    run = make_run(tmp_path, DEFAULT, EXPECT)
    b = run.build("B")
    assert b is not None and b.patches == ("pr-49146", "pr-52807") and b.expect == "SURVIVED"
    first = b.runs[0]
    assert isinstance(first, RunResult) and first.verdict is Verdict.SURVIVED
    assert first.load == LoadSummary(600, 600, 0, 1.5, "budget") and first.state_groups == {"full_attention": 3}
    assert b.build is not None and b.build.probe_sha256 == "cd" * 32
    assert b.manifest is not None and b.manifest.engine_args == ("qwen3-next-tiny", "--block-size", "16")
    assert run.info.host == HostInfo("box", "Linux", "3.11", 2)


def test_run_without_base_takes_the_runs_base(tmp_path):
    run = make_run(tmp_path, {"A": [C]})
    path = run.path / "A" / "0" / "verdict.json"
    data = json.loads(path.read_text())
    del data["base"]
    path.write_text(json.dumps(data))
    assert results.load_run(tmp_path, "latest").builds[0].runs[0].base == "0.26.0"


def test_a_folder_of_another_kvrepro_is_one_clear_line(tmp_path):
    run = make_run(tmp_path, {"A": [C]})
    info = json.loads((run.path / "run.json").read_text())
    del info["schema"]  # what kvrepro 0.1.0 wrote before results were versioned
    (run.path / "run.json").write_text(json.dumps(info))
    with pytest.raises(ResultsSchemaError, match=r"written by an older kvrepro \(0\.1\.0, results schema 1\)"):
        results.load_run(tmp_path, run.run_id)
    info["schema"] = 99
    (run.path / "run.json").write_text(json.dumps(info))
    with pytest.raises(ResultsSchemaError, match="a newer kvrepro"):
        results.load_run(tmp_path, run.run_id)
    proc = subprocess.run([sys.executable, "-m", "kvrepro.cli", "report", run.run_id, "--results", str(tmp_path)],
                          capture_output=True, text=True)
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr, proc.stderr


def test_a_field_of_the_wrong_type_names_the_file_and_field(tmp_path):
    run = make_run(tmp_path, {"A": [C]})
    path = run.path / "A" / "0" / "verdict.json"
    data = json.loads(path.read_text())
    data["state_count"] = "many"
    path.write_text(json.dumps(data))
    # one damaged verdict.json degrades that repetition only (issue 16): DAMAGED, and its title says why
    (shown,) = results.load_run(tmp_path, "latest").builds[0].runs
    assert shown.label == "DAMAGED"
    assert re.search(r"A/0/verdict.json: field state_count: expected an integer", shown.title), shown.title


def test_report_markdown_has_the_table_stats_and_image_link(tmp_path):
    run = make_run(tmp_path, DEFAULT, EXPECT)
    md_path, html_path = document.write_report(run)
    md = md_path.read_text()
    assert "Every verdict as `expect:` says." in md
    assert ("| 0.26.0 | A | pr-49146 | CRASH(target) | 3x CRASH(target) ✓ | 3/3 = 100% (29-100%) | "
            "crash at 40, 70, 100 |") in md
    assert ("| 0.26.0 | B | pr-49146 → pr-52807 | SURVIVED | 3x SURVIVED ✓ | 0/3 = 0% (0-71%), <= 63% | "
            "none (runs ended at 600, 600, 600) |") in md
    assert "| `pr-52807` | any | A → B | 3/3 | 0/3 | 0.05 | 1 |" in md
    assert "| `pr-52807` | target | A → B | 3/3 | 0/3 | 0.05 | 1 |" in md
    assert "| interaction (does one patch change what the other does?) | +0 pts | -65 to +65 pts |" in md
    assert "![time to first failure per build" in md and (run.path / "survival.png").read_bytes().startswith(b"\x89PNG")
    # the crash section carries the traceback's relevant lines, without the probe's wrapper frame
    assert 'File "vllm/distributed/kv_transfer/kv_connector/v1/offloading/scheduler.py", line 829' in md
    assert "kvrepro_probe.py" not in md
    assert "vllm serve qwen3-next-tiny --block-size 16" in md
    # as a PR comment preview renders it: real tables and an image
    rendered = MarkdownIt("commonmark").enable("table").render(md)
    assert rendered.count("<table>") >= 4 and '<img src="survival.png"' in rendered


def test_report_html_is_self_contained_and_readable_without_script(tmp_path):
    run = make_run(tmp_path, DEFAULT, EXPECT)
    _, html_path = document.write_report(run)
    page = html_path.read_text()
    assert "<script" not in page
    assert not re.search(r'(src|href)="(https?:)?//', page)  # nothing fetched when it is opened
    assert "<svg" in page and "time to crash" not in page.split("<svg", 1)[0][-200:]
    assert '<td class="bad">3x CRASH(target) ✓</td>' in page
    assert '<td class="good">3x SURVIVED ✓</td>' in page
    # the curve of a build that crashed goes down to 0; text is drawn as paths (no font needed)
    assert "<text" not in page.split("<svg", 1)[1]


def test_a_differing_verdict_is_named_in_the_report(tmp_path):
    run = make_run(tmp_path, {"A": [C, C, C], "B": [S, C, S]}, {"A": "CRASH(target)", "B": "SURVIVED"})
    md = pages.to_markdown(document.document(run))
    assert "**1 verdict(s) differ from `expect:`**: build B rep 1: CRASH(target), expected SURVIVED" in md
    assert "SURVIVED CRASH(target) SURVIVED ✗ (expected SURVIVED)" in md


def _junit_cases(xml_text: str) -> dict[str, str]:
    """testcase name -> "pass" | "failure: message" | "error: message" | "skipped"."""
    import xml.etree.ElementTree as ET

    out = {}
    for case in ET.fromstring(xml_text).iter("testcase"):
        status = "pass"
        for tag in ("failure", "error", "skipped"):
            el = case.find(tag)
            if el is not None:
                status = f"{tag}: {el.get('message')}"
        out[case.get("name")] = status
    return out


def test_junit_validates_against_the_schema_and_names_expected_and_actual(tmp_path):
    schema = xmlschema.XMLSchema(XSD)
    run = make_run(tmp_path / "a", DEFAULT, EXPECT)
    xml_ok = junit.junit_xml(run)
    schema.validate(xml_ok)
    cases = _junit_cases(xml_ok)
    assert len(cases) == 12 and set(cases.values()) == {"pass"}
    assert "trigger count: 5" in xml_ok and "AssertionError" in xml_ok  # evidence in system-out

    flipped = dict(EXPECT, B="CRASH(target)")  # flip one expect:
    run = make_run(tmp_path / "b", DEFAULT, flipped)
    xml_bad = junit.junit_xml(run)
    schema.validate(xml_bad)
    cases = _junit_cases(xml_bad)
    failing = {name for name, status in cases.items() if status != "pass"}
    assert failing == {"B rep 0", "B rep 1", "B rep 2"}
    assert cases["B rep 0"] == "failure: expected CRASH(target), got SURVIVED"


def test_junit_infra_is_an_error_interrupted_is_skipped_and_control_characters_are_escaped(tmp_path):
    run = make_run(tmp_path, {"A": [C, C]}, {"A": "CRASH(target)"})
    bad_dir = run.path / "A" / "1"
    infra = RunResult(build="A", rep=1, verdict=Verdict.INFRA, outcome=Outcome.INFRA, title="engine did not start",
                      trigger_count=0, external_hit_calls=0, requests=0, seconds=0.5, run_dir=str(bad_dir),
                      infra_error="pip said \x1b[31mERROR\x1b[0m")
    results.write_json(bad_dir / "verdict.json", infra)
    results.write_json(run.path / "A" / "2" / "verdict.json", RunResult(
        build="A", rep=2, verdict=Verdict.INTERRUPTED, outcome=Outcome.NONE, title="interrupted",
        trigger_count=0, external_hit_calls=0, requests=3, seconds=0.5))
    xml_text = junit.junit_xml(results.load_run(tmp_path, "latest"))
    xmlschema.XMLSchema(XSD).validate(xml_text)
    cases = _junit_cases(xml_text)
    assert cases == {"A rep 0": "pass", "A rep 1": "error: infrastructure: engine did not start",
                     "A rep 2": "skipped: interrupted before the budget was spent"}
    assert "\\x1b[31mERROR" in xml_text


def test_compare_names_the_builds_whose_verdicts_changed(tmp_path):
    before = make_run(tmp_path, DEFAULT, EXPECT)
    after = make_run(tmp_path, {"A": [S, S, S], "B": [S, S, S], "C": [C, C, C], "D": [S, S, S]}, base="0.27.1")
    c = compare(before, after)
    assert [b.build for b in c.changed] == ["A"]
    a = c.builds[0]
    assert (a.before, a.after) == ("3x CRASH(target)", "3x SURVIVED") and a.p_value == pytest.approx(0.1)
    proc = subprocess.run([sys.executable, "-m", "kvrepro.cli", "results", "compare", before.run_id, after.run_id,
                           "--json", "--results", str(tmp_path)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["changed"] == ["A"]


def _bisection():
    from kvrepro.bisect.points import ReleasePoint
    from kvrepro.report.records import BisectResult, BisectStep

    steps = (BisectStep(ReleasePoint("0.26.0"), "0.26.0", "bad end", "bad", {"CRASH(target)": 3}, None),
             BisectStep(ReleasePoint("0.29.0"), "0.29.0", "midpoint", "good", {"SURVIVED": 2}, 2, state="handled"))
    return BisectResult(kind="releases", answer="0.29.0", reason="", confidence=0.96, p_bad=0.8, alpha=0.05,
                        steps=steps, status="complete", bisection_id="bisect-x", path="results/bisect-x",
                        detail={"direction": "fixed", "first_good": "0.29.0"})


def test_bisection_steps_render_in_every_format():
    from rich.console import Console

    from kvrepro.report import bisection

    result = _bisection()
    md = pages.to_markdown(bisection.bisection_blocks(result))
    assert "| 2 | midpoint | `0.29.0` | GOOD (handled) | 2x SURVIVED | 2 |" in md, md
    assert "**answer: 0.29.0 (p_bad 0.8, alpha 0.05, confidence 0.960)**" in md
    assert '<td class="bad">BAD</td>' in pages.to_html("b", bisection.bisection_blocks(result))
    console = Console(width=200, record=True)
    console.print(bisection.bisection_table(result))
    text = console.export_text()
    assert "kvrepro bisect releases bisect-x (complete)" in text and "answer: 0.29.0" in text
    assert "first_good: 0.29.0" in text and "recorded: results/bisect-x" in text
    data = bisection.bisection_json(result)
    assert list(data)[:3] == ["answer", "reason", "steps"]
    assert data["steps"][0]["point"] == {"kind": "release", "release": "0.26.0"}
    assert "0.26.0: BAD" in bisection.step_line(result.steps[0])


def test_bisection_report_alone_and_inside_a_matrix_report(tmp_path):
    from kvrepro.report import bisection

    md_path, html_path = bisection.write_bisection_report(_bisection(), tmp_path)
    assert "| 1 | bad end | `0.26.0` | BAD | 3x CRASH(target) | - |" in md_path.read_text()
    assert "<h2>Bisection</h2>" in html_path.read_text()
    run = make_run(tmp_path / "r", {"A": [C]})
    md, _ = document.write_report(run, bisection=bisection.bisection_blocks(_bisection()))
    text = md.read_text()
    assert text.index("## Bisection") < text.index("## Time to first failure")


def test_step_summary_is_appended_when_github_provides_it(tmp_path, monkeypatch):
    summary = tmp_path / "summary.md"
    summary.write_text("earlier step\n")
    monkeypatch.setenv("GITHUB_STEP_SUMMARY", str(summary))
    assert report.append_step_summary("| a |\n") == summary
    assert summary.read_text() == "earlier step\n| a |\n"
    monkeypatch.delenv("GITHUB_STEP_SUMMARY")
    assert report.append_step_summary("x") is None


def test_markdown_too_long_for_a_pr_comment_leaves_out_the_details(tmp_path, monkeypatch):
    """The limit (GitHub's comment size) is lowered so that a small run exceeds it: no fake
    beyond that constant; the report code runs as it would on a long run."""
    run = make_run(tmp_path, DEFAULT, EXPECT)
    monkeypatch.setattr(document, "MARKDOWN_LIMIT", 3000)
    md_path, html_path = document.write_report(run)
    md = md_path.read_text()
    assert "left out to fit a PR comment" in md and "## Runs" not in md and "| 0.26.0 | A |" in md
    assert "<h2>Runs</h2>" in html_path.read_text()


def test_a_run_over_two_releases_keeps_cells_apart(tmp_path):
    """The base axis: cells A@0.26.0 and A@0.30.0; expect: names the matrix build A."""
    cells = {"A@0.26.0": ("A", "0.26.0", [], C), "B@0.26.0": ("B", "0.26.0", ["fix"], S),
             "A@0.30.0": ("A", "0.30.0", [], S), "B@0.30.0": ("B", "0.30.0", ["fix"], S)}
    folder = results.create_run(tmp_path, "", planned_run(**{
        "target": "sim", "base": ["0.26.0", "0.30.0"], "bases": ["0.26.0", "0.30.0"], "repetitions": 1,
        "build_order": list(cells), "expect": {"A": "CRASH(target)"},
        "builds": {cell: {"patches": stack, "base": base, "build": build}
                   for cell, (build, base, stack, _) in cells.items()}}))
    for cell, (build, base, _, verdict) in cells.items():
        run_dir = folder.rep_dir(cell, 0)
        results.write_json(run_dir / "verdict.json", RunResult(
            build=cell, rep=0, verdict=verdict, outcome=Outcome.TARGET if verdict is C else Outcome.NONE,
            title="t", trigger_count=1, external_hit_calls=1, requests=10, seconds=1.0, base=base))
    folder.update(status="complete")
    run = results.load_run(tmp_path, "latest")
    assert [(b.name, b.build_name, b.base, b.expect) for b in run.builds] == [
        ("A@0.26.0", "A", "0.26.0", "CRASH(target)"), ("B@0.26.0", "B", "0.26.0", None),
        ("A@0.30.0", "A", "0.30.0", "CRASH(target)"), ("B@0.30.0", "B", "0.30.0", None)]
    assert [str(m) for m in report.mismatches(run)] == ["build A@0.30.0 rep 0: SURVIVED, expected CRASH(target)"]
    effects = report.matrix_json(run)["patch_effects"]
    assert {(e["without"], e["with"]) for e in effects} == {("A@0.26.0", "B@0.26.0"), ("A@0.30.0", "B@0.30.0")}
    md = pages.to_markdown(document.document(run))
    assert "# kvrepro " + run.run_id + ": vLLM 0.26.0, 0.30.0" in md
    assert "| 0.30.0 | A | (base) | CRASH(target) | SURVIVED ✗ (expected CRASH(target)) |" in md
    xmlschema.XMLSchema(XSD).validate(junit.junit_xml(run))


def test_the_junit_schema_refuses_what_ci_readers_would():
    """The schema is ours: check it bites (negative times, two outcomes, a suite without tests=)."""
    schema = xmlschema.XMLSchema(XSD)
    good = ('<testsuites><testsuite name="a" tests="1"><testcase name="x" time="0.5">'
            '<failure message="m">t</failure><system-out>o</system-out></testcase></testsuite></testsuites>')
    assert schema.is_valid(good)
    assert not schema.is_valid(good.replace('time="0.5"', 'time="-1"'))
    assert not schema.is_valid(good.replace('<failure message="m">t</failure>', "<failure/><error/>"))
    assert not schema.is_valid(good.replace(' tests="1"', ""))


def test_each_report_section_is_one_file_and_they_come_in_order(tmp_path):
    """A section is found by its file in kvrepro/report/sections/ (adding one is adding a file);
    the report shows the sections' headings in their ORDER."""
    from kvrepro.report.sections import known_sections

    folder = ROOT / "kvrepro" / "report" / "sections"
    files = {p.stem for p in folder.glob("*.py") if p.stem != "__init__"}
    modules = known_sections()
    assert {m.__name__.rsplit(".", 1)[1] for m in modules} == files
    assert [m.ORDER for m in modules] == sorted(m.ORDER for m in modules)
    run = make_run(tmp_path, DEFAULT, EXPECT)
    md = pages.to_markdown(document.document(run))
    headings = [line for line in md.splitlines() if line.startswith("## ")]
    assert headings.index("## Runs") < headings.index("## What ran")
    assert headings.index("## Crashes") < headings.index("## Runs")


def test_the_matrix_report_shows_the_upstream_tests_of_its_builds(tmp_path):
    """A `kvrepro builds test` record (written here by hand: our own record type) in the same
    results folder: the matrix report shows its builds' counts, what differs and the regression."""
    from kvrepro.builds.records import UpstreamBuildTests, UpstreamTestChange, UpstreamTestRun
    from kvrepro.report import upstream_tests

    run = make_run(tmp_path, DEFAULT, EXPECT)
    change = UpstreamTestChange("tests/v1/x.py::test_y", "passed", "failed", "pr-52771", 2, "assert 4 == 0",
                                "changed in vllm 0.30.0: - == 0 | + == 4")
    record = UpstreamTestRun(
        base="0.26.0", sdist_sha256="ab" * 32, roots=("tests/v1/core",), selected=960, excluded=(), patch_tests=(),
        release=UpstreamBuildTests("vLLM 0.26.0", (), "k", 960, 0, 133, (), ran=960),
        builds=(UpstreamBuildTests("C", ("pr-49146", "pr-52771"), "k", 959, 1, 133, (), (change,), ran=120),
                UpstreamBuildTests("C", ("pr-49146",), "k", 1, 1, 1, (), ran=1)),  # another stack: not shown
        seconds=1.0, command="kvrepro builds test", impact_rule=True)
    upstream_tests.write(record, tmp_path)
    md = pages.to_markdown(document.document(run))
    assert "## vLLM 0.26.0's own tests on these builds" in md
    assert "| C | pr-49146, pr-52771 | 959 | 1 | 133 | 120 |" in md and "| C | pr-49146 | 1 |" not in md
    assert "pr-52771 (2)" in md and "changed in vllm 0.30.0" in md
    assert "**regression** on C: `tests/v1/x.py::test_y` passes on the release, failed here" in md
    assert upstream_tests.regressions(record) == [("C", change)]
