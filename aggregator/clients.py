"""The live client set: which devices each round is run with.

A federation starts with the configured ``expected_clients``.  With ``enrollment: open`` a
device whose id the aggregator has not seen enrolls by coming online (its retained status):
it joins the roster of the next round announced.  A device that missed
``drop_after_missed`` rounds in a row leaves the roster (it enrolls again when it is back
online, if enrollment is open or it is one of the configured clients).  Every round has a
fixed roster, taken when the round opens: the quorum is a share of it, and only its
members' updates are accepted for that round.

With a membership table (``fclcore.membership``) the roster of a round is the enrolled
clients active in the round's task; a client is removed for good when a task starts in which
it is retired (its retained "online" status never enrolls it again).  ``changes`` lists what
the last ``open_round`` did: ``(client, "retired")``, and ``(client, "enrolled")`` the first
time a client that enrolls after task 0 is in a roster.

The set is part of the committed state, so a restarted aggregator continues with the same
roster; the state fingerprint does not include it.
"""

from __future__ import annotations

import logging
from typing import Callable, Iterable, Sequence

from fclcore.membership import Membership

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
        membership: Membership | None = None,
    ) -> None:
        """``admit(client)``: a last check before a new device enrolls (e.g. its signing key exists);
        ``membership``: who is active in which task (None: everyone, always)."""
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
        self.membership = membership
        self.retired: list[str] = []  # retired by the membership table: never enrolled again
        self.activated: list[str] = []  # late clients that have been in a roster
        self.changes: list[tuple[str, str]] = []  # (client, "retired" | "enrolled") of the last open_round

    def __contains__(self, client: object) -> bool:
        return client in self.enrolled

    def __len__(self) -> int:
        return len(self.enrolled)

    def on_status(self, client: str, state: str) -> None:
        if state != "online":
            self.online.discard(client)
            return
        self.online.add(client)
        if client in self.retired:
            return
        rejoining = client in self.initial or client in self.known
        if client not in self.enrolled and client not in self.waiting and (self.open_enrollment or rejoining):
            self.waiting.append(client)

    def open_round(self, rnd: int, task: int = 0) -> list[str]:
        """The roster of round ``rnd`` (of task ``task``): the enrolled clients active in the task,
        after retiring those the membership table retires and enrolling those waiting."""
        self.changes = []
        if self.membership is not None:
            for client in self.membership.schedules:
                if self.membership.state(client, task) == "o" and client not in self.retired:
                    self.retired.append(client)
                    self.enrolled.pop(client, None)
                    self.missed.pop(client, None)
                    self.changes.append((client, "retired"))
                    log.info("client %s retired from task %d", client, task)
        for client in self.waiting:
            if client in self.enrolled or client not in self.online or client in self.retired:
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
        roster = self.roster(task)
        if self.membership is not None:
            for client in roster:
                if self.membership.first_task(client) > 0 and client not in self.activated:
                    self.activated.append(client)
                    self.changes.append((client, "enrolled"))
        return roster

    def roster(self, task: int | None = None) -> list[str]:
        """Enrolled clients, in the order they first enrolled (configured ones first); with
        ``task`` and a membership table, only those active in that task."""
        return [c for c in self.known if c in self.enrolled and self.active(c, task)]

    def active(self, client: str, task: int | None) -> bool:
        """Whether the membership table lets ``client`` take part in ``task`` (None: any task)."""
        return task is None or self.membership is None or self.membership.is_active(client, task)

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
        return {
            "enrolled": dict(self.enrolled),
            "missed": dict(self.missed),
            "known": list(self.known),
            "retired": list(self.retired),
            "activated": list(self.activated),
        }

    def restore(self, meta: dict) -> None:
        """Inverse of ``state`` (an empty ``meta``: the configured clients, as at the start)."""
        if not meta:
            return
        self.enrolled = {str(c): int(r) for c, r in meta["enrolled"].items()}
        self.missed = {str(c): int(n) for c, n in meta["missed"].items()}
        self.known = [str(c) for c in meta["known"]]
        self.retired = [str(c) for c in meta.get("retired", [])]  # absent in state written before membership
        self.activated = [str(c) for c in meta.get("activated", [])]
