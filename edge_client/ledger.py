"""Every byte a device meters, attributed: to the round row of ``metrics.jsonl`` that counts it
(the aggregator's ``round_client`` row of this device and that round), or to a run-level kind.

The device's meter tags each message it receives by what it is (``downlink_tag``) and each one
it sends by what it sends (``update:<round>``, ``resend:<round>``, ``eval:<round>``, ``status``).
A round's row counts, up, the round's update; down, the announcement the device acted on, its
own frames for the round and the sync frames its update reports (``RoundLedger.counted``,
``RoundLedger.reported``).  Whatever else the meter holds is run-level, by kind: statuses, the
final EVAL and FINISH, re-sent updates, re-announcements seen again, requests, sync frames no
update reported, deleted retained messages.  ``run_level`` + the rows = the meter, exactly.
"""

from __future__ import annotations

from collections import Counter

from fclcore.chunks import CHUNK_MAGIC
from fclcore.codec import MAGIC, Kind

ROW_UP = "update"  # the up tag whose bytes the round rows count (one per round)
_KIND_AT = len(MAGIC) + 1  # the header's kind byte follows the magic and the version


def downlink_tag(aggregator_status_topic: str):
    """The meter's ``classify`` for a device: ``status`` (the aggregator's), ``clear`` (an empty
    payload: a retained message deleted), the frame's kind in lower case (``round``, ``finish``,
    ``request``, ``knowledge``, ``model``; a chunk of a frame or its manifest by the frame's kind,
    which it carries at the same place), or ``unreadable``.  It reads one header byte and never
    raises: validating is the daemon's work."""

    def tag(topic: str, payload: bytes) -> str:
        if topic == aggregator_status_topic:
            return "status"
        if not payload:
            return "clear"
        if payload[: len(MAGIC)] not in (MAGIC, CHUNK_MAGIC) or len(payload) <= _KIND_AT:
            return "unreadable"
        try:
            return Kind(payload[_KIND_AT]).name.lower()
        except ValueError:
            return "unreadable"

    return tag


class RoundLedger:
    """What each round's row counts of the bytes this device received, by kind."""

    def __init__(self) -> None:
        self.rows: dict[int, Counter[str]] = {}  # round -> down bytes by tag its row counts
        self.synced = 0  # the sync frames' bytes reported so far (``ModelReplica`` totals["bytes"])

    def counted(self, rnd: int, announcement: int, own: int) -> None:
        """Round ``rnd``'s row counts the announcement the device acted on and its own frames."""
        self.rows[rnd] = Counter(round=announcement, knowledge=own)

    def reported(self, rnd: int, sync: dict) -> None:
        """The update of ``rnd`` reports the sync frames fetched so far: its row counts the new ones."""
        total = int(sync.get("bytes", 0))
        if total > self.synced:
            self.rows.setdefault(rnd, Counter())["model"] += total - self.synced
        self.synced = total

    def bytes_down(self) -> dict[int, int]:
        return {rnd: sum(kinds.values()) for rnd, kinds in self.rows.items()}

    def run_level(self, meter: dict) -> dict:
        """The bytes no round row counts, by direction and kind (a tag's text before its ``:``),
        and those the meter holds without a tag (``untagged``: none on a device)."""
        out: dict = {"up": Counter(), "down": Counter()}
        for key, count in meter["by_tag"].items():
            direction, tag = key.split(":", 1)
            kind = tag.split(":", 1)[0]
            if not (direction == "up" and kind == ROW_UP):
                out[direction][kind] += count["bytes"]
        for kinds in self.rows.values():
            out["down"].subtract(kinds)
        tagged = {d: sum(c["bytes"] for k, c in meter["by_tag"].items() if k.startswith(d + ":")) for d in out}
        return {
            **{d: {k: n for k, n in sorted(c.items()) if n} for d, c in out.items()},
            "untagged": {d: meter[d]["bytes"] - tagged[d] for d in out},
        }
