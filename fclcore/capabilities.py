"""What this implementation speaks, as each daemon says in its retained status and ``fcl status``
lists it (docs/protocol.md, "Versions and capabilities", P-VER-5 and P-VER-6).

Protocol versions: 1 numbered device frames on the aggregator's clock (``meta.clock_us``) and
had no NACKs; 2 numbers them with per-run counters (P-SEQ) and answers dropped frames with
NACKs (P-NACK); 3 reads large retained frames in chunks (docs/protocol.md section 16, P-CHK).
A status without ``protocol`` is a protocol-1 daemon's.
"""

from __future__ import annotations

from fclcore.codec import SPOKEN, VALUE_DTYPES

PROTOCOL = 3
ACCEPTED = (1, 2, 3)  # the device protocols an aggregator of this version serves
LAYOUTS = ("dense", "index", "bitmap")


def device_capabilities() -> dict:
    """The status fields a device announces: its protocol and what it decodes."""
    decodes = {
        "frames": list(SPOKEN),
        "dtypes": list(VALUE_DTYPES),
        "layouts": list(LAYOUTS),
        "derived_positions": True,
        "chunks": True,
    }
    return {"protocol": PROTOCOL, "decodes": decodes}


def aggregator_capabilities() -> dict:
    """The status fields an aggregator announces: its protocol and the device protocols it serves."""
    return {"protocol": PROTOCOL, "accepts": list(ACCEPTED)}
