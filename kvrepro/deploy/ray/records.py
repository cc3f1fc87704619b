"""The ray target's part of a run's records: the node the engine ran on and, for an engine spread
over several nodes, its placement group's nodes.

Shared records hold no field of a target: a run's ``verdict.json`` and ``manifest.json`` keep this
under ``"by_target": {"ray": {...}}`` (:attr:`kvrepro.records.RunResult.by_target`,
:attr:`kvrepro.deploy.records.RunManifest.by_target`), and this record reads and writes that section
with the one JSON pair (kvrepro.records.to_jsonable / from_jsonable). Folders written before the
section existed had ``node`` and ``placement_nodes`` at the top level: :data:`TOP_LEVEL_BEFORE`
says so, and kvrepro.deploy.lift_target_keys moves them when such a file is read.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from ...records import Json, from_jsonable, to_jsonable

SECTION = "ray"
# keys a kvrepro before the target section wrote at the top level of verdict.json and manifest.json
TOP_LEVEL_BEFORE = ("node", "placement_nodes")


@dataclass(frozen=True)
class NodeInfo:
    """A cluster node: Ray's node id and the node's address."""

    node_id: str
    address: str

    @property
    def label(self) -> str:
        return f"{self.address} ({self.node_id[:8]})"


@dataclass(frozen=True)
class RayPlacement:
    """Where a run's engine ran: the node of its task, and every node of its placement group in
    bundle order (ray.nodes_per_engine > 1; bundle 0 is ``node``)."""

    node: NodeInfo | None = None
    placement_nodes: tuple[NodeInfo, ...] = ()

    @classmethod
    def of(cls, record: Any) -> "RayPlacement | None":
        """The section of ``record`` (a RunResult or a RunManifest), None when the run was not Ray's."""
        section = record.by_target.get(SECTION)
        return None if section is None else from_jsonable(cls, section, f"by_target.{SECTION}")

    def onto(self, record: Any) -> Any:
        """``record`` with this as its ray section."""
        return dataclasses.replace(record, by_target={**record.by_target, SECTION: to_jsonable(self)})

    def where(self) -> str:
        """The node, then the group's other nodes: ``10.0.0.2 (ab12cd34) + 10.0.0.3 (ef56...)``."""
        text = self.node.label if self.node is not None else "-"
        others = [n.label for n in self.placement_nodes if self.node is None or n.node_id != self.node.node_id]
        return text + (f" + {', '.join(others)}" if others else "")


def where_ran(section: Json) -> str:
    """kvrepro.deploy.where_ran's hook: the words for a run's ray section."""
    return from_jsonable(RayPlacement, section, f"by_target.{SECTION}").where()
