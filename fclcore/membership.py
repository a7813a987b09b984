"""Per-device membership schedules: devices that enroll late and retire (docs/membership.md).

A federation may give a device one state per task (``federation.membership``)::

    client-0: "* * o o"     # active in tasks 0 and 1, retired from task 2
    client-1: "x * * *"     # enrolls at task 1

``x`` not yet enrolled, ``*`` active, ``o`` retired (its earlier contributions stay).  A
schedule only moves forward, x -> * -> o.  Devices that are not listed are always active.
The aggregator runs each round with the enrolled devices that are active in its task; a
device learns its own schedule from the federation spec in every round announcement.
"""

from __future__ import annotations

from typing import Mapping, Sequence

from fclcore.topics import validate_id

NOT_ENROLLED, ACTIVE, RETIRED = "x", "*", "o"
SYMBOLS = (NOT_ENROLLED, ACTIVE, RETIRED)  # in the only order a schedule may take them
PRESETS = ("fully", "decreasing", "increasing", "scattered")


class Membership:
    """A validated table ``client id -> schedule`` (one symbol per task, separated by spaces).

    ``clients``: the federation's configured client ids, when known; every key must be one of
    them and every one of them must be listed.  ValueError (one line naming the client and the
    task) for anything else."""

    def __init__(self, table: Mapping[str, str], num_tasks: int, clients: Sequence[str] | None = None) -> None:
        if not isinstance(table, Mapping) or not table:
            raise ValueError("membership: expected a mapping client id -> schedule such as '* * o', got nothing")
        self.num_tasks = num_tasks
        self.schedules: dict[str, tuple[str, ...]] = {
            client: _parse(client, schedule, num_tasks) for client, schedule in table.items()
        }
        if clients is not None:
            unknown = [c for c in self.schedules if c not in clients]
            if unknown:
                raise ValueError(f"membership: client {unknown[0]!r} is not a client of the federation")
            missing = [c for c in clients if c not in self.schedules]
            if missing:
                raise ValueError(f"membership: client {missing[0]!r} has no schedule (list every configured client)")
        for task in range(num_tasks):
            if not self.active(task):
                raise ValueError(f"membership: task {task} has no active client")

    @classmethod
    def of(cls, fed: object, clients: Sequence[str] | None = None) -> "Membership | None":
        """The table of a ``FederationSpec`` (None when it has none)."""
        table = getattr(fed, "membership", None)
        return None if table is None else cls(table, fed.num_tasks, clients)

    def table(self) -> dict[str, str]:
        """The schedules as written: ``{client: "x * o"}``."""
        return {c: " ".join(s) for c, s in self.schedules.items()}

    def listed(self, client: str) -> bool:
        return client in self.schedules

    def state(self, client: str, task: int) -> str:
        """``x``, ``*`` or ``o``: the client's state in ``task`` (``*`` for a client not listed)."""
        if not 0 <= task < self.num_tasks:
            raise ValueError(f"membership: task {task} is not in [0, {self.num_tasks})")
        schedule = self.schedules.get(client)
        return ACTIVE if schedule is None else schedule[task]

    def is_active(self, client: str, task: int) -> bool:
        return self.state(client, task) == ACTIVE

    def active(self, task: int) -> list[str]:
        """The listed clients active in ``task``, in table order."""
        return [c for c in self.schedules if self.state(c, task) == ACTIVE]

    def first_task(self, client: str) -> int:
        """The first task the client is active in (0 for a client not listed)."""
        schedule = self.schedules.get(client)
        return 0 if schedule is None else schedule.index(ACTIVE)

    def retired_from(self, client: str) -> int | None:
        """The first task in which the client is retired, or None if it never retires."""
        schedule = self.schedules.get(client)
        return schedule.index(RETIRED) if schedule is not None and RETIRED in schedule else None


def _parse(client: object, schedule: object, num_tasks: int) -> tuple[str, ...]:
    validate_id(client, "membership: client id")
    if not isinstance(schedule, str):
        raise ValueError(
            f"membership: client {client!r}: expected a string of {num_tasks} symbols x, * or o "
            f"separated by spaces, got {schedule!r}"
        )
    symbols = tuple(schedule.split())
    if len(symbols) != num_tasks:
        raise ValueError(
            f"membership: client {client!r}: expected {num_tasks} symbols (one per task), "
            f"got {len(symbols)} in {schedule!r}"
        )
    for task, symbol in enumerate(symbols):
        if symbol not in SYMBOLS:
            raise ValueError(
                f"membership: client {client!r}, task {task}: unknown symbol {symbol!r} "
                "(expected x not yet enrolled, * active, o retired)"
            )
        if task and SYMBOLS.index(symbol) < SYMBOLS.index(symbols[task - 1]):
            raise ValueError(
                f"membership: client {client!r}, task {task}: {symbols[task - 1]!r} -> {symbol!r} goes back "
                "(a schedule only moves x -> * -> o)"
            )
    if ACTIVE not in symbols:
        raise ValueError(f"membership: client {client!r}: never active (no '*' in {schedule!r})")
    return symbols


def preset(name: str, clients: Sequence[str], num_tasks: int) -> dict[str, str]:
    """One of the FIL-VER enrollment scenarios as a table.  Client i gets the slot
    ``s = i * num_tasks // len(clients)``:

    * ``fully``: active in every task;
    * ``decreasing``: active in tasks <= s, then retired;
    * ``increasing``: enrolls at task s, active to the end;
    * ``scattered``: active in task s only.

    (With fewer clients than tasks a task may be left without a client: ``Membership``
    rejects such a table.)"""
    if name not in PRESETS:
        raise ValueError(f"membership: unknown preset {name!r} (expected one of {', '.join(PRESETS)})")
    table = {}
    for i, client in enumerate(clients):
        slot = i * num_tasks // len(clients)
        symbols = [_preset_state(name, slot, task) for task in range(num_tasks)]
        table[client] = " ".join(symbols)
    return table


def _preset_state(name: str, slot: int, task: int) -> str:
    if name == "fully":
        return ACTIVE
    if name == "decreasing":
        return ACTIVE if task <= slot else RETIRED
    if task < slot:
        return NOT_ENROLLED
    if name == "increasing" or task == slot:
        return ACTIVE
    return RETIRED
