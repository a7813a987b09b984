"""The live client set: which devices each round is run with.

A federation starts with the configured ``expected_clients``.  With ``enrollment: open`` a
device whose id the aggregator has not seen enrolls by coming online (its retained status):
it joins the roster of the next round announced.  A device that missed
``drop_after_missed`` rounds in a row leaves the roster (it enrolls again when it is back
online, if enrollment is open or it is one of the configured clients).  Every round has a
fixed roster, taken when the round opens: the quorum is a share of it, and only its
members' updates are accepted for that round.

The set is part of the committed state, so a restarted aggregator continues with the same
roster; the state fingerprint does not include it.
"""

from __future__ import annotations

import logging
from typing import Callable, Iterable, Sequence

log = logging.getLogger(__name__)


class ClientSet:
    def __init__(
        self,
        initial: Sequence[str],
        *,
        open_enrollment: bool = False,
        max_clients: int = 10_000,
        drop_after_missed: int | None = None,
        admit: Callable[[str], bool] = lambda client: True,
    ) -> None:
        """``admit(client)``: a last check before a new device enrolls (e.g. its signing key exists)."""
        self.initial = list(initial)
        self.open_enrollment = open_enrollment
        self.max_clients = max_clients
        self.drop_after_missed = drop_after_missed
        self.admit = admit
        self.enrolled: dict[str, int] = {c: 0 for c in initial}  # client -> first round of its membership
        self.missed: dict[str, int] = {}  # consecutive rounds missed
        self.known: list[str] = list(initial)  # every client ever enrolled, in order of first enrollment
        self.online: set[str] = set()
        self.waiting: list[str] = []  # online, not enrolled: they join the next roster

    def __contains__(self, client: object) -> bool:
        return client in self.enrolled

    def __len__(self) -> int:
        return len(self.enrolled)

    def on_status(self, client: str, state: str) -> None:
        if state != "online":
            self.online.discard(client)
            return
        self.online.add(client)
        rejoining = client in self.initial or client in self.known
        if client not in self.enrolled and client not in self.waiting and (self.open_enrollment or rejoining):
            self.waiting.append(client)

    def open_round(self, rnd: int) -> list[str]:
        """The roster of round ``rnd``: the enrolled clients, after enrolling those waiting."""
        for client in self.waiting:
            if client in self.enrolled or client not in self.online:
                continue
            if len(self.enrolled) >= self.max_clients:
                log.warning("client %s not enrolled: the federation has max_clients=%d", client, self.max_clients)
                continue
            if not self.admit(client):
                continue
            self.enrolled[client] = rnd
            self.missed.pop(client, None)
            if client not in self.known:
                self.known.append(client)
            log.info("client %s enrolled from round %d", client, rnd)
        self.waiting = []
        return self.roster()

    def roster(self) -> list[str]:
        """Enrolled clients, in the order they first enrolled (configured ones first)."""
        return [c for c in self.known if c in self.enrolled]

    def close_round(self, roster: Iterable[str], replied: Iterable[str]) -> list[str]:
        """Count who missed the round; those past ``drop_after_missed`` leave. Returns them."""
        replied = set(replied)
        left = []
        for client in roster:
            self.missed[client] = 0 if client in replied else self.missed.get(client, 0) + 1
            if self.drop_after_missed is not None and self.missed[client] >= self.drop_after_missed:
                del self.enrolled[client]
                left.append(client)
                log.info("client %s left the federation after missing %d rounds", client, self.missed[client])
        return left

    def state(self) -> dict:
        return {"enrolled": dict(self.enrolled), "missed": dict(self.missed), "known": list(self.known)}

    def restore(self, meta: dict) -> None:
        """Inverse of ``state`` (an empty ``meta``: the configured clients, as at the start)."""
        if not meta:
            return
        self.enrolled = {str(c): int(r) for c, r in meta["enrolled"].items()}
        self.missed = {str(c): int(n) for c, n in meta["missed"].items()}
        self.known = [str(c) for c in meta["known"]]
