"""OffloadingConnector variants that report a failed offload load as Mooncake store or NIXL does.

Why: vLLM's own OffloadingConnector cannot report a failed load before 0.34.0 -- its worker
asserts every transfer succeeded (``offloading/worker.py``: 0.30.0:285, 0.33.0:301), so there a
failed load crashes the engine, and kvrepro lets it (kvrepro/versions.py, "offload-tier faults").
The scheduler's handling of a *reported* failed load (``kv_load_failure_policy``,
``Scheduler._handle_failed_recving``) is reached in production through the connectors that report
one, and what happens next depends on what the connector answers when the scheduler asks again:

* **Mooncake store** (``engine.connector: mooncake-store-like``): its worker reports a failed load
  per request when the model has several KV-cache groups (``_report_load_error`` ->
  ``set_failed_request``, ``mooncake/store/worker.py`` 0.31.0:1206-1208, 0.33.0:1111-1113,
  0.34.0:1281-1283; collected by ``get_transfer_results``) and per block otherwise, and in 0.30.0
  always per block (``_add_load_error_block_ids``, worker.py 0.30.0:1468, 1480). On the retry its
  scheduler looks the request up in the store again (``get_num_new_matched_tokens``,
  ``mooncake/store/scheduler.py`` 0.33.0:210-265: ``self.client.lookup`` at 231, ``return
  need_to_allocate, self.load_async`` at 265): a tier that still holds the chunks answers with an
  asynchronous hit again.
* **NIXL** (``engine.connector: nixl-like``): its worker reports a failed receive per request, in
  ``finished_recving`` and ``failed_recving`` of the same step (``nixl/base_worker.py``
  0.30.0:2655-2664, 0.33.0:3227); its scheduler triggers one transfer per request and clears
  ``do_remote_prefill`` when it does (``nixl/pull_scheduler.py`` 0.30.0:188-189, 0.33.0:188,
  0.34.0:191), so the retry is never an asynchronous load: the request is recomputed locally.

What each class changes is only what no machine here has: the remote store's or the remote
prefill node's answers. The data movement stays the GPU-free engine's (the executor's
``SimTransferWorker``, whose fault plan fails a job); the scheduler, the KV-cache manager and the
OffloadingConnector's own scheduler side (its lookup of the CPU tier, which stands in for the
Mooncake store's lookup) are vLLM's. A failed load is taken from the transfer results before the
OffloadingConnector worker sees it (where it would assert, or, in 0.34.0, mark the request
``load_failed`` and never read the tier for it again: ``offloading/scheduler.py`` 0.34.0:376-378,
1411, 2487) and completed as a success for the connector's own bookkeeping -- the chunks in the
tier are intact, only the copy failed -- then reported to the scheduler the way the modelled
connector reports it. Store failures are not modelled (Mooncake's failed puts, NIXL has none):
kvrepro/versions.py refuses store faults with these connectors.

vLLM loads them as out-of-tree connectors: ``--kv-transfer-config {"kv_connector":
"MooncakeStoreLikeConnector", "kv_connector_module_path": "kvrepro.engine.load_failures", ...}``
(``KVConnectorFactory.get_connector_class``: a module path wins over the registry). Importable only
where vLLM is (the engine process).
"""

from __future__ import annotations

import dataclasses
import threading

import vllm
from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import OffloadingConnector
from vllm.v1.kv_offload.base import OffloadingWorker

from kvrepro import versions

MOONCAKE_STORE_LIKE = "MooncakeStoreLikeConnector"
NIXL_LIKE = "NixlLikeConnector"


class _FailedLoadsTaken(OffloadingWorker):
    """Stands between the OffloadingConnector worker and the transfer engine: a failed load job of
    an asynchronous load is recorded (its request, its GPU blocks) and handed on as finished, so the
    connector's bookkeeping completes; everything else passes through unchanged (a failed store,
    a failed synchronous load: the OffloadingConnector's own handling)."""

    def __init__(self, inner, load_jobs: dict) -> None:
        self.inner = inner
        self._load_jobs = load_jobs  # the connector worker's job -> request (None: a synchronous load)
        self._blocks: dict[int, list[int]] = {}
        self._lock = threading.Lock()
        self.failed_requests: set[str] = set()
        self.failed_blocks: set[int] = set()

    def __getattr__(self, name):  # begin_step, in_flight, ...: the executor's own calls
        return getattr(self.inner, name)

    def submit_store(self, job_id, src_spec, dst_spec, *args, **kwargs) -> bool:
        return self.inner.submit_store(job_id, src_spec, dst_spec, *args, **kwargs)

    def submit_load(self, job_id, src_spec, dst_spec, *args, **kwargs) -> bool:
        ids = getattr(dst_spec, "block_ids", None)
        with self._lock:
            self._blocks[job_id] = [int(b) for b in ids] if ids is not None else []
        return self.inner.submit_load(job_id, src_spec, dst_spec, *args, **kwargs)

    def wait(self, job_ids) -> None:
        self.inner.wait(job_ids)

    def get_finished(self):
        results = []
        for result in self.inner.get_finished():
            with self._lock:
                blocks = self._blocks.pop(result.job_id, None)
            request = self._load_jobs.get(result.job_id)
            if not result.success and request is not None:
                with self._lock:
                    self.failed_requests.add(request)
                    self.failed_blocks.update(blocks or ())
                result = dataclasses.replace(result, success=True)
            results.append(result)
        return results

    def take(self) -> tuple[set[str], set[int]]:
        with self._lock:
            requests, blocks = self.failed_requests, self.failed_blocks
            self.failed_requests, self.failed_blocks = set(), set()
        return requests, blocks


class _ReportsFailedLoads(OffloadingConnector):
    """The OffloadingConnector whose worker reports failed loads instead of asserting."""

    per_request = True  # report in failed_recving; False: per block (get_block_ids_with_load_errors)

    def _taken(self) -> _FailedLoadsTaken | None:
        worker = getattr(self, "connector_worker", None)
        engine = getattr(worker, "worker", None)
        if engine is None:
            return None
        if not isinstance(engine, _FailedLoadsTaken):
            engine = _FailedLoadsTaken(engine, worker._load_jobs)
            worker.worker = engine
        return engine

    def start_load_kv(self, *args, **kwargs):
        self._taken()  # installed before the first job is submitted: every load's blocks are known
        return super().start_load_kv(*args, **kwargs)

    def get_finished(self, finished_req_ids):
        self._taken()
        return super().get_finished(finished_req_ids)

    def get_transfer_results(self, finished_req_ids):
        results = super().get_transfer_results(finished_req_ids)
        taken = self._taken()
        if taken is None:
            return results
        requests, blocks = taken.take()
        # the failed request's load is over (it is in finished_recving: its job completed above)
        results.finished_recving = set(results.finished_recving) | requests
        if self.per_request:
            results.failed_recving = set(results.failed_recving) | requests
        else:
            self._pending_block_errors = getattr(self, "_pending_block_errors", set()) | blocks
        return results

    def get_block_ids_with_load_errors(self) -> set[int]:
        own = super().get_block_ids_with_load_errors()
        pending = getattr(self, "_pending_block_errors", set())
        self._pending_block_errors = set()
        return set(own or ()) | pending


class MooncakeStoreLikeConnector(_ReportsFailedLoads):
    """Mooncake store's failure report (per request on a hybrid model from 0.31.0, per block in
    0.30.0) over the OffloadingConnector, whose lookup of the CPU tier answers the retry again."""

    # MooncakeStoreWorker: `_is_hma_required = len(kv_cache_config.kv_cache_groups) > 1` (worker.py
    # 0.33.0:1405); 0.30.0's recving thread has only _add_load_error_block_ids
    per_request = versions.mooncake_reports_per_request(vllm.__version__)

    def __init__(self, vllm_config, role, kv_cache_config):
        super().__init__(vllm_config, role, kv_cache_config)
        groups = len(getattr(kv_cache_config, "kv_cache_groups", None) or ())
        self.per_request = type(self).per_request and groups > 1


class NixlLikeConnector(_ReportsFailedLoads):
    """NIXL's failure report (per request) and its one transfer per request: once a request has
    had an external load admitted, every later lookup for it answers no external tokens."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._transferred: set[str] = set()

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        answer = super().get_num_new_matched_tokens(request, num_computed_tokens)
        if request.request_id in self._transferred:
            return 0, False  # do_remote_prefill was cleared by the one transfer
        return answer

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        if num_external_tokens > 0:
            self._transferred.add(request.request_id)
        return super().update_state_after_alloc(request, blocks, num_external_tokens)

    def request_finished(self, request, *args, **kwargs):
        self._transferred.discard(request.request_id)
        return super().request_finished(request, *args, **kwargs)

    def request_finished_all_groups(self, request, *args, **kwargs):
        self._transferred.discard(request.request_id)
        return super().request_finished_all_groups(request, *args, **kwargs)
