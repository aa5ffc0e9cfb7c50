"""Reading Prometheus text exposition (kvtier's, vLLM's, LMCache's ``/metrics``) with prometheus_client's parser.

Samples keep their full names (``kvtier_store_chunks_total``, ``kvtier_store_seconds_count``).
"""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def parse(text: str) -> Samples:
    """Every sample of exposition ``text``: ``{(sample name, sorted (label, value) pairs): value}``."""
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def scrape(url: str) -> Samples:
    """``parse`` of what ``url`` (a ``/metrics`` endpoint) answers."""
    return parse(httpx.get(url, timeout=10).text)


def total(samples: Samples, name: str, **labels) -> float:
    """Sum of the samples called ``name`` whose labels include ``labels`` (0.0 when there are none)."""
    want = {(k, str(v)) for k, v in labels.items()}
    return sum(v for (n, lab), v in samples.items() if n == name and want <= set(lab))


def metric_sum(text: str, name: str, **labels) -> float:
    """Sum of the series ``name`` in exposition ``text`` whose labels include ``labels``."""
    return total(parse(text), name, **labels)


def metric_value(text: str, name: str, **labels) -> float | None:
    """Value of the one series ``name`` with exactly ``labels`` in exposition ``text`` (None when absent)."""
    return parse(text).get((name, tuple(sorted((k, str(v)) for k, v in labels.items()))))
