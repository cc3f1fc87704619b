"""The triage as plain lines (80 columns) and as JSON data."""

from __future__ import annotations

import textwrap
from typing import Any

from ..records import to_jsonable
from ..untrusted import quote
from .records import READ_FIELDS, Match, Triage

WIDTH = 80


def _wrap(text: str, indent: str = "", first: str = "") -> list[str]:
    return textwrap.wrap(text, WIDTH, initial_indent=first or indent, subsequent_indent=indent,
                         break_long_words=True, break_on_hyphens=False) or [first.rstrip()]


def _config_items(t: Triage) -> list[tuple[str, str]]:
    """(text, source) for each part of the configuration, in the order a person reads it; every
    value is the log's: quoted (one line, at most ~80 characters; kvrepro/untrusted.py)."""
    c = t.config
    connector = quote(c.kv_connector) if c.kv_connector else "none"
    if c.kv_connector_settings:
        connector += " (" + ", ".join(f"{quote(k)}={quote(v)}" for k, v in c.kv_connector_settings.items()
                                      if not isinstance(v, dict)) + ")"
    spec = f"{quote(c.speculative_method)} x {quote(c.num_speculative_tokens)}" if c.num_speculative_tokens else \
        (quote(c.speculative_method) if c.speculative_method else "none")
    items = [
        ("release", f"vLLM {quote(c.release)}"), ("model", quote(c.model)), ("architecture", quote(c.architecture)),
        ("tensor_parallel_size", f"TP{quote(c.tensor_parallel_size)}"),
        ("data_parallel_size", f"DP{quote(c.data_parallel_size)}"),
        ("pipeline_parallel_size", f"PP{quote(c.pipeline_parallel_size)}"),
        ("prefix_caching", f"prefix caching {'on' if c.prefix_caching else 'off'}"),
        ("mamba_cache_mode", "Mamba cache mode align or none" if c.mamba_mode_default
         else f"Mamba cache mode {quote(c.mamba_cache_mode or 'none')}"),
        ("block_size", f"block {quote(c.block_size)}"), ("speculative_method", f"speculative {spec}"),
        ("kv_connector", f"KV connector {connector}"), ("scheduling_policy", f"scheduling {quote(c.scheduling_policy)}"),
    ]
    return [(text, c.source(name)) for name, text in items]


_UNREAD = {"release": "version", "model": "model", "architecture": "architecture", "tensor_parallel_size": "TP",
           "data_parallel_size": "DP", "pipeline_parallel_size": "PP", "prefix_caching": "prefix caching",
           "mamba_cache_mode": "Mamba cache mode", "block_size": "block", "speculative_method": "speculative",
           "kv_connector": "KV connector", "scheduling_policy": "scheduling policy"}


def _config_lines(t: Triage) -> list[str]:
    """What was deployed, grouped by the line that says it; what no line says, named as such (a
    default is never shown as read)."""
    c = t.config
    by_source: dict[str, list[str]] = {}
    unread: list[str] = []
    names = list(_UNREAD)
    for name, (text, source) in zip(names, _config_items(t), strict=True):
        if name == "num_speculative_tokens":
            continue
        if c.known(name):
            by_source.setdefault(source, []).append(text)
        else:
            unread.append(_UNREAD[name])
    lines = ["deployed:"]
    for source, texts in by_source.items():
        lines += _wrap(f"{', '.join(texts)} ({quote(source, 200)})", "    ", "  - ")
    if c.engines_seen and not c.known("data_parallel_size"):
        lines += _wrap(f"{c.engines_seen} engine process(es) in the log", "    ", "  - ")
    if unread:
        lines += _wrap(", ".join(unread), "    ", "  - not in the log: ")
    return lines


def _match_lines(m: Match, rank: int | None) -> list[str]:
    head = f"{rank}. {m.entry}" if rank is not None else f"-  {m.entry}"
    lines = _wrap(m.title, "     ", f"{head}: ")
    # a reason may hold a value the log gave (the release, the connector): quoted on one line
    lines += _wrap("; ".join(quote(w, 200) for w in m.why), "       ", "     why: ")
    if m.why_not:
        lines += _wrap("; ".join(quote(w, 200) for w in m.why_not), "       ", "     why not: ")
    fix = ", ".join(m.fixed_in_releases) or "no release yet"
    back = "; ".join(" + ".join(s) for s in m.backports) or "none in the catalogue"
    lines += _wrap(f"fixed in {fix}; backports on this base: {back}", "       ", "     ")
    if m.upstream:
        lines += _wrap(" ".join(u.replace("https://github.com/", "") for u in m.upstream), "       ", "     upstream: ")
    return lines


def plain(t: Triage) -> list[str]:
    lines = _wrap(f"{quote(t.log, 240)} ({t.lines:,} lines, {t.bytes_read / 1e6:,.1f} MB)", "  ", "log: ")
    lines += _config_lines(t)
    f = t.failure
    lines += _wrap(quote(f.title, 240), "  ", f"failure: {f.kind}: " if f.kind != "none" else "failure: ")
    if f.kind in ("crash", "infra"):
        when = {"runtime": "while serving", "startup": "at start-up", "unknown": "when: not in the text"}[f.phase]
        at = f"at line {f.line:,}, " if f.line else ""
        lines += _wrap(f"{at}{when}; read from {quote(f.evidence, 400)}" if f.evidence else f"{at}{when}", "  ", "  ")
    elif f.line:
        lines.append(f"  at line {f.line:,}")
    for w in t.warnings:
        lines += _wrap(quote(w, 400), "  ", "warning: ")
    if f.kind in ("crash", "stall"):
        if t.matches:
            lines.append("matches, best first:")
            for i, m in enumerate(t.matches, 1):
                lines += _match_lines(m, i)
            if t.tie is not None:
                lines += _wrap(f"{', '.join(t.tie.entries)} fit equally; would decide: {'; '.join(t.tie.would_decide)}",
                               "  ", "unresolved tie: ")
        else:
            why = (" (no crash signature knows it)" if f.kind == "crash" and not f.pattern else
                   f" (no entry with its crash signature {f.pattern} claims this deployment)"
                   if f.kind == "crash" and t.near_misses and any(m.entry for m in t.near_misses) else
                   f" (its crash signature {f.pattern} is in no entry)" if f.kind == "crash" else "")
            lines += _wrap("no catalogue entry fits: this failure is not a known defect" + why, "  ", "unknown: ")
        if t.near_misses:
            lines.append("near misses:")
            for m in t.near_misses:
                lines += _match_lines(m, None)
    elif f.kind == "infra":
        lines += _wrap("not a defect the catalogue holds (the engine's environment or start-up)", "  ", "unknown: ")
    if t.matches and t.base:
        clean = " + ".join(t.minimal_clean_set) if t.minimal_clean_set else \
            ("empty (no defect present here has a backport)" if t.minimal_clean_set == () else
             "none in the catalogue")
        lines += _wrap(f"on {t.base}: {clean}", "  ", "minimal clean set ")
        if t.still_present:
            lines += _wrap(", ".join(t.still_present) + " (no backport in the catalogue; upgrade)", "  ",
                           "  still present on every stack: ")
    return lines


def as_json(t: Triage) -> dict[str, Any]:
    data = to_jsonable(t)
    config = data["config"]
    # a field no line says is null here (its default only builds a reproduction), listed as such
    config["not_in_log"] = [name for name in READ_FIELDS if not t.config.known(name)]
    for name in config["not_in_log"]:
        config[name] = None
    data["unknown"] = t.unknown
    data["best"] = t.best.entry if t.best else None
    return data
