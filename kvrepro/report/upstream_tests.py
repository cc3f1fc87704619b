"""The report of ``kvrepro builds test``: vLLM's own tests per build, and what the patches changed.

Per build: passed / failed / excluded; every test whose outcome differs from the unpatched release
with the patch of the stack that changed it and what a newer release did to the same test; each
patch's upstream tests with the helpers copied from the later release. Written as
``results/upstream-tests-<time>/report.md`` next to ``upstream-tests.json`` (the record).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from ..builds.records import UpstreamTestChange, UpstreamTestRun
from ..records import RecordError, from_jsonable, to_jsonable
from ..results.store import write_atomic
from .pages import Block, Bullets, Heading, Para, Table

REPORT_JSON = "upstream-tests.json"
REPORT_MD = "report.md"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def markdown(run: UpstreamTestRun) -> str:
    lines = [f"# vLLM {run.base}'s own tests on every build", "",
             f"`{run.command or 'kvrepro builds test'}`, {run.created}, {run.seconds:.0f} s. Tests of "
             f"{', '.join(f'`{r}`' for r in run.roots)} from the vLLM {run.base} sdist (sha256 "
             f"{run.sdist_sha256[:12]}), vLLM's CPU platform: {run.selected} pass on the unpatched release "
             f"and run on every build; {len(run.excluded)} do not pass there and are excluded."
             + (f" Model configs given offline (config.json only, no weights): {', '.join(run.offline_models)}."
                if run.offline_models else ""), "",
             impact_note(run), "",
             "| build | patches | passed | failed | excluded | ran | time | |", "|---|---|---|---|---|---|---|---|"]
    for row in (run.release, *run.builds):
        note = row.error or ("cached" if row.cached else "")
        lines.append(f"| {row.build} | {', '.join(row.patches) or '-'} | {row.passed} | {row.failed} | {row.excluded} "
                     f"| {row.ran} | {row.seconds:.0f} s | {_cell(note)} |")
    regressed = regressions(run)
    if regressed:
        lines += ["", f"**{len(regressed)} test(s) pass on the release and fail on a build** (exit code 1): "
                  + "; ".join(f"{build}: `{change.nodeid}`" for build, change in regressed)]
    if run.impact_rule and any(b.changed_code for b in run.builds):
        lines += ["", "## What each build changed (the impact rule's units)", ""]
        for build in run.builds:
            units = ", ".join(f"`{u.file.rsplit('/', 1)[-1]}` {u.name or u.scope}" for u in build.changed_code)
            lines.append(f"- {build.build}: {units or 'nothing'}")
    patch_tests = [o for o in run.release.outcomes if o.patch]
    if patch_tests:
        builds = [b for b in run.builds if not b.error]
        lines += ["", "## Each patch's upstream tests", "",
                  "| test | patch | release | " + " | ".join(b.build for b in builds) + " |",
                  "|---|---|---|" + "---|" * len(builds)]
        for outcome in patch_tests:
            cells = []
            for build in builds:
                found = next((o for o in build.outcomes if o.nodeid == outcome.nodeid), None)
                cells.append(found.outcome if found else "-")
            lines.append(f"| `{outcome.nodeid.rsplit('::', 1)[-1]}` ({outcome.nodeid.split(' ')[1]}) | {outcome.patch} "
                         f"| {outcome.outcome} | " + " | ".join(cells) + " |")
        lines.append("")
        for module in run.patch_tests:
            for helper in module.helpers:
                lines.append(f"- {module.patch}: helper `{helper.name}` copied from vllm {helper.release} "
                             f"`{helper.file}` ({helper.why})")
            for problem in module.problems:
                lines.append(f"- {module.patch}: not carried over: {problem}")
    lines += ["", "## Tests whose outcome differs from the unpatched release", ""]
    changed = [(b, c) for b in run.builds for c in b.changes]
    if not changed:
        lines.append("None.")
    else:
        lines += ["| build | test | release -> build | changed by (stack position) | failure | upstream later |",
                  "|---|---|---|---|---|---|"]
        for build, change in changed:
            by = f"{change.changed_by} ({change.stack_position})" if change.changed_by else "not reproduced on a prefix"
            lines.append(f"| {build.build} | `{_cell(change.nodeid)}` | {change.release_outcome} -> {change.build_outcome} "
                         f"| {by} | {_cell(change.message)} | {_cell(change.later)} |")
    failures = [(b, o) for b in run.builds for o in b.outcomes if o.outcome != "passed"]
    if failures:
        lines += ["", "## Every failing test per build", ""]
        for build, outcome in failures:
            where = f": `{_cell(outcome.line)}`" if outcome.line else ""
            lines.append(f"- {build.build}: `{outcome.nodeid}` {outcome.outcome}: {_cell(outcome.message)}{where}")
    if run.excluded:
        lines += ["", f"## Excluded ({len(run.excluded)}: not passing on the unpatched release)", ""]
        reasons: dict[str, int] = {}
        for test in run.excluded:
            reasons[test.why[:120]] = reasons.get(test.why[:120], 0) + 1
        for why, count in sorted(reasons.items(), key=lambda item: -item[1]):
            lines.append(f"- {count} x {_cell(why)}")
        lines.append(f"\n(every excluded test with why: `{REPORT_JSON}`)")
    return "\n".join(lines) + "\n"


def impact_note(run: UpstreamTestRun) -> str:
    if not run.impact_rule:
        return "Every selected test ran on every build (`--all`)."
    return ("Each build ran the tests that reach code its patch stack changed (on the release, under coverage: "
            "a changed function's body, or any line of a module changed at module level or of a module importing "
            "it), tests that start a process, and the patches' own tests; the others are counted with the "
            "release's outcome, marked `not affected` in the record (rule and limits: docs/upstream-tests.md; "
            "`--all` runs everything).")


def regressions(run: UpstreamTestRun) -> list[tuple[str, UpstreamTestChange]]:
    """(build, change): a test that passes on the release and not on the build (``kvrepro builds
    test`` exits 1)."""
    return [(build.build, change) for build in run.builds for change in build.changes
            if change.release_outcome == "passed" and change.build_outcome != "passed"]


def latest_matching(results_root: Path, base: str, stacks: dict[str, tuple[str, ...]]) -> tuple[Path, UpstreamTestRun] | None:
    """The newest ``upstream-tests-*`` record of ``base`` in which a build of ``stacks`` (name -> patch
    names) appears with the same patches."""
    for folder in sorted(results_root.glob("upstream-tests-*"), reverse=True):
        try:
            run = from_jsonable(UpstreamTestRun, json.loads((folder / REPORT_JSON).read_text()))
        except (OSError, ValueError, RecordError):
            continue
        if run.base == base and any(stacks.get(b.build) == b.patches for b in run.builds):
            return folder, run
    return None


def blocks(run: UpstreamTestRun, folder: Path, stacks: dict[str, tuple[str, ...]]) -> list[Block]:
    """The matrix report's section: the builds of this matrix in the newest check of their stacks."""
    rows = [run.release] + [b for b in run.builds if stacks.get(b.build) == b.patches]
    out: list[Block] = [
        Heading(2, f"vLLM {run.base}'s own tests on these builds"),
        Para(f"`{run.command or 'kvrepro builds test'}`, {run.created} (`{folder.name}/{REPORT_MD}`): "
             f"{run.selected} of the release's tests pass unpatched and run on the builds, {len(run.excluded)} "
             f"excluded. {impact_note(run)}"),
        Table(("build", "patches", "passed", "failed", "excluded", "ran"),
              tuple((r.build, ", ".join(r.patches) or "-", str(r.passed), str(r.failed), str(r.excluded), str(r.ran))
                    for r in rows), align="llrrrr"),
    ]
    changes = [(b, c) for b in rows[1:] for c in b.changes]
    if changes:
        out.append(Table(("build", "test", "release -> build", "changed by", "upstream later"),
                         tuple((b.build, f"`{c.nodeid}`", f"{c.release_outcome} -> {c.build_outcome}",
                                f"{c.changed_by} ({c.stack_position})" if c.changed_by else "not reproduced on a prefix",
                                c.later or "-") for b, c in changes)))
    regressed = [(b, c) for b, c in regressions(run) if stacks.get(b) is not None]
    if regressed:
        out.append(Bullets(tuple(f"**regression** on {b}: `{c.nodeid}` passes on the release, "
                                 f"{c.build_outcome} here" for b, c in regressed)))
    return out


def write(run: UpstreamTestRun, results_root: Path) -> Path:
    """Write the record and report.md into a new folder under ``results_root``; returns the folder."""
    folder = results_root / time.strftime("upstream-tests-%Y%m%d-%H%M%S", time.gmtime())
    folder.mkdir(parents=True, exist_ok=True)
    write_atomic(folder / REPORT_JSON, json.dumps(to_jsonable(run), indent=2) + "\n")
    write_atomic(folder / REPORT_MD, markdown(run))
    return folder


def run_builds_test(loaded, builds: list[str] | None, only: list[str], later: list[str], jobs: int,
                    results_root: Path, as_json: bool, run_all: bool = False, target: str | None = None) -> int:
    """`kvrepro builds test`: vLLM's own tests on every build of ``loaded`` (a spec LoadedMatrix),
    recorded under ``results_root`` and printed (markdown, or --json); the exit code: 1 when a build
    fails a test that passes on the release. ``run_all``: every test on every build, no impact rule.
    ``target``: ``ray`` sends each build's pytest job to the cluster of ``ray:`` (default: the
    matrix's ``target:`` when it is ray, else here)."""
    from rich.markup import escape

    from .. import deploy
    from ..builds import prepare_runtime, upstream_tests
    from ..errors import BadInputError
    from ..results.store import checked_root
    from .terminal import emit_json, err, out

    results_root = checked_root(results_root)  # before the run, not after minutes of pytest
    plans = loaded.plans(builds)
    patches = [loaded.patch_ref(name) for name in loaded.matrix.patches]
    releases = list(later) if later else upstream_tests.newer_releases(plans[0].base)
    upstream_tests.check_later_releases(plans[0].base, later)
    command = "kvrepro builds test" + "".join(f" --build {b}" for b in builds or []) + "".join(
        f" --only {o}" for o in only) + (" --all" if run_all else "")
    # default: the matrix's target when it runs vLLM's tests (ray: on its cluster), else here
    target = target or (loaded.matrix.target if deploy.runs_upstream_tests(loaded.matrix.target) else "local")
    if target != "local" and not deploy.runs_upstream_tests(target):
        raise BadInputError(f"--target {target}: builds test runs here (local) or on a target that runs vLLM's "
                            f"tests ({', '.join(deploy.with_capability(deploy.runs_upstream_tests))})")
    show = lambda line: err.print(escape(line[:200]), highlight=False)  # noqa: E731
    runner = upstream_tests.LOCAL
    if target != "local":
        runner = deploy.upstream_tests(target, loaded, plans[0].base, show) or upstream_tests.LOCAL
    if runner is not upstream_tests.LOCAL:
        command += f" --target {target}"
    try:
        with err.status("vLLM's own tests") as status:
            runtime = prepare_runtime(plans[0].base, on_line=lambda line: status.update(escape(line[:120])))
            run = upstream_tests.check_builds(plans, patches, runtime, workers=jobs, only=list(only),
                                              later_releases=releases, command=command, impact=not run_all,
                                              on_line=show, runner=runner)
    finally:
        if runner is not upstream_tests.LOCAL:
            runner.close()  # type: ignore[attr-defined]
    folder = write(run, results_root)
    if as_json:
        emit_json(run)
    else:
        out.print(markdown(run), markup=False, highlight=False, soft_wrap=True)
    err.print(f"recorded: {folder}", highlight=False)
    return 1 if regressions(run) else 0  # documented in kvrepro/cli.py
