"""Prometheus exposition of ``kvtier.metrics`` through OpenTelemetry meters.

Counters and gauges are observable instruments whose callbacks read the exact values kept by
``Metrics`` (so a scrape shows the same numbers a test reads in-process); histograms are OTel
histograms fed by a ``Metrics`` listener on every ``observe``. ``PrometheusMetricReader`` writes into a
registry of our own, so several servers in one process (tests) never collide.
"""

from __future__ import annotations

from opentelemetry.exporter.prometheus import PrometheusMetricReader
from opentelemetry.metrics import CallbackOptions, Observation
from opentelemetry.sdk.metrics import MeterProvider
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from kvtier import __version__
from kvtier.metrics import METRICS, Metrics

# latency buckets in seconds: 50 us .. 10 s
LATENCY_BUCKETS_SECONDS = (0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05,
                           0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
CONTENT_TYPE = CONTENT_TYPE_LATEST


class Telemetry:
    """OTel meter provider over a ``Metrics`` instance; ``render()`` gives the Prometheus text.

    Args:
        metrics: where the values live.
        before_collect: called before each scrape (e.g. to refresh gauges); may be None.
    """

    def __init__(self, metrics: Metrics, before_collect=None):
        self.metrics = metrics
        self.before_collect = before_collect
        self.registry = CollectorRegistry()
        self._reader = PrometheusMetricReader(disable_target_info=True, scope_info_enabled=False,
                                              registry=self.registry)
        self._provider = MeterProvider(metric_readers=[self._reader])
        meter = self._provider.get_meter("kvtier", __version__)
        self._histograms = {}
        for spec in METRICS.values():
            if spec.kind == "counter":
                meter.create_observable_counter(spec.name, [self._callback(spec.name)], unit=spec.unit,
                                                description=spec.help)
            elif spec.kind == "gauge":
                meter.create_observable_gauge(spec.name, [self._callback(spec.name)], unit=spec.unit,
                                              description=spec.help)
            else:
                self._histograms[spec.name] = meter.create_histogram(
                    spec.name, unit=spec.unit, description=spec.help,
                    explicit_bucket_boundaries_advisory=list(LATENCY_BUCKETS_SECONDS))
        metrics.listeners.append(self._on_observe)

    def _callback(self, name: str):
        labels = METRICS[name].labels

        def observe(options: CallbackOptions):
            samples = self.metrics.samples(name)
            if not samples and not labels:
                return [Observation(0)]  # unlabelled series exist from the start, at 0
            return [Observation(value, dict(zip(labels, key))) for key, value in samples.items()]
        return observe

    def _on_observe(self, name: str, key: tuple, value: float) -> None:
        hist = self._histograms.get(name)
        if hist is not None:
            hist.record(value, dict(zip(METRICS[name].labels, key)))

    def render(self) -> bytes:
        """Prometheus text exposition of every metric."""
        if self.before_collect is not None:
            self.before_collect()
        return generate_latest(self.registry)

    def close(self) -> None:
        try:
            self.metrics.listeners.remove(self._on_observe)
        except ValueError:
            pass
        self._provider.shutdown()
