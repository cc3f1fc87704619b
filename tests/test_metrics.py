"""The one Prometheus text parser (prometheus_client's) behind parse_prometheus, total and the
exposure counters: label values the format allows, a scrape cut short, junk lines."""

from __future__ import annotations

from kvrepro.classify.exposure import read_exposure
from kvrepro.classify.metrics import parse_prometheus, total, total_or_none

VLLM = """\
# HELP vllm:prefix_cache_hits_total Prefix cache hits, in terms of number of cached tokens.
# TYPE vllm:prefix_cache_hits_total counter
vllm:prefix_cache_hits_total{engine="0",model_name="m"} 48.0
vllm:prefix_cache_hits_total{engine="1",model_name="m"} 16.0
# HELP vllm:external_prefix_cache_hits_total External prefix cache hits.
# TYPE vllm:external_prefix_cache_hits_total counter
vllm:external_prefix_cache_hits_total{engine="0",model_name="m"} 32.0
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 2.0
"""


def test_vllm_counters_summed_over_label_sets():
    samples = parse_prometheus(VLLM)
    assert total(samples, "vllm:prefix_cache_hits_total") == 64
    assert total(samples, "vllm:external_prefix_cache_hits_total") == 32
    assert total(samples, "vllm:num_requests_running") == 2
    assert total_or_none(samples, "vllm:prefix_cache_hits") is None  # a prefix of a name is not the name
    assert samples['vllm:prefix_cache_hits_total{engine="0",model_name="m"}'] == 48


def test_label_values_with_comma_quote_brace_and_escaped_newline():
    text = ('kvrepro_probe_trigger_calls_total{path="a,b} 9",note="say \\"hi\\"\\nbye"} 3\n'
            'kvrepro_probe_trigger_calls_total{path="c"} 4\n'
            'kvrepro_probe_external_hit_calls_total{x="\\\\"} 5 1700000000000\n')
    samples = parse_prometheus(text)
    assert total(samples, "kvrepro_probe_trigger_calls_total") == 7
    assert samples['kvrepro_probe_trigger_calls_total{path="a,b} 9",note="say \\"hi\\"\\nbye"}'] == 3
    assert total(samples, "kvrepro_probe_external_hit_calls_total") == 5  # the timestamp is not the value
    exposure = read_exposure("", text)
    assert (exposure.trigger_calls, exposure.external_hit_calls) == (7, 5)


def test_a_scrape_cut_short_or_a_junk_line_keeps_every_good_sample():
    cut = VLLM + 'vllm:prefix_cache_hits_total{engine="2",model_na'
    assert total(parse_prometheus(cut), "vllm:prefix_cache_hits_total") == 64
    junk = "not a metric line at all\n" + VLLM + "vllm:num_requests_running two\n"
    samples = parse_prometheus(junk)
    assert total(samples, "vllm:prefix_cache_hits_total") == 64
    assert total(samples, "vllm:num_requests_running") == 2
    assert parse_prometheus("") == {} and parse_prometheus("# only a comment\n") == {}


def test_nan_and_inf_are_read_and_nan_is_no_exposure_count():
    samples = parse_prometheus("a NaN\nb +Inf\nkvrepro_probe_trigger_calls_total NaN\n")
    assert samples["b"] == float("inf") and samples["a"] != samples["a"]
    assert read_exposure("", "kvrepro_probe_trigger_calls_total NaN\n").trigger_calls == 0
