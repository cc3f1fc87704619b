"""Reading Prometheus text exposition (an engine's /metrics) into numbers."""

from __future__ import annotations


def parse_prometheus(text: str) -> dict[str, float]:
    """Sample name (with its label set, as written) -> value; comments and junk skipped."""
    samples: dict[str, float] = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        name, _, rest = line.rpartition(" ") if "}" not in line else (line[: line.rindex("}") + 1], " ", line[line.rindex("}") + 1 :])
        try:
            samples[name.strip()] = float(rest.split()[0])
        except (ValueError, IndexError):
            continue
    return samples


def total(samples: dict[str, float], metric: str) -> float:
    """Sum of a metric over all its label sets (vLLM labels per engine/model)."""
    return sum(v for k, v in samples.items() if k == metric or k.startswith(metric + "{"))


def total_or_none(samples: dict[str, float], metric: str) -> float | None:
    """Like ``total``, but None when the engine did not report the metric at all: "unknown"
    must not read as 0 (no metrics after a crash is not the same as no offload loads)."""
    found = [v for k, v in samples.items() if k == metric or k.startswith(metric + "{")]
    return sum(found) if found else None
