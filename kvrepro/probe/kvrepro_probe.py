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
    "last_reported": None,  # the counts tuple last written
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


def report(force: bool = False) -> None:
    """Write the counts line (when they changed since the last one, or when forced)."""
    if not _state["installed"]:
        return
    with _lock:
        groups = ",".join(f"{kind}:{n}" for kind, n in sorted(_state_groups.items()))
        snapshot = (_counts["external_hit_calls"], _counts["trigger_calls"], _counts["state_calls"], groups,
                    _counts["deferred_lookups"], _counts["loads_behind_deferred"], _counts["finished_unscheduled"],
                    _counts["divergent_hits"], _counts["divergent_loads"], _counts["cow_calls"],
                    _counts["truncate_calls"], _counts["partial_hits"], _counts["lookups_in_flight"])
        if not force and snapshot == _state["last_reported"]:
            return
        _state["last_reported"] = snapshot
    _write(f"kvrepro-probe: counts external_hit_calls={snapshot[0]} trigger_calls={snapshot[1]} "
           f"state_calls={snapshot[2]} state_groups={snapshot[3] or '-'} deferred_lookups={snapshot[4]} "
           f"loads_behind_deferred={snapshot[5]} finished_unscheduled={snapshot[6]} divergent_hits={snapshot[7]} "
           f"divergent_loads={snapshot[8]} cow_calls={snapshot[9]} truncate_calls={snapshot[10]} "
           f"partial_hits={snapshot[11]} lookups_in_flight={snapshot[12]} pid={os.getpid()}")


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


def _wrap_module(module) -> None:
    try:
        cls = getattr(module, TARGET_CLASS, None)
        if cls is not None:
            _wrap(cls)
            _wrap_divergent_lookup()
            _wrap_manager_steps()
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
        _wrap_module(module)

    def __getattr__(self, name):
        return getattr(self._kvrepro_loader, name)


class _Finder(importlib.abc.MetaPathFinder):
    """Finds nothing itself; for the one target module it decorates the real finder's spec."""

    def find_spec(self, fullname, path, target=None):
        if fullname != TARGET_MODULE:
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
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())


os.register_at_fork(after_in_child=_after_fork_in_child)
install()
