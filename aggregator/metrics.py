"""Prometheus metrics of the aggregator service (``prometheus-client``, the ``service`` extra).

One ``AggregatorMetrics`` per service, with its own registry (so tests and several
federations in one process never collide with the global default registry), served on
``addr:port`` when a port is configured.  The default address is loopback: put a reverse
proxy or an SSH tunnel in front rather than exposing the endpoint.

The federation's series live in the registry; the per-device ones in ``devices`` (a
``DeviceBook``, which writes its own exposition text: see ``aggregator.fleet_metrics``).
The endpoint serves both, gzipped when the scraper asks for it.  Every series and what it
means: docs/monitoring.md.

Without a port nothing listens; without prometheus-client installed and no port, every
method is a no-op, so the round loop calls them unconditionally.

Wiring::

    metrics = AggregatorMetrics(fed.name, cfg.metrics_port, ...)  # service.py, __init__
    metrics.configure(total_rounds, deadline_s)                   # service.py, __init__
    metrics.round_started(rnd, task, roster)                      # service.py, before the announcement
    metrics.round_done(rnd, task, accepted, duration_s)           # report.py, RunReport.record
    metrics.add_bytes(up=..., down=..., dense_up=..., dense_down=...)  # RunReport.record
    metrics.learning(...)                                         # RunReport.record and .summary
    metrics.rejected(rejection.reason)                            # intake.py, Intake.reject
    metrics.clients_online(len(self.online & expected))           # Intake, on a status message
    metrics.devices.*                                             # Intake and RunReport, per device
    metrics.run_failed()                                          # service.py, the failure announced
    metrics.close()                                               # run()'s finally
"""

from __future__ import annotations

import gzip
import logging
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from aggregator.fleet_metrics import DeviceBook
from fclcore.errors import ConfigError

log = logging.getLogger(__name__)

# Round latency runs from a second (8x8 digits) to many minutes (slow devices, deadlines).
LATENCY_BUCKETS = (0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300, 600, 1800, 3600)
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class AggregatorMetrics:
    def __init__(
        self,
        federation: str,
        port: int | None = None,
        addr: str = "127.0.0.1",
        registry: Any = None,
        max_devices: int = 10_000,
        linger_s: float = 0.0,
        stop: threading.Event | None = None,
    ) -> None:
        """``linger_s``: at ``close``, keep serving this long (unless ``stop`` is set), so a
        scrape sees how the run ended."""
        self.federation = federation
        self.devices = DeviceBook(federation, max_devices)
        self.linger_s, self.stop = linger_s, stop or threading.Event()
        self._server: ThreadingHTTPServer | None = None
        try:
            import prometheus_client as prom
        except ImportError:
            if port is not None:
                raise ConfigError(
                    "metrics_port is set but prometheus-client is not installed: pip install 'fcl-edge[service]'"
                ) from None
            self.registry = None
            return
        self._prom = prom
        self.registry = registry if registry is not None else prom.CollectorRegistry()
        self._make(prom)
        if port is not None:
            self._serve(port, addr)

    def _make(self, prom: Any) -> None:
        fed, reg = ["federation"], self.registry
        self._rounds = prom.Counter("fcl_rounds", "Rounds aggregated", fed, registry=reg)
        self._accepted = prom.Counter("fcl_accepted_updates", "Client updates aggregated", fed, registry=reg)
        self._clients = prom.Gauge(
            "fcl_clients_connected", "Expected clients whose status is online", fed, registry=reg
        )
        self._up = prom.Counter(
            "fcl_bytes_up", "MQTT PUBLISH bytes of client uploads (clients to aggregator)", fed, registry=reg
        )
        self._down = prom.Counter(
            "fcl_bytes_down",
            "MQTT PUBLISH bytes delivered to clients "
            "(round announcements and per-client frames, counted once per client)",
            fed,
            registry=reg,
        )
        self._dense = prom.Counter(
            "fcl_dense_reference_bytes",
            "What the same rounds would send as dense float32 FedAvg of the trained tensors (the reference)",
            fed + ["direction"],
            registry=reg,
        )
        self._rejected = prom.Counter(
            "fcl_rejected_updates", "Messages dropped by validation, by reason", fed + ["reason"], registry=reg
        )
        self._latency = prom.Histogram(
            "fcl_round_latency_seconds",
            "From a round's announcement to its aggregation",
            fed,
            buckets=LATENCY_BUCKETS,
            registry=reg,
        )
        self._round = prom.Gauge("fcl_current_round", "The round in progress (or last finished)", fed, registry=reg)
        self._task = prom.Gauge("fcl_current_task", "The task of the round in progress", fed, registry=reg)
        self._make_run(prom, fed, reg)
        self._make_learning(prom, fed, reg)

    def _make_run(self, prom: Any, fed: list[str], reg: Any) -> None:
        self._total = prom.Gauge("fcl_total_rounds", "Rounds the federation runs", fed, registry=reg)
        self._deadline = prom.Gauge(
            "fcl_round_deadline_seconds", "A round attempt's deadline (federation.rounds.deadline_s)", fed, registry=reg
        )
        self._roster = prom.Gauge("fcl_round_roster", "Devices the round in progress is run with", fed, registry=reg)
        self._started = prom.Gauge(
            "fcl_round_started_timestamp_seconds", "Unix time the round in progress was opened", fed, registry=reg
        )
        self._closed = prom.Gauge(
            "fcl_round_closed_timestamp_seconds", "Unix time the last round closed (0: none yet)", fed, registry=reg
        )
        self._failed = prom.Gauge(
            "fcl_run_failed", "1 once the run failed (a round missed its quorum)", fed, registry=reg
        )
        for gauge in (self._started, self._closed, self._failed):
            gauge.labels(self.federation).set(0)

    def _make_learning(self, prom: Any, fed: list[str], reg: Any) -> None:
        self._task_metric = prom.Gauge(
            "fcl_task_metric",
            "The fleet's mean test metric per task (NLL in nats, or accuracy) in the latest evaluation that scored it",
            fed + ["task", "metric"],
            registry=reg,
        )
        self._average = prom.Gauge(
            "fcl_learning_average",
            "Mean over the tasks ended so far of the fleet's metric after the latest one (summary.json fleet)",
            fed + ["metric"],
            registry=reg,
        )
        self._forgetting = prom.Gauge(
            "fcl_learning_forgetting",
            "Forgetting over the tasks ended so far, as summary.json's fleet defines it",
            fed + ["metric"],
            registry=reg,
        )
        self._tasks_ended = prom.Gauge(
            "fcl_learning_tasks_ended", "Tasks whose end evaluation the learning gauges include", fed, registry=reg
        )

    def _serve(self, port: int, addr: str) -> None:
        if not 0 <= port <= 65535:
            raise ConfigError(f"metrics_port: expected 0-65535, got {port}")
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                if self.path.split("?", 1)[0] not in ("/", "/metrics"):
                    self.send_error(404)
                    return
                body = owner.exposition()
                self.send_response(200)
                self.send_header("Content-Type", CONTENT_TYPE)
                if "gzip" in self.headers.get("Accept-Encoding", ""):
                    body = gzip.compress(body, compresslevel=1)
                    self.send_header("Content-Encoding", "gzip")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:
                pass  # a scrape every few seconds is not news

        try:
            self._server = ThreadingHTTPServer((addr, port), Handler)
        except OSError as exc:
            raise ConfigError(f"metrics_port: cannot listen on {addr}:{port}: {exc.strerror or exc}") from None
        self._server.daemon_threads = True
        threading.Thread(target=self._server.serve_forever, name="metrics", daemon=True).start()
        log.info("Prometheus metrics on http://%s:%d/metrics", addr, self.port)

    def exposition(self) -> bytes:
        """The scrape's text: the federation's series, then every device's."""
        return self._prom.generate_latest(self.registry) + self.devices.render().encode()

    @property
    def enabled(self) -> bool:
        return self.registry is not None

    @property
    def port(self) -> int | None:
        """The port actually bound (useful with port 0), or None when nothing listens."""
        return self._server.server_port if self._server is not None else None

    # -- events from the round loop ------------------------------------------------------------
    def configure(self, total_rounds: int, deadline_s: float) -> None:
        if self.enabled:
            self._total.labels(self.federation).set(total_rounds)
            self._deadline.labels(self.federation).set(deadline_s)

    def round_started(self, round: int, task: int, roster: int | None = None) -> None:
        if self.enabled:
            self._round.labels(self.federation).set(round)
            self._task.labels(self.federation).set(task)
            if roster is not None:
                self._roster.labels(self.federation).set(roster)
                self._started.labels(self.federation).set(time.time())

    def round_done(self, round: int, task: int, accepted: int, duration_s: float) -> None:
        self.devices.closed_round = max(self.devices.closed_round, round)
        if not self.enabled:
            return
        self.round_started(round, task)
        self._rounds.labels(self.federation).inc()
        self._accepted.labels(self.federation).inc(max(0, accepted))
        self._latency.labels(self.federation).observe(max(0.0, duration_s))
        self._closed.labels(self.federation).set(time.time())

    def add_bytes(self, up: int = 0, down: int = 0, dense_up: int = 0, dense_down: int = 0) -> None:
        if self.enabled:
            self._up.labels(self.federation).inc(max(0, up))
            self._down.labels(self.federation).inc(max(0, down))
            self._dense.labels(self.federation, "up").inc(max(0, dense_up))
            self._dense.labels(self.federation, "down").inc(max(0, dense_down))

    def learning(self, metric: str, per_task: dict[int, float], scores: dict | None, tasks_ended: int) -> None:
        """The latest per-task means; ``scores``: the continual metrics of the tasks ended so far
        (``RunLog.fleet_scores``: ``avg_nll`` or ``avg_accuracy``, ``forgetting``), if any."""
        if not self.enabled:
            return
        for task, value in per_task.items():
            self._task_metric.labels(self.federation, str(task), metric).set(value)
        average = (scores or {}).get("avg_nll" if metric == "nll" else "avg_accuracy")
        if average is not None:
            self._average.labels(self.federation, metric).set(average)
            self._forgetting.labels(self.federation, metric).set(scores.get("forgetting") or 0.0)
            self._tasks_ended.labels(self.federation).set(tasks_ended)

    def rejected(self, reason: str) -> None:
        if self.enabled:
            self._rejected.labels(self.federation, reason).inc()

    def clients_online(self, n: int) -> None:
        if self.enabled:
            self._clients.labels(self.federation).set(n)

    def run_failed(self) -> None:
        if self.enabled:
            self._failed.labels(self.federation).set(1)

    def close(self) -> None:
        """Stop the HTTP server and free the port (the service calls this on shutdown), after
        ``linger_s`` unless the service is being stopped."""
        if self._server is not None:
            if self.linger_s > 0:
                self.stop.wait(self.linger_s)
            self._server.shutdown()
            self._server.server_close()
            self._server = None
