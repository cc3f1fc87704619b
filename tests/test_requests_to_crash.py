"""benchmarks/requests_to_crash.py: its medians, lower bounds and the access-log cross-check."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

_PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "requests_to_crash.py"
_spec = importlib.util.spec_from_file_location("requests_to_crash", _PATH)
rtc = importlib.util.module_from_spec(_spec)
sys.modules.setdefault("requests_to_crash", rtc)  # its dataclasses look their module up
_spec.loader.exec_module(rtc)


def runs(*values):
    return [rtc.Run(seed=i, requests=v, label="CRASH(target)" if v else "SURVIVED", sent=v or 2000)
            for i, v in enumerate(values)]


def test_a_run_without_crash_counts_as_the_budget_and_marks_the_median_a_lower_bound():
    crashed_most = runs(10, 20, 30, None)
    assert rtc.median_of(crashed_most, 2000) == 25
    assert not rtc.median_censored(crashed_most)
    half = runs(10, 20, None, None)
    assert rtc.median_of(half, 2000) == 1010
    assert rtc.median_censored(half)
    odd = runs(10, None, None)
    assert rtc.median_of(odd, 2000) == 2000 and rtc.median_censored(odd)


def test_summary_ratio_is_each_median_over_the_default_and_names_the_best_generic():
    rows = {rtc.DEFAULT: runs(50, 60, 70),
            "vllm bench random+prefix": runs(500, 600, None),
            "guidellm multi-turn": runs(60, 64, 70)}
    summary = rtc.summarise(rows, 2000)
    assert summary["loads"]["vllm bench random+prefix"]["ratio_to_default"] == 10.0
    assert summary["best_generic"] == "guidellm multi-turn"
    assert summary["best_generic_over_default"] == round(64 / 60, 3)
    assert summary["loads"]["guidellm multi-turn"]["crashed"] == 3


def test_access_log_count_takes_generation_posts_only():
    log = "\n".join([
        '(APIServer pid=1) INFO:     127.0.0.1:1 - "GET /v1/models HTTP/1.1" 200 OK',
        '(APIServer pid=1) INFO:     127.0.0.1:1 - "POST /tokenize HTTP/1.1" 200 OK',
        '(APIServer pid=1) INFO:     127.0.0.1:1 - "POST /v1/completions HTTP/1.1" 200 OK',
        '(APIServer pid=1) INFO:     127.0.0.1:1 - "POST /v1/chat/completions HTTP/1.1" 500 Internal Server Error',
    ])
    assert rtc.access_log_requests(log) == 2


def _sweep():
    path = _PATH.parent / "release_sweep.py"
    spec = importlib.util.spec_from_file_location("release_sweep", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_release_sweep_reads_each_entrys_failure_from_the_run_and_runs_releases_as_released():
    """benchmarks/release_sweep.py: a crash entry's failure is the request the engine died on when it
    died on that entry's signature; a corruption entry's is the first request a violation of its
    defect named; a release runs with no patch; entries that differ only in seeds share runs."""
    from kvrepro.suite.catalogue import load_catalogue

    sweep = _sweep()
    cat = {e.name: e for e in load_catalogue().entries}
    crash, null = cat["offload-boundary-assert"], cat["mamba-null-state"]
    died = rtc.Run(seed=0, requests=8, label="CRASH(target)", sent=8, signature=crash.signature,
                   kv_first_request_by_class={"mamba/null-block/hit": 5}, kv_groups=["mamba", "full_attention"])
    assert sweep.failure_at(crash, died) == 8 and sweep.failure_at(null, died) == 5
    other = rtc.Run(seed=1, requests=None, label="CRASH(other)", sent=30, signature="kv_cache_truncate_computed_blocks")
    assert sweep.failure_at(crash, other) is None and sweep.failure_at(null, other) is None
    assert sweep.median([8, 9, None], 600) == (9, False) and sweep.median([8, None, None], 600) == (600, True)
    matrix = sweep.release_matrix("0.25.1", {"mamba_cache_mode": "all"})
    assert (matrix["base"], matrix["common"], matrix["builds"], matrix["expect"]) == ("0.25.1", [], {"A": []}, {})
    assert matrix["engine"]["mamba_cache_mode"] == "all" and matrix["engine"]["speculative_method"] == "mtp"
    keys = {sweep._engine_key(cat[n]) for n in ("offload-boundary-assert", "mamba-null-state", "fa-hole-below-mamba-hit")}
    assert len(keys) == 1  # fa-hole-below-mamba-hit's fragment differs in seeds only
    assert sweep._engine_key(cat["offload-boundary-assert-all-mode"]) not in keys
