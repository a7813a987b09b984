"""The device's own downlink frames (``edge_client.frames.ClientFrames``) alone, without a broker:
which frames it keeps and where, the full-frame fetch a learner's gap starts and ends, the bytes
each round counts, and which frames survive a change of run."""

from __future__ import annotations

import numpy as np
import pytest

from edge_client.frames import ClientFrames
from edge_client.protocol import RejectedFrame
from edge_client.state import ClientStateStore
from fclcore.codec import CodecLimits, Frame, Header, Kind, decode, encode

OWN, FULL = "fcl/fed/kb/dev-1", "fcl/fed/kb/dev-1/full"
RUN_A, RUN_B = "000000000000000a-00000001", "000000000000000b-00000001"


class Link:
    """What ClientFrames asks of a link: topic subscriptions, recorded."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []

    def subscribe(self, topic: str) -> None:
        self.calls.append(("subscribe", topic))

    def unsubscribe(self, topic: str) -> None:
        self.calls.append(("unsubscribe", topic))


class Learner:
    """A learner that lacks the entries named in ``missing`` unless the frame carries them."""

    def __init__(self, missing: set[str]) -> None:
        self.missing = missing

    def lacks(self, frame: Frame) -> list[str]:
        return sorted(m for m in self.missing if m not in frame.tensors)


def payload(task: int, rnd: int = 0, run: str = RUN_A, carries: tuple[str, ...] = (), **meta) -> bytes:
    header = Header(Kind.KNOWLEDGE, "fed", rnd, task, "aggregator", 1)
    tensors = {name: np.ones(2, np.float32) for name in carries}
    return encode(Frame(header, {"run": run, **meta}, tensors))


@pytest.fixture
def frames(tmp_path):
    link = Link()
    got = ClientFrames("dev-1", OWN, FULL, ClientStateStore(tmp_path), link, CodecLimits())
    return got, link


def round_frame(client_frames: object, task: int, rnd: int) -> Frame:
    return Frame(Header(Kind.ROUND, "fed", rnd, task, "aggregator", 1), {"client_frames": client_frames}, {})


def test_a_new_tasks_frame_is_kept_in_a_file_and_counted_for_the_tasks_first_round(frames, tmp_path) -> None:
    frames, _ = frames
    raw = payload(task=1)
    assert frames.take(OWN, decode(raw), raw, len(raw) + 40, task=0, done_round=3)
    assert (tmp_path / "knowledge" / "1.frame").read_bytes() == raw  # the checkpoint's own layout
    assert not frames.wanted(round_frame(True, task=1, rnd=4), task=0, done_round=3)
    assert frames.first(1).meta["run"] == RUN_A and frames.first(2) is None
    assert frames.round_bytes(4, task=1, new_task=True) == len(raw) + 40
    assert frames.round_bytes(4, task=1, new_task=False) == 0


def test_a_frame_for_a_later_round_of_the_task_in_hand_waits_for_its_round(frames) -> None:
    frames, _ = frames
    old, later = payload(task=0, rnd=3), payload(task=0, rnd=5)
    assert not frames.take(OWN, decode(old), old, 10, task=0, done_round=3)  # a round already done
    assert frames.take(OWN, decode(later), later, 11, task=0, done_round=3)
    assert not frames.wanted(round_frame(True, task=0, rnd=5), task=0, done_round=4)
    assert frames.round_bytes(5, task=0, new_task=False) == 11
    assert frames.pop_mid(5).header.round == 5 and frames.pop_mid(5) is None


# docs/protocol.md P-3.2, P-8.7
def test_frames_on_another_topic_or_for_another_task_are_rejected(frames) -> None:
    frames, _ = frames
    raw = payload(task=1)
    with pytest.raises(RejectedFrame, match="^topic:"):
        frames.take("fcl/fed/kb/dev-2", decode(raw), raw, 1, task=0, done_round=0)
    wrong = payload(task=1, for_task=2)
    with pytest.raises(RejectedFrame, match="^knowledge: meta.for_task"):
        frames.take(OWN, decode(wrong), wrong, 1, task=0, done_round=0)


def test_a_gap_fetches_the_full_frame_once_and_the_full_frame_ends_the_fetch(frames) -> None:
    frames, link = frames
    raw = payload(task=1, carries=("a",))
    frames.take(OWN, decode(raw), raw, len(raw), task=0, done_round=3)
    learner = Learner(missing={"a", "b"})
    assert frames.lacking(1, learner) and frames.lacking(1, learner)  # asked twice, fetched once
    assert link.calls == [("subscribe", FULL)] and frames.fetching == 1
    assert frames.syncs == {"knowledge": 1}
    short = payload(task=1, carries=("a",))
    with pytest.raises(RejectedFrame, match="lacks 1 of its entries"):
        frames.take_full(decode(short), short, len(short), learner)
    assert not frames.take_full(decode(payload(task=2)), payload(task=2), 1, learner)  # not the task fetched
    full = payload(task=1, carries=("a", "b"))
    assert frames.take_full(decode(full), full, len(full), learner)
    assert link.calls[-1] == ("unsubscribe", FULL) and frames.fetching is None
    assert frames.syncs == {"knowledge": 1, "knowledge_bytes": len(full)}
    assert frames.round_bytes(4, task=1, new_task=True) == len(raw) + len(full)  # it received both
    assert not frames.lacking(1, learner)


def test_joining_a_run_keeps_its_frames_only(frames) -> None:
    frames, _ = frames
    mine, other = payload(task=1, run=RUN_A), payload(task=2, run=RUN_B)
    frames.take(OWN, decode(mine), mine, 5, task=0, done_round=0)
    newer = payload(task=1, run=RUN_B)
    frames.hold_newer(RUN_B, decode(newer), newer, 7)
    frames.take(OWN, decode(other), other, 6, task=0, done_round=0)
    frames.adopt(RUN_B)
    assert sorted(frames.raw) == [1, 2] and frames.first(1).meta["run"] == RUN_B
    assert frames.sizes == {1: 7, 2: 6} and frames.newer == {}
    frames.reset()
    assert frames.raw == {} and frames.sizes == {} and frames.mid == {}


def test_only_frames_for_tasks_not_started_are_stored_without_tensors(frames) -> None:
    frames, _ = frames
    header = Header(Kind.KNOWLEDGE, "fed", 4, 1, "aggregator", 1)
    assert not frames.keeps_tensors(header, task=0)
    assert frames.keeps_tensors(header, task=1)
    assert frames.keeps_tensors(Header(Kind.ROUND, "fed", 4, 1, "aggregator", 1), task=0)
