"""The aggregator's NACKs, read on the device: why a frame of this device was dropped.

Each NACK (``aggregator.nacks``; docs/protocol.md, "Rejections (NACK)") is checked like any
input from the network, logged once (a re-sent update rejected again for the same reason is
not logged again), and the last one goes into the device's retained status (``nack``, which
``fcl status`` shows) and its control socket's status.
"""

from __future__ import annotations

import json
import logging

log = logging.getLogger("edge_client.daemon")  # its parts log as the daemon did before the split
MAX_NACK_BYTES = 4096
MAX_LOGGED = 256  # distinct NACKs remembered as logged; older ones may be logged again
_INT_OR_NULL = ("round", "sequence", "mark", "open_round")


def parse_nack(payload: bytes) -> dict | None:
    """A NACK as a dict with checked fields, or None for anything else (P-NACK-2)."""
    if len(payload) > MAX_NACK_BYTES:
        return None
    try:
        raw = json.loads(payload)
    except (ValueError, RecursionError):
        return None
    if not isinstance(raw, dict) or not _word(raw.get("reason")) or not isinstance(raw.get("detail"), str):
        return None
    if any(not _int_or_null(raw.get(k)) for k in _INT_OR_NULL) or not (raw.get("kind") is None or _word(raw["kind"])):
        return None
    versions = raw.get("versions")
    return {
        "run": raw.get("run") if isinstance(raw.get("run"), str) else None,
        "round": raw.get("round"),
        "kind": raw.get("kind"),
        "sequence": raw.get("sequence"),
        "reason": raw["reason"],
        "detail": "".join(c if c.isprintable() else "?" for c in raw["detail"][:200]),
        "mark": raw.get("mark"),
        "versions": [v for v in versions if _int_or_null(v) and v is not None][:16]
        if isinstance(versions, list)
        else [],
    }


class NackLog:
    def __init__(self, link) -> None:
        self.link = link
        self.last: dict | None = None
        self.logged: list[tuple] = []

    def take(self, payload: bytes, run: str | None) -> dict | None:
        """A NACK for this device (None if it is garbage or of another run): logged once, kept as
        the last, and put into the retained status."""
        nack = parse_nack(payload)
        if nack is None or (run is not None and nack["run"] not in (None, run)):
            log.warning("ignored a NACK that is not one of this run: %r", payload[:120])
            return None
        key = (nack["round"], nack["kind"], nack["sequence"], nack["reason"])
        if key not in self.logged:
            self.logged = [*self.logged[-(MAX_LOGGED - 1) :], key]
            where = f"{nack['kind']} for round {nack['round']}" if nack["kind"] else "a frame"
            log.warning("the aggregator dropped %s: %s: %s", where, nack["reason"], nack["detail"])
        self.last = nack
        self.link.publish_status("online", nack={k: nack[k] for k in ("round", "kind", "sequence", "reason", "detail")})
        return nack


def _word(value: object) -> bool:
    return isinstance(value, str) and 0 < len(value) <= 32 and value.replace("-", "").replace("_", "").isalnum()


def _int_or_null(value: object) -> bool:
    return value is None or (isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2**64)
