"""Request traces: what a run sent, in order, so that it can be sent again.

``trace.jsonl`` (next to load.jsonl in every run folder) starts with one header line (``"trace":
1``, the profile, its settings and seed, the engine capacity it was sized for, how requests went
out) and then one line per request *as it was sent* -- written before the request leaves, so a
request that killed the engine is in the trace even though it never got an answer:

``{"index", "slot", "sent_s", "in_flight", "max_tokens", "tokens": [...]}`` and, when the load did
something to the request besides sending it (``load.events``), ``"events": {"abort": "queued", ...}``
(:class:`~kvrepro.records.RequestEvents`): a replay repeats it, the minimizer may drop it with its request.

``slot`` is the worker (concurrency slot) that sent it, ``sent_s`` seconds since the run's first
request, ``in_flight`` the requests in flight including this one. Prompts are stored as token ids
even when they went out as text (the text is a function of the ids), so a trace can be replayed,
cut down (:mod:`kvrepro.minimize`) and turned into a test that drives vLLM's scheduler directly.
"""

from __future__ import annotations

import dataclasses
import json
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import SpecError
from ..records import Json, RecordError, RequestEvents, type_hints, from_jsonable, to_jsonable
from .profiles import Profile, Prompt
from ..spec.matrix import LoadSpec

FORMAT_VERSION = 1


@dataclass(frozen=True)
class TraceRequest:
    index: int
    tokens: tuple[int, ...]
    max_tokens: int
    slot: int = 0
    sent_s: float = 0.0
    in_flight: int = 1
    rank: int | None = None  # the data-parallel rank it was sent to (None: vLLM's balancer chose)
    events: RequestEvents | None = None  # aborts, priority, pause, reset (load.events) as sent


@dataclass(frozen=True)
class TraceHeader:
    """A trace's first line (after ``"trace": 1``): who sent it and how, as far as each part knows.

    The matrix runner gives the run (``build`` to ``engine_args``), the load generator the profile
    (``profile`` to ``load``: the matrix's ``load:`` as recorded, read back by
    :meth:`Trace.load_spec`) and how requests went out (``model`` to ``started_at``); a replay adds
    ``replay_of``, a minimized trace ``minimized_from``. Keys this kvrepro does not know are kept
    in ``extra`` and written back, so every trace on disk reads whatever wrote it."""

    build: str | None = None
    rep: int | None = None
    sim_seed: int | None = None
    engine_args: tuple[str, ...] | None = None
    profile: str | None = None
    seed: int | None = None
    settings: dict[str, Json] | None = None  # the profile's own settings (loadgen/profiles), as recorded
    capacity: dict[str, Json] | None = None  # the EngineCapacity the profile was sized for
    load: dict[str, Json] | None = None  # the LoadSpec as recorded (Trace.load_spec reads it)
    replay_of: str | None = None
    requests_in_trace: int | None = None
    minimized_from: str | None = None
    model: str | None = None
    concurrency: int | None = None
    arrival: str | None = None
    rate_rps: float | None = None
    stream: bool | None = None
    prompt_format: str | None = None
    started_at: float | None = None
    extra: dict[str, Json] = field(default_factory=dict)
    nulls: frozenset[str] = frozenset()  # known fields recorded as null (written back as null)

    @classmethod
    def from_json(cls, value: Json, where: str = "header") -> "TraceHeader":
        """Lenient like BuildManifest: unknown keys go to ``extra``; a known key of the wrong type
        raises RecordError naming it. ``trace`` (the format number) is not kept."""
        if not isinstance(value, dict):
            raise RecordError(where, f"expected an object, found {type(value).__name__}")
        hints = type_hints(cls)
        known = {f.name for f in dataclasses.fields(cls)} - {"extra", "nulls"}
        kwargs = {k: from_jsonable(hints[k], v, f"{where}.{k}") for k, v in value.items() if k in known}
        return cls(**kwargs, extra={k: v for k, v in value.items() if k not in known and k != "trace"},
                   nulls=frozenset(k for k, v in value.items() if k in known and v is None))

    def to_json(self) -> dict[str, Json]:
        """The header's JSON object: the fields that are set (or recorded as null), then ``extra``
        (without ``trace``)."""
        data = {f.name: to_jsonable(getattr(self, f.name)) for f in dataclasses.fields(self)
                if f.name not in ("extra", "nulls") and (getattr(self, f.name) is not None or f.name in self.nulls)}
        data.update(self.extra)
        return data

    __json__ = to_json

    def updated(self, **fields: Any) -> "TraceHeader":
        """``dataclasses.replace`` that records a field given as None as null (the file says so)."""
        nulls = (self.nulls - fields.keys()) | {k for k, v in fields.items() if v is None}
        return dataclasses.replace(self, **fields, nulls=frozenset(nulls))

    def merged(self, values: dict[str, Any]) -> "TraceHeader":
        """This header with ``values`` (JSON-ready, such as a profile's describe()) laid over it."""
        return TraceHeader.from_json({**self.to_json(), **to_jsonable(values)})


@dataclass
class Trace:
    path: Path
    header: TraceHeader
    requests: list[TraceRequest]

    def load_spec(self):
        """The LoadSpec the trace was sent with (for max_tokens, vocab, format, streaming)."""
        return LoadSpec.model_validate(self.header.load or {})

    def with_requests(self, requests: list[TraceRequest]) -> "Trace":
        return Trace(self.path, self.header, list(requests))


class TraceWriter:
    """Appends request lines and flushes each one: a crash of the engine or of kvrepro loses none."""

    def __init__(self, path: Path, header: TraceHeader):
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(path, "w", encoding="utf-8")
        self._lock = threading.Lock()
        from ..secrets import redact_value

        # the header carries the engine's arguments: one redaction for every file (issue 8)
        self._write(redact_value({"trace": FORMAT_VERSION, **header.to_json()}))

    def _write(self, obj: dict[str, Any]) -> None:
        with self._lock:
            if not self._file.closed:
                self._file.write(json.dumps(obj, separators=(",", ":")) + "\n")
                self._file.flush()

    def request(self, prompt: Prompt, *, slot: int, sent_s: float, in_flight: int,
                tokens_json: str | None = None) -> None:
        """One request line. ``tokens_json``: the prompt's ids already encoded compactly
        (``[1,2,3]``), as the load generator has them for the request body: encoding a long
        prompt is most of what a line costs, and the line comes out the same."""
        head = {"index": prompt.index, "slot": slot, "sent_s": round(sent_s, 6), "in_flight": in_flight,
                "max_tokens": prompt.max_tokens}
        if prompt.rank is not None:
            head["rank"] = prompt.rank
        if prompt.events is not None and prompt.events.any():
            head["events"] = prompt.events.to_json()
        if tokens_json is None:
            tokens_json = json.dumps(list(prompt.tokens), separators=(",", ":"))
        line = json.dumps(head, separators=(",", ":"))[:-1] + ',"tokens":' + tokens_json + "}\n"
        with self._lock:
            if not self._file.closed:
                self._file.write(line)
                self._file.flush()

    def close(self) -> None:
        with self._lock:
            self._file.close()


def open_writer(path: Path, header: TraceHeader) -> TraceWriter:
    return TraceWriter(Path(path), header)


def write_trace(path: Path, trace: Trace) -> None:
    """Write a whole trace (a minimized one, say) in the same format."""
    writer = TraceWriter(Path(path), trace.header)
    for i, r in enumerate(trace.requests):
        writer.request(Prompt(index=i, tokens=r.tokens, max_tokens=r.max_tokens, events=r.events), slot=r.slot,
                       sent_s=r.sent_s, in_flight=r.in_flight)
    writer.close()


def read_trace(path: str | Path) -> Trace:
    """Read a trace; SpecError (exit 2) naming the file and line if it is not one."""
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        raise SpecError(f"{path}: no such trace; every run writes results/<run>/<build>/<rep>/trace.jsonl") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise SpecError(f"{path}: cannot read the trace: {exc}") from None
    header: TraceHeader | None = None
    requests: list[TraceRequest] = []
    truncated: int | None = None
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except ValueError:
            if number == len(lines) and header is not None:  # the last line of a run killed mid-write
                truncated = number
                break
            raise SpecError(f"{path}:{number}: not a JSON line") from None
        if header is None:
            if not isinstance(obj, dict) or obj.get("trace") != FORMAT_VERSION:
                raise SpecError(f"{path}:{number}: not a kvrepro trace (the first line must be its header, "
                                f'"trace": {FORMAT_VERSION})')
            try:
                header = TraceHeader.from_json(obj, f"{path}:{number}")
            except RecordError as exc:
                raise SpecError(f"{exc} (in the trace's header)") from None
            continue
        try:
            tokens = tuple(int(t) for t in obj["tokens"])
            requests.append(TraceRequest(index=int(obj["index"]), tokens=tokens, max_tokens=int(obj["max_tokens"]),
                                         slot=int(obj.get("slot", 0)), sent_s=float(obj.get("sent_s", 0.0)),
                                         in_flight=int(obj.get("in_flight", 1)),
                                         rank=int(obj["rank"]) if obj.get("rank") is not None else None,
                                         events=_events(obj.get("events"))))
        except (KeyError, TypeError, ValueError) as exc:
            raise SpecError(f"{path}:{number}: a request line needs index, max_tokens and tokens, and its events "
                            f"the fields of load.events ({exc})") from None
    if header is None:
        raise SpecError(f"{path}: empty trace")
    if not requests:
        if truncated is not None:
            raise SpecError(f"{path}:{truncated}: the only request line is truncated (the run was killed while "
                            "writing it); nothing to replay: use a trace with at least one whole request")
        raise SpecError(f"{path}: no request lines after the header; nothing to replay")
    return Trace(path, header, requests)


def _events(value: Any) -> RequestEvents | None:
    """A request line's ``events`` (absent: none); TypeError/ValueError name what is wrong."""
    if value is None:
        return None
    events = RequestEvents.from_json(value)
    if events.abort not in (None, "queued", "first_token", "tokens"):
        raise ValueError(f"abort {events.abort!r} is not queued, first_token or tokens")
    if events.reset_prefix_cache not in (None, "local", "external"):
        raise ValueError(f"reset_prefix_cache {events.reset_prefix_cache!r} is not local or external")
    return events


class ReplayProfile(Profile):
    """Serves a trace's requests in the order they were sent (request i = the i-th line)."""

    name = "replay"

    def __init__(self, trace: Trace, load):
        self.trace = trace
        self.load = load
        self.seed = trace.header.seed or 0
        self.capacity = None
        self.settings = None

    def prompt(self, index: int) -> Prompt:
        r = self.trace.requests[index]
        # the trace's events, never load.events again: a minimized trace has removed some of them
        return Prompt(index=index, tokens=r.tokens, max_tokens=r.max_tokens,
                      fields={"trace_index": r.index}, rank=r.rank, events=r.events or RequestEvents())

    def describe(self) -> dict[str, Any]:
        return {"profile": "replay", "seed": self.seed}
