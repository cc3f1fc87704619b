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


def test_survival_plot_request_axis_is_logarithmic(tmp_path):
    import matplotlib.pyplot as plt

    from kvrepro.report import plots

    crashed_early = plots.survival_curve("A", _runs(tmp_path, [(C, 4), (C, 4), (C, 7)]), "requests")
    survived = plots.survival_curve("B", _runs(tmp_path, [(S, 600), (S, 600), (S, 600)]), "requests")
    fig = plots.draw_survival({"requests": [crashed_early, survived]})
    try:
        ax = fig.axes[0]
        assert ax.get_xscale() == "log"
        left, right = ax.get_xlim()
        assert 0 < left < 1 and right >= 600
        # the crash at request 4 is a step well inside the panel, not a line at its left edge
        xs = [x for line in ax.get_lines() for x in line.get_xdata()]
        assert 4 in xs and all(x > 0 for x in xs)
        import math
        assert (math.log(4) - math.log(left)) / (math.log(right) - math.log(left)) > 0.2
    finally:
        plt.close(fig)


def test_survival_plot_draws_runs_at_0_and_1_requests(tmp_path):
    import math

    import matplotlib.pyplot as plt

    from kvrepro.report import plots

    at_zero = plots.survival_curve("A", _runs(tmp_path, [(C, 0), (C, 1), (S, 0)]), "requests")
    at_one = plots.survival_curve("B", _runs(tmp_path, [(C, 1)]), "requests")
    seconds = plots.survival_curve("A", _runs(tmp_path, [(C, 0), (C, 1)]), "seconds")
    fig = plots.draw_survival({"requests": [at_zero, at_one], "seconds": [seconds]})
    try:
        for ax in fig.axes:
            assert ax.get_xscale() == "log"
            left, right = ax.get_xlim()
            assert 0 < left < right
            xs = [x for line in ax.get_lines() for x in line.get_xdata()]
            assert xs and all(x >= left and math.isfinite(x) for x in xs)
    finally:
        plt.close(fig)
    svg, png = plots.survival_figure({"requests": [at_zero, at_one]})
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
