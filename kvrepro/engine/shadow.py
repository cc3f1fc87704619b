"""Shadow KV: what every KV block of the GPU-free engine would hold, and a check before each forward.

Why: the fake model computes nothing, so a wrong load (wrong destination block, a block that is
neither loaded nor recomputed, a recurrent state from the wrong position) cannot show up in its
output. A real GPU would silently attend to stale keys. This module keeps, for every GPU block and
every offloaded (CPU) block, the *identity* of what it holds and checks, before every forward,
that each scheduled request's context is really there. A violation is logged on stderr::

    kvrepro-shadow: installed groups=0:full_attention/16,1:mamba/16
    kvrepro-shadow: violation step=<S> class=<class> <what, in words>
    kvrepro-shadow: counts checks=<N> violations=<M> by=<class>:<n>,... hits=<kind>:<n>,... stored=<kind>:<n>,... pid=<P>

``hits`` and ``stored`` say which paths ran, whatever was found there (what a known-defect entry
needs before it may call a build clean): ``hits`` counts requests that resumed from a prefix hit,
per group kind (each request once per group: its first forward read KV or a Mamba state that came
with the hit), and under ``<kind>+offload`` those of them that had blocks loaded for them; ``stored`` counts GPU blocks copied
to the offload tier per group kind, a Mamba block only when it held a state (a load that never
gets a Mamba state offloaded cannot reach an offload hit on a hybrid model).

A violation's *class* is ``<group kind>[+offload]/<read>/<region>``: the kind of KV group,
whether the request had an offload hit, what the read found (``no-block``, ``missing``: never
written, ``stale``: other tokens' KV, ``misplaced``: this request's KV from other positions,
``foreign``: another group's data, ``null-block``: a Mamba state read from the null block,
``wrong-state``: a Mamba state after another prefix, ``chained-copy``: any of these, brought by a
copy-on-write copy that read its source block before another copy of the same step filled it) and
where (``hit``: the request got the block with its prefix hit, ``computed``: it computed there
itself, ``inherited``: a local hit on
a block that an earlier request had already been caught reading wrong below its own hit, i.e. a
hole that the prefix cache then served again; there ``+offload`` says whether the request that
left the hole had an offload hit, since that tells which defect made it). kvrepro's corruption signatures
(``kvrepro/classify/corruptions/``) name the defect behind a class.

(the counts line every ~2 s while it changes and at exit, like the probe's), and kvrepro's
classifier turns a violation into the run verdict CORRUPT.

Content identity: a token's KV (and a recurrent state) depends on the whole token prefix it was
computed from, so a slot holds ``prefix_hash(tokens[:p + 1])`` for position ``p``; two requests
sharing a prefix hold equal values, which is what makes prefix-cache sharing check out. A Mamba
block in ``align`` mode holds a *state* after some prefix; under speculative decoding the state
written by a forward can be read back at any of the accepted lengths, so it is a small set of
prefix hashes.

What is modelled, per vLLM's GPU model runner (``gpu_model_runner._update_states``) and the
Mamba ``align`` helpers (``v1/worker/mamba_utils.preprocess_mamba`` and the align postprocess):

* asynchronous scheduling: the runner (kvrepro/engine/executor.py) hands every check the
  positions the GPU computes, not the scheduler's: ``computed`` lowered by the previous step's
  rejected drafts (the scheduler, one step behind, counted them as accepted), and the drafts the
  runner proposed in place of the scheduler's ``-1`` placeholders; the GPU's positions and slot
  mapping come from the corrected count too (gpu_model_runner.py 0.26.0 :2130-2177), and its
  Mamba ``align`` copy runs after the correction (:4266-4283). A step's reads and writes happen in
  call order, as the GPU stream orders a step's kernels after the previous step's, so a block the
  scheduler published one step before its forward ran holds what that forward wrote when a later
  step reads it; a read of a block no step wrote is a violation like any other;

* attention groups: a forward writes positions ``[computed, computed + scheduled)`` (drafts with
  the draft tokens) into ``block_ids[position // block_size]``; it reads every position below
  ``computed`` (sliding window: the last ``sliding_window`` of them);
* Mamba ``align`` groups: a forward reads the running state from block ``prev`` (the block the
  last forward of this request wrote, or ``(computed - 1) // block_size`` for a new or resumed
  request), copies it to ``curr = cdiv(computed + scheduled, block_size) - 1`` and writes there
  the states after the scheduled tokens; after sampling, when the accepted length crosses a block
  boundary ``a``, the state after exactly ``a`` tokens is saved to block ``a // block_size - 1``
  (the block prefix caching will hash);
* copy-on-write (vLLM 0.26.0+, a local hit ending inside a block): the scheduler's
  ``kv_cache_block_copies`` give the private block the shared block's contents before the step;
* offloading: ``GPULoadStoreSpec`` lists GPU blocks group after group (``group_sizes``), CPU specs
  list offloaded chunks of ``blocks_per_chunk`` GPU blocks, the first one entered at
  ``block_indices[g] % blocks_per_chunk`` (as vLLM's CPU offloading worker computes its copies);
  stores and loads copy contents at submission (the engine waits for a load before computing on
  it, and vLLM flushes stores before their blocks are reused);
* multi-tier offloading (``TieringOffloadingSpec``): the CPU tier is real memory there, the
  scheduler's shared region ``/dev/shm/vllm_offload_<engine id>.mmap``, and vLLM's own secondary
  tiers move its rows (an fs tier writes row ``c`` to a file when it cascades chunk ``c`` and reads
  a file into whichever row it promotes the chunk to, ``tiering/fs/manager.py`` 0.34.0:222-268).
  With a :class:`CpuRegion` attached, a store writes into the chunk's row an 8-byte stamp naming
  what the chunk now holds, and a load reads the stamp back from the row it loads: a chunk that
  went to the fs tier and came back in another row is then judged by what the tier really copied,
  not by what this engine last stored in that row (before 2026-12-05 it was, and 0.34.0's
  promotions read as ~790 false violations: docs/suite.md);
* copy-on-write (vLLM 0.26.0+, a prefix-match unit below the block): the scheduler lists
  ``kv_cache_block_copies`` (source, destination GPU block) and the runner copies each whole
  block before the forward (``gpu_model_runner._update_states`` -> ``copy_kv_cache_blocks_inplace``:
  0.29.0 :1234, 0.30.0 :1247, 0.33.0 :1208). A hit that ends inside a block gets a private copy
  of the cached block, and a Mamba state cached at a unit boundary inside a block moves its cache
  entry to a fresh block that only this copy fills (``allocate_new_blocks``, 0.30.0
  single_type_kv_cache_manager.py:1890-1927); without the copy both read as another group's or
  another prefix's data. The copies of one step are one batched index copy
  (``blocks[dst] = blocks[src]``, 0.34.0 v1/worker/utils.py:985): every source is read before any
  destination is written, so a copy whose source is the destination of another copy of the same
  step copies what the source held *before* that step (vLLM zeroes new blocks first,
  v1/worker/gpu/model_runner.py 0.34.0:1363-1375, so on a GPU it copies zeros; here: whatever the
  block last held). Such a copy is marked, and a wrong read of it is classed ``chained-copy``.
  vLLM 0.34.0 queues such chains when two requests of one step take a partial hit on one block:
  the second hits the first one's copy-on-write block, which the first cached as a full block in
  the same step (docs/defect-family.md, ``cow-chained-copy``).

Knobs (environment of the engine): ``KVREPRO_SIM_SHADOW_KV=0`` turns it off,
``KVREPRO_SIM_SHADOW_DESCRIBE=N`` describes the first N violations (default 5; the rest are
counted), ``KVREPRO_SIM_SHADOW_DEBUG=1`` adds each violating request's block table and one line per
offload transfer: its GPU blocks per group and the CPU sub-blocks they pair with (``store step=..
job=.. pairs=g0:95->41.1,...``), which tells a stored chunk with a hole from a chunk never stored.

Runs in the engine process; stdlib only, no vLLM import.
"""

from __future__ import annotations

import atexit
import mmap
import os
import sys
import threading
import time
from dataclasses import dataclass, field

TAG = "kvrepro-shadow:"
REPORT_INTERVAL_S = 0.5
DESCRIBE_ENV = "KVREPRO_SIM_SHADOW_DESCRIBE"
MAX_RECORDS = 1000  # violations kept as data (ShadowKV.records); the rest are counted
_ROOT_HASH = 0x6B7672


def max_described() -> int:
    """Violations described one by one (the rest counted): read when the shadow KV is made, not at
    import, since an engine forked from a build zygote (kvrepro/engine/zygote.py) may share imports."""
    value = os.environ.get(DESCRIBE_ENV, "").strip()
    return int(value) if value.isdigit() else 5


def _extend(prefix_hash: int, token: int) -> int:
    # tuple hashing of ints is deterministic (no hash randomisation for ints)
    return hash((prefix_hash, int(token)))


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass
class Group:
    index: int
    kind: str  # "full_attention" | "sliding_window" | "mamba" | "other" (not checked)
    block_size: int
    window: int | None = None


def describe_groups(kv_cache_config) -> list[Group]:
    """Group kinds from the KV-cache specs, by class name (no vLLM import needed here)."""
    groups = []
    for index, group in enumerate(kv_cache_config.kv_cache_groups):
        spec = group.kv_cache_spec
        names = {cls.__name__ for cls in type(spec).__mro__}
        if "MambaSpec" in names:
            kind = "mamba" if getattr(spec, "mamba_cache_mode", "align") == "align" else "other"
        elif names & {"SlidingWindowSpec", "SlidingWindowMLASpec", "ChunkedLocalAttentionSpec"}:
            kind = "sliding_window"
        elif "FullAttentionSpec" in names or "AttentionSpec" in names:
            kind = "full_attention"
        else:
            kind = "other"
        window = getattr(spec, "sliding_window", None) or getattr(spec, "attention_chunk_size", None)
        groups.append(Group(index, kind, int(spec.block_size), int(window) if window else None))
    return groups


@dataclass
class Content:
    """What one block holds. ``slots``: per position of an attention block, the prefix hash the
    KV there was computed from (None: never written). ``states``: for a recurrent block, the
    prefix hashes whose state it holds. ``source`` says how it got there, in words."""

    group: int
    slots: list | None = None
    states: frozenset | None = None
    writer: str = ""
    first_position: int = 0  # position of slot 0 in the writer's sequence
    state_lengths: tuple = ()  # prefix lengths of ``states`` (for the description)
    source: str = ""
    # a copy-on-write copy read this block's contents from a source that another copy of the same
    # step filled only afterwards (module docstring): in words, for the violation; "" otherwise
    chained: str = ""

    def copy(self, source: str) -> "Content":
        return Content(self.group, list(self.slots) if self.slots is not None else None, self.states,
                       self.writer, self.first_position, self.state_lengths, source, self.chained)


@dataclass
class _Request:
    hashes: list = field(default_factory=lambda: [_ROOT_HASH])  # hashes[i]: prefix of i tokens
    blocks: list = field(default_factory=list)  # per group: block ids, as the runner's block table
    state_idx: int | None = None  # Mamba: block index the last forward wrote the running state to
    hit: int = 0  # tokens the request started with (prefix hit + offload hit)

    def append(self, tokens) -> None:
        h = self.hashes[-1]
        for token in tokens:
            h = _extend(h, token)
            self.hashes.append(h)


class CpuRegion:
    """The CPU tier's real memory, one row of ``row_bytes`` per chunk, as the GPU->CPU copies would
    write it: the sim writes and reads an 8-byte stamp at the start of a row (module docstring).

    ``path``: the file vLLM's scheduler maps the region from (``SharedOffloadRegion.mmap_path``,
    ``/dev/shm/vllm_offload_<engine id>.mmap`` in 0.26.0-0.34.0, one file: the scheduler's region
    has one segment); opened at the first transfer, when the scheduler has made it. No file then
    (a CPU-only spec, whose region only GPU workers map): :meth:`open` answers False and the shadow
    keeps CPU contents by chunk id, as before."""

    STAMP_BYTES = 8

    def __init__(self, path: str, row_bytes: int):
        self.path = path
        self.row_bytes = int(row_bytes)
        self._map: mmap.mmap | None = None
        self._tried = False

    def open(self) -> bool:
        if not self._tried:
            self._tried = True
            try:
                fd = os.open(self.path, os.O_RDWR)
            except OSError:
                return False
            try:
                size = os.fstat(fd).st_size
                if self.row_bytes >= self.STAMP_BYTES and size >= self.row_bytes:
                    self._map = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
            finally:
                os.close(fd)
        return self._map is not None

    def _offset(self, chunk: int) -> int | None:
        """The row's first byte; None for a chunk id outside the region (vLLM's allocator hands out
        none, and the shadow must not be what ends an engine: such a store is lost and its load
        reads as unwritten KV)."""
        offset = int(chunk) * self.row_bytes
        if self._map is None or not 0 <= offset <= len(self._map) - self.STAMP_BYTES:
            return None
        return offset

    def read(self, chunk: int) -> int:
        offset = self._offset(chunk)
        return 0 if offset is None else int.from_bytes(self._map[offset:offset + self.STAMP_BYTES], "little")

    def write(self, chunk: int, stamp: int) -> None:
        offset = self._offset(chunk)
        if offset is not None:
            self._map[offset:offset + self.STAMP_BYTES] = int(stamp).to_bytes(self.STAMP_BYTES, "little")

    def close(self) -> None:
        if self._map is not None:
            try:
                self._map.close()
            except (BufferError, ValueError):
                pass
            self._map = None


class ShadowKV:
    """Shadow contents of the GPU and offloaded blocks; see the module docstring."""

    # the engine's shadow KV, for the probe's prefix-cache invariant (kvrepro/probe/kvrepro_probe.py
    # reads what a cached block holds here); one engine per process
    current: "ShadowKV | None" = None

    def __init__(self, kv_cache_config, blocks_per_chunk: int = 1, stream=None):
        ShadowKV.current = self
        self.groups = describe_groups(kv_cache_config)
        self.blocks_per_chunk = max(1, int(blocks_per_chunk))
        self.gpu: dict[int, Content] = {}
        self.cpu: dict[tuple[int, int], Content] = {}
        # the CPU tier's real memory (multi-tier offloading, CpuRegion): a row's stamp names what the
        # chunk holds, per sub-block; without one, ``cpu`` above keys contents by chunk id
        self.region: CpuRegion | None = None
        self._rows: dict[int, dict[int, Content | None]] = {}
        self._stamp_chunk: dict[int, int] = {}  # the chunk each stamp was written to
        self._stamp_base = (int.from_bytes(os.urandom(4), "little") | 1) << 32  # this engine's stamps only
        self._stamps = 0
        self.moved_loads = 0  # GPU blocks loaded from a row a secondary tier filled (a promotion)
        self.requests: dict[str, _Request] = {}
        self.step = 0
        self.checks = 0
        self.violations = 0
        self._max_described = max_described()
        self._stream = stream
        self._lock = threading.Lock()
        self._last_reported: tuple | None = None  # (counts, region) last written
        self._last_report_time = 0.0
        self._seen: set[tuple] = set()  # (request, group, block index) already counted
        # violations by class (module docstring): kind of group, "+offload" when the request had
        # loaded blocks (an offload hit), what the read found, where
        self.by_kind: dict[str, int] = {}
        # GPU blocks (group, block id) some request was caught reading wrong below its prefix hit,
        # whether that request had an offload hit and what its read found: a later local hit on one
        # of them inherits the hole (class region "inherited"; "+offload", and a chained copy's read
        # class, as the hole's maker had them)
        self._holes: dict[tuple[int, int], tuple[bool, str]] = {}
        # which request a load job is for (the connector worker knows; None: unknown), and the
        # requests that had blocks loaded for them (an offload hit)
        self.load_owner = lambda job_id: None
        self.loaded_for: set[str] = set()
        # every violation as data (the first MAX_RECORDS): what a minimizer or a test compares
        self.records: list[dict] = []
        # paths that ran (module docstring): requests resumed from a hit per group kind[+offload],
        # and blocks stored to the offload tier per group kind
        self.hit_reads: dict[str, int] = {}
        self.stored: dict[str, int] = {}
        self._hit_counted: set[str] = set()
        self.copied = 0  # GPU blocks filled by the scheduler's copy-on-write copies
        self._write("installed groups=" + ",".join(f"{g.index}:{g.kind}/{g.block_size}" for g in self.groups))
        atexit.register(self.report, True)

    # -- output ------------------------------------------------------------------------------

    def _write(self, text: str) -> None:
        try:
            stream = self._stream or sys.stderr
            stream.write(f"{TAG} {text}\n")
            stream.flush()
        except Exception:
            pass

    def report(self, force: bool = False) -> None:
        def listed(counts: dict[str, int]) -> str:
            return ",".join(f"{k}:{n}" for k, n in sorted(counts.items())) or "-"

        # the counts line's fields by name, in its order (kvrepro/classify/exposure.py reads them by name)
        snapshot = {"checks": self.checks, "violations": self.violations, "by": listed(self.by_kind),
                    "hits": listed(self.hit_reads), "stored": listed(self.stored)}
        region = (self._stamps, self.moved_loads)
        if not force and ((snapshot, region) == self._last_reported
                          or time.monotonic() - self._last_report_time < REPORT_INTERVAL_S):
            return
        self._last_reported, self._last_report_time = (snapshot, region), time.monotonic()
        # pid: the reader keys each process's last line by it (a line vLLM's stream decoration left
        # without its "(EngineCore pid=N)" prefix is still that process's, not a second one)
        self._write("counts " + " ".join(f"{name}={value}" for name, value in snapshot.items()) + f" pid={os.getpid()}")
        self._report_region()

    def _report_region(self) -> None:
        """What the CPU tier's real memory carried (module docstring): stores stamped into its rows,
        and loads of blocks that reached their row through a secondary tier. Written with every
        counts line and at the first stamp, not only at exit: an engine stopped by a signal may never
        get to its exit report (a run's log once lacked it: 2026-12-05 CI)."""
        if self.region is not None and self._stamps:
            self._write(f"cpu-region path={self.region.path} stamped={self._stamps} "
                        f"loaded_after_promotion={self.moved_loads} pid={os.getpid()}")

    def _violation(self, key: tuple, text: str, read: str, in_hit: bool, block: int | None = None) -> None:
        """Count (once per request, group and block index) and describe one wrong read.

        ``read`` is what the read found and ``in_hit`` whether the position came with the
        request's prefix hit; ``block`` the GPU block read (None or 0: none)."""
        # a broken context stays broken on every later step of that request: count it once
        if key in self._seen:
            return
        self._seen.add(key)
        self.violations += 1
        req_id, group_index = key[0], key[1]
        req = self.requests.get(req_id)
        loaded = req_id in self.loaded_for
        region, offload = "computed", loaded
        if in_hit and block and (group_index, block) in self._holes:
            # a hole served again: the class says how the hole was made (its maker's offload hit;
            # a chained copy's hole stays one, since that names the defect)
            region, (offload, made_by) = "inherited", self._holes[(group_index, block)]
            if made_by == "chained-copy":
                read = made_by
        elif in_hit:
            region = "hit"
            if block:
                self._holes[(group_index, block)] = (loaded, read)
        cls = f"{self.groups[group_index].kind}{'+offload' if offload else ''}/{read}/{region}"
        self.by_kind[cls] = self.by_kind.get(cls, 0) + 1
        text += f" (request {'had' if loaded else 'had no'} offload hit)"
        if os.environ.get("KVREPRO_SIM_SHADOW_DEBUG") and req is not None:
            text += f" [hit={req.hit} state_idx={req.state_idx} blocks={req.blocks}]"
        if len(self.records) < MAX_RECORDS:
            self.records.append({"step": self.step, "request": req_id, "group": group_index,
                                 "group_kind": self.groups[group_index].kind, "block_index": key[2],
                                 "offload": loaded, "kind": cls.split("/", 1)[0], "class": cls, "text": text})
        if self.violations <= self._max_described:
            self._write(f"violation step={self.step} class={cls} {text}")
            self.report(force=True)

    # -- the runner's request table ----------------------------------------------------------

    def update_requests(self, so) -> None:
        """Mirror GPUModelRunner._update_states: finished requests go, new ones come, block
        tables grow (or are replaced for a request resumed after preemption)."""
        self.step += 1
        for req_id in so.finished_req_ids:
            self.requests.pop(req_id, None)
            self.loaded_for.discard(req_id)
            self._hit_counted.discard(req_id)
        if so.finished_req_ids and self._seen:
            self._seen = {key for key in self._seen if key[0] not in so.finished_req_ids}
        self._copy_blocks(getattr(so, "kv_cache_block_copies", None) or ())
        for req_id in getattr(so, "preempted_req_ids", None) or ():
            if req_id in self.requests:
                self.requests[req_id].state_idx = None
        for new in so.scheduled_new_reqs:
            req = self.requests.get(new.req_id)
            if req is None:
                req = self.requests[new.req_id] = _Request()
                req.append(new.prompt_token_ids or ())
            req.blocks = [list(ids) for ids in new.block_ids]
            req.state_idx = None
            req.hit = new.num_computed_tokens
        cached = so.scheduled_cached_reqs
        resumed = getattr(cached, "resumed_req_ids", None) or set()
        computed_now = list(getattr(cached, "num_computed_tokens", None) or [])
        for i, (req_id, new_ids) in enumerate(zip(cached.req_ids, cached.new_block_ids, strict=True)):
            req = self.requests.get(req_id)
            if req is None:
                continue
            if req_id in resumed:
                req.blocks = [list(ids) for ids in new_ids]
                req.state_idx = None
                if i < len(computed_now):  # resumed after preemption: its new prefix hit is what it holds
                    req.hit = computed_now[i]
            elif new_ids is not None:
                for mine, more in zip(req.blocks, new_ids, strict=False):
                    mine.extend(more)

    def resync(self, req_id: str, tokens) -> None:
        """Asynchronous scheduling: a request that was not in the previous step takes its tokens
        from the scheduler (``all_token_ids``, as the GPU runner does), which may have dropped an
        output still in flight; the positions it will compute follow those tokens."""
        req = self.requests.get(req_id)
        if req is None:
            return
        with self._lock:
            req.hashes = [_ROOT_HASH]
            req.append(tokens)

    def _copy_blocks(self, copies) -> None:
        """The scheduler's copy-on-write copies (``SchedulerOutput.kv_cache_block_copies``, vLLM
        0.26.0+): a prefix hit that ends inside a block, or a Mamba state cached at a prefix-match
        unit inside a block, is copied whole into another GPU block before the step's forward
        (the runner's ``copy_kv_cache_blocks_inplace``, after zeroing new blocks). All copies of a
        step read their sources before any is written, as that batched index copy does."""
        pairs = [(int(copy[0]), int(copy[1])) for copy in copies]
        if not pairs:
            return
        with self._lock:
            self.copied += len(pairs)
            sources = [self.gpu.get(src) for src, _ in pairs]
            # the batched copy reads every source before it writes any destination: a source that
            # another pair of this step fills is copied as it was before the step (module docstring)
            filled_by = {dst: src for src, dst in pairs}
            # a known hole (positions of the source left unfilled) travels with the bytes
            holes = [{g.index: self._holes[(g.index, src)] for g in self.groups if (g.index, src) in self._holes}
                     for src, _ in pairs]
            for (src, dst), content, hole in zip(pairs, sources, holes):
                for group in self.groups:  # the copy overwrites the block for every group
                    self._holes.pop((group.index, dst), None)
                for group_index, value in hole.items():
                    self._holes[(group_index, dst)] = value
                chained = ""
                if filled_by.get(src, src) != src:
                    chained = (f"copy-on-write {src}->{dst} at step {self.step} read GPU block {src} before "
                               f"the same step's copy {filled_by[src]}->{src} filled it")
                if content is None:
                    self.gpu.pop(dst, None)
                    if chained:  # nothing to copy, but a read of it is the chain's
                        self.gpu[dst] = Content(-1, source="never written", chained=chained)
                else:
                    self.gpu[dst] = content.copy(f"{content.source}, copied from GPU block {src} "
                                                 f"at step {self.step} (copy-on-write)")
                    self.gpu[dst].chained = chained
        if os.environ.get("KVREPRO_SIM_SHADOW_DEBUG"):
            self._write(f"copies step={self.step} pairs={','.join(f'{s}->{d}' for s, d in pairs)}")

    def sampled(self, req_id: str, tokens, seq_end: int) -> None:
        """After sampling: the accepted tokens become part of the request; Mamba saves the state
        at a block boundary the accepted length crossed (the align postprocess)."""
        req = self.requests.get(req_id)
        if req is None:
            return
        req.append(tokens)
        new_computed = len(req.hashes) - 2  # the newest sampled token is not computed yet
        for group in self.groups:
            if group.kind != "mamba" or not req.blocks[group.index]:
                continue
            aligned = new_computed // group.block_size * group.block_size
            if aligned <= 0 or aligned < seq_end:
                continue
            dest = aligned // group.block_size - 1
            ids = req.blocks[group.index]
            if dest < len(ids) and ids[dest] != 0:
                self.gpu[ids[dest]] = Content(group.index, states=frozenset((req.hashes[aligned],)), writer=req_id,
                                              state_lengths=(aligned,),
                                              source=f"state saved by request {req_id} at step {self.step}")

    # -- the forward --------------------------------------------------------------------------

    def forward(self, req_id: str, computed: int, scheduled: int, drafts) -> None:
        """Check what this request's forward reads, then record what it writes."""
        req = self.requests.get(req_id)
        if req is None:
            return
        with self._lock:
            self.checks += 1
            if req.hit > 0 and computed > 0 and req_id not in self._hit_counted:
                # its first forward after the hit: it reads what came with the hit, in every group
                self._hit_counted.add(req_id)
                loaded = req_id in self.loaded_for
                for kind in {g.kind for g in self.groups}:
                    for key in (kind, kind + "+offload") if loaded else (kind,):
                        self.hit_reads[key] = self.hit_reads.get(key, 0) + 1
            for group in self.groups:
                if group.kind in ("full_attention", "sliding_window"):
                    self._check_attention(req_id, req, group, computed)
                elif group.kind == "mamba":
                    self._mamba_read(req_id, req, group, computed, scheduled)
            self._write_forward(req_id, req, computed, scheduled, drafts)
        self.report()

    def _position_hashes(self, req: _Request, start: int, end: int, drafts) -> list:
        """Prefix hashes of positions [start, end): known tokens, then the drafts."""
        known = len(req.hashes) - 1
        out = [req.hashes[p + 1] for p in range(start, min(end, known))]
        h = req.hashes[min(end, known)] if end > known else None
        for p in range(max(start, known), end):
            draft = drafts[p - known] if p - known < len(drafts) else -1
            h = _extend(h, draft)
            out.append(h)
        return out

    def _write_forward(self, req_id, req, computed, scheduled, drafts) -> None:
        end = computed + scheduled
        hashes = self._position_hashes(req, computed, end, drafts)
        for group in self.groups:
            ids = req.blocks[group.index] if group.index < len(req.blocks) else []
            bs = group.block_size
            if group.kind in ("full_attention", "sliding_window"):
                for p in range(computed, end):
                    j = p // bs
                    if j >= len(ids) or ids[j] == 0:
                        continue  # nothing to write to: the read check of a later step says so
                    content = self.gpu.get(ids[j])
                    if (content is None or content.slots is None or content.group != group.index
                            or content.writer != req_id or content.first_position != j * bs):
                        old = content.slots if content is not None and content.slots is not None else None
                        content = Content(group.index, slots=list(old) if old is not None else [None] * bs,
                                          writer=req_id, first_position=j * bs,
                                          source=f"computed by request {req_id} at step {self.step}",
                                          # the slots it keeps came from a chained copy, if that filled it
                                          chained=content.chained if content is not None else "")
                        self.gpu[ids[j]] = content
                        self._holes.pop((group.index, ids[j]), None)
                    content.slots[p - j * bs] = hashes[p - computed]
            elif group.kind == "mamba":
                curr = _cdiv(end, bs) - 1
                if 0 <= curr < len(ids) and ids[curr] != 0:
                    n_drafts = len(drafts)
                    lengths = tuple(range(end - n_drafts, end + 1))
                    states = frozenset(hashes[length - computed - 1] if length > computed else req.hashes[computed]
                                       for length in lengths)
                    self.gpu[ids[curr]] = Content(group.index, states=states, writer=req_id, state_lengths=lengths,
                                                  source=f"state computed by request {req_id} at step {self.step}")
                    self._holes.pop((group.index, ids[curr]), None)
                req.state_idx = curr

    def _origin(self, req_id: str, req: _Request, content: Content | None, position: int) -> str:
        """How the request came to hold this block, and where the block's content came from."""
        how = ("the request got this block with its prefix hit (local cache or offload)" if position < req.hit
               else "the request computed here itself")
        what = content.source if content is not None and content.source else "never written since the engine started"
        return f"{how}; its content: {what}"

    def _check_attention(self, req_id, req, group, computed) -> None:
        bs = group.block_size
        start = 0
        if group.kind == "sliding_window" and group.window:
            start = max(0, computed - group.window + 1)
        ids = req.blocks[group.index] if group.index < len(req.blocks) else []
        for j in range(start // bs, _cdiv(computed, bs)):
            lo, hi = max(j * bs, start), min((j + 1) * bs, computed)
            where = f"request {req_id} group {group.index} ({group.kind}) block index {j}"
            if j >= len(ids) or ids[j] == 0:
                self._violation((req_id, group.index, j),
                                f"{where}: positions {lo}-{hi - 1} must be held but the request has no block there",
                                "no-block", lo < req.hit)
                return
            block = ids[j]
            content = self.gpu.get(block)
            want = req.hashes[lo + 1:hi + 1]
            held = None
            if content is not None and content.slots is not None and content.group == group.index:
                held = content.slots[lo - j * bs:hi - j * bs]
            if held == want:
                continue
            read, held = self._held(content, group, lo - j * bs, hi - j * bs, want, j * bs, req)
            self._violation((req_id, group.index, j), f"{where} (GPU block {block}): positions {lo}-{hi - 1} expected with this request's "
                            f"tokens; {held}; {self._origin(req_id, req, content, lo)}",
                            read, lo < req.hit, block)
            return  # the first wrong block of a request names the problem; the rest follow from it

    def _held(self, content: Content | None, group: Group, lo: int, hi: int, want: list, block_start: int,
              req: _Request) -> tuple[str, str]:
        """What the block holds instead: its read class (missing: never written, foreign: another
        group's data, misplaced: KV of other positions, stale: other tokens' KV; chained-copy: any of
        these, copied by a copy-on-write that ran before its source was filled) and the words."""
        read, words = self._held_as_such(content, group, lo, hi, want, block_start, req)
        if content is not None and content.chained:
            return "chained-copy", f"{words} ({content.chained})"
        return read, words

    def _held_as_such(self, content: Content | None, group: Group, lo: int, hi: int, want: list,
                      block_start: int, req: _Request) -> tuple[str, str]:
        if content is None or (content.slots is None and content.states is None):
            return "missing", "stale KV: the block was never written (neither computed nor loaded)"
        if content.group != group.index or content.slots is None:
            return "foreign", f"stale KV: the block holds group {content.group}'s data"
        slots = content.slots[lo:hi]
        bad = [i for i, (a, b) in enumerate(zip(slots, want)) if a != b]
        if all(slots[i] is None for i in bad):
            return "missing", f"stale KV: {len(bad)} of {hi - lo} positions were never written"
        held = (f"it holds positions {content.first_position + lo}-{content.first_position + hi - 1} of request "
                f"{content.writer}")
        own = set(req.hashes)
        if (content.source.startswith("offload load") and content.first_position != block_start
                and all(h in own for h in slots if h is not None)):
            # loaded into this block, and it is this request's own prefix, from other positions
            return "misplaced", f"misplaced KV: {held}"
        return "stale", f"stale KV: {held}, {len(bad)} of {hi - lo} positions computed from other tokens"

    def _mamba_read(self, req_id, req, group, computed, scheduled) -> None:
        bs = group.block_size
        ids = req.blocks[group.index] if group.index < len(req.blocks) else []
        prev = req.state_idx if req.state_idx is not None else (computed - 1) // bs
        curr = _cdiv(computed + scheduled, bs) - 1
        if computed <= 0 or prev < 0:
            return
        where = f"request {req_id} group {group.index} (mamba) block index {prev}"
        if os.environ.get("KVREPRO_SIM_SHADOW_DEBUG"):
            where += f" [computed={computed} scheduled={scheduled} hit={req.hit} state_idx={req.state_idx} blocks={ids[:12]} tokens={len(req.hashes) - 1}]"
        if prev >= len(ids) or ids[prev] == 0:
            self._violation((req_id, group.index, prev), f"{where}: the state after {computed} tokens must be read from a block the request "
                            "does not have (null block)", "null-block", computed <= req.hit)
            return
        content = self.gpu.get(ids[prev])
        want = req.hashes[computed]
        if content is None or content.states is None or content.group != group.index or want not in content.states:
            if content is None or (content.slots is None and content.states is None):
                read, held = "missing", "holds nothing (never written)"
            elif content.states is None or content.group != group.index:
                read, held = "foreign", f"holds group {content.group}'s data"
            else:
                lengths = "/".join(str(n) for n in content.state_lengths)
                read, held = "wrong-state", f"holds the state after {lengths} tokens of request {content.writer}"
            if content is not None and content.chained:
                read, held = "chained-copy", f"{held} ({content.chained})"
            self._violation((req_id, group.index, prev), f"{where} (GPU block {ids[prev]}): the state after exactly {computed} tokens of this "
                            f"request expected; {held}; {self._origin(req_id, req, content, computed - 1)}",
                            read, computed <= req.hit, ids[prev])
            return
        if prev != curr and 0 <= curr < len(ids) and ids[curr] != 0:
            self.gpu[ids[curr]] = content.copy(f"state copied by request {req_id} at step {self.step}")

    # -- the offload tier ---------------------------------------------------------------------

    def _pairs(self, gpu_spec, cpu_spec):
        """(group, gpu block id, (cpu block id, sub-block)) for every GPU block of a transfer."""
        gpu_ids = [int(b) for b in gpu_spec.block_ids]
        cpu_ids = [int(b) for b in cpu_spec.block_ids]
        sizes = getattr(gpu_spec, "group_sizes", None) or [len(gpu_ids)]
        indices = getattr(gpu_spec, "block_indices", None) or [0] * len(sizes)
        bpc = self.blocks_per_chunk
        g_off = c_off = 0
        for group, (size, first) in enumerate(zip(sizes, indices)):
            skip = int(first) % bpc
            for k in range(int(size)):
                cpu_block = cpu_ids[c_off + (skip + k) // bpc]
                yield group, gpu_ids[g_off + k], (cpu_block, (skip + k) % bpc)
            g_off += int(size)
            c_off += _cdiv(int(size) + skip, bpc) if size else 0

    def _trace_transfer(self, what: str, job_id, gpu_spec, cpu_spec) -> None:
        """KVREPRO_SIM_SHADOW_DEBUG: each transfer's GPU blocks per group and the CPU sub-blocks
        they pair with (what tells a hole in a stored chunk from a chunk never stored)."""
        if not os.environ.get("KVREPRO_SIM_SHADOW_DEBUG"):
            return
        pairs = ",".join(f"g{g}:{b}->{c}.{s}" for g, b, (c, s) in self._pairs(gpu_spec, cpu_spec))
        self._write(f"{what} step={self.step} job={job_id} group_sizes={list(getattr(gpu_spec, 'group_sizes', []))} "
                    f"block_indices={list(getattr(gpu_spec, 'block_indices', []))} "
                    f"cpu={[int(b) for b in cpu_spec.block_ids]} pairs={pairs}")

    def _in_region(self) -> bool:
        return self.region is not None and self.region.open()

    def _cpu_put(self, cpu_key: tuple[int, int], content: "Content | None") -> None:
        """Sub-block ``cpu_key[1]`` of chunk ``cpu_key[0]`` now holds ``content``."""
        if not self._in_region():
            self.cpu[cpu_key] = content
            return
        chunk, sub = cpu_key
        # the row's other sub-blocks keep what the row holds now (a promotion may have filled it)
        row = dict(self._rows.get(self.region.read(chunk), {}))
        row[sub] = content
        self._stamps += 1
        stamp = self._stamp_base | self._stamps
        self._rows[stamp] = row
        self._stamp_chunk[stamp] = chunk
        self.region.write(chunk, stamp)
        if self._stamps == 1:  # the region is wired: say so now (_report_region)
            self._report_region()

    def _cpu_get(self, cpu_key: tuple[int, int]) -> "Content | None":
        if not self._in_region():
            return self.cpu.get(cpu_key)
        # a stamp of no store of this engine (a row never written, or a file another engine wrote)
        # holds nothing this engine knows
        stamp = self.region.read(cpu_key[0])
        content = self._rows.get(stamp, {}).get(cpu_key[1])
        home = self._stamp_chunk.get(stamp)
        if content is not None and home != cpu_key[0]:
            self.moved_loads += 1
            content = content.copy(f"{content.source}, in CPU chunk {home}, moved by a secondary tier "
                                   f"to CPU chunk {cpu_key[0]}")
        return content

    def store(self, job_id, gpu_spec, cpu_spec) -> None:
        self._trace_transfer("store", job_id, gpu_spec, cpu_spec)
        with self._lock:
            for group, gpu_block, cpu_key in self._pairs(gpu_spec, cpu_spec):
                content = self.gpu.get(gpu_block)
                kind = self.groups[group].kind if group < len(self.groups) else "?"
                if kind != "mamba" or (content is not None and content.states is not None):
                    self.stored[kind] = self.stored.get(kind, 0) + 1
                self._cpu_put(cpu_key, content.copy(f"{content.source}, stored to offload (job {job_id})")
                              if content is not None else None)

    def load(self, job_id, cpu_spec, gpu_spec) -> None:
        owner = None
        try:
            owner = self.load_owner(job_id)
        except Exception:
            pass
        self._trace_transfer(f"load(for {owner})", job_id, gpu_spec, cpu_spec)
        with self._lock:
            if owner is not None:
                self.loaded_for.add(owner)
            for group, gpu_block, cpu_key in self._pairs(gpu_spec, cpu_spec):
                content = self._cpu_get(cpu_key)
                self._holes.pop((group, gpu_block), None)
                origin = (f"offload load (job {job_id}, CPU block {cpu_key[0]}.{cpu_key[1]}"
                          + (f", for request {owner})" if owner is not None else ")"))
                if content is None:
                    self.gpu.pop(gpu_block, None)
                    self.gpu[gpu_block] = Content(group, source=f"{origin} of a CPU sub-block no store wrote")
                else:
                    self.gpu[gpu_block] = content.copy(f"{origin} of: {content.source}")


    def load_failed(self, job_id, cpu_spec, gpu_spec) -> None:
        """An injected load failure (engine.sim.offload_faults): the job's GPU blocks are not
        filled. They hold nothing from now on, so a recompute (vLLM's ``recompute`` policy) writes
        them before any read and is clean, while a read of them is a ``missing`` read: CORRUPT."""
        owner = None
        try:
            owner = self.load_owner(job_id)
        except Exception:
            pass
        self._trace_transfer(f"failed load(for {owner})", job_id, gpu_spec, cpu_spec)
        with self._lock:
            if owner is not None:
                self.loaded_for.add(owner)
            for group, gpu_block, cpu_key in self._pairs(gpu_spec, cpu_spec):
                self._holes.pop((group, gpu_block), None)
                self.gpu[gpu_block] = Content(group, source=f"a failed offload load (job {job_id}, injected "
                                              f"fault) left it unfilled")

def enabled(environ=None) -> bool:
    """On unless KVREPRO_SIM_SHADOW_KV=0 (it costs a few percent of engine time)."""
    env = os.environ if environ is None else environ
    return env.get("KVREPRO_SIM_SHADOW_KV", "1").strip() not in ("0", "false", "no", "off")
