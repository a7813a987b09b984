"""docs/protocol.md's numbered rules: every one that a test can check is cited by a test (a
``P-x.y`` tag in tests/), and the few that are checked nowhere else are checked here."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from edge_client.protocol import RejectedFrame, check_downlink
from fclcore import topics, transport
from fclcore.codec import CodecLimits, Frame, Header, Kind, encode
from fclcore.config import from_dict, to_dict
from fclcore.schema import FederationSpec, ModelSpec
from tests.support.builders import federation_spec

ROOT = Path(__file__).resolve().parents[2]
# rules no test can check, and why
NOT_CHECKABLE = {
    "P-2.6": "a statement about brokers; what peers do about it is P-11.1 and P-11.2",
    "P-5.8": "leaves the quantizer to the encoder",
}


def rules() -> list[str]:
    return sorted(set(re.findall(r"\[(P-\d+\.\d+)\]", (ROOT / "docs" / "protocol.md").read_text())))


def test_every_checkable_rule_is_cited_by_a_test() -> None:
    texts = [p.read_text() for p in (ROOT / "tests").rglob("*.py") if p.name != Path(__file__).name]
    texts.append(re.sub(r"NOT_CHECKABLE = \{.*?\n\}\n", "", Path(__file__).read_text(), flags=re.S))  # its tests
    cited = {r for r in rules() if any(re.search(rf"{re.escape(r)}(?!\d)", t) for t in texts)}
    assert len(rules()) > 40
    assert sorted(set(rules()) - cited - set(NOT_CHECKABLE)) == []
    assert set(NOT_CHECKABLE) <= set(rules())  # no stale exemption


def test_every_publish_and_subscription_is_qos_1() -> None:
    """P-2.1."""
    assert transport.QOS == 1


@pytest.mark.parametrize(
    "value, ok",
    [
        ("client-0", True),
        ("a.b_c-D9", True),
        ("x" * 64, True),
        ("x" * 65, False),
        ("a/b", False),
        ("+", False),
        ("#", False),
        ("", False),
        ("é", False),
    ],
)
def test_ids_are_single_topic_levels(value: str, ok: bool) -> None:
    """P-3.1."""
    if ok:
        assert topics.validate_id(value, "client id") == value
    else:
        with pytest.raises(ValueError, match="1-64 characters"):
            topics.validate_id(value, "client id")


def _round(meta_changes: dict, **header) -> bytes:
    fed = federation_spec()
    meta = {"run": "0006f1c2a3b4c5d6-1a2b3c4d", "federation": to_dict(fed), "input_dim": 8, "total_rounds": 6}
    meta["schedule"] = {"task": 0, "task_start": True, "task_end": False, "previous": None}
    fields = {"kind": Kind.ROUND, "federation": "t", "round": 0, "task": 0, "client": "aggregator", "sequence": 1}
    return encode(Frame(Header(**{**fields, **header}), {**meta, **meta_changes}, {}))


def _check(payload: bytes) -> Frame:
    return check_downlink(payload, "t", CodecLimits(), lambda h: True, None, 8, None)[0]


def test_a_round_announcement_carries_what_the_device_reads() -> None:
    """P-8.2 (federation, input_dim, schedule) and P-4.3 on the device: sender, federation and kind."""
    assert _check(_round({})).meta["input_dim"] == 8
    cases = {
        "federation": _round({"federation": {"method": "no-such-method"}}),
        "input_dim": _round({"input_dim": 9}),
        "schedule": _round({"schedule": {"task": 1}}),
        "sender": _round({}, client="dev-1"),
        "sender ": _round({}, federation="other"),
        "kind": _round({}, kind=Kind.UPDATE),
    }
    for reason, payload in cases.items():
        with pytest.raises(RejectedFrame) as err:
            _check(payload)
        assert reason.strip() in str(err.value)


def test_mask_rng_is_announced_only_when_it_is_not_the_default() -> None:
    """P-7.10: a federation on PCG64 announces exactly what protocol 1 devices read."""
    default, neutral = federation_spec(), federation_spec(model=ModelSpec(hidden_sizes=[8], mask_rng="splitmix64"))
    assert "mask_rng" not in to_dict(default)["model"]
    assert to_dict(neutral)["model"]["mask_rng"] == "splitmix64"
    assert from_dict(FederationSpec, to_dict(neutral), "round message").model.mask_rng == "splitmix64"
    with pytest.raises(ValueError, match="mask_rng"):
        ModelSpec(mask_rng="mt19937").made_config(4)
