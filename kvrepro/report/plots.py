"""Time to first failure of each build, drawn with matplotlib: a crash and a wrong KV read alike.

A repetition fails at its first wrong KV read or its crash, whichever came first
(:mod:`kvrepro.report.failures`); every other timed repetition is censored where its load ended:
it only says the engine lived, and read right, that long. Two panels, both over requests sent on
a logarithmic axis (a failure at request 2 beside a run that lived 600):

* left, per build, the Kaplan-Meier estimate of the share of runs with no failure yet (scipy's
  ``ecdf`` of right-censored data), each drop marked with its kind (x crash, o wrong KV read), so a
  build that serves wrong KV from request 2 falls there instead of staying at 1 beside a clean
  one;
* right, every repetition on its build's row: where it first failed, what happened after (a run
  that read wrong KV and went on serving draws a line to its end; one that crashed later, an x
  there), and where a clean run ended (|). Three runs of a build can share a drop on the left;
  here each has its own mark.

Text is drawn as paths, so the SVG needs no font when it is viewed.
"""

from __future__ import annotations

import io
import re
from dataclasses import dataclass

import matplotlib

matplotlib.use("Agg")  # no display here, and none needed
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402
from matplotlib.lines import Line2D  # noqa: E402
from matplotlib.ticker import FuncFormatter  # noqa: E402
from scipy import stats as _sp  # noqa: E402

from ..records import RunResult  # noqa: E402
from .failures import CRASH, WRONG_KV, FirstFailure, first_failures, summary  # noqa: E402

MARKERS = {CRASH: "X", WRONG_KV: "o"}
KIND_COLOUR = {CRASH: "#a40e26", WRONG_KV: "#d97706"}
CLEAN = "#6e7781"


@dataclass(frozen=True)
class Curve:
    """One build's Kaplan-Meier curve: steps (requests, share with no failure yet), the censored
    requests, and its runs' first failures (what the right panel draws and the legend counts)."""

    label: str
    times: tuple[float, ...]
    survival: tuple[float, ...]
    censored: tuple[float, ...]
    events: int
    failures: tuple[FirstFailure, ...] = ()

    @property
    def legend(self) -> str:
        return f"{self.label}: {summary(list(self.failures))}"


def failure_curve(label: str, runs: list[RunResult]) -> Curve | None:
    """The build's curve of time to first failure in requests; None when no run of it was timed."""
    failures = first_failures(runs)
    if not failures:
        return None
    events = [f.at for f in failures if f.failed]
    censored = [f.at for f in failures if not f.failed]
    result = _sp.ecdf(_sp.CensoredData(uncensored=events, right=censored))
    times = (0.0, *(float(t) for t in result.sf.quantiles))
    survival = (1.0, *(float(p) for p in result.sf.probabilities))
    return Curve(label, times, survival, tuple(censored), len(events), tuple(failures))


def _svg_only(svg: str) -> str:
    """matplotlib's SVG minus the XML prolog and DOCTYPE, ready to sit inside an HTML page."""
    return svg[svg.index("<svg"):]


FLOOR = 1.0  # request 1: a log axis has no 0; a run at 0 sits at the left


def axes_limits(curves: list[Curve]) -> tuple[float, float]:
    """(left, right) of the logarithmic request axis; every curve starts at ``left``."""
    largest = max((max(t for t in (*c.times, *c.censored, *(f.ended for f in c.failures))) for c in curves),
                  default=FLOOR)
    return FLOOR * 0.7, max(largest * 1.4, FLOOR * 10)


def _survival_at(curve: Curve, ys: list[float], t: float) -> float:
    return next((y for time, y in zip(reversed(curve.times), reversed(ys)) if time <= t), ys[0])


def _draw_curves(ax, curves: list[Curve], colours: list[str], left: float, right: float) -> None:
    for i, curve in enumerate(curves):
        colour = colours[i % len(colours)]
        # offset identical curves a hair (up, and a few pixels right on the log axis) so that builds that
        # fail at the same request stay visible side by side; the tables carry the exact requests
        # (at most +-3% up and +-4% right in all, however many builds: a drop at 2 stays at 2 to the eye)
        half = max(1.0, (len(curves) - 1) / 2)
        offset = (i - (len(curves) - 1) / 2) / half
        ys = [min(1.04, max(-0.04, s + min(0.015 * half, 0.03) * offset)) for s in curve.survival]
        shift = 1.0 + min(0.025 * half, 0.04) * offset
        xs = [left, *(max(t, FLOOR) * shift for t in curve.times[1:])]
        ax.step(xs, ys, where="post", color=colour, linewidth=2, label=curve.legend)
        for kind, marker in MARKERS.items():
            at = [f.at for f in curve.failures if f.kind == kind]
            if at:
                ax.plot([max(t, FLOOR) * shift for t in at], [_survival_at(curve, ys, t) for t in at],
                        linestyle="none", marker=marker, markersize=8, color=KIND_COLOUR[kind],
                        markeredgecolor=colour, markeredgewidth=1.2)
        if curve.censored:
            ax.plot([max(c, FLOOR) * shift for c in curve.censored],
                    [_survival_at(curve, ys, c) for c in curve.censored],
                    linestyle="none", marker="|", markersize=12, color=colour)
    ax.set_xscale("log")
    ax.set_xlim(left, right)
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax.set_xlabel("requests sent (log scale)")
    ax.set_ylabel("share of runs with no failure yet")
    ax.set_ylim(-0.06, 1.06)
    ax.grid(True, alpha=0.3)
    ax.set_title("time to first failure (crash or wrong KV read)", fontsize=11)
    ax.legend(fontsize=7.5, loc="center right", title="build: runs failed, by first failure", title_fontsize=7.5)


def _draw_runs(ax, curves: list[Curve], colours: list[str], left: float, right: float) -> None:
    for i, curve in enumerate(curves):
        row = len(curves) - 1 - i  # the first build on top
        n = len(curve.failures)
        for j, f in enumerate(curve.failures):
            y = row + (j - (n - 1) / 2) * (0.6 / max(n, 1))
            start = max(f.at, FLOOR)
            if f.failed:
                after = f.crash_request if f.kind == WRONG_KV and f.crash_request else f.ended
                if after > f.at:  # what the run did after its first failure: served on (wrong KV), or crashed
                    ax.plot([start, max(after, FLOOR)], [y, y], color=KIND_COLOUR[f.kind], linewidth=1.2,
                            linestyle=":")
                    if f.crash_request and f.kind == WRONG_KV:
                        ax.plot([max(f.crash_request, FLOOR)], [y], marker=MARKERS[CRASH], markersize=7,
                                linestyle="none", color=KIND_COLOUR[CRASH], markeredgecolor="black",
                                markeredgewidth=0.5)
                    else:
                        ax.plot([max(after, FLOOR)], [y], marker="|", markersize=9, color=KIND_COLOUR[f.kind])
                ax.plot([left, start], [y, y], color=colours[i % len(colours)], linewidth=1.5)
                ax.plot([start], [y], marker=MARKERS[f.kind], markersize=8, linestyle="none",
                        color=KIND_COLOUR[f.kind], markeredgecolor="black", markeredgewidth=0.6)
            else:
                ax.plot([left, start], [y, y], color=colours[i % len(colours)], linewidth=1.5)
                ax.plot([start], [y], marker="|", markersize=10, color=CLEAN)
    ax.set_xscale("log")
    ax.set_xlim(left, right)
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax.set_yticks(range(len(curves)), [c.label for c in reversed(curves)])
    ax.set_ylim(-0.7, len(curves) - 0.3)
    ax.set_xlabel("requests sent (log scale)")
    ax.grid(True, axis="x", alpha=0.3)
    ax.set_title("each run: first failure, then what followed", fontsize=11)
    handles = [Line2D([], [], marker=MARKERS[WRONG_KV], linestyle="none", color=KIND_COLOUR[WRONG_KV],
                      markeredgecolor="black", label="first wrong KV read"),
               Line2D([], [], marker=MARKERS[CRASH], linestyle="none", color=KIND_COLOUR[CRASH],
                      markeredgecolor="black", label="crash"),
               Line2D([], [], color=KIND_COLOUR[WRONG_KV], linestyle=":", label="served on after a wrong read"),
               Line2D([], [], marker="|", linestyle="none", color=CLEAN, markersize=10,
                      label="run ended, no failure")]
    ax.legend(handles=handles, fontsize=7.5, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=4,
              handletextpad=0.3, columnspacing=1.0)


def draw_failures(curves: list[Curve]) -> Figure:
    """The figure (two panels, see the module docstring). The caller closes it."""
    plt.rcParams["svg.fonttype"] = "path"
    fig, (left_ax, right_ax) = plt.subplots(1, 2, figsize=(12, 4.4), gridspec_kw={"width_ratios": [1.15, 1]})
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    left, right = axes_limits(curves)
    _draw_curves(left_ax, curves, colours, left, right)
    _draw_runs(right_ax, curves, colours, left, right)
    fig.tight_layout()
    return fig


def failure_figure(curves: list[Curve]) -> tuple[str, bytes]:
    """Returns (inline SVG, PNG bytes)."""
    fig = draw_failures(curves)
    svg_buf, png_buf = io.StringIO(), io.BytesIO()
    fig.savefig(svg_buf, format="svg", metadata={"Date": None})
    fig.savefig(png_buf, format="png", dpi=110)
    plt.close(fig)
    svg = _svg_only(svg_buf.getvalue())
    # matplotlib names clip paths with random ids; stable ids keep reports diffable
    ids = {old: f"kv{i}" for i, old in enumerate(dict.fromkeys(re.findall(r'id="(p[0-9a-f]{10})"', svg)))}
    for old, new in ids.items():
        svg = svg.replace(old, new)
    return svg, png_buf.getvalue()
