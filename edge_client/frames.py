"""The device's own downlink frames ("client frames"): what the method's strategy sends one
device on its own topic, for the first round of a task (kept for restarts) or for a later
round of the task in hand.  The runtime never reads them: it keeps them, hands them to the
learner (``Learner.start_task``, ``Learner.receive_frame``) and, when the learner says a task's
frame names something it does not hold (``Learner.lacks``), fetches the full frame the
aggregator keeps retained for that case.  On the wire they are ``Kind.KNOWLEDGE`` frames.

A task's frame is kept as received, validated on arrival, in a file of the state directory
(not in memory: 36 MB by ConFedMADE's fifth MNIST task), decoded again only when its task
starts (a decoded frame is 5x its bytes).
"""

from __future__ import annotations

import logging
from collections import Counter

from edge_client.protocol import RejectedFrame, no_tensors
from fclcore.checkpoint import FileBytes
from fclcore.codec import CodecLimits, Frame, Header, Kind, decode
from fclcore.learner import Learner
from fclcore.model_sync import SYNC_KNOWLEDGE, SYNC_KNOWLEDGE_BYTES
from fclcore.runid import is_newer

log = logging.getLogger("edge_client.daemon")  # its parts log as the daemon did before the split


class ClientFrames:
    def __init__(self, client_id: str, topic: str, full_topic: str, store, link, limits: CodecLimits) -> None:
        """``store``: spills frames to files (``ClientStateStore.spill``); ``link``: subscribes to
        ``full_topic`` while a full frame is fetched."""
        self.client_id = client_id
        self.topic, self.full_topic = topic, full_topic
        self.store, self.link, self.limits = store, link, limits
        self.raw: dict[int, FileBytes] = {}  # task -> the task's first frame, as received
        self.sizes: dict[int, int] = {}  # task -> its bytes received (both frames after a full fetch)
        self.mid: dict[int, tuple[Frame, int]] = {}  # round -> (frame, size) inside a started task
        self.newer: dict[str, dict[int, tuple[bytes, int]]] = {}  # frames of a newer run, until it is joined
        self.fetching: int | None = None  # the task whose full frame is being fetched
        self.syncs: Counter[str] = Counter()  # full frames fetched, and their bytes

    def keeps_tensors(self, header: Header, task: int) -> bool:
        """For ``decode``: a frame for a task not yet started is stored raw, so its tensors go."""
        return header.kind is not Kind.KNOWLEDGE or header.task == task

    def wanted(self, frame: Frame, task: int, done_round: int) -> bool:
        """The round says the strategy sent this device its own frame for it, and it is not here
        yet: a task's first frame (kept for restarts), or a frame for a later round of the task
        this device is in (``task``).  ``client_frames`` is True (every device of the round gets
        one) or the list of the devices that do."""
        frames = frame.meta.get("client_frames")
        if frames is not True and not (isinstance(frames, list) and self.client_id in frames):
            return False
        if frame.header.task != task:
            return frame.header.task not in self.raw
        return frame.header.round > done_round and frame.header.round not in self.mid

    def take(self, topic: str, frame: Frame, payload: bytes, size: int, task: int, done_round: int) -> bool:
        """Keep a frame from this device's own topic; False when it is dropped as done with."""
        if topic != self.topic:
            raise RejectedFrame(f"topic: knowledge frame on {topic}")
        _check_for_task(frame)
        if frame.header.task == task:  # for a later round of the task in hand
            if frame.header.round <= done_round:
                return False  # a retained frame of a round already done
            self.mid = {r: f for r, f in self.mid.items() if r > done_round}
            self.mid[frame.header.round] = (frame, size)
        else:
            self.raw[frame.header.task] = self.store.spill(frame.header.task, payload)
            self.sizes[frame.header.task] = size
        return True

    def hold_newer(self, run: str, frame: Frame, payload: bytes, size: int) -> None:
        """A frame of a newer run than this device's: kept until the device joins that run."""
        self.newer.setdefault(run, {})[frame.header.task] = (payload, size)

    def adopt(self, run: str) -> None:
        """Frames of other runs go; those of ``run`` kept aside come in."""
        for task, raw in list(self.raw.items()):
            # (a frame from before runs had ids stays)
            if decode(raw.read(), self.limits, no_tensors).meta.get("run", run) != run:
                self.raw.pop(task, None)
                self.sizes.pop(task, None)
        for task, (raw, size) in sorted(self.newer.pop(run, {}).items()):
            self.raw[task], self.sizes[task] = self.store.spill(task, raw), size
        self.newer = {r: f for r, f in self.newer.items() if is_newer(r, run)}

    def reset(self) -> None:
        """Start over (a newer run is joined): nothing kept, nothing fetched."""
        self.raw, self.sizes, self.mid = {}, {}, {}
        self.fetch(None)

    def restore(self, frames: dict[int, bytes]) -> None:
        """The frames a checkpoint kept, spilled to files again."""
        self.raw = {t: self.store.spill(t, raw) for t, raw in frames.items()}

    def first(self, task: int) -> Frame | None:
        """Task ``task``'s first frame, decoded (only when the task starts), or None."""
        raw = self.raw.get(task)
        return None if raw is None else decode(raw.read(), self.limits)

    def pop_mid(self, rnd: int) -> Frame | None:
        """The frame for round ``rnd`` of the task in hand, if one came."""
        got = self.mid.pop(rnd, None)
        return None if got is None else got[0]

    def round_bytes(self, rnd: int, task: int, new_task: bool) -> int:
        """The bytes of this device's own frames that count for round ``rnd``: the task's first
        frame in its first round, else the round's own frame."""
        if new_task:
            return self.sizes.get(task, 0)
        return self.mid.get(rnd, (None, 0))[1]

    def lacking(self, task: int, learner: Learner) -> bool:
        """Whether task ``task``'s frame names what ``learner`` neither holds nor finds in it (its
        store was lost, or the aggregator's idea of what it holds is wrong): then the full frame
        is fetched (counted) and the round must wait for it."""
        raw = self.raw.get(task)
        try:  # decoded whole here (it is kept without its tensors) and dropped before the task starts
            lacking = learner.lacks(decode(raw.read(), self.limits)) if raw is not None else []
        except ValueError as exc:
            raise RejectedFrame(f"knowledge: {exc}") from None
        if not lacking:
            return False
        if self.fetching != task:
            log.warning(
                "task %d's knowledge frame names %d entries this device does not hold: fetching the full frame",
                task,
                len(lacking),
            )
            self.syncs[SYNC_KNOWLEDGE] += 1
            self.fetch(task)
        return True

    def fetch(self, task: int | None) -> None:
        """Subscribe to this device's full frame while task ``task``'s is wanted (None: stop)."""
        if task is not None and self.fetching is None:
            self.link.subscribe(self.full_topic)
        elif task is None and self.fetching is not None:
            self.link.unsubscribe(self.full_topic)
        self.fetching = task

    def take_full(self, frame: Frame, payload: bytes, size: int, learner: Learner) -> bool:
        """The full frame: it replaces the task's own frame (also in the checkpoint) and ends the
        fetch; False when it is not the one fetched."""
        task = frame.header.task
        if self.fetching is None or task != self.fetching:
            return False  # a retained copy delivered after the fetch ended, or another task's
        _check_for_task(frame)
        try:  # ``frame`` came without its tensors (a task not yet started): decoded whole here
            lacking = learner.lacks(decode(payload, self.limits))
        except ValueError as exc:
            raise RejectedFrame(f"knowledge: {exc}") from None
        if lacking:
            raise RejectedFrame(f"knowledge: the full frame lacks {len(lacking)} of its entries")
        self.syncs[SYNC_KNOWLEDGE_BYTES] += size
        self.raw[task] = self.store.spill(task, payload)
        self.sizes[task] = self.sizes.get(task, 0) + size  # it received both
        self.fetch(None)
        return True


def _check_for_task(frame: Frame) -> None:
    if frame.meta.get("for_task", frame.header.task) != frame.header.task:
        raise RejectedFrame("knowledge: meta.for_task differs from the header's task")
