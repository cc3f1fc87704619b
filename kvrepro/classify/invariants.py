"""The engine's invariants at quiescent points: what each one's failure means (issue 48).

The probe (kvrepro/probe/kvrepro_probe.py, ``INVARIANT_CHECKS``) checks them in the EngineCore
process whenever vLLM's scheduler comes to rest (its own ``has_requests()`` is False after a step:
nothing running or waiting, no finished request awaiting cleanup, no connector work pending). It
reads vLLM's own structures (BlockPool and its free queue, the KV-cache manager's per-group managers,
the Scheduler's queues and reservations, the OffloadingConnector scheduler and its offloading
manager) and re-computes none of vLLM's accounting: at rest, what vLLM itself keeps must say "empty".
A broken one is logged as ``kvrepro-probe: invariant broken name=<name> ...`` and counted per name
(kvrepro/classify/exposure.py reads both into ``RunResult.invariants_broken``).

Each name here is a failure kind of its own: ``kvrepro explore`` judges it as ``invariant:<name>``
(kvrepro/explore/judge.py), and a catalogue entry names it as its signature (``kind: invariant``,
kvrepro/suite/catalogue.py). A new invariant is one check function in the probe's table and one row
here (tests/test_invariants.py holds the two to the same names).

A false positive of an invariant is a bug in the invariant: docs/explore.md says how each was read
against vLLM's source on the releases measured.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Invariant:
    name: str  # the probe's name, the catalogue signature
    title: str  # in words, for a finding's title
    means: str  # what a failure says about the engine


INVARIANTS: dict[str, Invariant] = {i.name: i for i in (
    Invariant("block-leak", "KV blocks referenced with no request in the engine",
              "a block's reference count stayed above zero after every request holding it ended: a leak; the "
              "pool shrinks until the engine stalls or preempts (BlockPool.blocks[].ref_cnt at rest)"),
    Invariant("block-double-free", "KV blocks freed more often than allocated",
              "a negative reference count, or a block listed twice in the free queue: a block was freed while "
              "still in use or freed twice; the next owner shares it with the last"),
    Invariant("free-queue", "the free-block queue disagrees with the reference counts",
              "BlockPool.free_block_queue's count is not the number of blocks it links, or an unreferenced "
              "block is outside it (never reusable), or a referenced one is in it (handed out twice)"),
    Invariant("prefix-cache-hash", "a prefix-cache entry names a block that no longer carries its hash",
              "BlockPool.cached_block_hash_to_block maps a hash to a block whose own hash differs: a lookup "
              "would hand out another prefix's KV"),
    Invariant("prefix-cache-content", "a prefix-cache entry's block holds other KV than its hash names",
              "a block vLLM cached (BlockPool.cache_full_blocks) for a request's first n tokens does not hold, "
              "by the GPU-free engine's shadow KV, the attention KV or Mamba state of those tokens: the next "
              "prefix hit on it reads wrong KV (checked where the shadow KV runs)"),
    Invariant("request-stranded", "a finished request still held by the scheduler or the KV-cache manager",
              "a queue, reservation (e.g. Scheduler._inflight_prefills) or per-request map (a group's "
              "req_to_blocks) still refers to a request after it ended"),
    Invariant("offload-stranded", "the offloading connector still tracks finished requests or transfer jobs",
              "OffloadingConnectorScheduler's per-request state (_req_status), jobs (_jobs) or fences are "
              "not empty although vLLM stopped stepping: nothing will ever complete them"),
    Invariant("offload-pinned", "offloaded chunks pinned by a load or half-written, with no transfer in flight",
              "the offloading manager holds chunks with a reference (a load never completed) or not ready (a "
              "store never completed): they can never be evicted or loaded"),
    Invariant("never-at-rest", "vLLM keeps stepping with no request to run",
              "has_requests() stayed true for 1,000 steps after every request ended (a finished request never "
              "released from Scheduler.requests, a connector job never reported): the engine spins and never "
              "comes to rest, so the checks above cannot run"),
    Invariant("probe-error", "an invariant could not be checked on this release",
              "the probe met a layout it does not know (another vLLM release): the check says nothing; a bug "
              "in kvrepro's probe, not in vLLM"),
)}


def invariant(name: str) -> Invariant:
    """The row of ``name``; an unknown name (a newer probe) gets a row saying so."""
    return INVARIANTS.get(name) or Invariant(name, name, "an invariant this kvrepro does not describe")
