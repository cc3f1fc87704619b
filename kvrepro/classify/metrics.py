"""Reading Prometheus text exposition (an engine's /metrics) into numbers.

The one parser of the exposition format in kvrepro is ``prometheus_client``'s
(:func:`prometheus_client.parser.text_string_to_metric_families`): the library that vLLM itself
exports its metrics with, so label values with commas, quotes, braces or escaped newlines, ``NaN``
and ``+Inf``, timestamps and ``# TYPE``/``# HELP`` lines are read as the writer meant them.
"""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families


def parse_prometheus(text: str) -> dict[str, float]:
    """Sample name (with its label set) -> value; comments and junk skipped.

    A scrape cut short (the engine died while answering) or a line the format does not allow makes
    the library stop at that line; the text is then read one line at a time, so every well-formed
    sample still counts and only the bad lines are dropped. The label set is written back in the
    exposition syntax (``name{a="1",b="x\\"y"}``, labels as the library returns them). As the
    library reads the format, a sample of a family declared ``counter`` is named with ``_total``
    (vLLM's counters, exported with this library, always are).
    """
    samples: dict[str, float] = {}
    try:
        _add(samples, text)
    except ValueError:
        samples.clear()
        for line in text.splitlines():
            if line.strip() and not line.lstrip().startswith("#"):
                try:
                    _add(samples, line + "\n")
                except ValueError:
                    continue
    return samples


def _add(samples: dict[str, float], text: str) -> None:
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[_key(sample.name, sample.labels)] = float(sample.value)


def _key(name: str, labels: dict[str, str]) -> str:
    if not labels:
        return name
    escaped = (k + '="' + v.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'
               for k, v in labels.items())
    return name + "{" + ",".join(escaped) + "}"


def total(samples: dict[str, float], metric: str) -> float:
    """Sum of a metric over all its label sets (vLLM labels per engine/model)."""
    return sum(v for k, v in samples.items() if k == metric or k.startswith(metric + "{"))


def total_or_none(samples: dict[str, float], metric: str) -> float | None:
    """Like ``total``, but None when the engine did not report the metric at all: "unknown"
    must not read as 0 (no metrics after a crash is not the same as no offload loads)."""
    found = [v for k, v in samples.items() if k == metric or k.startswith(metric + "{")]
    return sum(found) if found else None
