"""What this implementation speaks, as each daemon says in its retained status and ``fcl status``
lists it (docs/protocol.md, "Versions and capabilities", P-VER-5 and P-VER-6), and what a device
says it decodes (``Decodes``), which the aggregator honours (section 17, P-CAP).

Protocol versions: 1 numbered device frames on the aggregator's clock (``meta.clock_us``) and
had no NACKs; 2 numbers them with per-run counters (P-SEQ) and answers dropped frames with
NACKs (P-NACK); 3 reads large retained frames in chunks (docs/protocol.md section 16, P-CHK);
4 lets a device declare less than everything and read frames made for it on its own topic
(section 17).  A status without ``protocol`` is a protocol-1 daemon's.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping

from fclcore import topics
from fclcore.codec import BITMAP, DENSE, INDEX, SPOKEN, VALUE_DTYPES, CodecLimits, dtype_code

PROTOCOL = 4
ACCEPTED = (1, 2, 3, 4)  # the device protocols an aggregator of this version serves
OWN_DOWNLINK = 4  # the first protocol whose devices read frames made for them (``down/<client>``)
LAYOUTS = ("dense", "index", "bitmap")
LAYOUT_CODES = {"dense": DENSE, "index": INDEX, "bitmap": BITMAP}
FIELDS = ("frames", "dtypes", "layouts", "derived_positions", "chunks")


@dataclass(frozen=True)
class Decodes:
    """What a device decodes (its status's ``decodes``, P-VER-5): frame versions, value dtypes,
    tensor layouts, whether it derives mask positions and whether it reads chunked frames."""

    frames: tuple[int, ...] = SPOKEN
    dtypes: tuple[str, ...] = VALUE_DTYPES
    layouts: tuple[str, ...] = LAYOUTS
    derived_positions: bool = True
    chunks: bool = True

    @classmethod
    def of(cls, raw: Mapping[str, Any] | None, where: str = "decodes") -> Decodes:
        """``raw`` (fields of a status's ``decodes``, or a config's overrides: absent ones are
        everything) checked; ValueError naming the field otherwise."""
        raw = dict(raw or {})
        unknown = sorted(set(raw) - set(FIELDS))
        if unknown:
            raise ValueError(f"{where}.{unknown[0]}: unknown; expected some of {', '.join(FIELDS)}")
        out = cls()
        for name, allowed in (("frames", SPOKEN), ("dtypes", VALUE_DTYPES), ("layouts", LAYOUTS)):
            if name in raw:
                value = raw[name]
                kind = type(allowed[0])  # int or str: a bool or 1.0 is not a frame version
                if not isinstance(value, list) or any(type(v) is not kind or v not in allowed for v in value):
                    raise ValueError(f"{where}.{name}: expected a list of {list(allowed)}, got {value!r}")
                out = dataclasses.replace(out, **{name: tuple(v for v in allowed if v in value)})
        for name in ("derived_positions", "chunks"):
            if name in raw:
                if not isinstance(raw[name], bool):
                    raise ValueError(f"{where}.{name}: expected true or false, got {raw[name]!r}")
                out = dataclasses.replace(out, **{name: raw[name]})
        return out

    def to_dict(self) -> dict:
        return {
            "frames": list(self.frames),
            "dtypes": list(self.dtypes),
            "layouts": list(self.layouts),
            "derived_positions": self.derived_positions,
            "chunks": self.chunks,
        }

    @property
    def everything(self) -> bool:
        """Whether it decodes all that this aggregator sends (then it reads the shared topics)."""
        return self == Decodes()

    @property
    def int8(self) -> bool:
        return "int8" in self.dtypes and 2 in self.frames

    def brief(self) -> str:
        """What it lacks, in a few words (for logs and ``fcl status``)."""
        lacks = [f"no {d}" for d in ("float32", "float16") if d not in self.dtypes]
        lacks += ["no int8"] * (not self.int8) + [f"no {n}" for n in LAYOUTS if n not in self.layouts]
        lacks += ["no derived positions"] * (not self.derived_positions) + ["no chunks"] * (not self.chunks)
        return ", ".join(lacks) or f"frames {list(self.frames)}"

    def unservable(self) -> str | None:
        """Why no frame can be made for it (P-CAP-5), or None: every frame has a version-1
        form with float32 values and dense tensors."""
        if 1 not in self.frames:
            return f"frames {list(self.frames)}: every frame needs version 1 (int8 values need 2 as well)"
        if "float32" not in self.dtypes:
            return f"dtypes {list(self.dtypes)}: the model is float32, and a frame made for it must hold it exactly"
        if "dense" not in self.layouts:
            return f"layouts {list(self.layouts)}: a full model is dense"
        return None

    def announcements(self, federation: str, client: str) -> str:
        """The topic a device that declared this reads its announcements on (P-CAP-2)."""
        return topics.round_topic(federation) if self.everything else topics.downlink_topic(federation, client)

    def limits(self, base: CodecLimits = CodecLimits()) -> CodecLimits:
        """A decoder that reads only this (a device holds itself to what it declared)."""
        return dataclasses.replace(
            base,
            frame_versions=self.frames,
            value_dtypes=tuple(dtype_code(d) for d in self.dtypes if d != "int8" or 2 in self.frames),
            layouts=tuple(LAYOUT_CODES[name] for name in self.layouts),
        )


def announced(status: Mapping[str, Any]) -> Decodes | None:
    """What a device's status says it decodes when it reads frames made for it (protocol 4 or
    later, ``decodes`` less than everything); None: it reads the shared topics.  ValueError for
    a ``decodes`` that is not one (P-CAP-1)."""
    protocol = status.get("protocol")
    if not isinstance(protocol, int) or isinstance(protocol, bool) or protocol < OWN_DOWNLINK:
        return None
    raw = status.get("decodes")
    if raw is None:
        return None  # it says nothing: it reads what a protocol 3 device reads
    if not isinstance(raw, dict):
        raise ValueError(f"decodes: expected an object, got {type(raw).__name__}")
    decodes = Decodes.of(raw)
    return None if decodes.everything else decodes


def device_capabilities(decodes: Decodes = Decodes()) -> dict:
    """The status fields a device announces: its protocol and what it decodes."""
    return {"protocol": PROTOCOL, "decodes": decodes.to_dict()}


def aggregator_capabilities() -> dict:
    """The status fields an aggregator announces: its protocol and the device protocols it serves."""
    return {"protocol": PROTOCOL, "accepts": list(ACCEPTED)}
