"""kvrepro's probe: counts how often vLLM's offload-hit load path runs, without changing it.

Why it exists: a build that survives a run proves nothing unless the code path that crashes
in the other builds actually ran. The path is
``OffloadingConnectorScheduler.update_state_after_alloc`` (vllm/distributed/kv_transfer/
kv_connector/v1/offloading/scheduler.py); the probe wraps it and counts

* ``external_hit_calls``: calls with ``num_external_tokens > 0`` (the request loads from the
  offload tier), and
* ``trigger_calls``: those calls where the request ALSO has a local prefix-cache hit
  (``num_locally_computed_tokens > 0``), the combination the matrix's crash needs.
* ``state_calls``: those trigger calls where the bug's own state is there: some KV-cache group
  holds a real (non-null) block WITHOUT a block hash below the local boundary
  ``cdiv(num_locally_computed_tokens, tokens_per_block)`` -- what the crashing scan stops on. The
  probe reads what the method itself reads (the ``blocks`` argument's per-group lists,
  ``block.is_null`` / ``block.block_hash``, the connector's per-group ``tokens_per_block``), and
  ``state_groups`` counts, per kind of group (``full_attention``, ``mamba``, ``sliding_window``,
  ...; from the group's KV-cache spec kind), the calls in which a group of that kind held it.

It also wraps the same class's ``get_num_new_matched_tokens`` and ``build_connector_meta`` (the
scheduler calls the latter once at the end of every scheduling pass) and counts, for the
waiting-queue stall of vllm#57841:

* ``deferred_lookups``: lookups that returned ``None`` ("ask again later": a chunk the request
  needs is being loaded for another request, or its own transfers are in flight); the scheduler
  then parks the request, holding no blocks, in its skipped-waiting queue;
* ``lookups_in_flight``: lookups of a request whose own transfer jobs were still in flight (a
  request preempted while its stores ran, re-admitted before they were reported done: under
  asynchronous scheduling the next pass is scheduled before the step that reports them is
  processed). vllm#46231 defers them (``None``); without it a load joins the stores and
  ``update_state_after_alloc`` asserts ``not req_status.transfer_jobs`` (vllm#46014);
* ``loads_behind_deferred``: offload loads admitted (``update_state_after_alloc`` with
  ``num_external_tokens > 0``) in a scheduling pass after another request's lookup was deferred
  earlier in the same pass. The scheduler walks its waiting queues in order and re-queues what it
  skipped in that order, so such a load holds blocks *behind* a block-less deferred request: the
  ordering the stall needs (whether it stalls then depends on whether the deferred request fits
  once it can go).

And it wraps ``request_finished`` and counts ``finished_unscheduled``: requests the connector tracks
that finished with no token computed -- aborted while queued, never scheduled (vllm#49118's path:
their offload keys exist, their GPU blocks never did).

And, for connectors that take divergent hybrid hits (the capable connector, kvrepro/engine/capable.py),
it wraps ``KVCacheManager.get_computed_blocks_for_connector`` (0.27.0+; from 0.28.0 the scheduler calls it
only for a connector declaring ``supports_divergent_local_hybrid_hits``) and counts

* ``divergent_hits``: calls that returned ``hit_diverged``: the connector was handed full attention's
  local hit although a Mamba group's hit lags behind it;
* ``divergent_loads``: those whose next offload lookup found tokens to load (the request then
  resumes past the lagging Mamba state, trusting the connector to restore it).

And it wraps two KV-cache-manager steps of a local hit that ends inside a block (a prefix-match unit,
``--prefix-match-unit``, finer than the block; vLLM 0.26.0+) and counts

* ``cow_calls``: calls of ``SingleTypeKVCacheManager._apply_cow`` (0.26.0+): a request's shared partial
  tail block was redirected to a private copy-on-write block (the path of vllm#46453's partial-hit form,
  catalogue entry ``apply-cow-mamba-deeper``);
* ``truncate_calls``: calls of ``KVCacheManager.truncate_computed_blocks`` (0.27.0+): an offload hit
  longer than the local hit's partial tail made the scheduler cut the local hit back to the block
  boundary in every group (the path of vllm#51468, entry ``truncate-lagging-mamba``);
* ``partial_hits``: requests whose local hit ended inside a block and reached one of the two, counted
  once each: full attention's copy-on-write (a Mamba group's is not counted again) or the truncation.
  Whatever a release then does with such a hit, this says the geometry produced one.

Counting happens BEFORE the original runs, so the call that crashes is counted. The wrapper
returns what the original returns and re-raises what it raises.

The file is self-contained (stdlib only) and identical in every build, so that it can go into
any vLLM environment:

1. The sim overlay puts it next to ``vllm/`` and ``kvrepro.engine`` imports it explicitly
   (``.pth`` files are not processed for PYTHONPATH entries).
2. In a vllm/vllm-openai image it is ``site-packages/kvrepro_probe.py`` plus a
   ``kvrepro_probe.pth`` holding ``import kvrepro_probe``, so it loads in every python
   process (API server and the EngineCore subprocess) without vLLM importing it.

On import it therefore wraps at once if the scheduler module is already loaded, and otherwise
installs a ``sys.meta_path`` finder that wraps right after that module executes. Processes that
never import vLLM pay for one string comparison per import and print nothing.

Output, on stderr, flushed, one line each (kvrepro's classifier parses these exact formats)::

  kvrepro-probe: installed function=OffloadingConnectorScheduler.update_state_after_alloc file=<path> source_sha256=<hex>
  kvrepro-probe: counts external_hit_calls=<N> trigger_calls=<M> state_calls=<K> state_groups=<kind>:<n>,... deferred_lookups=<D> loads_behind_deferred=<L> finished_unscheduled=<F> divergent_hits=<H> divergent_loads=<G> cow_calls=<C> truncate_calls=<T> partial_hits=<Q> lookups_in_flight=<I> pid=<P>

(``pid`` because vLLM >= 0.33 no longer prefixes what a child process writes to stderr with
its ``(EngineCore pid=N)`` tag: the API server's zero counts must not hide the EngineCore's.)

The counts line is written every ~2 s while the counts change, right before re-raising when
the wrapped call raises, and at interpreter exit.
"""

from __future__ import annotations

import atexit
import functools
import hashlib
import importlib.abc
import inspect
import os
import sys
import threading

TARGET_MODULE = "vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler"
TARGET_CLASS = "OffloadingConnectorScheduler"
TARGET_METHOD = "update_state_after_alloc"
REPORT_INTERVAL_S = 2.0

_lock = threading.Lock()
_counts = {"external_hit_calls": 0, "trigger_calls": 0, "state_calls": 0, "deferred_lookups": 0,
           "loads_behind_deferred": 0, "finished_unscheduled": 0, "divergent_hits": 0, "divergent_loads": 0,
           "cow_calls": 0, "truncate_calls": 0, "partial_hits": 0, "lookups_in_flight": 0}
_deferred_this_pass: set = set()  # requests whose lookup returned None in the current scheduling pass
_diverged: set = set()  # requests handed a divergent local hit, until their next offload lookup answers
MANAGER_MODULE = "vllm.v1.core.kv_cache_manager"
MANAGER_CLASS = "KVCacheManager"
DIVERGENT_METHOD = "get_computed_blocks_for_connector"
LOOKUP_METHOD = "get_num_new_matched_tokens"
PASS_END_METHOD = "build_connector_meta"
FINISHED_METHOD = "request_finished"
SINGLE_TYPE_MODULE = "vllm.v1.core.single_type_kv_cache_manager"
# (module, class, method, the counter its calls add to): see the module docstring
MANAGER_STEPS = ((SINGLE_TYPE_MODULE, "SingleTypeKVCacheManager", "_apply_cow", "cow_calls"),
                 (MANAGER_MODULE, MANAGER_CLASS, "truncate_computed_blocks", "truncate_calls"))
_state_groups: dict = {}  # kind of KV-cache group -> calls in which it held the bug's state
_state = {
    "installed": False,
    "source_sha256": None,  # of inspect.getsource(original)
    "file": None,
    "last_reported": None,  # the counts line's fields last written (name -> value)
    "reporter": None,  # the reporter thread of this process
}


def counts() -> dict:
    """A copy of the counters (for the sim engine's /metrics)."""
    with _lock:
        return {**_counts, "state_groups": dict(_state_groups)}


def source_sha256() -> str | None:
    """sha256 of the wrapped function's source, or None while nothing is wrapped."""
    return _state["source_sha256"]


def installed() -> bool:
    return bool(_state["installed"])


def _write(line: str) -> None:
    # The probe must never take its host down: a closed stderr only loses the line.
    try:
        sys.stderr.write(line + "\n")
        sys.stderr.flush()
    except Exception:
        pass


# the fields of the counts line, in the order it names them
_COUNTS_LINE = ("external_hit_calls", "trigger_calls", "state_calls", "state_groups", "deferred_lookups",
                "loads_behind_deferred", "finished_unscheduled", "divergent_hits", "divergent_loads", "cow_calls",
                "truncate_calls", "partial_hits", "lookups_in_flight")


def report(force: bool = False) -> None:
    """Write the counts line (when they changed since the last one, or when forced), and the
    invariants' line."""
    if not _state["installed"]:
        return
    report_invariants(force)
    with _lock:
        groups = ",".join(f"{kind}:{n}" for kind, n in sorted(_state_groups.items()))
        # the line's fields by name, in its order (kvrepro/classify/exposure.py reads them by name)
        snapshot = {name: (groups or "-") if name == "state_groups" else _counts[name] for name in _COUNTS_LINE}
        if not force and snapshot == _state["last_reported"]:
            return
        _state["last_reported"] = snapshot
    _write("kvrepro-probe: counts " + " ".join(f"{name}={value}" for name, value in snapshot.items())
           + f" pid={os.getpid()}")


def _reporter_loop() -> None:
    import time

    while True:
        time.sleep(REPORT_INTERVAL_S)
        report()


def _start_reporter() -> None:
    thread = threading.Thread(target=_reporter_loop, name="kvrepro-probe-reporter", daemon=True)
    thread.start()
    _state["reporter"] = thread


def _after_fork_in_child() -> None:
    # A forked child inherits the wrapped class and the counts but not the reporter thread;
    # the parent's counts belong to the parent, so the child starts from zero.
    if _state["installed"]:
        with _lock:
            for name in _counts:
                _counts[name] = 0
            _state_groups.clear()
            _deferred_this_pass.clear()
            _diverged.clear()
            _state["last_reported"] = None
        with _inv_lock:
            _invariants.update(checks=0, busy=False, last_reported=None, idle_steps=0)
            _broken.clear()
            _seen_requests.clear()
            _cached_expect.clear()
            _prefixes.clear()
        _stall.update(idle=0, next=STALL_FIRST_STEPS, last=None)
        _refused.clear()
        _start_reporter()


def _locally_computed_tokens(scheduler, request) -> int:
    """What update_state_after_alloc itself reads: the request status the connector keeps."""
    try:
        return int(scheduler._req_status[request.request_id].num_locally_computed_tokens)
    except Exception:
        # Unknown layout (another vLLM version): the original will run and decide for itself;
        # this call just cannot count as a trigger.
        return 0


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _group_kind(group_config) -> str:
    """The kind of a connector group: its KV-cache spec kind where the release records it
    (``kv_event_group_spec.kv_cache_spec_kind``), else full attention vs windowed."""
    kind = getattr(getattr(group_config, "kv_event_group_spec", None), "kv_cache_spec_kind", None)
    if kind:
        return str(getattr(kind, "value", kind))
    window = getattr(group_config, "sliding_window_size_in_chunks",
                     getattr(group_config, "sliding_window_size_in_blocks", None))
    return "full_attention" if window is None else "windowed"


def _state_kinds(scheduler, blocks, local: int) -> list:
    """Kinds of the groups holding a non-null, unhashed block below the local boundary."""
    kinds = []
    per_group = blocks.blocks
    for i, group_config in enumerate(scheduler.config.kv_group_configs):
        tokens_per_block = getattr(group_config, "tokens_per_block", None) or group_config.gpu_block_size
        group_blocks = per_group[getattr(group_config, "group_idx", i)]
        boundary = _cdiv(local, int(tokens_per_block))
        if any(not b.is_null and b.block_hash is None for b in group_blocks[:boundary]):
            kinds.append(_group_kind(group_config))
    return kinds


def _wrap(cls) -> None:
    original = cls.__dict__.get(TARGET_METHOD)
    if original is None or getattr(original, "__kvrepro_probe__", False):
        return
    signature = inspect.signature(original)

    @functools.wraps(original)
    def update_state_after_alloc(*args, **kwargs):
        try:
            bound = signature.bind(*args, **kwargs)
            num_external_tokens = bound.arguments.get("num_external_tokens") or 0
            if num_external_tokens > 0:
                scheduler = bound.arguments["self"]
                local = _locally_computed_tokens(scheduler, bound.arguments["request"])
                kinds = []
                if local > 0:
                    try:
                        kinds = _state_kinds(scheduler, bound.arguments["blocks"], local)
                    except Exception:
                        kinds = []  # unknown layout: the trigger still counts
                request_id = getattr(bound.arguments["request"], "request_id", None)
                with _lock:
                    _counts["external_hit_calls"] += 1
                    if _deferred_this_pass - {request_id}:
                        _counts["loads_behind_deferred"] += 1
                    if local > 0:
                        _counts["trigger_calls"] += 1
                    if kinds:
                        _counts["state_calls"] += 1
                        for kind in set(kinds):
                            _state_groups[kind] = _state_groups.get(kind, 0) + 1
        except Exception:
            pass  # counting is best effort; the call itself must behave exactly as before
        try:
            return original(*args, **kwargs)
        except BaseException:
            report(force=True)
            raise

    update_state_after_alloc.__kvrepro_probe__ = True
    try:
        source = inspect.getsource(original)
        digest = hashlib.sha256(source.encode()).hexdigest()
    except (OSError, TypeError):
        digest = "0" * 64  # no source on disk (zipped install): still counted
    setattr(cls, TARGET_METHOD, update_state_after_alloc)
    _wrap_queue_methods(cls)
    module = sys.modules.get(cls.__module__)
    path = getattr(module, "__file__", None) or "?"
    _state.update(installed=True, source_sha256=digest, file=path)
    _write(
        f"kvrepro-probe: installed function={TARGET_CLASS}.{TARGET_METHOD} "
        f"file={path} source_sha256={digest}"
    )
    _start_reporter()
    atexit.register(report, True)


def _wrap_queue_methods(cls) -> None:
    """Count deferred lookups and loads admitted behind them (module docstring). A release
    without one of the two methods only loses these two counts."""
    lookup = cls.__dict__.get(LOOKUP_METHOD)
    if lookup is not None and not getattr(lookup, "__kvrepro_probe__", False):

        @functools.wraps(lookup)
        def get_num_new_matched_tokens(self, request, *args, **kwargs):
            try:  # the request's own transfer jobs still in flight (#46014's window), read before the lookup
                status = (getattr(self, "_req_status", None) or {}).get(getattr(request, "request_id", None))
                in_flight = bool(getattr(status, "transfer_jobs", None))
            except Exception:
                in_flight = False
            result = lookup(self, request, *args, **kwargs)
            try:
                request_id = getattr(request, "request_id", None)
                if in_flight:
                    with _lock:
                        _counts["lookups_in_flight"] += 1
                if isinstance(result, tuple) and result and result[0] is None:
                    with _lock:
                        _counts["deferred_lookups"] += 1
                        _deferred_this_pass.add(request_id)
                elif isinstance(result, tuple) and result and request_id in _diverged:
                    with _lock:
                        _diverged.discard(request_id)
                        if isinstance(result[0], int) and result[0] > 0:
                            _counts["divergent_loads"] += 1
            except Exception:
                pass
            return result

        get_num_new_matched_tokens.__kvrepro_probe__ = True
        setattr(cls, LOOKUP_METHOD, get_num_new_matched_tokens)
    pass_end = cls.__dict__.get(PASS_END_METHOD)
    if pass_end is not None and not getattr(pass_end, "__kvrepro_probe__", False):

        @functools.wraps(pass_end)
        def build_connector_meta(*args, **kwargs):
            with _lock:
                _deferred_this_pass.clear()
            return pass_end(*args, **kwargs)

        build_connector_meta.__kvrepro_probe__ = True
        setattr(cls, PASS_END_METHOD, build_connector_meta)
    finished = cls.__dict__.get(FINISHED_METHOD)
    if finished is not None and not getattr(finished, "__kvrepro_probe__", False):

        @functools.wraps(finished)
        def request_finished(self, request, *args, **kwargs):
            try:
                tracked = request.request_id in getattr(self, "_req_status", {})
                if tracked and int(getattr(request, "num_computed_tokens", 1)) == 0:
                    with _lock:
                        _counts["finished_unscheduled"] += 1
            except Exception:
                pass
            return finished(self, request, *args, **kwargs)

        request_finished.__kvrepro_probe__ = True
        setattr(cls, FINISHED_METHOD, request_finished)


def _wrap_divergent_lookup() -> None:
    """Count divergent local hits handed to the connector (module docstring). The KV-cache manager is
    imported before any connector (the scheduler imports it); a release without the method (before
    0.27.0) has no divergent hit to hand over, and loses only these two counts."""
    manager = getattr(sys.modules.get(MANAGER_MODULE), MANAGER_CLASS, None)
    original = getattr(manager, "__dict__", {}).get(DIVERGENT_METHOD)
    if original is None or getattr(original, "__kvrepro_probe__", False):
        return

    @functools.wraps(original)
    def get_computed_blocks_for_connector(self, request, *args, **kwargs):
        result = original(self, request, *args, **kwargs)
        try:
            if isinstance(result, tuple) and len(result) == 4 and result[3] is True:
                with _lock:
                    _counts["divergent_hits"] += 1
                    _diverged.add(getattr(request, "request_id", None))
        except Exception:
            pass
        return result

    get_computed_blocks_for_connector.__kvrepro_probe__ = True
    setattr(manager, DIVERGENT_METHOD, get_computed_blocks_for_connector)


def _is_full_attention(manager) -> bool:
    return any(c.__name__ == "FullAttentionManager" for c in type(manager).__mro__)


def _wrap_manager_steps() -> None:
    """Count the partial-hit copy-on-write and the truncation of a local hit (module docstring). Both
    modules are imported before any connector (the scheduler imports the KV-cache manager); a release
    without a method (before 0.26.0 / 0.27.0) loses only its count."""
    for module_name, class_name, method, counter in MANAGER_STEPS:
        owner = getattr(sys.modules.get(module_name), class_name, None)
        original = getattr(owner, "__dict__", {}).get(method)
        if original is None or getattr(original, "__kvrepro_probe__", False):
            continue

        def counted(*args, _original=original, _counter=counter, **kwargs):
            with _lock:
                _counts[_counter] += 1
                if _counter == "truncate_calls" or _is_full_attention(args[0] if args else None):
                    _counts["partial_hits"] += 1
            try:
                return _original(*args, **kwargs)
            except BaseException:
                report(force=True)
                raise

        functools.update_wrapper(counted, original)
        counted.__kvrepro_probe__ = True
        setattr(owner, method, counted)


# -- invariants at quiescent points ------------------------------------------------------------------
#
# At a quiescent point (the scheduler's own has_requests() is False right after a step's
# update_from_output: nothing running or waiting, no finished request awaiting cleanup, no
# connector work pending -- vLLM's own reason to stop stepping) the engine's bookkeeping must be
# back at rest. Each check reads vLLM's structures as they are (BlockPool, the KV-cache manager's
# coordinator and per-group managers, the Scheduler's queues and reservations, the
# OffloadingConnector scheduler and its offloading manager) and computes nothing vLLM computes;
# what breaks is logged, one line for each of the first INVARIANT_DESCRIBED per invariant:
#
#   kvrepro-probe: invariant broken name=<name> check=<N> <words>
#   kvrepro-probe: invariants checks=<N> broken=<name>:<n>,... pid=<P>
#
# (the second with the counts line). The names are kvrepro's catalogue signatures for them
# (kvrepro/classify/invariants.py says what each means); INVARIANT_CHECKS below is the table.

SCHEDULER_MODULE = "vllm.v1.core.sched.scheduler"
INVARIANTS_ENV = "KVREPRO_PROBE_INVARIANTS"  # "0": not checked (the cost benchmark's other engine)
INVARIANT_DESCRIBED = 3
# steps vLLM may go on stepping with nothing running or waiting before "never-at-rest": a store or a
# load in flight ends within a few steps (engine.sim.load_steps, an injected latency's tail)
NEVER_AT_REST_STEPS = 1000
_inv_lock = threading.Lock()
_invariants = {"checks": 0, "busy": False, "installed": False, "last_reported": None, "idle_steps": 0}
_broken: dict = {}  # invariant name -> quiescent checks it failed
_seen_requests: set = set()  # ids the scheduler was given (add_request): what "a request" is below
# attributes that refer to a finished request by design, not as a leftover: none known yet; a false
# positive of an invariant is a bug in it (docs/explore.md says how each was read)
_HISTORY_ATTRIBUTES: frozenset = frozenset()
# the connector scheduler's per-job and per-step state: empty when nothing is in flight
_CONNECTOR_IN_FLIGHT = ("_req_status", "_jobs", "_block_id_to_pending_jobs", "_chunks_being_loaded",
                        "_current_batch_load_jobs", "_current_batch_sync_loads", "_current_batch_jobs_to_flush",
                        "_reset_fence")


def _request_id_of(value):
    """The id of a request this value stands for (a Request, or an id the scheduler was given)."""
    if isinstance(value, str):
        return value if value in _seen_requests else None
    rid = getattr(value, "request_id", None)
    if isinstance(rid, str) and rid in _seen_requests:
        return rid
    rid = getattr(value, "req_id", None)
    return rid if isinstance(rid, str) and rid in _seen_requests else None


def _requests_in(value, depth: int = 0) -> list:
    """Request ids a container attribute refers to: its keys, items or (one level down) their
    containers; an entry whose value is an empty container is not a reference (a defaultdict read)."""
    found = []
    if isinstance(value, dict):
        for key, item in value.items():
            rid = _request_id_of(key)
            if rid is not None and not (isinstance(item, (list, set, dict, tuple)) and not item):
                found.append(rid)
            elif depth == 0 and isinstance(item, (set, list, tuple, dict)):
                found.extend(_requests_in(item, depth + 1))
            elif _request_id_of(item) is not None:
                found.append(_request_id_of(item))
        return found
    if isinstance(value, (str, bytes)) or not hasattr(value, "__iter__") or not hasattr(value, "__len__"):
        return found
    try:
        items = list(value)
    except Exception:
        return found
    for item in items:
        rid = _request_id_of(item)
        if rid is not None:
            found.append(rid)
        elif depth == 0 and isinstance(item, (set, list, tuple)):
            found.extend(_requests_in(item, depth + 1))
    return found


def _pools(scheduler) -> list:
    manager = scheduler.kv_cache_manager
    pools, seen = [], set()
    for pool in [getattr(manager, "block_pool", None)] + [getattr(m, "block_pool", None) for m in _group_managers(scheduler)]:
        if pool is not None and id(pool) not in seen:
            seen.add(id(pool))
            pools.append(pool)
    return pools


def _group_managers(scheduler) -> list:
    coordinator = getattr(scheduler.kv_cache_manager, "coordinator", None)
    return list(getattr(coordinator, "single_type_managers", ()) or ())


def _group_of(block) -> str:
    key = getattr(block, "block_hash", None)
    group = getattr(key, "group_id", None)
    if group is None and isinstance(key, (bytes, bytearray)) and len(key) >= 4:
        group = int.from_bytes(bytes(key[-4:]), "big")  # BlockHashWithGroupId: hash bytes + 4-byte group id
    return "?" if group is None else str(group)


def _ids(blocks, limit: int = 8) -> str:
    listed = ",".join(str(b.block_id) for b in blocks[:limit])
    return listed + (",..." if len(blocks) > limit else "")


def _cached_entries(pool, cache_map, cached: dict):
    """(key, block) for every block the prefix cache maps a key to. Up to 0.33.0 ``_cache`` holds the
    block, or a dict of them for a key several blocks carry; 0.34.0 holds block ids, one per key, the
    others of a key in ``_dup_ids`` (block_pool.py 0.34.0:56-64)."""
    dups = getattr(cache_map, "_dup_ids", None) or {}
    for key, entry in list(cached.items()):
        if isinstance(entry, int):
            ids = list(dups.get(key) or ()) or [entry]
            blocks = [pool.blocks[i] for i in ids]
        else:
            blocks = list(entry.values()) if isinstance(entry, dict) else [entry]
        for block in blocks:
            yield key, block


def _check_block_pool(scheduler) -> list:
    """Per pool: the free queue holds exactly the blocks with no reference, each once, and its count
    says so; at rest no block is referenced (free + cached = the pool less its null block)."""
    out = []
    # blocks a finished request returns once the steps still writing them are processed (async
    # scheduling with a KV connector: Scheduler.deferred_frees, drained by update_from_output): held
    # by vLLM on purpose until the next step with tokens, not leaked
    deferred = {id(b) for _, blocks in list(getattr(scheduler, "deferred_frees", ()) or ()) for b in blocks}
    for pool in _pools(scheduler):
        queue = pool.free_block_queue
        walked = queue.get_all_free_blocks()
        ids = [b.block_id for b in walked]
        in_queue = set(ids)
        twice = []
        if len(in_queue) != len(ids):
            seen: set = set()
            twice = sorted({i for i in ids if i in seen or seen.add(i)})
        negative, held, lost = [], [], []
        for b in pool.blocks:
            if b.is_null:
                continue
            if b.ref_cnt < 0:
                negative.append(b)
            elif b.ref_cnt > 0 and id(b) not in deferred:
                held.append(b)
            elif b.block_id not in in_queue:
                lost.append(b)
        if twice or negative:
            out.append(("block-double-free",
                        f"{len(negative)} block(s) with a negative reference count ({_ids(negative)}), "
                        f"{len(twice)} listed twice in the free queue ({','.join(map(str, twice[:8]))}): freed "
                        f"more often than allocated"))
        if held:
            by_group: dict = {}
            for b in held:
                by_group[_group_of(b)] = by_group.get(_group_of(b), 0) + 1
            out.append(("block-leak",
                        f"{len(held)} of {pool.num_gpu_blocks - 1} blocks still referenced with no request in the "
                        f"engine (blocks {_ids(held)}; by KV group of their hash: "
                        f"{','.join(f'{g}:{n}' for g, n in sorted(by_group.items()))}); free {queue.num_free_blocks}"))
        wrong = [b for b in walked if b.is_null or b.ref_cnt > 0]  # a negative one is a double free's
        if lost or wrong or queue.num_free_blocks != len(walked):
            out.append(("free-queue",
                        f"free count {queue.num_free_blocks}, {len(walked)} blocks in the free queue; "
                        f"{len(lost)} unreferenced block(s) outside it ({_ids(lost)}), {len(wrong)} referenced "
                        f"or null block(s) in it ({_ids(wrong)})"))
        cache_map = getattr(pool, "cached_block_hash_to_block", None)
        cached = getattr(cache_map, "_cache", None)
        if isinstance(cached, dict):
            bad = []
            for key, block in _cached_entries(pool, cache_map, cached):
                if getattr(block, "block_hash", None) != key and key not in (
                        getattr(pool, "cached_block_hashes_by_block", {}).get(block.block_id, ())):
                    bad.append(block)
            if bad:
                out.append(("prefix-cache-hash",
                            f"{len(bad)} block(s) in the prefix cache under a hash they no longer carry "
                            f"({_ids(bad)}): a lookup would hand out a block whose content is another prefix's"))
    return out


def _stranded(owner, name: str, skip=()) -> list:
    out = []
    for attr, value in list(vars(owner).items()):
        if attr in skip or f"{type(owner).__name__}.{attr}" in _HISTORY_ATTRIBUTES:
            continue
        if not isinstance(value, (dict, set, list, tuple, frozenset)) and type(value).__name__ not in (
                "deque", "defaultdict", "OrderedDict", "FCFSRequestQueue", "PriorityRequestQueue"):
            continue
        found = _requests_in(value)
        if found:
            out.append(f"{name}.{attr} ({len(set(found))}: {', '.join(sorted(set(found))[:3])})")
    return out


def _check_requests(scheduler) -> list:
    """No finished request is left in any queue, reservation or per-request map of the scheduler, the
    KV-cache manager or any group's manager."""
    where = _stranded(scheduler, "Scheduler", skip=("connector",))
    manager = scheduler.kv_cache_manager
    where += _stranded(manager, "KVCacheManager")
    coordinator = getattr(manager, "coordinator", None)
    if coordinator is not None:
        where += _stranded(coordinator, type(coordinator).__name__)
    for m in _group_managers(scheduler):
        where += _stranded(m, f"{type(m).__name__}[group {getattr(m, 'kv_cache_group_id', '?')}]")
    return [("request-stranded", "finished requests still held by " + "; ".join(where))] if where else []


def _check_offload(scheduler) -> list:
    """The OffloadingConnector's scheduler side tracks no request and no job, and its offloading
    manager has no chunk pinned by a load or left half-written by a store."""
    cs = getattr(getattr(scheduler, "connector", None), "connector_scheduler", None)
    if cs is None:
        return []
    out = []
    busy = [f"{attr} ({len(value)})" for attr in _CONNECTOR_IN_FLIGHT
            if (value := getattr(cs, attr, None)) and hasattr(value, "__len__")]
    busy += _stranded(cs, type(cs).__name__, skip=_CONNECTOR_IN_FLIGHT)
    if busy:
        out.append(("offload-stranded", "the connector still tracks " + "; ".join(busy)))
    manager = getattr(cs, "manager", None)
    pinned, unwritten = 0, 0
    for holder in (manager, getattr(manager, "_policy", None), getattr(manager, "policy", None)):
        for value in (vars(holder).values() if holder is not None and hasattr(holder, "__dict__") else ()):
            if not isinstance(value, dict):
                continue
            for status in value.values():
                if hasattr(status, "ref_cnt") and hasattr(status, "is_ready"):
                    pinned += bool(status.is_ready and status.ref_cnt > 0)
                    unwritten += not status.is_ready
    if pinned or unwritten:
        out.append(("offload-pinned", f"{pinned} offloaded chunk(s) still pinned by a load, {unwritten} still "
                                      "being written, with no transfer in flight"))
    return out


# -- the prefix cache against what the blocks hold (the GPU-free engine's shadow KV) ------------------
#
# When vLLM caches a full block (BlockPool.cache_full_blocks) the block's hash names the first n tokens
# of the request that caches it; the shadow KV (kvrepro/engine/shadow.py, the sim engine only) knows
# what the block holds by the same token prefix's identity. At rest, every block still cached must hold
# exactly that: attention KV whose last slot was computed from those n tokens, or the Mamba state after
# them. The identity is the shadow KV's own (its _extend over the tokens): nothing of vLLM's hashing is
# re-done. Without a shadow KV (a GPU, a Docker image without it) this check says nothing.

POOL_MODULE = "vllm.v1.core.block_pool"
SHADOW_MODULE = "kvrepro.engine.shadow"
_cached_expect: dict = {}  # block id -> (group, request id, tokens its hash covers, shadow identity, the hash)
_prefixes: dict = {}  # request id -> the shadow identities of its token prefixes, grown on demand


def _shadow():
    module = sys.modules.get(SHADOW_MODULE)
    return getattr(getattr(module, "ShadowKV", None), "current", None), module


def _identity(module, request, n: int):
    hashes = _prefixes.setdefault(request.request_id, [module._ROOT_HASH])
    tokens = request.all_token_ids
    while len(hashes) <= n and len(hashes) <= len(tokens):
        hashes.append(module._extend(hashes[-1], tokens[len(hashes) - 1]))
    return hashes[n] if n < len(hashes) else None


def _note_cached(request, blocks, num_cached_blocks: int, num_full_blocks: int, block_size: int, group: int) -> None:
    shadow, module = _shadow()
    if shadow is None:
        return
    for i in range(num_cached_blocks, min(num_full_blocks, len(blocks))):
        block = blocks[i]
        if block.is_null or block.block_hash is None:
            continue
        n = (i + 1) * block_size
        identity = _identity(module, request, n)
        if identity is not None:
            _cached_expect[block.block_id] = (group, request.request_id, n, identity, block.block_hash)


def _check_prefix_content(scheduler) -> list:
    shadow, _ = _shadow()
    if shadow is None or not _cached_expect:
        return []
    pools = _pools(scheduler)
    wrong = []
    for block_id, (group, rid, n, identity, key) in list(_cached_expect.items()):
        block = next((p.blocks[block_id] for p in pools if block_id < len(p.blocks)), None)
        if block is None or block.block_hash != key:
            # evicted since, or carrying another entry now (a copy-on-write moves a block's hashes to
            # the copy: BlockPool.move_block_hashes): not the entry this expectation is about
            del _cached_expect[block_id]
            continue
        kind = shadow.groups[group].kind if group < len(shadow.groups) else "other"
        content = shadow.gpu.get(block_id)
        if kind in ("full_attention", "sliding_window"):
            ok = (content is not None and content.group == group and bool(content.slots)
                  and content.slots[-1] == identity)
        elif kind == "mamba":
            ok = content is not None and content.group == group and identity in (content.states or ())
        else:
            continue
        if not ok:
            wrong.append((block_id, group, rid, n, content.source if content is not None and content.source
                          else "nothing (never written)"))
    _prefixes.clear()  # at rest: every request that cached a block has ended
    if not wrong:
        return []
    b, g, rid, n, held = wrong[0]
    return [("prefix-cache-content",
             f"{len(wrong)} block(s) in the prefix cache hold other KV than the prefix their hash names (block {b}, "
             f"group {g} ({shadow.groups[g].kind}), cached for the first {n} tokens of request {rid}, holds: {held})")]


def _wrap_pool() -> None:
    """Wrap BlockPool.cache_full_blocks: which prefix each newly cached block's hash names."""
    cls = getattr(sys.modules.get(POOL_MODULE), "BlockPool", None)
    original = getattr(cls, "__dict__", {}).get("cache_full_blocks")
    if original is None or getattr(original, "__kvrepro_probe__", False):
        return
    signature = inspect.signature(original)

    @functools.wraps(original)
    def cache_full_blocks(*args, **kwargs):
        result = original(*args, **kwargs)
        try:
            a = signature.bind(*args, **kwargs).arguments
            _note_cached(a["request"], a["blocks"], a["num_cached_blocks"], a["num_full_blocks"], a["block_size"],
                         a["kv_cache_group_id"])
        except Exception:
            pass  # the probe must never take its host down; this check then says nothing
        return result

    cache_full_blocks.__kvrepro_probe__ = True
    setattr(cls, "cache_full_blocks", cache_full_blocks)


# the checks, in order; each returns [(invariant name, words)]
INVARIANT_CHECKS = (_check_block_pool, _check_requests, _check_offload, _check_prefix_content)


def _why_busy(scheduler) -> str:
    """What keeps vLLM stepping with no request running or waiting (has_requests()'s other terms)."""
    held = [f"{rid} ({getattr(getattr(r, 'status', None), 'name', '?')})"
            for rid, r in list(getattr(scheduler, "requests", {}).items())[:3]]
    cs = getattr(getattr(scheduler, "connector", None), "connector_scheduler", None)
    jobs = getattr(cs, "_jobs", None) or {}
    return (f"vLLM's has_requests() stayed true for {NEVER_AT_REST_STEPS} steps with no request running or "
            f"waiting: {len(getattr(scheduler, 'requests', {}))} request(s) still in Scheduler.requests "
            f"{', '.join(held) or ''}; {len(getattr(scheduler, 'finished_req_ids', ()) or ())} finished id(s) "
            f"pending; {len(jobs)} connector job(s) in flight (of requests "
            f"{', '.join(sorted({str(getattr(j, 'req_id', '?')) for j in list(jobs.values())[:3]}))})")


def check_invariants(scheduler, found=None) -> list:
    """Run every check on ``scheduler`` at rest (or record ``found``, already decided); log and count
    what broke. Returns [(name, words)]."""
    if found is not None:
        return _record(list(found))
    found = []
    for check in INVARIANT_CHECKS:
        try:
            found.extend(check(scheduler))
        except Exception as exc:  # an unknown layout (another release): that check says nothing
            found.append(("probe-error", f"{check.__name__}: {type(exc).__name__}: {exc}"))
    return _record(found)


def _record(found: list) -> list:
    with _inv_lock:
        _invariants["checks"] += 1
        n = _invariants["checks"]
        described = []
        for name, words in found:
            _broken[name] = _broken.get(name, 0) + 1
            if _broken[name] <= INVARIANT_DESCRIBED:
                described.append((name, words))
    for name, words in described:
        _write(f"kvrepro-probe: invariant broken name={name} check={n} {words}")
    if described:
        report_invariants(force=True)
    return found


def report_invariants(force: bool = False) -> None:
    if not _invariants["installed"]:
        return
    with _inv_lock:
        snapshot = {"checks": _invariants["checks"],
                    "broken": ",".join(f"{k}:{v}" for k, v in sorted(_broken.items())) or "-"}
        if not force and snapshot == _invariants["last_reported"]:
            return
        _invariants["last_reported"] = snapshot
    _write(f"kvrepro-probe: invariants checks={snapshot['checks']} broken={snapshot['broken']} pid={os.getpid()}")


def after_step(scheduler) -> None:
    """What the wrapped update_from_output does after each step: at rest (and busy since the last
    check) check everything; with nothing to run but vLLM still stepping, count the steps."""
    if not scheduler.has_requests():
        _invariants["idle_steps"] = 0
        if _invariants["busy"]:
            _invariants["busy"] = False
            check_invariants(scheduler)
    elif scheduler.has_unfinished_requests():
        _invariants["idle_steps"] = 0
        if len(_prefixes) > 64:  # a load that never rests: forget the prefixes of ended requests
            for rid in [r for r in _prefixes if r not in scheduler.requests]:
                del _prefixes[rid]
    else:
        # nothing running or waiting, yet vLLM goes on stepping: something it waits for
        _invariants["idle_steps"] = _invariants.get("idle_steps", 0) + 1
        if _invariants["idle_steps"] == NEVER_AT_REST_STEPS:
            check_invariants(scheduler, [("never-at-rest", _why_busy(scheduler))])


def _wrap_scheduler() -> None:
    """Wrap Scheduler.add_request (the ids it is given) and update_from_output (after each step:
    at rest now, and busy since the last check? then check; nothing scheduled for a while? then
    say where the engine waits). The scheduler module is imported before any connector (it
    creates it); a release without these loses only the invariants and the stall's location."""
    # off: benchmarks/invariants_overhead.py measures the engine without the checks (the stall's
    # location, written only when nothing is scheduled, stays on)
    checking = os.environ.get(INVARIANTS_ENV, "1").strip().lower() not in ("0", "off", "no", "false")
    cls = getattr(sys.modules.get(SCHEDULER_MODULE), "Scheduler", None)
    add = getattr(cls, "__dict__", {}).get("add_request")
    step_end = getattr(cls, "__dict__", {}).get("update_from_output")
    if add is None or step_end is None or getattr(step_end, "__kvrepro_probe__", False):
        return

    @functools.wraps(add)
    def add_request(self, request, *args, **kwargs):
        try:
            with _inv_lock:
                _seen_requests.add(request.request_id)
                _invariants["busy"] = True
        except Exception:
            pass
        return add(self, request, *args, **kwargs)

    @functools.wraps(step_end)
    def update_from_output(self, *args, **kwargs):
        result = step_end(self, *args, **kwargs)
        try:
            _watch_stall(self, args[0] if args else kwargs.get("scheduler_output"))
        except Exception:
            pass  # the probe must never take its host down
        if not checking:
            return result
        try:
            after_step(self)
        except Exception:
            pass  # the probe must never take its host down
        return result

    _wrap_pool()  # imported by the scheduler module (through the KV-cache manager) before its class
    _wrap_allocate()
    add_request.__kvrepro_probe__ = True
    update_from_output.__kvrepro_probe__ = True
    setattr(cls, "add_request", add_request)
    setattr(cls, "update_from_output", update_from_output)
    if checking:
        _invariants["installed"] = True
        report_invariants(force=True)


# -- where a stall waits --------------------------------------------------------------------------
#
# A stall is the engine stepping with requests unfinished and nothing scheduled (EngineCore goes on
# calling schedule() and update_from_output(), v1/engine/core.py 0.30.0:589-619, sleeping 1 ms
# between idle steps, :1474). Every "stall" looks the same from the client (no answer for
# runs.stall_timeout_s); what tells two apart is what vLLM's scheduler is waiting on. After
# STALL_FIRST_STEPS such steps in a row (and at every doubling after) the probe reads the scheduler
# as it stands and writes, when it changed since the last such line:
#
#   kvrepro-probe: stall-state idle_steps=<N> where=<key> <words>
#
# The key names no request id, no count and no queue (two runs of one stall give one key): the request
# the scheduling pass could not allocate for (KVCacheManager.allocate_slots returned None: its status,
# whether it holds blocks, loads from the connector, reserves
# for itself as an in-flight prefill), whose reservation it was refused against (its own, ended
# requests', live others'), whether blocks are referenced by no live request, and which other
# requests hold something while they wait (loads done and never promoted, loads in flight, blocks).
# With no allocation refused, the pass skipped everything: the key is what the waiting requests
# wait for. The classifier keeps the last line of the run (kvrepro/classify/exposure.py); explore
# keys a stall by it (kvrepro/explore/judge.py).

STALL_FIRST_STEPS = 200
_stall = {"idle": 0, "next": STALL_FIRST_STEPS, "last": None}
_refused: list = []  # this pass's refused allocations: (request, new tokens, external tokens, reserved, free)


def _wrap_allocate() -> None:
    """Wrap KVCacheManager.allocate_slots: note the allocations a scheduling pass was refused."""
    cls = getattr(sys.modules.get(MANAGER_MODULE), MANAGER_CLASS, None)
    original = getattr(cls, "__dict__", {}).get("allocate_slots")
    if original is None or getattr(original, "__kvrepro_probe__", False):
        return
    signature = inspect.signature(original)

    @functools.wraps(original)
    def allocate_slots(*args, **kwargs):
        result = original(*args, **kwargs)
        if result is None:
            try:
                a = signature.bind(*args, **kwargs).arguments
                pool = getattr(a["self"], "block_pool", None)
                free = pool.get_num_free_blocks() if pool is not None else -1
                if len(_refused) < 64:
                    _refused.append((a["request"], int(a.get("num_new_tokens") or 0),
                                     int(a.get("num_external_computed_tokens") or 0),
                                     int(a.get("reserved_blocks") or 0), int(free)))
            except Exception:
                pass
        return result

    allocate_slots.__kvrepro_probe__ = True
    setattr(cls, "allocate_slots", allocate_slots)


def _containers(scheduler) -> dict:
    """The scheduler's request containers by attribute name: ``running``, every request queue
    (``waiting``, ``skipped_waiting`` 0.30.0, ``kv_holding_waiting`` 0.31.0+, ...) and every set
    of requests named like a queue (``deferred_waiting``), each as a set of request ids."""
    out = {}
    for attr, value in list(vars(scheduler).items()):
        if attr == "_inflight_prefills":
            continue
        queue_like = type(value).__name__.endswith("RequestQueue") or (
            attr in ("running", "waiting") or "waiting" in attr) and isinstance(value, (list, set, frozenset))
        if not queue_like:
            continue
        try:
            out[attr] = {r.request_id for r in list(value) if hasattr(r, "request_id")}
        except Exception:
            continue
    return out


def _holds_blocks(scheduler, rid: str) -> bool:
    for m in _group_managers(scheduler):
        if any(not getattr(b, "is_null", False) for b in (getattr(m, "req_to_blocks", {}) or {}).get(rid, ())):
            return True
    return False


def _queues_of(rid: str, containers: dict) -> str:
    return "+".join(sorted(name for name, ids in containers.items() if rid in ids)) or "no queue"


def _request_class(scheduler, request, inflight: set) -> str:
    """``STATUS[/load-done|/load-in-flight][+holds-blocks][+self-reserved]``: what a request waits with.
    Not the queue it is in (the words say it): which of the waiting queues holds a request is the
    release's bookkeeping (``skipped_waiting`` in 0.30.0, ``kv_holding_waiting``/``deferred_waiting``
    from 0.31.0) and moves with the order requests came in, not with what blocks it; the measured
    stranded reservation on 0.30.0 gave two keys for one stall by it."""
    rid = request.request_id
    status = getattr(getattr(request, "status", None), "name", "?")
    text = status
    if status == "WAITING_FOR_REMOTE_KVS":
        done = rid in (getattr(scheduler, "finished_recving_kv_req_ids", ()) or ())
        text += "/load-done" if done else "/load-in-flight"
    if _holds_blocks(scheduler, rid):
        text += "+holds-blocks"
    if rid in inflight:
        text += "+self-reserved"
    return text


def _unheld_blocks(scheduler) -> int:
    """Blocks referenced in the pools that no live request's table holds (nor vLLM's deferred frees)."""
    held = set()
    for m in _group_managers(scheduler):
        for blocks in list((getattr(m, "req_to_blocks", {}) or {}).values()):
            held.update(id(b) for b in blocks)
    for _, blocks in list(getattr(scheduler, "deferred_frees", ()) or ()):
        held.update(id(b) for b in blocks)
    return sum(1 for pool in _pools(scheduler) for b in pool.blocks
               if not b.is_null and b.ref_cnt > 0 and id(b) not in held)


def stall_state(scheduler, refused=None) -> tuple:
    """(key, words): where the engine waits, read from vLLM's scheduler (the section's comment)."""
    refused = list(_refused if refused is None else refused)
    containers = _containers(scheduler)
    live = {rid: r for rid, r in list(getattr(scheduler, "requests", {}).items())
            if not str(getattr(getattr(r, "status", None), "name", "")).startswith("FINISHED")}
    inflight = {getattr(r, "request_id", None) for r in list(getattr(scheduler, "_inflight_prefills", ()) or ())}
    classes = {rid: _request_class(scheduler, r, inflight) for rid, r in live.items()}
    unheld = _unheld_blocks(scheduler)
    parts, words = [], []
    blocker = refused[-1] if refused else None
    if blocker is not None:
        request, new, external, reserved, free = blocker
        rid = request.request_id
        cls = classes.get(rid) or _request_class(scheduler, request, inflight)
        key = "refused:" + cls + ("+async-load" if external > 0 else "")
        if reserved > 0:
            by = sorted({"self" if r == rid else ("other" if r in live else "ended") for r in inflight})
            key += "/reserved-by-" + "+".join(by)
        parts.append(key)
        words.append(f"allocation refused for request {rid} ({cls} in {_queues_of(rid, containers)}, "
                     f"{getattr(request, 'num_computed_tokens', '?')} of "
                     f"{getattr(request, 'num_tokens', '?')} tokens computed): {new} new tokens, {external} from the "
                     f"connector, {reserved} blocks reserved by in-flight prefills "
                     f"({', '.join(sorted(str(r) for r in inflight)[:3]) or 'none'}), {free} free")
        others = {c for r, c in classes.items() if r != rid}
    else:
        others = set(classes.values())
        parts.append("nothing-allocated")
        words.append("no allocation tried: the scheduling pass skipped every waiting request")
    # what the others hold while they wait (plain block-less waiting requests say nothing)
    held = sorted(c for c in others if "/load-" in c or "+holds-blocks" in c or "+self-reserved" in c
                  or c.startswith("RUNNING") or blocker is None)
    if held:
        parts.append("waiting:" + ",".join(held))
    if unheld:
        parts.append("blocks-held-by-no-request")
    words.append(f"{len(live)} unfinished request(s): " + ", ".join(
        f"{rid} {c} in {_queues_of(rid, containers)}" for rid, c in sorted(classes.items())[:6])
        + ("..." if len(classes) > 6 else ""))
    if unheld:
        words.append(f"{unheld} block(s) referenced with no live request holding them")
    return "|".join(parts), "; ".join(words)


def _watch_stall(scheduler, scheduler_output) -> None:
    scheduled = getattr(scheduler_output, "total_num_scheduled_tokens", None)
    try:
        if scheduled is None or scheduled > 0 or not scheduler.has_unfinished_requests():
            _stall.update(idle=0, next=STALL_FIRST_STEPS)
            return
        _stall["idle"] += 1
        if _stall["idle"] < _stall["next"]:
            return
        _stall["next"] *= 2
        where, words = stall_state(scheduler)
        if where != _stall["last"]:
            _stall["last"] = where
            _write(f"kvrepro-probe: stall-state idle_steps={_stall['idle']} where={where} {words}")
    finally:
        _refused.clear()  # the next pass's refusals only


def _wrap_module(module) -> None:
    try:
        cls = getattr(module, TARGET_CLASS, None)
        if cls is not None:
            _wrap(cls)
            _wrap_divergent_lookup()
            _wrap_manager_steps()
            _wrap_scheduler()
        else:
            _write(f"kvrepro-probe: not installed: {TARGET_MODULE} has no {TARGET_CLASS}")
    except Exception as exc:  # never break the import of vLLM itself
        _write(f"kvrepro-probe: not installed: {type(exc).__name__}: {exc}")


class _LoaderProxy:
    """Runs the real loader, then wraps the freshly executed module. Everything else delegates."""

    def __init__(self, loader):
        self._kvrepro_loader = loader

    def create_module(self, spec):
        create = getattr(self._kvrepro_loader, "create_module", None)
        return create(spec) if create is not None else None

    def exec_module(self, module):
        self._kvrepro_loader.exec_module(module)
        if module.__name__ == SCHEDULER_MODULE:
            try:
                _wrap_scheduler()
            except Exception as exc:  # never break the import of vLLM itself
                _write(f"kvrepro-probe: invariants not installed: {type(exc).__name__}: {exc}")
        else:
            _wrap_module(module)

    def __getattr__(self, name):
        return getattr(self._kvrepro_loader, name)


class _Finder(importlib.abc.MetaPathFinder):
    """Finds nothing itself; for the target module (and vLLM's scheduler module, whose class the
    invariants wrap once it is defined: the connector may be imported while it executes) it
    decorates the real finder's spec."""

    def find_spec(self, fullname, path, target=None):
        if fullname not in (TARGET_MODULE, SCHEDULER_MODULE):
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            try:
                spec = finder.find_spec(fullname, path, target)
            except Exception:
                continue
            if spec is None:
                continue
            if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                spec.loader = _LoaderProxy(spec.loader)
            return spec
        return None


def install() -> None:
    """Idempotent: wrap now if vLLM's scheduler module is loaded, else wait for its import."""
    module = sys.modules.get(TARGET_MODULE)
    if module is not None:
        _wrap_module(module)
        return
    if getattr(sys.modules.get(SCHEDULER_MODULE), "Scheduler", None) is not None:
        _wrap_scheduler()
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())


os.register_at_fork(after_in_child=_after_fork_in_child)
install()
