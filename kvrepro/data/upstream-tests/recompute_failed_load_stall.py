"""A request whose async KV load failed under kv_load_failure_policy="recompute" is never scheduled again.

Regression test for vLLM's Scheduler, written by kvrepro from a GPU-free load run (the numbers below
are that run's; see RUN). The connector is a mock, as in test_kv_load_failure_recovery.py: a
store that still holds the prompt's KV, so every lookup -- the retry after the failed load
included -- answers an asynchronous hit again (what Mooncake store's scheduler does:
store/scheduler.py get_num_new_matched_tokens looks the store up on every call).

The mechanism (vllm/v1/core/sched/scheduler.py; line numbers are MECHANISM_RELEASE's):

1. the async load is admitted and the request joins ``_inflight_prefills``;
2. the load fails: ``_handle_failed_recving`` sets its computed tokens to 0, and
   ``_update_waiting_for_remote_kv`` frees its blocks but leaves it in ``_inflight_prefills``;
3. the retry's lookup hits again, so its admission reserves ``_inflight_prefill_reserved_blocks()``,
   which counts the request's own full sequence; ``allocate_slots`` fails whenever the request's
   blocks, counted twice, exceed the free pool, and the pass ends with the request at the head
   of the queue: nothing is scheduled again.

A request needing less than half the pool is admitted despite the stale reservation (the second
case passes on an unfixed scheduler): the stall needs about one request over half the KV cache.
"""

from unittest.mock import Mock

import pytest

from vllm.v1.request import RequestStatus

from .utils import create_model_runner_output, create_request, create_scheduler, create_vllm_config

RUN = "(filled in by kvrepro)"
MECHANISM_RELEASE = "0.33.0"
MECHANISM = "(filled in by kvrepro)"
BLOCK_SIZE = 16
NUM_BLOCKS = 96
PROMPT_TOKENS = 881
HIT_TOKENS = 864
RETRY_STEPS = 20


def mock_store_connector(hit_tokens: int) -> Mock:
    """A connector whose store keeps the prompt's KV: every lookup answers an async hit."""
    connector = Mock()

    def get_num_new_matched_tokens(request, num_computed_tokens):
        return max(0, hit_tokens - num_computed_tokens), True

    connector.get_num_new_matched_tokens.side_effect = get_num_new_matched_tokens
    connector.get_external_cache_hit_sources.return_value = {}
    connector.get_loaded_kv_cache_group_ids.return_value = (0,)
    connector.request_finished.return_value = (False, None)
    connector.take_events.return_value = ()
    return connector


def stall_numbers(scheduler, request) -> str:
    """The scheduler's block accounting for the retried request, in words."""
    reserved = scheduler._inflight_prefill_reserved_blocks()
    own = scheduler._request_remaining_blocks(request)
    free = scheduler.kv_cache_manager.block_pool.get_num_free_blocks()
    stale = request in scheduler._inflight_prefills
    return (f"request {request.request_id} ({request.num_tokens} tokens, {request.num_computed_tokens} computed, "
            f"status {request.status.name}) was not scheduled in {RETRY_STEPS} steps after its failed load: "
            f"{reserved} blocks reserved for in-flight prefills, {own} of them its own (still in "
            f"_inflight_prefills: {stale}); its retry needs about {own} more of {free} free blocks "
            f"({reserved} + {own} > {free}). {MECHANISM}")


@pytest.mark.parametrize("prompt_tokens", [PROMPT_TOKENS, NUM_BLOCKS * BLOCK_SIZE // 2 - 2 * BLOCK_SIZE],
                         ids=["over-half-the-pool", "under-half-the-pool"])
def test_failed_async_load_recompute_schedules_the_retry(prompt_tokens):
    vllm_config = create_vllm_config(kv_load_failure_policy="recompute", block_size=BLOCK_SIZE,
                                     max_num_batched_tokens=max(2048, prompt_tokens),
                                     max_model_len=NUM_BLOCKS * BLOCK_SIZE)
    scheduler = create_scheduler(vllm_config, num_blocks=NUM_BLOCKS)
    request = create_request(num_tokens=prompt_tokens, block_size=BLOCK_SIZE)
    scheduler.add_request(request)
    hit = min(HIT_TOKENS, (prompt_tokens - 1) // BLOCK_SIZE * BLOCK_SIZE)
    scheduler.connector = mock_store_connector(hit)

    output = scheduler.schedule()
    assert request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    # the load is over, and it failed (reported as NIXL and Mooncake store report one)
    runner_output = create_model_runner_output([], finished_recving={request.request_id})
    runner_output.kv_connector_output.failed_recving = {request.request_id}
    scheduler.update_from_output(output, runner_output)
    assert request.num_computed_tokens == 0

    for _ in range(RETRY_STEPS):
        output = scheduler.schedule()
        if (request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
                or request.request_id in output.num_scheduled_tokens):
            break
        scheduler.update_from_output(output, create_model_runner_output([]))
    assert (request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
            or request.request_id in output.num_scheduled_tokens), stall_numbers(scheduler, request)
