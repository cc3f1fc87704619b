"""Time-to-crash (survival) curves of each build, drawn with matplotlib.

A repetition that crashed is an event at the number of requests it had sent (and at the seconds
it had been under load); every other counted repetition is censored there: it only says the
engine lived at least that long. The curve per build is the Kaplan-Meier estimate (scipy's
``ecdf`` of right-censored data), so a build whose runs all survived stays at 1 and a build that
crashed early drops early. The x axes are logarithmic (a crash at request 4 beside a run that
lived 600 requests); a run at 0 sits at the axis' left floor. Text is drawn as paths, so the SVG
needs no font when it is viewed.
"""

from __future__ import annotations

import io
import re
from dataclasses import dataclass

import matplotlib

matplotlib.use("Agg")  # no display here, and none needed
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402
from matplotlib.ticker import FuncFormatter  # noqa: E402
from scipy import stats as _sp  # noqa: E402

from ..records import RunResult, Verdict  # noqa: E402
from .render import NOT_TIMED  # noqa: E402


@dataclass(frozen=True)
class Curve:
    """One build's Kaplan-Meier curve: steps (time, survival) and the censored times."""

    label: str
    times: tuple[float, ...]
    survival: tuple[float, ...]
    censored: tuple[float, ...]
    events: int


def survival_curve(label: str, runs: list[RunResult], axis: str) -> Curve | None:
    """``axis`` is "requests" or "seconds"; None when no run of the build was timed."""
    timed = [r for r in runs if r.verdict not in NOT_TIMED]
    if not timed:
        return None
    value = (lambda r: float(r.requests)) if axis == "requests" else (lambda r: float(r.load_seconds))
    events = [value(r) for r in timed if r.verdict is Verdict.CRASH]
    censored = [value(r) for r in timed if r.verdict is not Verdict.CRASH]
    result = _sp.ecdf(_sp.CensoredData(uncensored=events, right=censored))
    times = (0.0, *(float(t) for t in result.sf.quantiles))
    survival = (1.0, *(float(p) for p in result.sf.probabilities))
    return Curve(label, times, survival, tuple(censored), len(events))


def _svg_only(svg: str) -> str:
    """matplotlib's SVG minus the XML prolog and DOCTYPE, ready to sit inside an HTML page."""
    return svg[svg.index("<svg"):]


def _axis_floor(axis: str, curves: list[Curve]) -> float:
    """The smallest x a logarithmic axis draws: request 1, or a tenth of a second (or the shortest
    timed run's half, when one was shorter). A run at 0 is drawn at the floor: it sits at the left."""
    if axis == "requests":
        return 1.0
    positive = [t for c in curves for t in (*c.times, *c.censored) if t > 0]
    return min(0.1, min(positive) / 2) if positive else 0.1


def survival_axes_limits(axis: str, curves: list[Curve]) -> tuple[float, float, float]:
    """(floor, left, right) of a panel's logarithmic x axis; every curve starts at ``left``."""
    floor = _axis_floor(axis, curves)
    largest = max((t for c in curves for t in (*c.times, *c.censored)), default=floor)
    left = floor * 0.7
    return floor, left, max(largest * 1.4, floor * 10)


def draw_survival(curves_by_axis: dict[str, list[Curve]]) -> Figure:
    """The figure: one panel per axis (requests, seconds under load), each on a logarithmic x axis,
    so that a crash at request 4 and a run that survived 600 requests are both readable (on a
    linear axis the crash is a vertical line at the left edge). The caller closes it."""
    plt.rcParams["svg.fonttype"] = "path"
    fig, axes = plt.subplots(1, len(curves_by_axis), figsize=(11, 3.8), squeeze=False)
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, (axis, curves) in zip(axes[0], curves_by_axis.items()):
        floor, left, right = survival_axes_limits(axis, curves)
        for i, curve in enumerate(curves):
            colour = colours[i % len(colours)]
            # offset identical curves a hair so that builds that all survived stay visible
            nudge = 0.012 * (i - (len(curves) - 1) / 2)
            ys = [min(1.04, max(-0.04, s + nudge)) for s in curve.survival]
            # the curve starts (at 1) at the left edge; a log axis has no 0, so events at 0 sit at the floor
            xs = [left, *(max(t, floor) for t in curve.times[1:])]
            ax.step(xs, ys, where="post", color=colour, linewidth=2,
                    label=f"{curve.label} ({curve.events} crashed)")
            if curve.censored:
                at = [next((y for t, y in zip(reversed(curve.times), reversed(ys)) if t <= c), ys[0])
                      for c in curve.censored]
                ax.plot([max(c, floor) for c in curve.censored], at, linestyle="none", marker="|", markersize=12,
                        color=colour)
        ax.set_xscale("log")
        ax.set_xlim(left, right)
        ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        ax.set_xlabel(("requests sent" if axis == "requests" else "seconds under load") + " (log scale)")
        ax.set_ylabel("share of runs still alive")
        ax.set_ylim(-0.06, 1.06)
        ax.grid(True, alpha=0.3)
        ax.set_title(f"time to crash ({axis})", fontsize=11)
        ax.legend(fontsize=8, loc="lower left")
    fig.text(0.99, 0.01, "| = censored (the run ended without a crash)", ha="right", fontsize=7, color="#555")
    fig.tight_layout()
    return fig


def survival_figure(curves_by_axis: dict[str, list[Curve]]) -> tuple[str, bytes]:
    """Two panels (requests, seconds under load); returns (inline SVG, PNG bytes)."""
    fig = draw_survival(curves_by_axis)
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
