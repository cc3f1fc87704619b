"""`kvrepro classify` and `kvrepro signatures`: one engine log judged, and the known signatures
listed, as data; the command prints it (kvrepro/cli.py)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import BadInputError
from ..spec.matrix import TargetSignature
from ..untrusted import open_regular
from .report import parse_log
from .infra import known_infra_causes
from .patterns import known_patterns


def check_log_arguments(log: Path, source: Path | None) -> None:
    """The log is a readable regular file and --source a folder: one line (exit 2) otherwise."""
    if log.is_dir():
        raise BadInputError(f"{log}: is a folder; give an engine log file, e.g. {log / 'engine.log'} "
                            "(results/<run>/<build>/<rep>/engine.log)")
    if not log.exists():
        raise BadInputError(f"{log}: no such file; give an engine log (engine.log, `docker logs` output)")
    try:  # a FIFO, /dev/zero: one line, never a hang (kvrepro/untrusted.py)
        os.close(open_regular(log, follow=True))
    except OSError as exc:
        raise BadInputError(f"{log}: {exc.strerror or exc}; give an engine log file (engine.log, `docker logs` "
                            "output, or a .gz of one)") from None
    if source is not None and not source.is_dir():
        what = "is a file, not a folder" if source.exists() else "no such folder"
        raise BadInputError(f"--source {source}: {what}; give the folder that holds the build's vllm/ sources "
                            "(e.g. the overlay `kvrepro setup` prints)")


@dataclass(frozen=True)
class LogVerdict:
    """What `kvrepro classify` says about one log: the crash classification and the KV defects."""

    outcome: str
    title: str
    corrupt_title: str
    defects: dict[str, int]
    as_json: dict[str, Any] = field(repr=False)
    notices: tuple[str, ...] = ()  # what reading the log noticed (lines cut to the bound), for stderr

    def lines(self) -> list[str]:
        """What the terminal shows (rich markup; the log's own text escaped)."""
        from rich.markup import escape

        shown = [f"[bold]{self.outcome}[/]: {escape(self.title)}"]
        if self.defects:
            shown.append(f"[bold]corrupt[/]: {escape(self.corrupt_title)} "
                         f"({', '.join(f'{name} {n}' for name, n in self.defects.items())})")
        return shown


def classify_command(log: Path, source: Path | None, target: TargetSignature) -> LogVerdict:
    """``log`` judged against ``target`` (its arguments checked first: :func:`check_log_arguments`)."""
    from .corruption import defects_of
    from .logfile import open_log
    from .verdict import corruption_title

    notices: list[str] = []
    # one pass over the log, in lines of bounded length (kvrepro/classify/logfile.py): memory stays
    # flat whatever the file holds; a binary or damaged compressed file is NotTextLog (exit 2)
    with open_log(log, require_text=True, notices=notices) as fh:
        parsed = parse_log(fh, source, target)
    result, exposure = parsed.classification, parsed.exposure
    defects = defects_of(exposure.kv_violations, exposure.kv_violations_by, exposure.kv_first_violation_class,
                         exposure.kv_groups)

    return LogVerdict(outcome=result.outcome.value, title=result.title,
                      corrupt_title=corruption_title(defects, exposure.kv_first_violation) if defects else result.title,
                      defects=dict(defects), notices=tuple(notices),
                      as_json={**result.to_json(), "kv_violations": exposure.kv_violations, "kv_defects": defects,
                               "kv_violations_by_class": dict(exposure.kv_violations_by)})


def signature_rows() -> list[dict[str, Any]]:
    """Every known crash, corruption and infrastructure signature as a row: kind, name, title
    (a crash title with placeholders shown by its exception, function and expression)."""
    from .corruption import known_corruptions
    crashes = [{"kind": "crash", "name": p.name, "title": p.title if "{" not in p.title else
                f"{p.exception} in {p.function}" + (f": {p.expressions[0]}" if p.expressions else ""),
                "site": f"{p.file}:{p.function}", "upstream": list(p.upstream), "test_log": p.test_log}
               for p in known_patterns()]
    corruptions = [{"kind": "corruption", "name": c.name, "title": c.title,
                    "classes": [vars(k) for k in c.classes], "upstream": list(c.upstream),
                    "fixed_by": list(c.fixed_by), "test_log": c.test_log} for c in known_corruptions()]
    infra = [{"kind": "infra", "name": c.name, "title": f"{c.kind}: <the line>", "line": c.line,
              "upstream": list(c.upstream), "test_log": c.test_log} for c in known_infra_causes()]
    return crashes + corruptions + infra
