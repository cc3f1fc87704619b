"""One place from an engine log to a verdict.

The runner (after each repetition), the results read-back (a run recorded before a corruption
signature was added reads with it) and `kvrepro classify` (a log alone) all judge here, so a new
counter or a new rule is written once. What one run left goes in (its log, its /metrics, what
the load generator saw, how the engine ended); a :class:`~kvrepro.classify.records.Judgement` comes out.
"""

from __future__ import annotations

import dataclasses
from dataclasses import replace
from pathlib import Path
from typing import Any

from ..records import LoadSummary, Outcome, PathEvidence, RunResult, Verdict
from ..spec.matrix import TargetSignature
from .corruption import defects_of
from .records import Judgement
from .metrics import parse_prometheus, total
from .report import ParsedLog, parse_log
from .verdict import corruption_title, decide, died_without_traceback_title
from .verdict import title as verdict_title


def judge(log: ParsedLog | str, source_root: Path | None = None, target: TargetSignature | None = None, *,
          metrics_text: str | None = None, load: LoadSummary | None = None, engine_exit: int | None = None,
          expected_probe_sha256: str | None = None, other_engine: str | None = None,
          stall_timeout_s: float | None = None, judge_run: bool = True) -> Judgement:
    """Judge one engine log: its :class:`~kvrepro.classify.report.ParsedLog` (the runner parsed it
    once while the run went on), or its text (parsed here, once; ``source_root`` and ``target``
    are then the classifier's).

    ``judge_run`` False: the log alone (no load, no exit code), as `kvrepro classify` reads a log;
    the verdict is then None and the title names the corruption when the shadow KV caught one, else
    it is the classifier's (the crash's, in ``classification``, either way). Otherwise:
    ``other_engine`` says why the engine that ran is not the one the matrix describes (its
    geometry; the run is INFRA with that title); ``stall_timeout_s`` names the limit a STALL hit.
    """
    parsed = parse_log(log, source_root, target) if isinstance(log, str) else log
    classification, counters = parsed.classification, parsed.counters
    exposure = parsed.exposure_with(metrics_text)
    defects = defects_of(exposure.kv_violations, exposure.kv_violations_by, exposure.kv_first_violation_class,
                         exposure.kv_groups)
    samples = parse_prometheus(metrics_text or "")
    metrics = dict(external_prefix_cache_hits=int(total(samples, "vllm:external_prefix_cache_hits_total")),
                   prefix_cache_hits=int(total(samples, "vllm:prefix_cache_hits_total")))
    if not judge_run:
        title = corruption_title(defects, exposure.kv_first_violation) if defects else classification.title
        return Judgement(classification, exposure, counters, defects, None, title, **metrics)
    verdict = decide(classification, exposure, load, engine_exit, expected_probe_sha256, other_engine)
    if verdict is Verdict.INFRA and other_engine:
        title = other_engine
    else:
        title = verdict_title(verdict, exposure, load, expected_probe_sha256, defects) or classification.title
    if verdict is Verdict.CRASH and classification.outcome is Outcome.NONE:
        title = died_without_traceback_title(engine_exit)
    elif verdict is Verdict.STALL and stall_timeout_s is not None:
        title = f"no request finished for {stall_timeout_s:.0f}s (runs.stall_timeout_s)"
    return Judgement(classification, exposure, counters, defects, verdict, title, **metrics)


def reattributed(result: RunResult) -> RunResult:
    """A recorded repetition's corruption defects as today's signature table names them (the
    recorded violation classes are the facts; which defect they are follows the table, so a run
    recorded before a signature was added reads with it), and a CORRUPT title that names them."""
    if not result.kv_violations:
        return result
    defects = defects_of(result.kv_violations, result.kv_violations_by, result.kv_first_violation_class,
                         result.kv_groups)
    title = corruption_title(defects, result.kv_first_violation) if result.verdict is Verdict.CORRUPT else result.title
    return replace(result, kv_defects=defects, title=title)


def run_result(judgement: Judgement, **run: Any) -> RunResult:
    """A repetition's record from its judgement and ``run``, the repetition's own fields (build,
    rep, requests, seconds, run_dir, base, load, ...).

    What the probe and the shadow KV saw is one record, PathEvidence, that both Exposure and
    RunResult are: its fields are copied over, so a new probe counter is one field and a line of
    the probe's reader, and nothing else changes."""
    exposure, counters = judgement.exposure, judgement.counters
    fields: dict[str, Any] = {f.name: _copied(getattr(exposure, f.name)) for f in dataclasses.fields(PathEvidence)}
    fields.update(
        verdict=judgement.verdict, outcome=judgement.classification.outcome, title=judgement.title,
        refused_arguments=judgement.classification.refused_arguments,
        signature=judgement.classification.signature, trigger_count=exposure.trigger_calls,
        state_count=exposure.state_calls, kv_check=exposure.kv_check, kv_defects=dict(judgement.defects),
        offload_load_jobs=counters.offload_load_jobs, offload_store_jobs=counters.offload_store_jobs,
        engine_steps=counters.steps, external_prefix_cache_hits=judgement.external_prefix_cache_hits,
        prefix_cache_hits=judgement.prefix_cache_hits)
    return RunResult(**fields, **run)


def _copied(value: Any) -> Any:
    """A record's own copy of a mutable field (frozen dataclasses still hold mutable dicts)."""
    return dict(value) if isinstance(value, dict) else value
