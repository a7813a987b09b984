"""Builders for the aggregator's parts tested alone (``tests/unit/test_agg_*.py``): a small FedAvg
federation and a link that records what is published instead of reaching a broker."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import methods
from fclcore.config import from_dict
from fclcore.schema import FederationSpec
from fclcore.strategy import Strategy
from fclcore.transport import WireMeter

FED, INPUT_DIM = "parts", 6


def federation(**rounds: object) -> tuple[FederationSpec, Strategy]:
    """A two-task FedAvg federation of a tiny MADE and its strategy (``rounds``: RoundSpec fields)."""
    spec = {
        "name": FED,
        "method": "fedavg",
        "num_tasks": 2,
        "rounds_per_task": 2,
        "model": {"hidden_sizes": [8]},
        "rounds": rounds,
    }
    _, _, fed = methods.resolve(from_dict(FederationSpec, spec, "test"), "test")
    return fed, methods.strategy_for(fed, INPUT_DIM)


@dataclass
class RecordingLink:
    """The part of ``MqttLink`` the outbox and the report use, recording each publish."""

    connects: int = 1
    sent: list[tuple[str, bytes, bool, str | None]] = field(default_factory=list)
    statuses: list[dict] = field(default_factory=list)
    status_fields: dict = field(default_factory=dict)
    meter: WireMeter = field(default_factory=WireMeter)

    def publish(self, topic: str, payload: bytes, *, retain: bool = False, tag: str | None = None) -> None:
        self.meter.record("up", topic, len(payload), tag)
        self.sent.append((topic, payload, retain, tag))

    def publish_status(self, state: str, **extra: object) -> None:
        self.status_fields.update(extra)
        self.statuses.append({"state": state, **self.status_fields})
        self.publish("status", json.dumps(self.statuses[-1]).encode(), retain=True, tag="status")
