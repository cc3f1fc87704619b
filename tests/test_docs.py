"""Cheap checks that the README and docs/ stay short, runnable and sourced (issue 17, item 4).

* The README is at most 220 lines and opens with the two commands a fresh machine runs; the
  second is the command CI runs (`.ci/run` execs it), the first sets up the same `.venv` as
  `scripts/test.sh` and runs a command that exists.
* Every relative link in README.md and docs/*.md points to an existing file, and an anchor into a
  Markdown file to one of its headings (GitHub's slugs).
* The measured-table rule. A *table* is a run of lines starting with `|` outside fenced code,
  whose second line is a separator (`|---|`). A cell is *numeric* when, with `*`, backquotes and
  spaces stripped, it starts with a digit, optionally after one of `<`, `>`, `~`, `>=`, `<=`, and
  is not a release number (`0.27.0 release tree` is a name, not a measurement). A
  column is a *number column* when at least half of its non-empty body cells are numeric. Every
  table with a number column must have, within the 6 lines before its first line or within the
  6 lines after its last line (one window, both in it), a line naming a command that regenerates
  it (`benchmarks/<file>`, `scripts/<file>` or `kvrepro <word>`) and a date (`YYYY-MM-DD`).
  A table that is reference, not measurement (exit codes, limits, a catalogue of cases), says
  so with the line `<!-- reference table: not measured -->` within the 2 lines above it.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
PAGES = [README, *DOCS]

WINDOW = 6
REFERENCE_MARK = "<!-- reference table: not measured -->"
COMMAND = re.compile(r"(?:benchmarks|scripts)/[\w.-]+|\bkvrepro [a-z]")
DATE = re.compile(r"\b20\d\d-[01]\d-[0-3]\d\b")
NUMERIC = re.compile(r"^(?:>=|<=|[<>~])?\d")
RELEASE = re.compile(r"^\d+\.\d+\.\d+")
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")


def prose_lines(text: str) -> list[tuple[int, str]]:
    """(index, line) of every line outside fenced code blocks."""
    out, fenced = [], False
    for i, line in enumerate(text.splitlines()):
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if not fenced:
            out.append((i, line))
    return out


def tables(text: str) -> list[tuple[int, int, list[list[str]]]]:
    """(first line, last line, body rows as cells) of each Markdown table outside code."""
    lines = text.splitlines()
    prose = dict(prose_lines(text))
    found, i = [], 0
    while i < len(lines):
        if i in prose and lines[i].lstrip().startswith("|") and i + 1 in prose \
                and re.match(r"^\s*\|\s*:?-{3,}", lines[i + 1]):
            j = i + 2
            while j < len(lines) and j in prose and lines[j].lstrip().startswith("|"):
                j += 1
            body = [split_row(row) for row in lines[i + 2:j]]
            found.append((i, j - 1, body))
            i = j
        else:
            i += 1
    return found


def split_row(row: str) -> list[str]:
    cells = re.split(r"(?<!\\)\|", row.strip().strip("|"))
    return [c.strip() for c in cells]


def numeric(cell: str) -> bool:
    cell = cell.replace("*", "").replace("`", "").replace(" ", "")
    return bool(NUMERIC.match(cell)) and not RELEASE.match(cell)


def has_number_column(body: list[list[str]]) -> bool:
    width = max((len(r) for r in body), default=0)
    for col in range(width):
        cells = [r[col] for r in body if col < len(r) and r[col] not in ("", "-")]
        if cells and sum(map(numeric, cells)) * 2 >= len(cells):
            return True
    return False


def slug(heading: str) -> str:
    text = heading.strip().lstrip("#").strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    return {slug(line) for _, line in prose_lines(path.read_text()) if line.startswith("#")}


def test_readme_is_short():
    n = len(README.read_text().splitlines())
    assert n <= 220, f"README.md has {n} lines; at most 220 (move detail to docs/)"


def readme_commands() -> list[str]:
    lines = README.read_text().splitlines()
    assert lines[0].startswith("# "), "README.md starts with its title"
    start = next(i for i, line in enumerate(lines) if line.strip())  # the title
    body = [line for line in lines[start + 1:] if line.strip()]
    assert body[0].startswith("```"), "the README's first lines after the title are the commands"
    commands = []
    for line in body[1:]:
        if line.startswith("```"):
            break
        commands.append(re.split(r"\s+#\s", line, maxsplit=1)[0].strip())
    return commands


def test_readme_opens_with_the_two_commands_ci_runs():
    commands = readme_commands()
    assert len(commands) == 2, commands
    setup_and_run, test = commands

    ci = (ROOT / ".ci" / "run").read_text()
    execs = [line.split("exec", 1)[1].strip() for line in ci.splitlines() if line.strip().startswith("exec ")]
    assert execs == [test], f".ci/run execs {execs}, the README says {test!r}"
    script = test.split()[-1]
    assert test == f"bash {script}" and (ROOT / script).is_file()

    test_sh = (ROOT / "scripts" / "test.sh").read_text()
    assert setup_and_run == "python3 -m venv .venv && .venv/bin/pip install -e . && .venv/bin/kvrepro matrix run"
    assert "python3 -m venv .venv" in test_sh and ".venv/bin/pip install" in test_sh
    assert 'kvrepro = "kvrepro.cli:main"' in (ROOT / "pyproject.toml").read_text()
    help_ = subprocess.run([sys.executable, "-m", "kvrepro.cli", "matrix", "run", "--help"], cwd=ROOT,
                           capture_output=True, text=True, timeout=120)
    assert help_.returncode == 0, help_.stderr


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_point_to_files(page: Path):
    broken = []
    for _, line in prose_lines(page.read_text()):
        for target in LINK.findall(re.sub(r"`[^`]*`", "", line)):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.exists():
                broken.append(f"{target}: no such file")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                broken.append(f"{target}: no heading #{anchor} in {dest.relative_to(ROOT)}")
    assert not broken, f"{page.relative_to(ROOT)}: " + "; ".join(broken)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_measured_tables_name_their_command_and_date(page: Path):
    lines = page.read_text().splitlines()
    unsourced = []
    for first, last, body in tables(page.read_text()):
        if not has_number_column(body):
            continue
        if any(REFERENCE_MARK in line for line in lines[max(0, first - 2):first]):
            continue
        before = lines[max(0, first - WINDOW):first]
        after = lines[last + 1:last + 1 + WINDOW]
        if not any(any(COMMAND.search(l) for l in w) and any(DATE.search(l) for l in w) for w in (before, after)):
            unsourced.append(f"line {first + 1}: {lines[first][:60]}")
    assert not unsourced, (f"{page.relative_to(ROOT)}: tables with a number column and no command + "
                           f"YYYY-MM-DD within {WINDOW} lines: " + "; ".join(unsourced))


def test_the_rule_sees_what_it_should():
    text = "intro\n\n| a | n |\n|---|---|\n| x | 3 |\n| y | 4 |\n"
    (first, last, body), = tables(text)
    assert (first, last) == (2, 5) and has_number_column(body)
    assert not has_number_column([["x", "CRASH"], ["y", "`ok`"]])
    assert numeric("**3x** UNREACHED") and numeric(">600") and not numeric("pr-48425")
    assert not numeric("0.27.0 release tree") and numeric("0.53 s")
    assert slug("## Build E: the backports that make 0.26.0 correct") == "build-e-the-backports-that-make-0260-correct"
    assert tables("```\n| a |\n|---|\n| 1 |\n```\n") == []


# --- what the README and docs say they measured agrees with the records (issue 50) ------------

def _measured():
    """scripts/measured.py: the generated spans and the records under docs/records/."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("measured", ROOT / "scripts" / "measured.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_generated_span_says_what_its_record_says():
    """README's case paragraph, its matrix table and "what it proved", its release table, the
    default-load claim, and the docs' tables are generated from docs/records/*.json: a page edited
    by hand, or a record measured again without rendering, fails here."""
    measured = _measured()
    spans = 0
    drifted = []
    for page in PAGES:
        text = page.read_text()
        spans += len(measured.SPAN.findall(text)) + len(measured.BLOCK.findall(text))
        if measured.render_text(text, str(page.relative_to(ROOT))) != text:
            drifted.append(str(page.relative_to(ROOT)))
    assert not drifted, f"{', '.join(drifted)}: differ from docs/records/; run `python scripts/measured.py render`"
    readme = README.read_text()
    for name in ("case-releases", "default-load", "matrix-source", "suite-source"):
        assert f"<!--gen:{name}" in readme, f"README.md: the {name} claim is no longer generated from its record"
    for name in ("matrix-table", "matrix-proved", "release-table"):
        assert f"<!--gen-block:{name}" in readme, f"README.md: the {name} block is no longer generated"
    assert spans >= 12


def test_the_matrix_records_were_measured_on_todays_default_matrix():
    """A record of the default matrix (or of the default load on every release) holds a digest of the
    matrix its run used (builds, patches, engine, load, runs); a changed default (async scheduling, a
    new load) makes the README's numbers stale until `python scripts/measured.py matrix` / `releases`
    measures them again."""
    import json

    import yaml

    measured = _measured()
    today = yaml.safe_load((ROOT / "matrix.yaml").read_text())
    for name, keys, command in (("matrix-default", measured.MATRIX_KEYS, "matrix"),
                                ("releases", measured.RELEASES_KEYS, "releases")):
        record = json.loads((measured.RECORDS / f"{name}.json").read_text())
        assert record["matrix_digest"] == measured.matrix_digest(today, keys), (
            f"docs/records/{name}.json was measured on another matrix.yaml ({', '.join(keys)}): "
            f"run `python scripts/measured.py {command}`")
    changed = dict(today, engine={**today["engine"], "max_num_seqs": 99})
    assert measured.matrix_digest(changed, measured.RELEASES_KEYS) != measured.matrix_digest(today, measured.RELEASES_KEYS)


def test_a_drifted_page_is_seen(tmp_path):
    """The check can fail: a number edited by hand inside a span, a table row changed under a block."""
    measured = _measured()
    text = README.read_text()
    edited = re.sub(r"(<!--gen:case-releases-->.*?request )(\d+)", lambda m: m[1] + str(int(m[2]) + 1), text, count=1,
                    flags=re.S)
    assert edited != text and measured.render_text(edited) == text
    table_row = next(line for line in text.splitlines() if line.startswith("| B |"))
    assert measured.render_text(text.replace(table_row, table_row.replace("CORRUPT", "SURVIVED"))) == text


def test_the_catalogue_agrees_with_what_the_suite_measured():
    """defects/: every build an entry's present_in, fixed_in or masked_in names was run (docs/records/
    suite.json), and every recorded cell the catalogue makes a claim about agrees with it, judged with
    today's catalogue (MASKED included). An entry's claims edited without a measurement fail here;
    `python scripts/measured.py suite` measures them (a new release: `--release X`)."""
    from kvrepro.suite.catalogue import named_builds
    from kvrepro.suite.run import load
    from kvrepro.versions import SUPPORTED_RELEASES

    measured = _measured()
    judged = measured._judged_rows()
    cells = {(row["entry"], row["build"]): (row, shown) for row, shown, _, _ in judged}
    differ = [f"{row['entry']} on {row['build']}: expected {expected}, measured {shown} ({row['detail'][:90]})"
              for row, shown, expected, matches in judged if matches is False]
    assert not differ, "the catalogue differs from docs/records/suite.json: " + "; ".join(differ)
    unmeasured = []
    for entry in load().entries:
        for key in named_builds(entry) if entry.testable else ():
            cell = cells.get((entry.name, key))
            if cell is None or cell[0]["state"] == "INFRA":
                unmeasured.append(f"{entry.name} on {key}" + (": INFRA" if cell else ""))
    assert not unmeasured, "claims no suite run measured: " + "; ".join(unmeasured)
    releases = {row["build"] for row, *_ in judged if "+" not in row["build"]}
    missing = [r for r in SUPPORTED_RELEASES if r not in releases]
    assert not missing, (f"releases the release table lacks: {', '.join(missing)}; run "
                         f"`python scripts/measured.py suite --release {missing[0]}`")


def test_the_readmes_derived_numbers_are_what_their_sources_compute():
    """Numbers the README states that follow from code or another page, checked against it."""
    from kvrepro.classify.settle import EVENTS, upper_bound
    from kvrepro.report.stats import fisher_one_sided

    readme = " ".join(README.read_text().split())
    assert f"survived {EVENTS} times: crash rate per state < {100 * upper_bound(EVENTS):.1f}% at 95%" in readme
    assert round(fisher_one_sided(3, 3, 0, 3), 2) == 0.05 and fisher_one_sided(2, 2, 0, 2) > 0.05
    assert "3/3 against 0/3 is the smallest result with a one-sided Fisher p = 0.05" in readme
    benchmarks = (ROOT / "docs" / "benchmarks.md").read_text()
    best = re.search(r"best generic load: .*\(median ([\d.]+)\)", benchmarks)
    assert best and f"a median of {best[1]} requests with the best generic load tool on 0.26.0" in readme
    matrix = (ROOT / "matrix.yaml").read_text()
    assert re.search(r"^\s+block_size: 16\b", matrix, re.M) and re.search(r"^\s+num_gpu_blocks: 96\b", matrix, re.M)
    assert "block 16, 96 GPU blocks" in readme
    import json

    model = json.loads((ROOT / "kvrepro" / "data" / "models" / "qwen3-next-tiny" / "config.json").read_text())
    kinds = model["layer_types"]
    assert (f"{kinds.count('linear_attention')} Gated-DeltaNet layers, {kinds.count('full_attention')} attention, "
            f"{model['num_nextn_predict_layers']} MTP") in readme
    import yaml

    geometry = yaml.safe_load((ROOT / "examples" / "production-geometry.yaml").read_text())["engine"]["geometry"]
    assert (f"({geometry['block_size']:,}-token blocks, {geometry['mamba_groups']} + "
            f"{geometry['full_attention_groups']} KV groups, DP{geometry['data_parallel_size']})") in readme


def test_a_new_release_and_a_second_matrix_are_one_record_away(tmp_path, monkeypatch):
    """What other work adds comes through the records, not hand edits: a release's cells merged into
    the suite record (`measured.py suite --release 0.35.0`) make its column, named with the scheduling
    mode its cells ran in, and a second matrix record (`measured.py matrix --name gpu-mode`) a second
    measured column of the matrix table."""
    import json
    import shutil

    measured = _measured()
    shutil.copytree(measured.RECORDS, tmp_path / "records")
    monkeypatch.setattr(measured, "RECORDS", tmp_path / "records")
    suite = json.loads((tmp_path / "records" / "suite.json").read_text())
    suite["rows"].append({"entry": "offload-boundary-assert", "build": "0.35.0", "state": "INFRA", "ended_by": None,
                          "reps": 0, "detail": "engine did not start", "suite": "suite-x"})
    suite["suites"].append({"suite_id": "suite-x", "scheduling": "async"})
    (tmp_path / "records" / "suite.json").write_text(json.dumps(suite))
    table = measured.release_table([]).splitlines()
    # the new column names the mode its cells ran in, as every other column does
    assert table[0].endswith("| 0.35.0 async |") and "| 0.34.0 sync |" in table[0]
    assert any(line.startswith("| `offload-boundary-assert` |") and line.endswith("| INFRA |") for line in table)
    gpu = json.loads((tmp_path / "records" / "matrix-default.json").read_text())
    gpu["builds"][1]["labels"] = ["CRASH(target)"]
    gpu["builds"][1]["first_failures"] = [{"kind": "crash", "request": 5, "ended": 5, "exact": True,
                                           "crash_request": 5, "defect": None}]
    (tmp_path / "records" / "matrix-gpu-mode.json").write_text(json.dumps(gpu))
    two = measured.matrix_table(["default", "gpu-mode"]).splitlines()
    assert two[0] == "| build | patches | `expect:` | measured (default) | measured (gpu-mode) |"
    assert two[3].startswith("| B |") and two[3].endswith("| `CRASH(target)`: crash at 5 |")


def test_the_suite_plan_runs_every_build_the_catalogue_names():
    """`measured.py suite` runs each testable entry on every release, and on each stack one of its
    claims names (one suite run per stack): nothing the catalogue says goes unmeasured."""
    from kvrepro.suite.catalogue import named_builds, parse_build_key
    from kvrepro.suite.run import load
    from kvrepro.versions import SUPPORTED_RELEASES

    plan = _measured().suite_plan(list(SUPPORTED_RELEASES), stacks=True)
    covered = {(entry, release, stack) for stack, bases, entries in plan for entry in entries for release in bases}
    for entry in load().entries:
        for key in named_builds(entry) if entry.testable else ():
            release, patches = parse_build_key(key)
            assert (entry.name, release, patches) in covered, f"{entry.name} on {key}: not in the plan"
    assert plan[0][0] == () and plan[0][1] == list(SUPPORTED_RELEASES)
