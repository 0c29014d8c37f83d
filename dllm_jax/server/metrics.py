"""Prometheus metrics of a server (its own registry: two servers in one process never share counters).

Gauges and counters are read from the engine when scraped; the latency histograms are fed as requests finish.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 60, 120, 300)


class ServerMetrics:
    def __init__(self, service, model_name: str):
        self.service = service
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(service))
        self.first_block = Histogram(
            "dllm_jax_time_to_first_block_seconds",
            "Arrival to the first committed block",
            buckets=BUCKETS,
            registry=self.registry,
        )
        self.latency = Histogram(
            "dllm_jax_request_latency_seconds", "Arrival to the last block", buckets=BUCKETS, registry=self.registry
        )
        self._seen = 0

    def render(self) -> bytes:
        finished, self._seen = self.service.latencies_since(self._seen)
        for ttfb, total in finished:  # fed here: the engine thread never touches the registry
            self.first_block.observe(ttfb)
            self.latency.observe(total)
        return generate_latest(self.registry)


class _EngineCollector:
    def __init__(self, service):
        self.service = service

    def collect(self):
        s = self.service.engine.stats()
        audit = self.service.auditor.report()
        # the engine counts shadow requests (the audit's exact twins) with the users'; these counters are the users'
        s["requests"] -= audit["shadows"]
        s["finished"] -= audit["shadows_finished"]
        s["aborted"] -= audit["shadow_abort"]
        s["failed"] -= audit["shadow_error"]
        s["generated_tokens"] -= audit["shadow_tokens"]
        waits = dict(self.service.waits)
        ready = self.service.readiness()["status"] == "ready"
        gauges = {
            "requests_waiting": (
                "Requests queued for admission (the engine's queue and those not yet handed to it)",
                s["waiting"] + self.service.submitted_waiting(),
            ),
            "requests_running": ("Requests admitted and decoding", s["running"]),
            "kv_pages_total": ("Pages of the KV pool", s["pages_total"]),
            "kv_pages_used": ("Pages held by running requests and their affixes", s["pages_used"]),
            "kv_pages_shared": ("Pages of stored affix copies held by running requests", s["pages_shared"]),
            "kv_pages_cached": ("Pages of stored affix copies no request holds (evictable)", s["pages_cached"]),
            "kv_bytes_used": ("Bytes of the KV pool in use", s["kv_bytes_used"]),
            "kv_bytes_peak": ("The most bytes of the KV pool in use at once", s["peak_kv_bytes"]),
            "generation_tokens_per_second": (
                "Generated tokens per second over the last 10 s",
                self.service.tokens_per_second(),
            ),
            "draining": ("1 while the server finishes its requests before exiting", int(self.service.draining)),
            "ready": ("1 once warmed up and not draining (GET /ready)", int(ready)),
            "consecutive_faults": (
                "Device calls failed in a row (GET /health: 503 at the limit)",
                s["consecutive_faults"],
            ),
            "programs": ("Compiled programs the engine's settings imply (all warmed before serving)", s["programs"]),
            "warmup_seconds": ("Seconds the warm-up took (0 until it ends)", s["warmup_seconds"]),
        }
        for name, (doc, value) in gauges.items():
            yield GaugeMetricFamily(f"dllm_jax_{name}", doc, value=value)
        counters = {
            "requests": ("Requests accepted", s["requests"]),
            "requests_finished": ("Requests finished (stop or length)", s["finished"]),
            "requests_aborted": ("Requests aborted (client gone, stop string, shutdown)", s["aborted"]),
            "requests_failed": ("Requests failed by a device call that raised (answered 500)", s["failed"]),
            "requests_timed_out": ("Requests ended at their timeout (answered 504)", s["timed_out"]),
            "engine_faults": ("Device calls that raised (each fails only its own requests)", s["faults"]),
            "kv_pool_rebuilds": ("Times a failed call consumed the KV pool and it was rebuilt", s["pool_rebuilds"]),
            "generation_tokens": ("Answer tokens generated", s["generated_tokens"]),
            "affix_hits": ("Requests that reused a stored affix copy", s["affix_hits"]),
            "affix_builds": ("Affix copies computed", s["affix_builds"]),
            "blocks": ("Device calls that ran one block of a batch", s["blocks"]),
            "compiles": ("XLA compilations in this process (persistent-cache hits not counted)", s["compiles"]),
            "compile_seconds": ("Seconds of those compilations", s["compile_seconds"]),
            "compiles_after_warmup": ("XLA compilations after the warm-up (should stay 0)", s["compiles_after_warmup"]),
            "compile_seconds_after_warmup": ("Seconds of those", s["compile_seconds_after_warmup"]),
            "admission_waits": ("Block calls held for arrivals to take freed rows (--admission-wait)", waits["count"]),
            "admission_wait_seconds": ("Seconds those holds took", waits["seconds"]),
            "admission_wait_requests": ("Requests taken in during those holds", waits["admitted"]),
        }
        for name, (doc, value) in counters.items():
            yield CounterMetricFamily(f"dllm_jax_{name}", doc, value=value)
        yield from _audit_families(audit)


def _audit_families(audit: dict):
    """The audit (`dllm_jax.audit`, GET /v1/audit): its shadow requests, counted apart from the users', and per
    affix and technique setting the audited requests, their exact matches and their mean token agreement."""
    totals = {
        "audit_shadow_requests": ("Shadow requests (exact twins of audited requests; never answered)", "shadows"),
        "audit_shadow_dropped": ("Audits given up for a user request that waited (their shadows aborted)", "dropped"),
        "audit_skipped": ("Audits not started: too many waiting for room", "skipped"),
        "audit_incomplete": ("Audits given up: the served request was cut short", "incomplete"),
        "audit_shadow_tokens": ("Answer tokens the shadow requests generated", "shadow_tokens"),
    }
    for name, (doc, key) in totals.items():
        yield CounterMetricFamily(f"dllm_jax_{name}", doc, value=audit[key])
    labels = ["affix", "setting"]
    requests = CounterMetricFamily("dllm_jax_audit_requests", "Audited requests", labels=labels)
    exact = CounterMetricFamily("dllm_jax_audit_exact_matches", "Audited answers equal to the exact one", labels=labels)
    agreement = GaugeMetricFamily(
        "dllm_jax_audit_token_agreement", "Mean share of agreeing answer tokens", labels=labels
    )
    for g in audit["groups"]:
        at = [g["affix"], g["setting"]]
        requests.add_metric(at, g["requests"])
        exact.add_metric(at, g["exact_matches"])
        agreement.add_metric(at, g["mean_token_agreement"])
    ratio = GaugeMetricFamily(
        "dllm_jax_audit_auto_ratio", 'The ratio anchor_ratio "auto" serves each affix at (1: exact)', labels=["affix"]
    )
    depth = GaugeMetricFamily(
        "dllm_jax_audit_auto_depth", 'The depth shallow_depth "auto" serves each affix at (0: exact)', labels=["affix"]
    )
    for row in audit["calibration"]:
        (ratio if row["technique"] == "anchors" else depth).add_metric(
            [row["affix"]], row["ratio"] if row["technique"] == "anchors" else row["depth"]
        )
    yield from (requests, exact, agreement, ratio, depth)
