"""Frames made for devices that decode less than everything (docs/protocol.md, section 17).

A device of protocol 4 may declare in its status that it decodes less (no 8-bit values, no
derived positions, no chunks, fewer layouts).  It then reads its announcements on its own
topic, ``fcl/<fed>/down/<client>``, and this module publishes them there: the shared frame's
bytes when the device decodes them, else the same announcement made again within what it
declared.  The model a variant brings is the global model to the bit (its digest is the
shared frame's): a delta is the entries that changed at their new values, in a dtype that
holds them exactly (``exact``); a first announcement is the full model.  Devices that decode
everything read the shared topics, and nothing here sends them anything.

The sync frames and knowledge frames such a device fetches are coded within what it decoded
too: the shared sync frames within what every such device reads (``sync_coding``), a device's
own knowledge frame within what it declared (``knowledge``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Mapping

import numpy as np

from aggregator.outbox import Outbox
from fclcore import topics
from fclcore.capabilities import LAYOUT_CODES, Decodes, announced
from fclcore.codec import CodecError, CodecLimits, Frame, Header, SparseTensor, Tensor, ValueCoding, decode, encode
from fclcore.model_sync import ModelRef, catchup, lossless_dtype

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Shared:
    """One announcement as the shared topic got it, and what a variant of it needs: the global
    model it brings and the entries that changed from the version before (None: a full model)."""

    header: Header
    meta: dict
    payload: bytes
    served: Mapping[str, np.ndarray] | None  # None: no model (a failed run's FINISH)
    step: Mapping[str, np.ndarray] | None
    tag: str


@dataclass(frozen=True)
class Sent:
    """What one device's variant cost: its MQTT packet bytes, payload bytes and model bytes."""

    packet_bytes: int
    payload_bytes: int
    model_bytes: int


class Variants:
    def __init__(self, outbox: Outbox, federation: str, limits: CodecLimits) -> None:
        self.outbox, self.federation, self.limits = outbox, federation, limits
        self.declared: dict[str, Decodes] = {}  # devices that read their own topic, and what they decode
        self.last: Shared | None = None  # the latest announcement, for a device that declares after it

    def on_status(self, client: str, status: Mapping) -> str | None:
        """Take what a device's status declares; the reason no frame can be made for it (it is
        then served nothing: P-CAP-5), or None.  A device that declares anew gets the latest
        announcement made for it at once."""
        try:
            decodes = announced(status)
            problem = decodes.unservable() if decodes is not None else None
        except (ValueError, TypeError) as exc:  # a status is input from the network
            decodes, problem = None, str(exc)
        if decodes is None or problem is not None:
            self.declared.pop(client, None)
            return problem
        if self.declared.get(client) != decodes:
            self.declared[client] = decodes
            log.info("client %s decodes less (%s): its frames go to its own topic", client, decodes.brief())
            if self.last is not None:
                self._publish(client, self.last)
        return None

    def announce(self, shared: Shared) -> dict[str, Sent]:
        """Publish ``shared`` to every device that reads its own topic; what each got."""
        self.last = shared
        return {client: self._publish(client, shared) for client in sorted(self.declared)}

    def request(self, payload: bytes, missing: list[str], tag: str) -> None:
        """A re-send request (not retained) to the devices it names that read their own topic."""
        for client in missing:
            if client in self.declared:
                self.outbox.publish(self._topic(client), payload, tag=tag, retain=False)

    def retained_topics(self, clients: list[str]) -> list[str]:
        """The retained topics variants go to (a new run clears them)."""
        return [self._topic(c) for c in clients]

    def sync(
        self, tensors: dict[str, Tensor], served: Mapping[str, np.ndarray], dtype: str, header: Header
    ) -> tuple[dict[str, Tensor], ValueCoding, bool]:
        """A shared sync frame (``tensors``: ``served``'s values, the full model or a catch-up)
        coded so that every device reading its own topic reads it too (they fetch sync frames
        like any device): (tensors, coding, whether it goes whole, without chunks)."""
        everyone = list(self.declared.values())
        if not everyone:
            return tensors, ValueCoding(dtype), False
        if any("float16" not in d.dtypes for d in everyone):
            dtype = "float32"
        common = tuple(c for n, c in LAYOUT_CODES.items() if n != "dense" and all(n in d.layouts for d in everyone))
        tensors = _undensified(tensors, served, ValueCoding(dtype, sparse_layouts=common), self.limits, header)
        coding = ValueCoding(lossless_dtype(tensors) if dtype == "float16" else dtype, sparse_layouts=common)
        return tensors, coding, any(not d.chunks for d in everyone)

    def knowledge(self, client: str, payload: bytes) -> tuple[bytes, bool]:
        """A device's own knowledge frame as it decodes it (the values it would decode from
        ``payload``, coded without loss), and whether it goes whole."""
        decodes = self.declared.get(client)
        if decodes is None:
            return payload, False
        if not _reads(decodes, payload, self.limits):
            frame = decode(payload, self.limits)
            tensors = frame.tensors  # unlisted entries of a knowledge frame are 0: a dense form is the same
            payload = encode(frame, _coding(decodes, tensors), self.limits)
        return payload, not decodes.chunks

    def _publish(self, client: str, shared: Shared) -> Sent:
        payload = self.frame_for(self.declared[client], shared)
        wire, sent = self.outbox.publish(
            self._topic(client), payload, tag=shared.tag, whole=not self.declared[client].chunks
        )
        bare = encode(Frame(shared.header, decode(payload, self.limits).meta, {}), limits=self.limits)
        return Sent(wire, sent, len(payload) - len(bare))

    def frame_for(self, decodes: Decodes, shared: Shared) -> bytes:
        """``shared`` as a device that decodes ``decodes`` reads it: its own bytes when it can."""
        ref = ModelRef.of(shared.meta)
        if shared.served is None or ref is None:
            return shared.payload  # no tensors: version 1, read by everyone
        if _reads(decodes, shared.payload, self.limits) and (decodes.derived_positions or not ref.derived):
            return shared.payload
        step = shared.step if ref.base is not None else None
        tensors = exact(shared.served, step, decodes, self.limits, shared.header)
        base, removed = (ref.base, ref.removed) if step is not None else (None, ())
        variant = ModelRef(ref.version, base, ref.hash, (), removed, ref.digest)
        meta = {**shared.meta, "model": variant.to_meta()}
        return encode(Frame(shared.header, meta, tensors), _coding(decodes, tensors), self.limits)

    def _topic(self, client: str) -> str:
        return topics.downlink_topic(self.federation, client)


def exact(
    served: Mapping[str, np.ndarray],
    step: Mapping[str, np.ndarray] | None,
    decodes: Decodes,
    limits: CodecLimits,
    header: Header,
) -> dict[str, Tensor]:
    """The tensors that bring a device to ``served`` exactly within ``decodes``: the entries
    ``step`` changed, at their new values (a delta from the version before), or the full model
    (``step`` None).  A sparse change the codec would write dense (zeros for the entries it does not
    list, which a delta would take as values) is sent as the whole tensor instead."""
    if step is None:
        return {k: np.asarray(v, dtype=np.float32) for k, v in served.items()}
    tensors = catchup([step], served, 4)
    return _undensified(tensors, served, _coding(decodes, tensors), limits, header)


def _undensified(
    tensors: dict[str, Tensor], served: Mapping[str, np.ndarray], coding: ValueCoding, limits: CodecLimits, header
) -> dict[str, Tensor]:
    """``tensors`` (changes of a model delta) with each sparse tensor the codec would write dense,
    zeros filled (a delta takes them as values), replaced by ``served``'s whole tensor.  (Their
    values may need float32 where the changes did not: the caller picks the dtype after this;
    float32 never turns a sparse tensor dense that float16 kept sparse.)"""
    coded = decode(encode(Frame(header, {}, tensors), coding, limits), limits).tensors
    out = dict(tensors)
    for name, tensor in tensors.items():
        if isinstance(tensor, SparseTensor) and not isinstance(coded[name], SparseTensor):
            out[name] = np.asarray(served[name], dtype=np.float32)
    return out


def _coding(decodes: Decodes, tensors: Mapping[str, Tensor]) -> ValueCoding:
    """Values without loss (float16 where every value survives it and the device reads it), in
    the sparse layouts the device reads."""
    dtype = lossless_dtype(tensors)
    if dtype not in decodes.dtypes:
        dtype = "float32"
    layouts = tuple(LAYOUT_CODES[n] for n in decodes.layouts if n != "dense")
    return ValueCoding(dtype, sparse_layouts=layouts)


def _reads(decodes: Decodes, payload: bytes, limits: CodecLimits) -> bool:
    try:
        decode(payload, decodes.limits(limits), lambda header: True)
    except CodecError:
        return False
    return True
