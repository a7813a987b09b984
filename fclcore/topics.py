"""MQTT topic layout of a federation; the one place that spells topic strings.

    fcl/<fed>/round              aggregator -> clients, retained: ROUND and FINISH frames
    fcl/<fed>/update/<client>    client -> aggregator: UPDATE and EVAL frames
    fcl/<fed>/status/<who>       retained JSON status, last-will "dead" ("aggregator" or a client id)
    fcl/<fed>/kb/<client>        aggregator -> one client, retained: its knowledge-base entries
    fcl/<fed>/kb/<client>/full   aggregator -> one client, retained: the same, every entry carried
                                 (subscribed only while the device lacks an entry it should hold)
    fcl/<fed>/model/<which>      aggregator -> devices that must resync, retained: the global
                                 model, ``full`` or ``catchup`` (subscribed only while needed)
    fcl/<fed>/nack/<client>      aggregator -> one client, NOT retained: JSON, why a frame of
                                 its was dropped (``aggregator.nacks``, docs/protocol.md)
    fcl/<fed>/down/<client>      aggregator -> one client that decodes less than everything
                                 (protocol 4), retained: ROUND and FINISH made for it; REQUEST
                                 (not retained); it reads this instead of ``round`` (P-CAP)

A device's ACL can then grant it write access to its own ``update`` and ``status`` topics
and read access to ``round``, ``model/+`` and its own ``kb``, ``nack`` and ``down`` topics only.
"""

from __future__ import annotations

import re

ROOT = "fcl"
AGGREGATOR_ID = "aggregator"
_ID = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")


def validate_id(value: str, what: str) -> str:
    """Federation and client ids become topic levels: no wildcards, no slashes."""
    if not isinstance(value, str) or not _ID.match(value):
        raise ValueError(f"{what}: expected 1-64 characters from [A-Za-z0-9_.-], got {value!r}")
    return value


def round_topic(fed: str) -> str:
    return f"{ROOT}/{fed}/round"


def update_topic(fed: str, client: str) -> str:
    return f"{ROOT}/{fed}/update/{client}"


def status_topic(fed: str, who: str) -> str:
    return f"{ROOT}/{fed}/status/{who}"


def knowledge_topic(fed: str, client: str) -> str:
    return f"{ROOT}/{fed}/kb/{client}"


def knowledge_full_topic(fed: str, client: str) -> str:
    return f"{ROOT}/{fed}/kb/{client}/full"


def model_topic(fed: str, which: str) -> str:
    return f"{ROOT}/{fed}/model/{which}"


def downlink_topic(fed: str, client: str) -> str:
    return f"{ROOT}/{fed}/down/{client}"


def nack_topic(fed: str, client: str) -> str:
    return f"{ROOT}/{fed}/nack/{client}"


def update_filter(fed: str) -> str:
    return f"{ROOT}/{fed}/update/+"


def status_filter(fed: str) -> str:
    return f"{ROOT}/{fed}/status/+"


def parse_update_topic(fed: str, topic: str) -> str | None:
    """The client id of an update topic of this federation, or None."""
    return _last_level(f"{ROOT}/{fed}/update/", topic)


def parse_status_topic(fed: str, who_topic: str) -> str | None:
    """Who a status topic of this federation is about, or None."""
    return _last_level(f"{ROOT}/{fed}/status/", who_topic)


def _last_level(prefix: str, topic: str) -> str | None:
    if not topic.startswith(prefix):
        return None
    rest = topic[len(prefix) :]
    return rest if _ID.match(rest) else None
