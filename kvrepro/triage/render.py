"""The triage as plain lines (80 columns) and as JSON data."""

from __future__ import annotations

import textwrap
from typing import Any

from ..records import to_jsonable
from ..untrusted import quote
from .records import Match, Triage

WIDTH = 80


def _wrap(text: str, indent: str = "", first: str = "") -> list[str]:
    return textwrap.wrap(text, WIDTH, initial_indent=first or indent, subsequent_indent=indent,
                         break_long_words=True, break_on_hyphens=False) or [first.rstrip()]


def _config_lines(t: Triage) -> list[str]:
    # every value is the log's: quoted (one line, at most ~80 characters; kvrepro/untrusted.py)
    c = t.config
    spec = f"{quote(c.speculative_method)} x {quote(c.num_speculative_tokens)}" if c.speculative_method else "none"
    connector = quote(c.kv_connector) if c.kv_connector else "none"
    if c.kv_connector_settings:
        connector += " (" + ", ".join(f"{quote(k)}={quote(v)}" for k, v in c.kv_connector_settings.items()
                                      if not isinstance(v, dict)) + ")"
    return [
        *_wrap(f"vLLM {quote(c.release)}, {quote(c.model) if c.model else 'model not in the log'}"
               f"{f' ({quote(c.architecture)})' if c.architecture else ''}", "  ", "deployed: "),
        *_wrap(f"DP{c.data_parallel_size} x TP{c.tensor_parallel_size}"
               f"{f' x PP{c.pipeline_parallel_size}' if c.pipeline_parallel_size > 1 else ''}"
               f" ({c.engines_seen} engine(s) in the log); prefix caching {'on' if c.prefix_caching else 'off'};"
               f" Mamba cache mode {quote(c.mamba_cache_mode or 'none')}; block {quote(c.block_size or 'default')};"
               f" speculative {spec}; KV connector {connector}", "  ", "  "),
    ]


def _match_lines(m: Match, rank: int | None) -> list[str]:
    head = f"{rank}. {m.entry}" if rank is not None else f"-  {m.entry}"
    lines = _wrap(m.title, "     ", f"{head}: ")
    lines += _wrap("; ".join(m.why), "       ", "     why: ")
    if m.why_not:
        lines += _wrap("; ".join(m.why_not), "       ", "     why not: ")
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
    if f.line:
        lines.append(f"  at line {f.line:,}")
    for w in t.warnings:
        lines += _wrap(quote(w, 400), "  ", "warning: ")
    if f.kind in ("crash", "stall"):
        if t.matches:
            lines.append("matches, best first:")
            for i, m in enumerate(t.matches, 1):
                lines += _match_lines(m, i)
        else:
            why = (" (no crash signature knows it)" if f.kind == "crash" and not f.pattern else
                   f" (no entry with its crash signature {f.pattern} claims this deployment)"
                   if f.kind == "crash" and t.near_misses else
                   f" (its crash signature {f.pattern} is in no entry)" if f.kind == "crash" else "")
            lines += _wrap("no catalogue entry fits: this failure is not a known defect" + why, "  ", "unknown: ")
        if t.near_misses:
            lines.append("near misses:")
            for m in t.near_misses:
                lines += _match_lines(m, None)
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
    data["unknown"] = t.unknown
    data["best"] = t.best.entry if t.best else None
    return data
