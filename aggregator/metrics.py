"""Prometheus metrics of the aggregator service (``prometheus-client``, the ``service`` extra).

One ``AggregatorMetrics`` per service, with its own registry (so tests and several
federations in one process never collide with the global default registry), served on
``addr:port`` when a port is configured.  The default address is loopback: put a reverse
proxy or an SSH tunnel in front rather than exposing the endpoint.

Without a port nothing listens; without prometheus-client installed and no port, every
method is a no-op, so the round loop calls them unconditionally.

Wiring (see the report of issue 7)::

    metrics = AggregatorMetrics(fed.name, cfg.metrics_port)      # service.py, __init__
    metrics.round_started(rnd, task)                              # service.py, before the announcement
    metrics.round_done(rnd, task, accepted, duration_s)           # report.py, RunReport.record
    metrics.add_bytes(up=sum_up, down=sum_down)                   # RunReport.record, runlog's numbers
    metrics.rejected(rejection.reason)                            # intake.py, Intake.reject
    metrics.clients_online(len(self.online & expected))           # Intake, on a status message
    metrics.close()                                               # run()'s finally
"""

from __future__ import annotations

import logging
from typing import Any

from fclcore.errors import ConfigError

log = logging.getLogger(__name__)

# Round latency runs from a second (8x8 digits) to many minutes (slow devices, deadlines).
LATENCY_BUCKETS = (0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300, 600, 1800, 3600)


class AggregatorMetrics:
    def __init__(self, federation: str, port: int | None = None, addr: str = "127.0.0.1", registry: Any = None) -> None:
        self.federation = federation
        self._server = None
        try:
            import prometheus_client as prom
        except ImportError:
            if port is not None:
                raise ConfigError(
                    "metrics_port is set but prometheus-client is not installed: pip install 'fcl-edge[service]'"
                ) from None
            self.registry = None
            return
        self.registry = registry if registry is not None else prom.CollectorRegistry()
        self._make(prom)
        if port is not None:
            self._serve(prom, port, addr)

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

    def _serve(self, prom: Any, port: int, addr: str) -> None:
        if not 0 <= port <= 65535:
            raise ConfigError(f"metrics_port: expected 0-65535, got {port}")
        try:
            self._server, _thread = prom.start_http_server(port, addr=addr, registry=self.registry)
        except OSError as exc:
            raise ConfigError(f"metrics_port: cannot listen on {addr}:{port}: {exc.strerror or exc}") from None
        log.info("Prometheus metrics on http://%s:%d/metrics", addr, self.port)

    @property
    def enabled(self) -> bool:
        return self.registry is not None

    @property
    def port(self) -> int | None:
        """The port actually bound (useful with port 0), or None when nothing listens."""
        return self._server.server_port if self._server is not None else None

    # -- events from the round loop ------------------------------------------------------------
    def round_started(self, round: int, task: int) -> None:
        if self.enabled:
            self._round.labels(self.federation).set(round)
            self._task.labels(self.federation).set(task)

    def round_done(self, round: int, task: int, accepted: int, duration_s: float) -> None:
        if not self.enabled:
            return
        self.round_started(round, task)
        self._rounds.labels(self.federation).inc()
        self._accepted.labels(self.federation).inc(max(0, accepted))
        self._latency.labels(self.federation).observe(max(0.0, duration_s))

    def add_bytes(self, up: int = 0, down: int = 0) -> None:
        if self.enabled:
            self._up.labels(self.federation).inc(max(0, up))
            self._down.labels(self.federation).inc(max(0, down))

    def rejected(self, reason: str) -> None:
        if self.enabled:
            self._rejected.labels(self.federation, reason).inc()

    def clients_online(self, n: int) -> None:
        if self.enabled:
            self._clients.labels(self.federation).set(n)

    def close(self) -> None:
        """Stop the HTTP server and free the port (the service calls this on shutdown)."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
