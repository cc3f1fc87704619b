"""The capable connector (``engine.connector: capable``, kvrepro/engine/capable.py) and the entries
that use it or were added with it: how it is selected, where it is refused, that vLLM's own
connector factory resolves it, and that the probe counts the divergent hits it is handed.

Faked in the vLLM-backed cases: the ``self``/``request`` objects handed to vLLM's real
``KVCacheManager.get_computed_blocks_for_connector`` (a real one needs a whole engine); the
per-group hits they report stand in for a prefix cache. The suite's engine runs (docs/suite.md)
exercise the connector end to end.
"""

from __future__ import annotations

import json
import os
import subprocess
import textwrap
from pathlib import Path

import pytest

from kvrepro.errors import SpecError
from kvrepro.spec.matrix import EngineSpec, parse_matrix
from kvrepro.suite.catalogue import expected_state
from kvrepro.suite.run import SuiteBuild, check_entries, load as load_catalogue, refused_builds
from kvrepro.versions import (CAPABLE_CONNECTOR_CLASS, CAPABLE_CONNECTOR_MODULE, SUPPORTED_RELEASES,
                              divergent_hits_flag_problem)

pytestmark = pytest.mark.shares_zygotes  # one engine zygote per runtime for the session (conftest.shares_zygotes)

ROOT = Path(__file__).resolve().parents[1]


def _transfer(args: list[str]) -> dict:
    assert args.count("--kv-transfer-config") == 1, args
    return json.loads(args[args.index("--kv-transfer-config") + 1])


def test_the_capable_connector_is_named_in_the_transfer_config_not_by_offloading_size():
    plain = EngineSpec().serve_args("m", include_sim=False)
    assert "--kv-offloading-size" in plain and "--kv-transfer-config" not in plain

    args = EngineSpec(connector="capable", kv_offloading_size_gib=0.5).serve_args("m", include_sim=False)
    # --kv-offloading-size would make vLLM name the OffloadingConnector over ours
    assert "--kv-offloading-size" not in args and "--kv-offloading-backend" not in args
    assert _transfer(args) == {"kv_connector": CAPABLE_CONNECTOR_CLASS, "kv_connector_module_path": CAPABLE_CONNECTOR_MODULE,
                               "kv_role": "kv_both", "kv_connector_extra_config": {"cpu_bytes_to_use": 1 << 29}}
    # the geometry's offload chunk joins the same config
    chunked = EngineSpec(connector="capable", geometry={"offload_chunk_tokens": 64}).serve_args("m", include_sim=False)
    assert _transfer(chunked)["kv_connector_extra_config"] == {"cpu_bytes_to_use": 1 << 30, "block_size": 64}
    assert _transfer(EngineSpec(geometry={"offload_chunk_tokens": 64}).serve_args("m", include_sim=False)) == \
        {"kv_connector_extra_config": {"block_size": 64}}


def test_the_version_gate_follows_the_release_that_reads_the_declaration():
    assert [r for r in SUPPORTED_RELEASES if divergent_hits_flag_problem(r) is None] == \
        [r for r in SUPPORTED_RELEASES if tuple(map(int, r.split("."))) >= (0, 28, 0)]
    assert divergent_hits_flag_problem("0.26.0", ("pr-48425", "pr-50344")) is None  # the backport
    assert "0.27.1 does not read supports_divergent_local_hybrid_hits" in divergent_hits_flag_problem("0.27.1")


def test_a_matrix_on_a_release_without_the_declaration_is_refused_naming_the_field():
    text = 'base: "{base}"\nbuilds: {{A: [{stack}]}}\nengine: {{connector: capable}}\n{patches}'
    patches = "patches:\n" + "".join(f"  {p}: {{file: {p}.patch, upstream: https://github.com/vllm-project/vllm/pull/{p[3:]}}}\n"
                                      for p in ("pr-48425", "pr-50344"))
    with pytest.raises(SpecError) as bad:
        parse_matrix(text.format(base="0.27.1", stack="", patches=""), ROOT / "m.yaml")
    assert "engine.connector" in str(bad.value) and "build A on 0.27.1" in str(bad.value)
    assert parse_matrix(text.format(base="0.28.0", stack="", patches=""), ROOT / "m.yaml").matrix.engine.connector == "capable"
    ok = parse_matrix(text.format(base="0.26.0", stack="pr-48425, pr-50344", patches=patches), ROOT / "m.yaml")
    assert ok.matrix.engine.connector == "capable"


def test_the_suite_runs_a_capable_entry_only_where_it_means_something():
    catalogue = load_catalogue()
    entry = next(e for e in catalogue.entries if e.name == "capable-connector-mamba-state")
    assert entry.testable and entry.path_counter == "divergent_loads"
    old, new = SuiteBuild("0.26.0"), SuiteBuild("0.28.0")
    refused = refused_builds(entry, [old, new])
    assert list(refused) == ["0.26.0"] and "engine.connector" in refused["0.26.0"], refused
    matrices = check_entries([entry], [old, new])
    assert matrices[entry.name].matrix.bases == ["0.28.0"]  # the 0.26.0 row is NOT TESTABLE, not run
    assert check_entries([entry], [old]) == {}
    other = next(e for e in catalogue.entries if e.name == "mamba-null-state")
    assert refused_builds(other, [old]) == {}


def test_the_new_entries_load_with_their_claims():
    entries = {e.name: e for e in load_catalogue().entries}
    gap = entries["mamba-chunk-store-gap"]
    assert (gap.kind, gap.signature, gap.path_counter) == ("corruption", "mamba-chunk-store-gap", "kv_hit_reads.mamba+offload")
    assert expected_state(gap, "0.28.0") == "present" and expected_state(gap, "0.29.0") == "fixed"
    assert expected_state(gap, "0.33.0") == "fixed" and expected_state(gap, "0.27.0") is None  # code there, read by no load
    e_stack = ("pr-49146", "pr-52771", "pr-52807", "pr-48425", "pr-50344")
    assert expected_state(gap, "0.26.0", e_stack) == "present"


# --- against vLLM's own code -------------------------------------------------------------------


def _run(scripts, python: Path, code: str, path: list[Path]) -> subprocess.CompletedProcess:
    """``code`` in the runtime env, forked from the worker's shared zygote (conftest's runtime_scripts)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = os.pathsep.join(str(p) for p in path)
    return scripts.run(python, ["-c", textwrap.dedent(code)], env=env, timeout=180)


FACTORY = """
import json
from vllm.config import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import OffloadingConnector
config = KVTransferConfig(kv_connector="{cls}", kv_connector_module_path="{module}", kv_role="kv_both")
found = KVConnectorFactory.get_connector_class(config)
plain = KVConnectorFactory.get_connector_class(KVTransferConfig(kv_connector="OffloadingConnector", kv_role="kv_both"))
print("RESULT " + json.dumps({{"name": found.__name__, "subclass": issubclass(found, OffloadingConnector),
    "capable": found.supports_divergent_local_hybrid_hits.fget(None),
    "plain": plain.supports_divergent_local_hybrid_hits.fget(None)}}))
"""


@pytest.mark.vllm
def test_vllms_connector_factory_loads_the_capable_connector_from_its_module_path(runtime_python, runtime_scripts,
                                                                                overlays):
    # build E carries pr-50344: the declaration exists and its default is False
    proc = _run(runtime_scripts, runtime_python,
                FACTORY.format(cls=CAPABLE_CONNECTOR_CLASS, module=CAPABLE_CONNECTOR_MODULE), [overlays["E"], ROOT])
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(next(l for l in proc.stdout.splitlines() if l.startswith("RESULT "))[7:])
    assert result == {"name": CAPABLE_CONNECTOR_CLASS, "subclass": True, "capable": True, "plain": False}


DIVERGENT = """
import json, sys, types
sys.path.insert(0, {probe_dir!r})
import vllm.v1.core.kv_cache_manager as manager_module
from vllm.distributed.kv_transfer.kv_connector.v1.offloading import scheduler  # the probe installs here
import kvrepro_probe
from vllm.v1.core.kv_cache_coordinator import HybridKVCacheCoordinator

def manager(per_group_hits):
    coordinator = object.__new__(HybridKVCacheCoordinator)
    coordinator.full_attention_group_id = 0
    coordinator.find_longest_cache_hit_per_group = lambda hashes, n: (([], []), per_group_hits)
    return types.SimpleNamespace(
        kv_cache_config=types.SimpleNamespace(has_mamba_layers=True), coordinator=coordinator,
        enable_caching=True, log_stats=False, create_kv_cache_blocks=lambda computed: "blocks",
        get_computed_blocks=lambda request: ("reconciled", 16, 0))

method = manager_module.KVCacheManager.get_computed_blocks_for_connector
out = []
for hits in ([48, 16], [32, 32], [16, 48]):
    request = types.SimpleNamespace(request_id=str(hits), block_hashes=[], num_tokens=64,
                                    skip_reading_prefix_cache=False)
    result = method(manager(hits), request)
    out.append([repr(result[1:]), kvrepro_probe.counts()["divergent_hits"]])
print("RESULT " + json.dumps({{"calls": out, "marked": getattr(method, "__kvrepro_probe__", False)}}))
"""


@pytest.mark.vllm
def test_the_probe_counts_divergent_hits_handed_to_the_connector(runtime_python, runtime_scripts, overlays, tmp_path):
    probe = tmp_path / "probe"
    probe.mkdir()
    (probe / "kvrepro_probe.py").write_bytes((ROOT / "kvrepro" / "probe" / "kvrepro_probe.py").read_bytes())
    env_path = [overlays["E"]]
    proc = _run(runtime_scripts, runtime_python, DIVERGENT.format(probe_dir=str(probe)), env_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(next(l for l in proc.stdout.splitlines() if l.startswith("RESULT "))[7:])
    assert result["marked"] is True
    assert result["calls"] == [
        ["(48, 0, True)", 1],        # full attention deeper than Mamba: handed over, counted
        ["(32, 0, False)", 1],       # agreeing groups
        ["(16, 0, False)", 1],       # Mamba deeper: vLLM reconciles itself (get_computed_blocks)
    ]


def test_a_recorded_suite_gives_the_capable_entry_not_testable_on_an_older_release(tmp_path):
    """What `suite report` shows for a build the entry was never run on: NOT TESTABLE, with why."""
    from kvrepro.suite.records import SuiteBuildRecord, SuiteEntryRecord, SuiteRecord
    from kvrepro.results import store
    from kvrepro.suite.judge import NOT_TESTABLE
    from kvrepro.suite.run import SUITE_FILE, load_suite

    folder = tmp_path / "suite-x"
    folder.mkdir()
    record = SuiteRecord(suite_id="suite-x", status="complete", builds=(SuiteBuildRecord("0.27.1"),),
                         entries={"capable-connector-mamba-state": SuiteEntryRecord(testable=True)})
    store.write_json(folder / SUITE_FILE, record)
    rows = load_suite(folder, load_catalogue()).rows
    assert [(r.entry, r.build, r.state) for r in rows] == [("capable-connector-mamba-state", "0.27.1", NOT_TESTABLE)]
    assert "0.27.1 does not read supports_divergent_local_hybrid_hits" in rows[0].detail
    assert rows[0].matches is None  # nothing to compare: not a failure of the suite
