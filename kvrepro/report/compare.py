"""Which verdicts changed between two recorded runs (two releases, two days, two machines).

Builds are matched by name when each run is on one base (the usual case: the same matrix run on
0.26.0 and on 0.27.1 -- the base is what changed), and by (base, name) when a run spans several
bases. A build "changed" when its summary verdict differs (``3x CRASH(target)`` against
``3x SURVIVED``, or against a mix); the failure counts and a two-sided Fisher exact p-value say
whether the change is more than noise.
"""

from __future__ import annotations

from dataclasses import dataclass

from . import stats
from ..records import RunResult
from ..results.store import BuildResults, MatrixRun


@dataclass(frozen=True)
class BuildChange:
    build: str
    before: str  # summary verdict, "" when the build is not in that run
    after: str
    before_labels: tuple[str, ...]
    after_labels: tuple[str, ...]
    before_rate: stats.Rate
    after_rate: stats.Rate
    p_value: float | None  # two-sided Fisher exact on failed/passed counts; None if a side has no count

    @property
    def changed(self) -> bool:
        return self.before != self.after


@dataclass(frozen=True)
class Comparison:
    before: MatrixRun
    after: MatrixRun
    builds: tuple[BuildChange, ...]

    @property
    def changed(self) -> list[BuildChange]:
        return [b for b in self.builds if b.changed]


def summary(runs: tuple[RunResult, ...]) -> str:
    """``3x SURVIVED`` when every repetition agrees, else the labels in order; "" for no run."""
    labels = [r.label for r in runs]
    if not labels:
        return ""
    return f"{len(labels)}x {labels[0]}" if len(set(labels)) == 1 else " ".join(labels)


def _keyed(run: MatrixRun, by_base: bool) -> dict[str, BuildResults]:
    return {(f"{b.build_name}@{b.base}" if by_base else b.build_name): b for b in run.builds}


def compare(before: MatrixRun, after: MatrixRun) -> Comparison:
    by_base = len({b.base for b in before.builds}) > 1 or len({b.base for b in after.builds}) > 1
    old, new = _keyed(before, by_base), _keyed(after, by_base)
    changes = []
    for name in list(old) + [n for n in new if n not in old]:
        a_runs = old[name].runs if name in old else ()
        b_runs = new[name].runs if name in new else ()
        ra, rb = stats.rate(a_runs), stats.rate(b_runs)
        p = None
        if ra.trials and rb.trials:
            p = stats.fisher_two_sided(ra.crashes, ra.trials, rb.crashes, rb.trials)
        changes.append(BuildChange(name, summary(a_runs), summary(b_runs), tuple(r.label for r in a_runs),
                                   tuple(r.label for r in b_runs), ra, rb, p))
    return Comparison(before, after, tuple(changes))


def comparison_json(c: Comparison) -> dict:
    return {
        "before": {"run_id": c.before.run_id, "base": c.before.info.base_text, "path": str(c.before.path)},
        "after": {"run_id": c.after.run_id, "base": c.after.info.base_text, "path": str(c.after.path)},
        "changed": [b.build for b in c.changed],
        "builds": [
            {"build": b.build, "changed": b.changed, "before": b.before or None, "after": b.after or None,
             "before_labels": list(b.before_labels), "after_labels": list(b.after_labels),
             "failed_before": [b.before_rate.crashes, b.before_rate.trials],
             "failed_after": [b.after_rate.crashes, b.after_rate.trials],
             "fisher_p_two_sided": None if b.p_value is None else round(b.p_value, 4)}
            for b in c.builds
        ],
    }
