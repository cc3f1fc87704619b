"""A matrix as a whole, on top of every stage.

* :func:`load_matrix` / :func:`parse_matrix`: the spec's parser with every stage's own settings
  checked (the load profile's fields by the load generator, each target's sections such as
  ``docker:`` and ``hosts:`` by that target: kvrepro.deploy.check_settings), all with file:line errors. spec/
  parses the file's shape and imports no later stage; this is where the two meet.
* ``validate``: everything checkable before an engine starts (patches apply, the release
  resolves, expectations name known defects).
* ``runner``: a matrix run, stage by stage, recorded as it goes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..deploy import check_settings as check_target_settings
from ..loadgen.profiles import check_settings
from ..spec.matrix import LoadedMatrix
from ..spec.matrix import load_matrix as _load_shape
from ..spec.matrix import parse_matrix as _parse_shape


def load_matrix(path: str | Path) -> LoadedMatrix:
    """Read ``path`` and check it whole; raise SpecError naming file:line and field."""
    return _load_shape(path, check_load_settings=check_settings, check_target_settings=check_target_settings)


def parse_matrix(text: str, path: Path, data: dict[str, Any] | None = None) -> LoadedMatrix:
    """Check matrix ``text`` (read from ``path``) whole; raise SpecError naming file:line and field.
    ``data``: what ``text`` parses to, when the caller wrote it from that (not parsed again)."""
    return _parse_shape(text, path, check_load_settings=check_settings, check_target_settings=check_target_settings,
                        data=data)


__all__ = ["load_matrix", "parse_matrix"]
