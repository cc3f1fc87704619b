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

The stall needs the stale reservation plus the retry's need to exceed the free blocks: one request
over half the KV cache, or less when requests stuck behind it hold the rest. One request under half
the pool is admitted despite its stale reservation (the second case passes on an unfixed
scheduler); two under half are not, the second's failed load holding its blocks unpromoted behind
the first (the third case).
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
    """A connector whose store keeps every full block of each prompt (at most ``hit_tokens``): every
    lookup, the retry after a failed load included, answers an async hit."""
    connector = Mock()

    def get_num_new_matched_tokens(request, num_computed_tokens):
        hit = min(hit_tokens, (request.num_tokens - 1) // BLOCK_SIZE * BLOCK_SIZE)
        return max(0, hit - num_computed_tokens), True

    connector.get_num_new_matched_tokens.side_effect = get_num_new_matched_tokens
    connector.get_external_cache_hit_sources.return_value = {}
    connector.get_loaded_kv_cache_group_ids.return_value = (0,)
    connector.request_finished.return_value = (False, None)
    connector.take_events.return_value = ()
    return connector


def stall_numbers(scheduler, requests) -> str:
    """The scheduler's block accounting at the stall, in words: the retried request at the head of
    the queue (its load failed, its blocks were freed) and every failed request's state."""
    reserved = scheduler._inflight_prefill_reserved_blocks()
    free = scheduler.kv_cache_manager.block_pool.get_num_free_blocks()
    head = next((r for r in requests if r.status == RequestStatus.WAITING), requests[0])
    need = scheduler._request_remaining_blocks(head)
    parked = getattr(scheduler, "_parked_reservations", {})  # where later releases keep an async load's share
    each = "; ".join(f"request {r.request_id}: {r.num_tokens} tokens, status {r.status.name}, "
                     f"{len(scheduler.kv_cache_manager.get_block_ids(r.request_id)[0])} blocks held, in "
                     f"_inflight_prefills: {r in scheduler._inflight_prefills}, parked: {parked.get(r, '-')}"
                     for r in requests)
    return (f"no retry was admitted in {RETRY_STEPS} steps after the failed loads: {reserved} blocks reserved for "
            f"in-flight prefills, {need} of them request {head.request_id}'s own (it holds no blocks, yet its "
            f"whole sequence is still counted); its retry needs about {need} more of {free} free blocks ({reserved} "
            f"+ {need} > {free}). [{each}] {MECHANISM}")


UNDER_HALF = NUM_BLOCKS * BLOCK_SIZE // 2 - 2 * BLOCK_SIZE


@pytest.mark.parametrize("prompts", [[PROMPT_TOKENS], [UNDER_HALF], [UNDER_HALF, UNDER_HALF]],
                         ids=["one-request-over-half-the-pool", "one-request-under-half-the-pool",
                              "two-requests-under-half-the-pool"])
def test_failed_async_load_recompute_schedules_the_retry(prompts):
    vllm_config = create_vllm_config(kv_load_failure_policy="recompute", block_size=BLOCK_SIZE,
                                     max_num_batched_tokens=max(2048, sum(prompts)),
                                     max_model_len=NUM_BLOCKS * BLOCK_SIZE)
    scheduler = create_scheduler(vllm_config, num_blocks=NUM_BLOCKS)
    requests = [create_request(num_tokens=n, block_size=BLOCK_SIZE) for n in prompts]
    for request in requests:
        scheduler.add_request(request)
    scheduler.connector = mock_store_connector(HIT_TOKENS)

    output = scheduler.schedule()
    assert all(r.status == RequestStatus.WAITING_FOR_REMOTE_KVS for r in requests)
    # every load is over, and failed (reported as NIXL and Mooncake store report one)
    ids = {r.request_id for r in requests}
    runner_output = create_model_runner_output([], finished_recving=ids)
    runner_output.kv_connector_output.failed_recving = ids
    scheduler.update_from_output(output, runner_output)
    assert all(r.num_computed_tokens == 0 for r in requests)

    # a retry is admitted when it gets blocks again: an async load (the connector is told of the
    # allocation) or scheduled tokens; a failed load still WAITING_FOR_REMOTE_KVS is not admitted
    allocations = scheduler.connector.update_state_after_alloc.call_count

    def admitted() -> bool:
        return (scheduler.connector.update_state_after_alloc.call_count > allocations
                or any(r.request_id in output.num_scheduled_tokens for r in requests))

    for _ in range(RETRY_STEPS):
        output = scheduler.schedule()
        if admitted():
            break
        scheduler.update_from_output(output, create_model_runner_output([]))
    assert admitted(), stall_numbers(scheduler, requests)
