"""A results folder kvrepro recorded reads back typed and writes back the same (issue 49: one way
to JSON and back). tests/data/results/20261204-214850-f386 is a real `kvrepro suite run` run (sim
target, vLLM 0.34.0, two STALL repetitions) copied without its logs; it was written before the
records moved to their stages and before the target sections (``node``/``placement_nodes`` at
the top level), so it also pins that older folders stay readable."""

from __future__ import annotations

import dataclasses
import json
import shutil

from conftest import ROOT

from kvrepro.deploy.records import BuildRecord, RunManifest
from kvrepro.deploy import lift_target_keys, where_ran
from kvrepro.deploy.ray.records import NodeInfo, RayPlacement
from kvrepro.records import RunResult, Verdict, from_jsonable, to_jsonable
from kvrepro.results.records import RunInfo
from kvrepro.results.store import load_run

RUN = ROOT / "tests" / "data" / "results" / "20261204-214850-f386"
RECORDS = {"run.json": RunInfo, "build.json": BuildRecord, "manifest.json": RunManifest, "verdict.json": RunResult}


def _read(cls, data):
    return from_jsonable(cls, lift_target_keys(data, {f.name for f in dataclasses.fields(cls)}))


def test_a_recorded_results_folder_reads_typed_and_round_trips():
    run = load_run(RUN.parent, RUN.name)
    assert run.info.status == "complete" and run.info.base == "0.34.0" and run.info.target == "sim"
    [build] = run.builds
    assert [r.verdict for r in build.runs] == [Verdict.STALL, Verdict.STALL]
    assert build.build is not None and build.build.ok and build.manifest is not None
    assert build.runs[0].kv_checks == 88 and build.runs[0].load.stopped_because == "stall"
    files = sorted(p for p in RUN.rglob("*.json"))
    assert len(files) == 6
    for path in files:
        data = json.loads(path.read_text())
        record = _read(RECORDS[path.name], data)
        written = json.loads(json.dumps(to_jsonable(record)))
        assert from_jsonable(RECORDS[path.name], written) == record, path
        # every key written then is written now, with the same value, but the ray target's (empty
        # here: a sim run), which moved into the target's section
        dropped = {k for k in data if k not in written}
        assert dropped <= {"node", "placement_nodes"}, (path, dropped)
        assert {k: v for k, v in written.items() if k in data} == {k: v for k, v in data.items() if k in written}, path
        assert written.get("by_target", {}) == {}, path


def test_a_ray_run_recorded_before_target_sections_reads_into_the_ray_section(tmp_path):
    """A verdict.json and manifest.json of a Ray run as kvrepro wrote them before issue 49 (the node
    at the top level; planted in a copy of the recorded sim run: no Ray cluster is started here)."""
    copy = tmp_path / RUN.name
    shutil.copytree(RUN, copy)
    node = {"node_id": "ab12cd34ef", "address": "10.0.0.2"}
    other = {"node_id": "99887766aa", "address": "10.0.0.3"}
    for name in ("verdict.json", "manifest.json"):
        path = copy / "recompute-failed-load-stall" / "0" / name
        path.write_text(json.dumps({**json.loads(path.read_text()), "node": node, "placement_nodes": [node, other]}))
    result = load_run(tmp_path, RUN.name).builds[0].runs[0]
    placement = RayPlacement.of(result)
    assert placement == RayPlacement(NodeInfo(**node), (NodeInfo(**node), NodeInfo(**other)))
    assert where_ran(result) == "10.0.0.2 (ab12cd34) + 10.0.0.3 (99887766)"
    manifest = _read(RunManifest, json.loads((copy / "recompute-failed-load-stall" / "0" / "manifest.json").read_text()))
    assert RayPlacement.of(manifest) == placement
    # written now: under the target's own key, and read back as it was
    assert to_jsonable(result)["by_target"] == {"ray": {"node": node, "placement_nodes": [node, other]}}
    assert from_jsonable(RunResult, json.loads(json.dumps(to_jsonable(result)))) == result
    # a sim run has no section: no words, no target imported for it
    assert where_ran(load_run(RUN.parent, RUN.name).builds[0].runs[0]) is None


def test_a_records_own_json_form_goes_through_the_one_pair():
    """The records whose file format differs from their fields (a flat build manifest with the
    target's keys, the optional ``reverse``) still read back what they write."""
    for path in RUN.rglob("build.json"):
        data = json.loads(path.read_text())
        assert to_jsonable(from_jsonable(BuildRecord, data)) == data
