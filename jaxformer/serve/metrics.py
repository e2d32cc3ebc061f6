"""The service's Prometheus metrics (``GET /metrics``), in a registry of its own
(``prometheus-client``): requests by endpoint, model and status, their latency, the sentences of
each engine call (the batch sizes), the sentences waiting per model, engine errors; and the
access log (:class:`AccessLog`), which counts each request as it logs it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

log = logging.getLogger("jaxformer.serve")
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
ENDPOINTS = ("/translate", "/detect", "/languages", "/attention", "/health", "/metrics", "/models",
             "/frontend/settings", "/")   # the paths counted by name; any other is "other"
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


class Metrics:
    """The metrics of one service (every name starts ``jaxformer_``)."""

    def __init__(self):
        self.registry = CollectorRegistry()
        self.requests = Counter("jaxformer_requests", "HTTP requests answered",
                                ["endpoint", "model", "status"], registry=self.registry)
        self.latency = Histogram("jaxformer_request_seconds", "Time to answer a request",
                                 ["endpoint", "model"], buckets=LATENCY_BUCKETS, registry=self.registry)
        self.sentences = Counter("jaxformer_sentences", "Sentences translated", ["model"],
                                 registry=self.registry)
        self.batch = Histogram("jaxformer_batch_sentences", "Sentences per engine call", ["model"],
                               buckets=BATCH_BUCKETS, registry=self.registry)
        self.queue = Gauge("jaxformer_queue_sentences", "Sentences waiting for an engine call", ["model"],
                           registry=self.registry)
        self.errors = Counter("jaxformer_engine_errors", "Engine calls that failed", ["model"],
                              registry=self.registry)
        self.ready = Gauge("jaxformer_ready", "1 once every model is loaded and warmed up",
                           registry=self.registry)

    def watch_queue(self, model: str, waiting: Callable[[], int]) -> None:
        """The queue gauge of ``model`` reads ``waiting()`` when scraped."""
        self.queue.labels(model).set_function(waiting)

    def on_call(self, model: str) -> Callable[[int], None]:
        """What a batcher tells of each engine call of ``model``."""
        def observe(sentences: int) -> None:
            self.batch.labels(model).observe(sentences)
            self.sentences.labels(model).inc(sentences)
        return observe

    def on_error(self, model: str) -> Callable[[], None]:
        return self.errors.labels(model).inc

    def observe(self, endpoint: str, model: str, status: int, seconds: float) -> None:
        """One answered request."""
        self.requests.labels(endpoint, model, str(status)).inc()
        self.latency.labels(endpoint, model).observe(seconds)

    def text(self) -> bytes:
        """The exposition of every metric."""
        return generate_latest(self.registry)


class AccessLog:
    """ASGI middleware: one log line per request (client, method, path without its query string,
    status, milliseconds, model; the texts only with ``log_text``) and its metrics. A key is never
    logged."""

    def __init__(self, app, metrics: Metrics, log_text: bool = False):
        self.app, self.metrics, self.log_text = app, metrics, log_text

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started, status = time.perf_counter(), 500
        state = scope.setdefault("state", {})

        async def tracked(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, tracked)
        finally:
            self._record(scope, state, 499 if state.get("gone") else status, time.perf_counter() - started)

    def _record(self, scope, state: dict, status: int, seconds: float) -> None:
        path = scope["path"]
        endpoint = path if path in ENDPOINTS else "other"
        model = state.get("model", "")
        self.metrics.observe(endpoint, model, status, seconds)
        client = scope.get("client") or ("-", 0)
        line = f'{client[0]} "{scope["method"]} {path}" {status} {1000 * seconds:.1f} ms'
        if model:
            texts = state.get("texts") or []
            line += f" model={model} texts={len(texts)} chars={sum(map(len, texts))}"
            if self.log_text:
                line += f" q={texts!r} translated={state.get('translations')!r}"
        log.info(line)
