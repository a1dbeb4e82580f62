"""What the admission webhook counts, for Prometheus to scrape at GET /metrics.

Labels are bounded sets (endpoint, decision, a reason class, an HTTP status), never an image, a
namespace or a message: a label per image would let any Pod author grow the scrape without limit.
Each server has its own CollectorRegistry, so tests can run several in one process.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from imagebuild.trust.verify import CacheStats

CONTENT_TYPE = CONTENT_TYPE_LATEST
# Seconds: a cached verdict answers in well under a millisecond, a cold one in tens to hundreds of ms;
# the API server gives up at 10 s (the webhook's timeoutSeconds).
LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)

# Why a review was decided as it was, as a bounded class (the log line has the words).
REASONS = ("verified", "not_covered", "no_images", "refused", "registry_unreachable", "malformed")


def decision_reason(log: Mapping[str, Any]) -> str:
    """The reason class of one decision, from the decision's log line (review.decision_log, review.rejected)."""
    if log.get("decision") == "malformed" or "error" in log:
        return "malformed"
    if log.get("skipped") is not None:
        return "not_covered"
    images = [image for image in log.get("images") or () if isinstance(image, Mapping)]
    if not images:
        return "no_images"
    refused = [image for image in images if not image.get("allowed")]
    if any(image.get("unreachable") for image in refused):
        return "registry_unreachable"
    return "refused" if refused else "verified"


class _CacheCollector:
    """Reads the verifier's own counts at scrape time (they are kept where the cache is)."""

    def __init__(self, stats: Callable[[], CacheStats]) -> None:
        self._stats = stats

    def collect(self) -> Iterable[Metric]:
        stats = self._stats()
        hits = CounterMetricFamily("imagebuild_webhook_verify_cache_hits",
                                   "Image verdicts answered from the verifier's cache.")
        hits.add_metric([], stats.hits)
        misses = CounterMetricFamily("imagebuild_webhook_verify_cache_misses",
                                     "Image verdicts that needed the registry (nothing fresh in the cache).")
        misses.add_metric([], stats.misses)
        return [hits, misses]


class WebhookMetrics:
    """The webhook's counters, histogram and gauges, in a registry of their own."""

    def __init__(self, cache_stats: Callable[[], CacheStats] | None = None) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.decisions = Counter("imagebuild_webhook_decisions", "AdmissionReviews answered, by result and reason.",
                                 ["endpoint", "decision", "reason"], registry=self.registry)
        self.latency = Histogram("imagebuild_webhook_review_duration_seconds",
                                 "From a review's body starting to arrive to its answer being ready.",
                                 ["endpoint"], buckets=LATENCY_BUCKETS, registry=self.registry)
        self.images = Counter("imagebuild_webhook_images", "Images judged in reviews, by verdict.",
                              ["verdict"], registry=self.registry)
        self.registry_errors = Counter("imagebuild_webhook_registry_errors",
                                       "Image verifications that could not reach or read the registry.",
                                       registry=self.registry)
        self.in_flight = Gauge("imagebuild_webhook_in_flight_requests", "Reviews received whole and not answered yet.",
                               registry=self.registry)
        self.refused = Counter("imagebuild_webhook_requests_refused",
                               "Requests answered with an HTTP error instead of a review (408, 411, 413, 503...).",
                               ["status"], registry=self.registry)
        self.connections_refused = Counter("imagebuild_webhook_connections_refused",
                                           "Connections closed at once: over the per-client or total limit.",
                                           registry=self.registry)
        self.ready = Gauge("imagebuild_webhook_ready", "1 while the webhook accepts reviews (0 once stopping).",
                           registry=self.registry)
        for reason in REASONS:  # every series from the start, so rate() sees the first one
            for endpoint in ("validate", "mutate"):
                decision = "denied" if reason in ("refused", "registry_unreachable", "malformed") else "allowed"
                self.decisions.labels(endpoint, decision, reason)
        for endpoint in ("validate", "mutate"):
            self.latency.labels(endpoint)
        for verdict in ("allowed", "refused", "unreachable"):
            self.images.labels(verdict)
        if cache_stats is not None:
            self.registry.register(_CacheCollector(cache_stats))

    def decided(self, endpoint: str, log: Mapping[str, Any], seconds: float) -> None:
        self.decisions.labels(endpoint, str(log.get("decision", "unknown")), decision_reason(log)).inc()
        self.latency.labels(endpoint).observe(seconds)
        for image in log.get("images") or ():
            if not isinstance(image, Mapping):
                continue
            if image.get("allowed"):
                self.images.labels("allowed").inc()
            elif image.get("unreachable"):
                self.images.labels("unreachable").inc()
            else:
                self.images.labels("refused").inc()

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
