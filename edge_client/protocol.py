"""The device's half of the round protocol that needs no state: what a downlink frame must be
before anything acts on it, which run it belongs to, where its round sits in the schedule, and
this device's membership in a task.  Every check raises ``RejectedFrame``, whose message starts
with the reason the daemon counts (its updates report ``rejected`` by reason)."""

from __future__ import annotations

from typing import Callable

import methods
from fclcore import topics
from fclcore.codec import CodecError, CodecLimits, Frame, Header, Kind, decode
from fclcore.config import from_dict
from fclcore.membership import ACTIVE, Membership
from fclcore.runid import check_run_id
from fclcore.schedule import RoundPlace
from fclcore.schema import FederationSpec

DOWNLINK = (Kind.ROUND, Kind.FINISH, Kind.KNOWLEDGE, Kind.REQUEST, Kind.MODEL)
# frames that carry no federation settings: they are checked against the ones the device holds
_WITHOUT_SETTINGS = (Kind.KNOWLEDGE, Kind.REQUEST, Kind.MODEL)


class RejectedFrame(ValueError):
    """A downlink message that must be dropped; the message says why."""


def no_tensors(header: Header) -> bool:
    """For ``decode``: check a frame's tensors without keeping them."""
    return False


def check_downlink(
    payload: bytes,
    federation: str,
    limits: CodecLimits,
    keeps_tensors: Callable[[Header], bool],
    fed: FederationSpec | None,
    input_dim: int | None,
    tasks_on_device: int | None,
) -> tuple[Frame, FederationSpec | None]:
    """Validate a downlink frame without touching any state: the frame and the federation
    settings it is read under (its own for a round or the end, else ``fed``, those held).
    ``tasks_on_device``: how many tasks this device's data has (None: tasks arrive as folders)."""
    try:
        # a device's own frame for a task not yet started is only stored (raw): checked, not kept decoded
        frame = decode(payload, limits, keeps_tensors)
    except CodecError as exc:
        raise RejectedFrame(f"codec: {exc}") from None
    h = frame.header
    if h.federation != federation or h.client != topics.AGGREGATOR_ID:
        raise RejectedFrame(f"sender: {h.client!r} of {h.federation!r} is not this federation's aggregator")
    if h.kind not in DOWNLINK:
        raise RejectedFrame(f"kind: {h.kind.name} is not a downlink message")
    if h.kind in _WITHOUT_SETTINGS:
        return frame, fed
    try:
        fed = from_dict(FederationSpec, frame.meta.get("federation"), "round message", "federation")
        _, _, fed = methods.resolve(fed, "round message")  # as the aggregator resolved it: one value dtype
        Membership.of(fed)
    except ValueError as exc:  # ConfigError, or a bad membership table
        raise RejectedFrame(f"federation: {exc}") from None
    dim = frame.meta.get("input_dim")
    if not isinstance(dim, int) or isinstance(dim, bool) or dim < 1 or (input_dim is not None and dim != input_dim):
        raise RejectedFrame(f"input_dim: model expects {dim!r}, this device's data has {input_dim}")
    if tasks_on_device is not None and tasks_on_device < fed.num_tasks:
        raise RejectedFrame(f"tasks: federation has {fed.num_tasks} tasks, this device has {tasks_on_device}")
    places(frame)  # the schedule is checked before anything acts on the frame
    return frame, fed


def run_of(frame: Frame) -> str:
    """The run a downlink frame belongs to (every aggregator frame names it)."""
    try:
        return check_run_id(frame.meta.get("run"))
    except ValueError as exc:
        raise RejectedFrame(str(exc)) from None


def places(frame: Frame) -> tuple[RoundPlace, RoundPlace | None]:
    """(this round's place in the task schedule, the previous round's), from the round message."""
    schedule = frame.meta.get("schedule")
    try:
        place = RoundPlace.from_meta(schedule, frame.header.task)
        previous = schedule.get("previous")
        before = (
            None
            if previous is None
            else RoundPlace.from_meta(previous, previous.get("task") if isinstance(previous, dict) else -1)
        )
    except ValueError as exc:
        raise RejectedFrame(str(exc)) from None
    return place, before


def membership_state(fed: FederationSpec, client_id: str, task: int) -> str:
    """This device's state in ``task`` by the federation's membership table (checked in ``check_downlink``)."""
    try:
        table = Membership.of(fed)
        return ACTIVE if table is None else table.state(client_id, task)
    except ValueError as exc:
        raise RejectedFrame(f"federation: {exc}") from None
