"""What a daemon says it speaks (docs/protocol.md P-VER-5, P-VER-6) and how ``fcl status`` lists
devices by protocol version during a rolling upgrade."""

from __future__ import annotations

import io
import json

from fcl_edge.status import build_views, print_table, read_status
from fclcore.capabilities import ACCEPTED, PROTOCOL, Decodes, aggregator_capabilities, device_capabilities
from fclcore.codec import SPOKEN, VALUE_DTYPES


def test_a_device_announces_its_protocol_and_what_it_decodes() -> None:
    caps = device_capabilities()
    assert caps["protocol"] == PROTOCOL == max(ACCEPTED)
    assert caps["decodes"] == {
        "frames": list(SPOKEN),
        "dtypes": list(VALUE_DTYPES),
        "layouts": ["dense", "index", "bitmap"],
        "derived_positions": True,
        "chunks": True,
    }
    assert aggregator_capabilities() == {"protocol": PROTOCOL, "accepts": [1, 2, 3, 4]}
    json.dumps(caps)  # it goes into a JSON status as it is


def _status(**fields) -> bytes:
    return json.dumps({"state": "online", "time": 1.0, "role": "client", **fields}).encode()


def test_fcl_status_lists_devices_by_protocol_version() -> None:
    messages = [
        ("fcl/fed/status/new-0", _status(**device_capabilities())),
        ("fcl/fed/status/new-1", _status(**device_capabilities())),
        ("fcl/fed/status/old-0", _status()),  # a protocol-1 daemon says nothing
        ("fcl/fed/status/odd-0", _status(protocol="2")),  # garbage: treated as saying nothing
        ("fcl/fed/status/aggregator", _status(role="aggregator", expected=["gone-0"], **aggregator_capabilities())),
    ]
    assert read_status("new-0", messages[0][1]).protocol == 4
    assert read_status("odd-0", messages[3][1]).protocol is None
    out = io.StringIO()
    print_table(build_views(messages), 2.0, out)
    line = next(x for x in out.getvalue().splitlines() if "devices by" in x)
    assert line == "  devices by protocol 1 (says none): odd-0, old-0; protocol 4: new-0, new-1"  # not gone-0: absent


# docs/protocol.md P-CAP-1
def test_fcl_status_names_what_each_device_does_not_decode() -> None:
    lean = device_capabilities(Decodes.of({"frames": [1], "derived_positions": False, "chunks": False}))
    messages = [
        ("fcl/fed/status/lean-0", _status(**lean)),
        ("fcl/fed/status/new-0", _status(**device_capabilities())),
        ("fcl/fed/status/odd-0", _status(protocol=4, decodes=[1])),  # garbage: said, not understood
        ("fcl/fed/status/old-0", _status(protocol=3, decodes={"chunks": False})),  # reads the shared topics
    ]
    out = io.StringIO()
    print_table(build_views(messages), 2.0, out)
    line = next(x for x in out.getvalue().splitlines() if "decode less" in x)
    assert line == (
        "  devices that decode less (frames made for them): "
        "lean-0 (no int8, no derived positions, no chunks); odd-0 (? (not a decodes object))"
    )
