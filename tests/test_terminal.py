"""What a person sees in a terminal: the run table folded to the console's width (80 columns
included), progress lines without source positions, the survival plot's logarithmic request axis."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from rich.console import Console

from kvrepro.records import Verdict
from kvrepro.report import render

from test_report import DEFAULT, EXPECT, C, S, make_run

ROOT = Path(__file__).resolve().parents[1]


def _render(run, width: int) -> list[str]:
    console = Console(width=width, color_system=None, force_terminal=False, record=True)
    console.print(render.matrix_table(run))
    return console.export_text().splitlines()


def _table_rows(lines: list[str]) -> list[str]:
    """The table's body lines (rich draws a body row's cells between `│`; the header uses `┃`)."""
    return [line for line in lines if "│" in line]


def _check_one_line_per_build(run, lines: list[str], width: int) -> None:
    assert all(len(line) <= width for line in lines), [line for line in lines if len(line) > width]
    rows = _table_rows(lines)
    assert len(rows) == len(run.builds), "\n".join(lines)  # a wrapped cell would add a line
    for row, b in zip(rows, run.builds):
        assert row.strip(" │").split()[0] == b.build_name, row
    assert "…" not in "\n".join(rows)  # nothing cut either


def test_default_matrix_table_fits_80_columns_one_line_per_build(tmp_path):
    run = make_run(tmp_path, DEFAULT, EXPECT)
    lines = _render(run, 80)
    _check_one_line_per_build(run, lines, 80)
    text = "\n".join(lines)
    # the patch stacks moved under the table as a legend, whole
    assert "B = pr-49146 + pr-52807" in text and "D = pr-49146 + pr-52771 + pr-52807" in text
    assert "3x CRASH(target)" in text and "3/3 (29-100%)" in text and "5/6/7" in text


def test_mixed_verdicts_still_fit_80_columns(tmp_path):
    infra = Verdict.INFRA
    run = make_run(tmp_path, {"A": [C, infra, C], "B": [S, infra, S], "C": [C, C, C], "D": [S, S, infra]})
    lines = _render(run, 80)
    _check_one_line_per_build(run, lines, 80)
    assert "2x CRASH(target) 1x INFRA" in "\n".join(lines)


def test_wide_terminal_shows_the_full_columns(tmp_path):
    run = make_run(tmp_path, DEFAULT, EXPECT)
    lines = _render(run, 160)
    _check_one_line_per_build(run, lines, 160)
    text = "\n".join(lines)
    for header in ("patches", "failed (95% CI)", "trigger count", "bug state", "offload loads"):
        assert header in text
    assert "pr-49146, pr-52771, pr-52807" in text and "0/3 = 0% (0-71%), <= 63%" in text
    assert "5 / 6 / 7" in text and "11 / 11 / 11" in text
    assert "B = pr-49146" not in text  # no legend needed


def test_very_narrow_terminal_never_wraps_a_cell(tmp_path):
    run = make_run(tmp_path, DEFAULT, EXPECT)
    for width in (40, 60):
        lines = _render(run, width)
        assert all(len(line) <= width for line in lines)
        assert len(_table_rows(lines)) == len(run.builds), "\n".join(lines)


# --- progress lines ----------------------------------------------------------------------------

SOURCE_POSITION = re.compile(r"\w+\.py:\d+")


def test_progress_lines_carry_no_source_position(capsys):
    from kvrepro.report import terminal

    progress = terminal.RichProgress(1)
    with progress.progress:
        progress.stage("build A: pr-49146")
    bisect = terminal.BisectProgress()
    with bisect.progress:
        bisect.progress.console.log("point 0.26.0: CRASH")
    text = capsys.readouterr().err
    assert "build A: pr-49146" in text and "point 0.26.0" in text
    assert not SOURCE_POSITION.search(text), text


@pytest.mark.slow
@pytest.mark.vllm
def test_a_real_matrix_run_in_80_columns_logs_no_source_position(tmp_path, matrix_copy, overlays, shared_zygotes_here):
    """`kvrepro matrix run` (build A, one repetition: dies at the target assertion within a few
    requests) as a user runs it in an 80-column terminal: its progress lines and its table."""
    env = dict(os.environ, COLUMNS="80", LINES="40")
    proc = subprocess.run(
        [sys.executable, "-m", "kvrepro.cli", "matrix", "run", "-m", str(matrix_copy), "-b", "A", "--reps", "1",
         "--results", str(tmp_path / "results")],
        cwd=ROOT, capture_output=True, text=True, timeout=900, env=env)
    assert "build A rep 0: CRASH(target)" in proc.stderr, proc.stderr[-3000:]
    assert not SOURCE_POSITION.search(proc.stderr), proc.stderr
    lines = proc.stdout.splitlines()
    assert all(len(line) <= 80 for line in lines), proc.stdout
    assert len([line for line in lines if "│" in line]) == 1, proc.stdout  # build A's row, on one line


# --- the survival plot -------------------------------------------------------------------------

def _runs(tmp_path, requests_by_verdict):
    from test_report import _run

    return [_run("A", i, verdict, requests, tmp_path) for i, (verdict, requests) in enumerate(requests_by_verdict)]


def _corrupt(tmp_path, rep, first_read, requests, crash_at=None):
    """A run whose shadow KV named its first wrong read at request ``first_read`` (B and D on 0.26.0:
    CORRUPT, serving on to ``requests``); with ``crash_at``, one that read wrong KV and crashed later (A)."""
    import dataclasses

    from test_report import _run

    base = _run("A", rep, C if crash_at else Verdict.CORRUPT, crash_at or requests, tmp_path)
    load = dataclasses.replace(base.load, first_failed_index=crash_at - 1) if crash_at else base.load
    return dataclasses.replace(base, kv_check="corrupt", kv_violations=5, load=load, kv_groups=("full_attention", "mamba"),
                               kv_first_request_by_class={"full_attention/foreign/hit": first_read,
                                                          "mamba/null-block/hit": first_read + 5})


def test_first_failure_is_the_first_wrong_read_or_the_crash_whichever_came_first(tmp_path):
    from kvrepro.report import failures

    served = failures.first_failure(_corrupt(tmp_path, 0, 2, 187))
    assert (served.kind, served.request, served.crash_request, served.ended) == (failures.WRONG_KV, 2, None, 187)
    assert served.defect == "fa-hole-below-mamba-hit" and served.text() == \
        "wrong KV read at request 2 (fa-hole-below-mamba-hit)"
    then_crashed = failures.first_failure(_corrupt(tmp_path, 1, 2, 8, crash_at=8))
    assert (then_crashed.kind, then_crashed.request, then_crashed.crash_request) == (failures.WRONG_KV, 2, 8)
    # a wrong read counted at the request that died is not before the crash: the crash is in scheduling
    crash_first = failures.first_failure(_corrupt(tmp_path, 2, 8, 8, crash_at=8))
    assert (crash_first.kind, crash_first.request) == (failures.CRASH, 8)
    clean = failures.first_failure(_runs(tmp_path, [(S, 600)])[0])
    assert not clean.failed and clean.at == 600
    assert failures.build_text([served, then_crashed, clean]) == \
        "wrong KV read at 2, 2 (fa-hole-below-mamba-hit; crash later at 8); none (runs ended at 600)"
    assert failures.summary([served, then_crashed, clean]) == "2/3 failed: 2 wrong KV read first (then 1 crashed)"


def test_failure_plot_drops_a_build_that_serves_wrong_kv_where_it_first_read_it(tmp_path):
    """issue 50: B and D served every request while reading wrong KV; the picture showed them as
    '0 crashed' lines at 1.0 beside the clean E. They now fall at their first wrong read."""
    import math

    import matplotlib.pyplot as plt

    from kvrepro.report import plots

    b = plots.failure_curve("B", [_corrupt(tmp_path, i, 2, 190) for i in range(3)])
    a = plots.failure_curve("A", [_corrupt(tmp_path, i, 2, 8, crash_at=8) for i in range(3)])
    e = plots.failure_curve("E", _runs(tmp_path, [(S, 170), (S, 190), (S, 180)]))
    assert b.events == 3 and b.survival[-1] == 0.0 and b.times[1] == 2.0
    assert e.events == 0 and e.survival[-1] == 1.0 and e.censored == (170.0, 190.0, 180.0)
    assert b.legend == "B: 3/3 failed: 3 wrong KV read first"
    assert a.legend == "A: 3/3 failed: 3 wrong KV read first (then 3 crashed)"
    fig = plots.draw_failures([a, b, e])
    try:
        curves, each = fig.axes
        assert curves.get_xscale() == each.get_xscale() == "log"
        left, right = curves.get_xlim()
        assert 0 < left < 1 and right >= 190
        # B's step falls (to 0) near request 2, well inside the panel; E's stays at the top
        b_line = next(line for line in curves.get_lines() if line.get_label().startswith("B:"))
        xs, ys = b_line.get_xdata(), b_line.get_ydata()
        assert min(ys) < 0.05 and any(abs(x - 2) < 0.2 for x in xs)
        assert (math.log(2) - math.log(left)) / (math.log(right) - math.log(left)) > 0.15
        e_line = next(line for line in curves.get_lines() if line.get_label().startswith("E:"))
        assert min(e_line.get_ydata()) > 0.95
        # each run on its row: wrong-read markers (o) at 2, crash markers (X) at 8, A's row on top
        markers = [(line.get_marker(), x) for line in each.get_lines() for x in line.get_xdata()
                   if line.get_linestyle() == "None"]
        assert sum(1 for m, x in markers if m == "o" and x == 2) == 6
        assert sum(1 for m, x in markers if m == "X" and x == 8) == 3
        assert [t.get_text() for t in each.get_yticklabels()] == ["E", "B", "A"]
    finally:
        plt.close(fig)


def test_failure_plot_draws_runs_at_0_and_1_requests(tmp_path):
    import math

    import matplotlib.pyplot as plt

    from kvrepro.report import plots

    at_zero = plots.failure_curve("A", _runs(tmp_path, [(C, 0), (C, 1), (S, 0)]))
    at_one = plots.failure_curve("B", _runs(tmp_path, [(C, 1)]))
    fig = plots.draw_failures([at_zero, at_one])
    try:
        for ax in fig.axes:
            assert ax.get_xscale() == "log"
            left, right = ax.get_xlim()
            assert 0 < left < right
            xs = [x for line in ax.get_lines() for x in line.get_xdata()]
            assert xs and all(x >= left and math.isfinite(x) for x in xs)
    finally:
        plt.close(fig)
    svg, png = plots.failure_figure([at_zero, at_one])
    assert svg.startswith("<svg") and png[:8] == b"\x89PNG\r\n\x1a\n"


def test_results_list_fits_80_columns_without_cutting_a_verdict(tmp_path):
    infra = Verdict.INFRA
    make_run(tmp_path, {"A": [C, infra, C], "B": [S, infra, S], "C": [C, C, C], "D": [S, S, S]})
    make_run(tmp_path, DEFAULT, EXPECT)
    env = dict(os.environ, COLUMNS="80")
    proc = subprocess.run([sys.executable, "-m", "kvrepro.cli", "results", "list", "--results", str(tmp_path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert all(len(line) <= 80 for line in lines), proc.stdout
    cells = [line.rstrip(" │").rsplit("│", 1)[-1].strip() for line in lines if "│" in line]
    # each line of the verdicts column is one whole build: `A: 2x CRASH(target) 1x INFRA`
    assert cells and all(re.fullmatch(r"[A-D]: (\d+x [A-Z()a-z]+ ?)+", c) for c in cells), cells
    assert "A: 2x CRASH(target) 1x INFRA" in cells
