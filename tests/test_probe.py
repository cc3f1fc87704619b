"""Tests of the probe (kvrepro/probe/kvrepro_probe.py) against vLLM's real scheduler module.

Each case runs in its own python process, because the probe installs an import hook and wraps
a class for the life of the process: forked from the worker's shared engine zygote (conftest's
``runtime_scripts``), as every engine kvrepro runs is, so torch & co. are imported already and vLLM
and the probe are not. The wrapped method is the real
``OffloadingConnectorScheduler.update_state_after_alloc`` of the vLLM tree named by
``KVREPRO_TEST_OVERLAY_A``. Faked: the ``self``/``request`` objects handed to it, which are
minimal stand-ins (a real scheduler needs a full engine config; the engine tests drive the real
one end to end). The stand-ins make the original raise after the probe has counted, which is
exactly what lets us check that the wrapper neither swallows nor alters what the original does.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import textwrap
from pathlib import Path

import pytest


pytestmark = [pytest.mark.vllm, pytest.mark.shares_zygotes]  # conftest.shares_zygotes

ROOT = Path(__file__).resolve().parents[1]
PROBE = ROOT / "kvrepro" / "probe" / "kvrepro_probe.py"
SCHEDULER_REL = "vllm/distributed/kv_transfer/kv_connector/v1/offloading/scheduler.py"


@pytest.fixture(scope="module")
def vllm_tree(runtime_python, overlays, runtime_scripts) -> tuple[tuple, Path]:
    """((python, its script runner), dir holding vllm/): the runtime env and build A's overlay, made
    by kvrepro.builds."""
    root = overlays["A"]
    assert (root / SCHEDULER_REL).is_file(), f"{root} has no {SCHEDULER_REL}"
    return (str(runtime_python), runtime_scripts), root


def run_py(python: tuple, code: str, path: list[Path], timeout: float = 120,
           plugins: bool = True) -> subprocess.CompletedProcess:
    executable, scripts = python
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = os.pathsep.join(str(p) for p in path)
    if not plugins:
        # an overlay carries kvrepro's vLLM plugin, which activates the probe as vLLM loads plugins;
        # VLLM_PLUGINS naming no installed plugin keeps vLLM from loading it
        env["VLLM_PLUGINS"] = "kvrepro-test-no-plugin"
    return scripts.run(executable, ["-c", textwrap.dedent(code)], env=env, timeout=timeout)


def probe_dir(tmp_path: Path) -> Path:
    """A directory holding only kvrepro_probe.py, as an overlay or site-packages would."""
    d = tmp_path / "probe"
    d.mkdir()
    (d / "kvrepro_probe.py").write_bytes(PROBE.read_bytes())
    return d


# Calls the wrapped method like the scheduler does, with stand-in arguments, and records for
# each call: the counts afterwards, and what the call produced next to what the unwrapped
# original produces for the same arguments.
CALLS = """
import json, sys, types
import kvrepro_probe
from vllm.distributed.kv_transfer.kv_connector.v1.offloading import scheduler as mod
cls = mod.OffloadingConnectorScheduler
wrapped = cls.update_state_after_alloc
original = wrapped.__wrapped__

def outcome(fn, *args):
    try:
        return ["returned", repr(fn(*args))]
    except BaseException as exc:
        return ["raised", type(exc).__name__, str(exc)]

def stand_in(local):
    status = types.SimpleNamespace(num_locally_computed_tokens=local)
    return types.SimpleNamespace(_req_status={"r": status}), types.SimpleNamespace(request_id="r")

results = []
for local, external in [(0, 0), (32, 0), (0, 16), (32, 16), (16, 48)]:
    self_, req = stand_in(local)
    got = outcome(wrapped, self_, req, None, external)
    self_, req = stand_in(local)
    want = outcome(original, self_, req, None, external)
    results.append({"local": local, "external": external, "got": got, "want": want,
                    "counts": kvrepro_probe.counts()})
print("RESULTS " + json.dumps({"results": results, "sha": kvrepro_probe.source_sha256(),
                               "marked": getattr(wrapped, "__kvrepro_probe__", False)}))
"""


def parse_results(stdout: str) -> dict:
    line = next(l for l in stdout.splitlines() if l.startswith("RESULTS "))
    return json.loads(line[len("RESULTS "):])


def test_counts_external_hits_and_triggers_and_keeps_behaviour(vllm_tree, tmp_path):
    python, tree = vllm_tree
    proc = run_py(python, CALLS, [probe_dir(tmp_path), tree])
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = parse_results(proc.stdout)
    assert data["marked"] is True

    counts = [r["counts"] for r in data["results"]]
    # (0,0) and (32,0): no offload hit -> nothing counted; (0,16): hit without local prefix;
    # (32,16) and (16,48): hit with a local prefix -> trigger.
    # (blocks=None: no group layout to read, so the bug's state is never counted)
    none = {"state_calls": 0, "state_groups": {}, "deferred_lookups": 0, "loads_behind_deferred": 0,
            "finished_unscheduled": 0, "divergent_hits": 0, "divergent_loads": 0, "cow_calls": 0, "truncate_calls": 0, "partial_hits": 0,
            "lookups_in_flight": 0}
    assert counts == [
        {"external_hit_calls": 0, "trigger_calls": 0, **none},
        {"external_hit_calls": 0, "trigger_calls": 0, **none},
        {"external_hit_calls": 1, "trigger_calls": 0, **none},
        {"external_hit_calls": 2, "trigger_calls": 1, **none},
        {"external_hit_calls": 3, "trigger_calls": 2, **none},
    ]
    for r in data["results"]:
        assert r["got"] == r["want"], r
    # The original returns at once without an offload hit and raises on the stand-ins with one:
    # the counted calls are counted even though the call then raises.
    assert data["results"][0]["got"] == ["returned", "None"]
    assert data["results"][3]["got"][0] == "raised"

    # Before re-raising, the probe reports; the format is what the classifier parses.
    assert "kvrepro-probe: counts external_hit_calls=2 trigger_calls=1" in proc.stderr
    assert "kvrepro-probe: counts external_hit_calls=3 trigger_calls=2" in proc.stderr
    # ... and at exit.
    assert re.fullmatch(r"kvrepro-probe: counts external_hit_calls=3 trigger_calls=2 state_calls=0 state_groups=- "
                        r"deferred_lookups=0 loads_behind_deferred=0 finished_unscheduled=0 divergent_hits=0 divergent_loads=0 "
                        r"cow_calls=0 truncate_calls=0 partial_hits=0 lookups_in_flight=0 pid=\d+", proc.stderr.rstrip().splitlines()[-1])


# The bug's state: real KVCacheBlock / KVCacheBlocks from vLLM; the connector config is a stand-in
# carrying what update_state_after_alloc reads of it (per group: tokens_per_block, the spec kind).
STATE_CALLS = """
import json, types
import kvrepro_probe
from vllm.distributed.kv_transfer.kv_connector.v1.offloading import scheduler as mod
from vllm.v1.core.kv_cache_utils import KVCacheBlock
from vllm.v1.core.kv_cache_manager import KVCacheBlocks

def group(i, kind):
    spec = types.SimpleNamespace(kv_cache_spec_kind=kind)
    return types.SimpleNamespace(group_idx=i, tokens_per_block=16, kv_event_group_spec=spec)

def block(i, hashed=True, null=False):
    b = KVCacheBlock(i)
    if hashed:
        b._block_hash = b"h%d" % i
    b.is_null = null
    return b

config = types.SimpleNamespace(kv_group_configs=(group(0, "full_attention"), group(1, "mamba")))
def call(local, fa, mamba):
    status = types.SimpleNamespace(num_locally_computed_tokens=local)
    self_ = types.SimpleNamespace(_req_status={"r": status}, config=config)
    try:
        mod.OffloadingConnectorScheduler.update_state_after_alloc(
            self_, types.SimpleNamespace(request_id="r"), KVCacheBlocks((fa, mamba)), 16)
    except Exception:
        pass  # the stand-in scheduler lacks what the rest of the method needs
    return kvrepro_probe.counts()

out = []
# local hit of 32 tokens = 2 blocks per group; everything below the boundary hashed: no state
out.append(call(32, [block(1), block(2), block(3, False)], [block(0, False, True), block(4), block(5, False)]))
# a real, unhashed full-attention block below the boundary: the state, in full attention
out.append(call(32, [block(1), block(6, False), block(7, False)], [block(0, False, True), block(8), block(9, False)]))
# the boundary is cdiv(local, 16): 17 tokens reach into block 1; the unhashed one there counts
out.append(call(17, [block(1), block(10, False)], [block(0, False, True), block(11, False)]))
# unhashed blocks above the boundary or null ones below it are not the state
out.append(call(16, [block(1), block(12, False)], [block(0, False, True), block(13, False)]))
print("RESULTS " + json.dumps(out))
"""


def test_counts_the_bugs_state_and_its_group_kind(vllm_tree, tmp_path):
    python, tree = vllm_tree
    proc = run_py(python, STATE_CALLS, [probe_dir(tmp_path), tree])
    assert proc.returncode == 0, proc.stderr[-3000:]
    counts = json.loads(next(l for l in proc.stdout.splitlines() if l.startswith("RESULTS "))[8:])
    assert [(c["trigger_calls"], c["state_calls"], c["state_groups"]) for c in counts] == [
        (1, 0, {}),
        (2, 1, {"full_attention": 1}),
        (3, 2, {"full_attention": 2, "mamba": 1}),
        (4, 2, {"full_attention": 2, "mamba": 1}),
    ]
    assert ("kvrepro-probe: counts external_hit_calls=4 trigger_calls=4 state_calls=2 "
            "state_groups=full_attention:2,mamba:1") in proc.stderr


# The waiting-queue stall's path (vllm#57841): the real get_num_new_matched_tokens answers None
# ("ask again later") at once for a request whose own transfers are in flight, before it reads
# anything else of the stand-in; without them it goes on and raises on the stand-in (not deferred).
DEFERRAL_CALLS = """
import json, types
import kvrepro_probe
from vllm.distributed.kv_transfer.kv_connector.v1.offloading import scheduler as mod
cls = mod.OffloadingConnectorScheduler

def status(jobs):
    return types.SimpleNamespace(group_states=[], transfer_jobs=set(jobs), num_locally_computed_tokens=0)

self_ = types.SimpleNamespace(_req_status={"a": status([7]), "b": status([]), "c": status([])})
req = {name: types.SimpleNamespace(request_id=name) for name in "abc"}
log = []

def call(what, fn, *args):
    try:
        out = repr(fn(*args))
    except Exception as exc:
        out = type(exc).__name__
    log.append([what, out, {k: v for k, v in kvrepro_probe.counts().items()
                            if k in ("deferred_lookups", "loads_behind_deferred", "external_hit_calls",
                                     "lookups_in_flight")}])

call("lookup a", cls.get_num_new_matched_tokens, self_, req["a"], 0)        # deferred
call("lookup b", cls.get_num_new_matched_tokens, self_, req["b"], 0)        # not deferred (raises)
call("load b", cls.update_state_after_alloc, self_, req["b"], None, 16)     # behind a
call("load a", cls.update_state_after_alloc, self_, req["a"], None, 16)     # a itself: not behind
call("pass end", cls.build_connector_meta, self_, None)
call("load c", cls.update_state_after_alloc, self_, req["c"], None, 16)     # next pass: nothing deferred
print("RESULTS " + json.dumps(log))
"""


def test_counts_deferred_lookups_and_loads_admitted_behind_them(vllm_tree, tmp_path):
    python, tree = vllm_tree
    proc = run_py(python, DEFERRAL_CALLS, [probe_dir(tmp_path), tree])
    assert proc.returncode == 0, proc.stderr[-3000:]
    log = parse_results(proc.stdout)
    assert [(what, out) for what, out, _ in log][:2] == [("lookup a", "(None, False)"), ("lookup b", "AttributeError")]
    assert [(what, c["deferred_lookups"], c["loads_behind_deferred"], c["external_hit_calls"])
            for what, _, c in log] == [
        ("lookup a", 1, 0, 0),
        ("lookup b", 1, 0, 0),   # the lookup raised: not a deferral
        ("load b", 1, 1, 1),     # admitted in the pass in which a was deferred
        ("load a", 1, 1, 2),     # the deferred request itself does not queue behind itself
        ("pass end", 1, 1, 2),
        ("load c", 1, 1, 3),     # a new pass: no deferral in it yet
    ]
    # a's lookup came while its own transfer (job 7) was in flight: #46014's window, which the guard defers
    assert [c["lookups_in_flight"] for _, _, c in log] == [1, 1, 1, 1, 1, 1]
    assert re.search(r"deferred_lookups=1 loads_behind_deferred=1 finished_unscheduled=0 divergent_hits=0 divergent_loads=0 "
                     r"cow_calls=0 truncate_calls=0 partial_hits=0 lookups_in_flight=1 pid=\d+$", proc.stderr.rstrip())


# vLLM's own _apply_cow (0.26.0's single_type_kv_cache_manager.py), called unbound on a stand-in manager
# holding only what it reads (req_to_blocks, _pending_cow_copies) and real KVCacheBlocks: once with the
# shared tail where the redirect expects it, once with the request one block short -- the assertion of
# the apply-cow-mamba-deeper crash.
COW_CALLS = """
import json
import kvrepro_probe
from vllm.distributed.kv_transfer.kv_connector.v1.offloading import scheduler  # installs the wrappers
from vllm.v1.core.kv_cache_utils import KVCacheBlock
from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager, SingleTypeKVCacheManager
import types

log = []
source, cow = KVCacheBlock(block_id=1), KVCacheBlock(block_id=2)
source.ref_cnt = 1
manager = types.SimpleNamespace(req_to_blocks={"r": [source]}, _pending_cow_copies=[])
FullAttentionManager._apply_cow(manager, "r", 0, source, cow)  # a subclass reaches the wrapped method
log.append(["redirected", manager.req_to_blocks["r"][0] is cow and cow.ref_cnt == 1,
            kvrepro_probe.counts()["cow_calls"]])
full = FullAttentionManager.__new__(FullAttentionManager)  # a full-attention manager: a partial hit
full.req_to_blocks, full._pending_cow_copies = {"r": [source]}, []
source.ref_cnt = 1
full._apply_cow("r", 0, source, KVCacheBlock(block_id=4))
log.append(["full attention", kvrepro_probe.counts()["cow_calls"], kvrepro_probe.counts()["partial_hits"]])
short = types.SimpleNamespace(req_to_blocks={"r": [source]}, _pending_cow_copies=[])
try:
    SingleTypeKVCacheManager._apply_cow(short, "r", 1, source, KVCacheBlock(block_id=3))
    log.append(["returned", None, kvrepro_probe.counts()["cow_calls"]])
except AssertionError:
    log.append(["raised", "AssertionError", kvrepro_probe.counts()["cow_calls"]])
log.append(["marked", getattr(SingleTypeKVCacheManager._apply_cow, "__kvrepro_probe__", False),
            kvrepro_probe.counts()["truncate_calls"]])
print("RESULTS " + json.dumps(log))
"""


def test_counts_copy_on_writes_and_keeps_their_behaviour(vllm_tree, tmp_path):
    """cow_calls, the path counter of apply-cow-mamba-deeper: counted before vLLM's _apply_cow runs,
    so the call that asserts is counted and reported before the assertion propagates unchanged."""
    python, tree = vllm_tree
    proc = run_py(python, COW_CALLS, [probe_dir(tmp_path), tree])
    assert proc.returncode == 0, proc.stderr[-3000:]
    # partial_hits: once per request, from full attention's copy-on-write (the stand-in is not a manager)
    assert parse_results(proc.stdout) == [["redirected", True, 1], ["full attention", 2, 1],
                                          ["raised", "AssertionError", 3],
                                          ["marked", True, 0]]  # 0.26.0 has no truncate_computed_blocks
    assert re.search(r" cow_calls=3 truncate_calls=0 partial_hits=1 lookups_in_flight=0 pid=\d+$", proc.stderr.rstrip())


def test_installed_line_names_file_and_source_hash(vllm_tree, tmp_path):
    python, tree = vllm_tree
    proc = run_py(python, CALLS, [probe_dir(tmp_path), tree])
    assert proc.returncode == 0, proc.stderr[-3000:]
    installed = [l for l in proc.stderr.splitlines() if l.startswith("kvrepro-probe: installed ")]
    assert len(installed) == 1
    fields = dict(kv.split("=", 1) for kv in installed[0][len("kvrepro-probe: installed "):].split(" "))
    assert fields["function"] == "OffloadingConnectorScheduler.update_state_after_alloc"
    assert Path(fields["file"]).resolve() == (tree / SCHEDULER_REL).resolve()
    # inspect.getsource of the original function, hashed independently here.
    check = run_py(python, """
        import hashlib, inspect
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler import OffloadingConnectorScheduler as C
        print("SHA", hashlib.sha256(inspect.getsource(C.update_state_after_alloc).encode()).hexdigest())
    """, [tree])
    assert check.returncode == 0, check.stderr[-2000:]
    sha_line = next(l for l in check.stdout.splitlines() if l.startswith("SHA "))
    assert fields["source_sha256"] == sha_line.split()[1]
    assert parse_results(proc.stdout)["sha"] == fields["source_sha256"]


def test_wraps_at_once_when_vllm_was_imported_first(vllm_tree, tmp_path):
    python, tree = vllm_tree
    proc = run_py(python, """
        import vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler as mod
        before = getattr(mod.OffloadingConnectorScheduler.update_state_after_alloc, "__kvrepro_probe__", False)
        import kvrepro_probe
        after = getattr(mod.OffloadingConnectorScheduler.update_state_after_alloc, "__kvrepro_probe__", False)
        kvrepro_probe.install()  # idempotent: no second wrapper
        inner = mod.OffloadingConnectorScheduler.update_state_after_alloc.__wrapped__
        print("STATE", before, after, getattr(inner, "__kvrepro_probe__", False))
    """, [probe_dir(tmp_path), tree], plugins=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "STATE False True False" in proc.stdout
    assert proc.stderr.count("kvrepro-probe: installed ") == 1


def test_pth_activation_and_silence_without_vllm(vllm_tree, tmp_path):
    """As in a vllm/vllm-openai image: site-packages/kvrepro_probe.py + kvrepro_probe.pth."""
    python, tree = vllm_tree
    site_dir = probe_dir(tmp_path)
    (site_dir / "kvrepro_probe.pth").write_text("import kvrepro_probe\n")
    # A process that never imports vLLM: untouched, silent, normal exit code.
    quiet = run_py(python, """
        import site, sys
        site.addsitedir(%r)
        import json, email.parser
        assert "kvrepro_probe" in sys.modules
        print(json.dumps({"ok": True}))
        sys.exit(3)
    """ % str(site_dir), [])
    assert quiet.returncode == 3
    assert quiet.stdout.strip() == '{"ok": true}'
    assert quiet.stderr == ""
    # The same activation, then vLLM's scheduler module: wrapped on import, nothing else done.
    active = run_py(python, """
        import site
        site.addsitedir(%r)
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler import OffloadingConnectorScheduler as C
        print("WRAPPED", getattr(C.update_state_after_alloc, "__kvrepro_probe__", False))
    """ % str(site_dir), [tree])
    assert active.returncode == 0, active.stderr[-3000:]
    assert "WRAPPED True" in active.stdout
    assert "kvrepro-probe: installed function=OffloadingConnectorScheduler.update_state_after_alloc" in active.stderr


def test_reports_periodically_while_counts_change(vllm_tree, tmp_path):
    python, tree = vllm_tree
    proc = run_py(python, """
        import sys, time, types
        import kvrepro_probe
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler import OffloadingConnectorScheduler as C
        status = types.SimpleNamespace(num_locally_computed_tokens=16)
        self_ = types.SimpleNamespace(_req_status={"r": status})
        try:
            C.update_state_after_alloc(self_, types.SimpleNamespace(request_id="r"), None, 0)
        except Exception:
            pass
        kvrepro_probe._counts["external_hit_calls"] += 5  # as if five hits happened quietly
        time.sleep(kvrepro_probe.REPORT_INTERVAL_S * 1.6)
        print("SLEPT", file=sys.stderr, flush=True)
        import os; os._exit(0)  # no atexit report: only the periodic one can have printed
    """, [probe_dir(tmp_path), tree])
    assert proc.returncode == 0, proc.stderr[-3000:]
    before_exit = proc.stderr.split("SLEPT")[0]
    assert "kvrepro-probe: counts external_hit_calls=5 trigger_calls=0" in before_exit
