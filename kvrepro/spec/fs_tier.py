"""Hermetic filesystem tiers: each run's engine writes its ``fs`` offload tier in a folder of its own.

vLLM's multi-tier offloading (``TieringOffloadingSpec``) takes its secondary tiers from
``--kv-transfer-config``'s ``kv_connector_extra_config.secondary_tiers``. An ``fs`` tier writes one
file per chunk under its ``root_dir``, named by the chunk's block hash, and keeps them when the
engine exits; vLLM seeds block hashes with a fixed default on purpose, so that instances sharing a
volume share the cache (``FileSystemTierManager``'s docstring, v1/kv_offload/tiering/fs/manager.py,
0.34.0). A later engine given the same ``root_dir`` (the next repetition, another build, another
campaign) hits the earlier engines' files, and the shadow KV (kvrepro/engine/shadow.py), which
learns what the offload tiers hold from the stores it saw, reports those loads as wrong KV: a
false CORRUPT, measured on 0.34.0 (docs/engine.md "Filesystem tiers").

So every run gets its own empty folders: the runner's target rewrites each ``fs`` tier's
``root_dir`` to ``<root>/fs-tier-<i>`` (``i``: the tier's index in ``secondary_tiers``), ``<root>``
being the run's folder as the engine sees it. The JSON is read and written as data (``json``);
what the matrix gave is untrusted, so a ``--kv-transfer-config`` that is not a JSON object, or an
``fs`` tier whose ``root_dir`` is not a non-empty string, is refused when the matrix is validated
(one line naming ``engine.extra_args.<n>``), not passed on for vLLM to fail on at start.
"""

from __future__ import annotations

import json
import posixpath
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

TRANSFER_FLAG = "--kv-transfer-config"
FS_TIER_TYPE = "fs"


def tier_folder(tier: int) -> str:
    """The folder (a name inside the run's folder) of secondary tier ``tier``."""
    return f"fs-tier-{tier}"


class FsTierError(ValueError):
    """A ``--kv-transfer-config`` kvrepro cannot read; ``arg`` is its index in engine.extra_args."""

    def __init__(self, arg: int, message: str):
        super().__init__(message)
        self.arg = arg


@dataclass(frozen=True)
class FsTier:
    """One ``fs`` secondary tier of the matrix: where its config is, and the folder the matrix named."""

    arg: int        # index in engine.extra_args of the --kv-transfer-config value (or of `--flag=value`)
    tier: int       # index in secondary_tiers
    root_dir: str   # as the matrix wrote it


def _transfer_values(args: Sequence[str]) -> Iterator[tuple[int, str, str]]:
    """(index, prefix, JSON) of every --kv-transfer-config value: ``--flag JSON`` (prefix '') and
    ``--flag=JSON`` (prefix ``--flag=``)."""
    for i, arg in enumerate(args):
        if arg == TRANSFER_FLAG and i + 1 < len(args):
            yield i + 1, "", args[i + 1]
        elif arg.startswith(TRANSFER_FLAG + "="):
            yield i, TRANSFER_FLAG + "=", arg[len(TRANSFER_FLAG) + 1:]


def _config(index: int, text: str) -> dict:
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise FsTierError(index, f"{TRANSFER_FLAG} is not valid JSON ({exc}); give one JSON object, "
                                 "e.g. '{\"kv_connector_extra_config\": {...}}'") from None
    if not isinstance(value, dict):
        raise FsTierError(index, f"{TRANSFER_FLAG} is JSON {type(value).__name__}, not an object; give one "
                                 "JSON object, e.g. '{\"kv_connector_extra_config\": {...}}'")
    return value


def _fs_entries(config: dict) -> Iterator[tuple[int, dict]]:
    extra = config.get("kv_connector_extra_config")
    tiers = extra.get("secondary_tiers") if isinstance(extra, dict) else None
    if isinstance(tiers, list):
        for j, tier in enumerate(tiers):
            if isinstance(tier, dict) and tier.get("type") == FS_TIER_TYPE:
                yield j, tier


def fs_tiers(extra_args: Sequence[str]) -> list[FsTier]:
    """The ``fs`` secondary tiers ``extra_args`` configure; FsTierError when kvrepro cannot read one."""
    found: list[FsTier] = []
    for index, _, text in _transfer_values(extra_args):
        for j, tier in _fs_entries(_config(index, text)):
            root = tier.get("root_dir")
            if not isinstance(root, str) or not root.strip():
                raise FsTierError(index, f"{TRANSFER_FLAG}: secondary_tiers[{j}] (type fs) has root_dir "
                                         f"{root!r}; give a folder path as a string (kvrepro points it to a "
                                         "fresh folder of each run, docs/engine.md)")
            found.append(FsTier(arg=index, tier=j, root_dir=root))
    return found


def redirected(extra_args: Sequence[str], root: str) -> list[str]:
    """``extra_args`` with every ``fs`` tier's root_dir set to ``<root>/fs-tier-<i>`` (``root``: a
    POSIX path as the engine sees it); everything else in the JSON as it was."""
    args = list(extra_args)
    for index, prefix, text in list(_transfer_values(args)):
        config = _config(index, text)
        entries = list(_fs_entries(config))
        if not entries:
            continue
        for j, tier in entries:
            tier["root_dir"] = posixpath.join(root, tier_folder(j))
        args[index] = prefix + json.dumps(config)
    return args


def folders(extra_args: Sequence[str]) -> list[str]:
    """The folder names (inside the run's folder) the ``fs`` tiers of ``extra_args`` get."""
    return sorted({tier_folder(t.tier) for t in fs_tiers(extra_args)})
