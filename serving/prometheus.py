"""Prometheus metrics of one ingress replica, per served model name (the ``model`` label).

Exposed as prometheus_client text at ``GET /metrics``. Each ingress replica has
its own collector registry; with several ingress replicas, scrape each (or use
Ray's metrics export).

>>> m = ServingMetrics()
>>> m.observe_generation("tiny/ngram", "ngram", prompt_tokens=5, completion_tokens=9, ttft_s=0.1, duration_s=0.9,
...                      stats={"drafted_tokens": 8, "accepted_tokens": 6, "target_forwards": 4, "wall_s": 0.8})
>>> text = m.render().decode()
>>> 'specray_acceptance_rate{model="tiny/ngram"} 0.75' in text
True
"""

from __future__ import annotations

import threading

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

disable_created_metrics()  # the *_created series only add noise here

TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.25, 0.5, 1.0)


class ServingMetrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self):
        r = self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter(
            "specray_requests", "Requests answered, by model, endpoint and HTTP status", ["model", "endpoint", "status"], registry=r
        )
        self.rejected = Counter("specray_admission_rejected", "Requests refused because the ingress queue was full (429)", registry=r)
        self.inflight = Gauge("specray_requests_inflight", "Requests admitted by this ingress replica and not finished", registry=r)
        self.prompt_tokens = Counter("specray_prompt_tokens", "Prompt tokens processed", ["model"], registry=r)
        self.output_tokens = Counter("specray_output_tokens", "Tokens generated and sent", ["model"], registry=r)
        self.ttft = Histogram(
            "specray_time_to_first_token_seconds", "Request arrival to first generated token", ["model"], buckets=TTFT_BUCKETS, registry=r
        )
        self.tpot = Histogram(
            "specray_time_per_output_token_seconds",
            "Mean time between output tokens after the first, per request",
            ["model"],
            buckets=TPOT_BUCKETS,
            registry=r,
        )
        self.cancelled = Counter(
            "specray_generations_cancelled", "Generations stopped because the client disconnected", ["model"], registry=r
        )
        self.drafted = Counter("specray_draft_tokens", "Draft tokens proposed", ["model"], registry=r)
        self.accepted = Counter("specray_accepted_draft_tokens", "Draft tokens accepted by the target", ["model"], registry=r)
        self.forwards = Counter("specray_target_forwards", "Target forward passes (prefill included)", ["model"], registry=r)
        self.acceptance = Gauge("specray_acceptance_rate", "Accepted / proposed draft tokens since start", ["model"], registry=r)
        self.tau = Gauge(
            "specray_mean_accepted_tokens",
            "Tokens committed per decoding target forward since start (tau; 1 for AR)",
            ["model"],
            registry=r,
        )
        self.tps = Gauge("specray_tokens_per_second", "Generated tokens / generation wall time since start", ["model"], registry=r)
        self.speedup = Gauge(
            "specray_speedup_estimate",
            "Speedup over AR: source=registry is the entry's measured speedup; source=live is tokens/s over this server's AR "
            "tokens/s for the same base model",
            ["model", "source"],
            registry=r,
        )
        self.info = Gauge("specray_model_info", "Served configurations (value 1)", ["model", "method", "base_model", "version"], registry=r)
        self._lock = threading.Lock()
        self._sums: dict[str, dict] = {}  # model -> running sums for the ratio gauges
        self._base_of: dict[str, tuple[str, str]] = {}  # model name -> (base model, method)

    def describe_model(self, name: str, method: str, base_model: str, version, registry_speedup) -> None:
        self.info.labels(name, method, base_model, str(version) if version is not None else "").set(1)
        with self._lock:
            self._base_of[name] = (base_model, method)
        if isinstance(registry_speedup, int | float) and not isinstance(registry_speedup, bool):
            self.speedup.labels(name, "registry").set(float(registry_speedup))

    def observe_request(self, model: str, endpoint: str, status: int) -> None:
        self.requests.labels(model, endpoint, str(status)).inc()

    def observe_generation(
        self,
        model: str,
        method: str,
        prompt_tokens: int,
        completion_tokens: int,
        ttft_s: float | None,
        duration_s: float | None,
        stats: dict | None,
        cancelled: bool = False,
    ) -> None:
        self.prompt_tokens.labels(model).inc(prompt_tokens)
        self.output_tokens.labels(model).inc(completion_tokens)
        if ttft_s is not None:
            self.ttft.labels(model).observe(ttft_s)
        if ttft_s is not None and duration_s is not None and completion_tokens > 1:
            self.tpot.labels(model).observe(max(duration_s - ttft_s, 0.0) / (completion_tokens - 1))
        if cancelled:
            self.cancelled.labels(model).inc()
        if not stats:
            return
        drafted, accepted = int(stats.get("drafted_tokens", 0)), int(stats.get("accepted_tokens", 0))
        forwards = int(stats.get("target_forwards", 0))
        self.drafted.labels(model).inc(drafted)
        self.accepted.labels(model).inc(accepted)
        self.forwards.labels(model).inc(forwards)
        with self._lock:
            s = self._sums.setdefault(
                model, {"drafted": 0, "accepted": 0, "decode_tokens": 0, "decode_forwards": 0, "tokens": 0, "wall": 0.0}
            )
            s["drafted"] += drafted
            s["accepted"] += accepted
            if forwards > 1:
                s["decode_tokens"] += completion_tokens - 1
                s["decode_forwards"] += forwards - 1
            s["tokens"] += completion_tokens
            s["wall"] += float(stats.get("wall_s") or 0.0)
            self.acceptance.labels(model).set(s["accepted"] / s["drafted"] if s["drafted"] else 0.0)
            self.tau.labels(model).set(s["decode_tokens"] / s["decode_forwards"] if s["decode_forwards"] else 1.0)
            if s["wall"] > 0:
                self.tps.labels(model).set(s["tokens"] / s["wall"])
            self._update_live_speedup()

    def _update_live_speedup(self) -> None:
        """tokens/s of every model over the AR tokens/s of its base model, when both were measured here."""
        ar_rate = {}
        for name, (base, method) in self._base_of.items():
            s = self._sums.get(name)
            if method == "ar" and s and s["wall"] > 0:
                ar_rate[base] = s["tokens"] / s["wall"]
        for name, (base, _method) in self._base_of.items():
            s = self._sums.get(name)
            if s and s["wall"] > 0 and ar_rate.get(base):
                self.speedup.labels(name, "live").set((s["tokens"] / s["wall"]) / ar_rate[base])

    def render(self) -> bytes:
        return generate_latest(self.registry)
