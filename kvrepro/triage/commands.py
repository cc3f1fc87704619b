"""`kvrepro triage`'s work, called by kvrepro/cli.py: read a production log, say what it matches,
and with --emit / --run write and run the matrix that reproduces it; the exit code."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

from rich.markup import escape

from ..untrusted import quote

from ..report import terminal
from ..report.terminal import err, out
from ..results import store as results
from ..secrets import redact
from ..classify import known_patterns
from ..errors import BadInputError
from ..versions import SUPPORTED_RELEASES, version_tuple
from . import triage_file


def target_of(found: Any) -> dict[str, str] | None:
    """The emitted matrix's target_signature: the matched crash's, as its signature pattern names it."""
    if found.failure.kind != "crash" or not found.failure.pattern:
        return None
    pattern = next(p for p in known_patterns() if p.name == found.failure.pattern)
    return {"exception": pattern.exception, "function": pattern.function, "file": pattern.file,
            **({"expression": pattern.expressions[0]} if pattern.expressions else {})}


def check_release(release: str | None) -> None:
    """--release, before the log is read: what is not a vLLM version is bad input naming --release
    (not the log), exit 2. A version far from the releases kvrepro runs is taken (issue 45: the
    text is triaged against the catalogue's claims, with no reproduction, and said)."""
    if release is None:
        return
    if len(release) > 40 or version_tuple(release) is None:
        raise BadInputError(f"--release {quote(release, 40)}: not a vLLM release kvrepro can triage (a version "
                            f"X.Y.Z; it runs {SUPPORTED_RELEASES[0]}-{SUPPORTED_RELEASES[-1]}); give the release the "
                            "log's server ran, e.g. --release 0.26.0")


def triage(log: Path, *, emit: Path | None, run: bool, release: str | None, jobs: int | None,
           catalogue: Path | None, results_root: Path, as_json: bool) -> int:
    from ..report.render import matrix_table
    from ..stopping import name, stop_on_signals
    from ..suite.run import load as load_catalogue
    from . import render as triage_render
    check_release(release)
    cat = load_catalogue(catalogue)
    found = triage_file(log, cat, release)
    if as_json and not run:
        terminal.emit_json(triage_render.as_json(found))
    elif not as_json:
        for line in triage_render.plain(found):
            out.print(escape(redact(line)), highlight=False, soft_wrap=True)
    if emit is None and not run:
        return 0
    if not found.matches:
        if as_json:
            terminal.emit_json(triage_render.as_json(found))
        err.print("nothing to reproduce: the failure matches no catalogue entry")
        return 1
    if found.base is None:
        err.print(f"{log}: the log's release ({found.config.release or 'not in the log'}) is not one kvrepro runs or is "
                  "near: say the release to reproduce on with --release X.Y.Z", highlight=False)
        return 2
    from .emit import build_matrix, write_matrix
    from .run import proofs, run_emitted, what_it_proved

    entry = next(e for e in cat.entries if e.name == found.best.entry)
    data, notes = build_matrix(found, entry, list(cat.entries), target_of(found))
    folder = emit or (results.checked_root(results_root) / f"triage-{results.new_run_id()}")
    path = write_matrix(folder, data, found, entry, notes)
    err.print(escape(f"wrote {quote(path, 240)}"), highlight=False)
    if not run:
        return 0
    stop = threading.Event()
    with stop_on_signals(stop, lambda signum: err.print(f"[yellow]{name(signum)}: stopping[/]")):
        progress = terminal.RichProgress(len(data["builds"]))
        with progress.progress:
            matrix_result = run_emitted(path, results.checked_root(results_root), progress, stop, jobs)
    items = proofs(matrix_result, entry)
    if as_json:  # one document: the triage and what the run proved
        terminal.emit_json({**triage_render.as_json(found), "run": matrix_result.run_id, "proofs": items})
    else:
        out.print(matrix_table(matrix_result))
        for line in what_it_proved(items):
            out.print(escape(redact(line)), highlight=False, soft_wrap=True)
    return 0 if all(p.as_expected for p in items) else 1
