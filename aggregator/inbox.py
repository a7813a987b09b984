"""Validation of everything that reaches the aggregator, before it can touch the model.

A bad message becomes a ``Rejection`` (a reason string that is logged and counted), never
an exception in the round loop.  Checks, in order: the sender is an expected client; its
signature (when device keys are configured); codec validity (size, version, checksum,
finiteness, index ranges); the sequence window (more than ``SEQUENCE_WINDOW`` past the
device's mark is never accepted, so no single frame can push the mark out of a device's reach);
federation, sender, kind and round in the header; the sequence against the run's floor and the
last one accepted from that device in this run (replays); duplicates; the metadata the round
loop relies on; tensor names and shapes (the strategy's ``normalize``); and the
update's L2 distance to the global model (``max_update_norm``).

No wall clock takes part (docs/protocol.md, "Sequences and clocks"): a device numbers its frames
with a counter it keeps per run, so a clock that steps on either side changes nothing here.  A
rejection of a decoded frame carries its header and the device's mark, which the device reads
in its NACK (``aggregator.nacks``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Callable, Container, Mapping

import numpy as np

from aggregator.buffered import STALE, Buffer
from fclcore.codec import MAGIC, SPOKEN, CodecError, CodecLimits, Frame, Header, Kind, SparseTensor, Tensor, decode
from fclcore.signing import SignatureError, verify
from fclcore.sparsify import DELTA
from fclcore.strategy import Checked, Update

MAX_SAMPLES = 2**31 - 1  # a sample count is a FedAvg weight: it must stay a sane float
# how far one accepted frame may move a device's mark (P-SEQ-4): ~12.7 days of microseconds, so
# devices that still number frames on a clock (protocol 1) fit between two frames; a counter never
# comes near it, and 2**64 holds ~16 million such steps above any run's start
SEQUENCE_WINDOW = 2**40


@dataclass(frozen=True)
class Rejection:
    reason: str  # short category used for counting, e.g. "codec", "duplicate"
    detail: str  # what was received and what was expected
    client: str | None = None
    late: bool = False
    header: Header | None = None  # the rejected frame's, once it decoded
    mark: int | None = None  # once the frame decoded: its next number must be above this (P-SEQ-6)


# The strategy's view of an update: full-shape tensors (or a ``Checked`` with its parse), or
# ValueError saying why not.
Normalizer = Callable[[Frame], "dict[str, Tensor] | Checked"]


@dataclass
class Inbox:
    """Checks update/eval frames against the federation, the open round and the template."""

    federation: str
    clients: Container[str]  # the live client set (membership is what is checked)
    normalize: Normalizer  # from the strategy, for UPDATE frames
    num_tasks: int
    limits: CodecLimits = field(default_factory=CodecLimits)
    keys: Mapping[str, bytes] | None = None  # per-device HMAC keys: when set, only signed frames pass
    max_update_norm: float | None = None
    last_seq: dict[str, int] = field(default_factory=dict)  # highest sequence accepted per device
    min_samples: int = 1  # 0 for methods where a device may have nothing to train in a task (fedet)
    max_skew_us: int = 30_000_000  # how far before the run's start a protocol-1 device's clock may number
    min_seq: int = 0  # no sequence below this: the run's start (minus the skew); a counter starts above it
    buffer: Buffer | None = None  # buffered rounds: updates of recent earlier versions are taken too

    def check(
        self,
        client: str | None,
        payload: bytes,
        packet_bytes: int,
        open_round: int,
        received: set[str],
        kind: Kind = Kind.UPDATE,
        current: Mapping[str, np.ndarray] | None = None,
    ) -> Update | Rejection:
        """Accept or reject one message; on acceptance the device's sequence mark advances."""
        if client is None or client not in self.clients:
            return Rejection("unknown-client", f"sender {client!r} is not an expected client", client)
        frame_bytes = payload
        if self.keys is not None:
            try:
                frame_bytes = verify(payload, self.keys[client])
            except SignatureError as exc:
                return Rejection("signature", str(exc), client)
        version = frame_bytes[4] if len(frame_bytes) > 4 and frame_bytes[:4] == MAGIC else None
        if version is not None and version not in SPOKEN:  # P-VER-3: the NACK names the versions spoken
            spoken = ", ".join(map(str, SPOKEN))
            return Rejection("version", f"frame version {version}; this aggregator speaks {spoken}", client)
        try:
            frame = decode(frame_bytes, self.limits)
        except CodecError as exc:
            return Rejection("codec", str(exc), client)
        result = self._check_frame(frame, client, payload, packet_bytes, open_round, received, kind, current)
        if isinstance(result, Rejection):
            return replace(result, header=frame.header, mark=max(self.last_seq.get(client, -1), self.min_seq))
        self.last_seq[client] = frame.header.sequence
        return result

    def _check_frame(
        self,
        frame: Frame,
        client: str,
        payload: bytes,
        packet_bytes: int,
        open_round: int,
        received: set[str],
        kind: Kind,
        current: Mapping[str, np.ndarray] | None,
    ) -> Update | Rejection:
        ceiling = max(self.last_seq.get(client, -1), self.min_seq) + SEQUENCE_WINDOW
        if frame.header.sequence > ceiling:  # P-SEQ-4: checked first, so one forged frame cannot move the mark
            past = frame.header.sequence - ceiling
            return Rejection("sequence", f"sequence {frame.header.sequence} is {past} past the window", client)
        problem = self._header_problem(frame, client, open_round, kind)
        if problem is not None:
            return problem
        if frame.header.sequence < self.min_seq:  # P-SEQ-3
            return Rejection("replay", f"sequence {frame.header.sequence} is older than this run", client)
        last = self.last_seq.get(client, -1)
        if frame.header.sequence <= last:
            reason = "duplicate" if frame.header.sequence == last else "replay"
            return Rejection(reason, f"sequence {frame.header.sequence}, last accepted {last}", client)
        if client in received:
            return Rejection("duplicate", f"second {kind.name} for round {open_round}", client)
        problem = self._content_problem(frame, kind)
        if problem is not None:
            return Rejection("content", problem, client)
        tensors: Mapping[str, Tensor] = {}
        parsed = None
        if kind is Kind.UPDATE:
            try:
                checked = self.normalize(frame)
            except ValueError as exc:  # a strategy may name the reason (``fclcore.strategy.Rejected``)
                return Rejection(getattr(exc, "reason", "content"), str(exc), client)
            tensors, parsed = (checked.tensors, checked.parsed) if isinstance(checked, Checked) else (checked, None)
            if self.max_update_norm is not None and current is not None:
                norm = update_distance(tensors, current)
                if not norm <= self.max_update_norm:
                    return Rejection(
                        "norm",
                        f"L2 distance to the global model {norm:.4g} exceeds "
                        f"max_update_norm {self.max_update_norm:.4g}",
                        client,
                    )
        n_samples = frame.meta["n_samples"] if kind is Kind.UPDATE else 0
        return Update(client, frame, n_samples, packet_bytes, len(payload), tensors, parsed)

    def _header_problem(self, frame: Frame, client: str, open_round: int, kind: Kind) -> Rejection | None:
        h = frame.header
        if h.federation != self.federation:
            return Rejection("federation", f"federation {h.federation!r}, expected {self.federation!r}", client)
        if h.client != client:
            return Rejection("sender", f"header client {h.client!r} does not match topic client {client!r}", client)
        if h.kind != kind:
            return Rejection("kind", f"kind {h.kind.name}, expected {kind.name}", client)
        if self.buffer is not None and kind is Kind.UPDATE and h.round < open_round:
            stale = self.buffer.stale_problem(h.round, open_round)
            return None if stale is None else Rejection(STALE, stale, client, late=True)
        if h.round != open_round:
            late = h.round < open_round
            what = "closed" if late else "not yet open"
            return Rejection(
                "late" if late else "round", f"round {h.round} is {what} (open: {open_round})", client, late=late
            )
        return None

    def _content_problem(self, frame: Frame, kind: Kind) -> str | None:
        meta = frame.meta
        if kind is Kind.UPDATE:
            n = meta.get("n_samples")
            if not _is_int(n) or not self.min_samples <= n <= MAX_SAMPLES:
                return f"meta.n_samples: expected an integer in [{self.min_samples}, {MAX_SAMPLES}], got {n!r}"
        if "eval" in meta:
            problem = eval_problem(meta["eval"], self.num_tasks)
            if problem is None and meta["eval"]["round"] != frame.header.round - 1:
                problem = (
                    f"meta.eval.round: expected {frame.header.round - 1} (the round before this "
                    f"frame's), got {meta['eval']['round']}"
                )
            return problem
        return None


def update_distance(tensors: Mapping[str, Tensor], current: Mapping[str, np.ndarray]) -> float:
    """L2 distance between an update and the global model over the entries it carries
    (tensors the global model does not have, such as those for other clients' frames, are skipped)."""
    total = 0.0
    for name, tensor in tensors.items():
        reference = current.get(name)
        if name.endswith(DELTA) and name[: -len(DELTA)] in current:  # a change from the model the device holds
            values = tensor.values if isinstance(tensor, SparseTensor) else np.asarray(tensor)
            total += float(np.sum(np.square(values, dtype=np.float64)))
            continue
        if reference is None:
            continue
        if isinstance(tensor, SparseTensor):
            diff = tensor.values.astype(np.float64) - reference.reshape(-1)[tensor.indices]
        else:
            diff = np.asarray(tensor, np.float64) - reference
        total += float(np.dot(diff.reshape(-1), diff.reshape(-1)))
    return math.sqrt(total)


METRICS = ("nll", "accuracy")  # what a device's evaluation reports per task


def eval_metric(report: dict) -> str:
    """The metric an (already checked) evaluation report carries."""
    return "accuracy" if "accuracy" in report else "nll"


def eval_problem(report: object, num_tasks: int) -> str | None:
    """An evaluation report is {"round": int, "task": int, "nll": [finite float or null] * (task + 1)},
    with the current task's entry present (earlier tasks are only scored after a task ends);
    accuracy-scored methods send "accuracy" (values in [0, 1]) instead of "nll"."""
    if not isinstance(report, dict):
        return f"meta.eval: expected a mapping, got {type(report).__name__}"
    rnd, task = report.get("round"), report.get("task")
    if not _is_int(rnd) or not _is_int(task) or not 0 <= task < num_tasks:
        return f"meta.eval: expected integer round and task in [0, {num_tasks}), got {rnd!r}, {task!r}"
    if all(m in report for m in METRICS):
        return f"meta.eval: expected one of {METRICS}, got both"
    metric = eval_metric(report)
    values = report.get(metric)
    if not isinstance(values, list) or len(values) != task + 1:
        return f"meta.eval.{metric}: expected a list of {task + 1} numbers"
    if not all(v is None or is_finite_number(v) for v in values) or values[task] is None:
        return f"meta.eval.{metric}: expected finite numbers (null only for earlier tasks)"
    if metric == "accuracy" and not all(v is None or 0 <= v <= 1 for v in values):
        return "meta.eval.accuracy: expected values in [0, 1]"
    return None


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_finite_number(value: object) -> bool:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:  # an integer too large for a float
        return False
