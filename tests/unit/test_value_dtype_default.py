"""``federation.wire.value_dtype`` left unset is the method's choice (``MethodSpec.value_dtype``),
filled in once by ``methods.resolve``: a scenario's own value wins, the dense FedAvg baselines
stay float32 (the reference), ConFedMADE and FedET go int8, and what the aggregator announces
and hashes is what its devices resolve again."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

import methods
from aggregator.state import fingerprint
from edge_client.protocol import check_downlink
from fclcore import topics
from fclcore.codec import CodecLimits, Frame, Header, Kind, encode
from fclcore.config import from_dict, load_config, to_dict
from fclcore.method import register
from fclcore.schema import FederationSpec, Scenario, WireSpec

QUICKSTART = Path(__file__).resolve().parents[2] / "configs/scenarios/quickstart.yaml"
CHOSEN = {"confedmade": "int8", "fedet": "int8", "fedavg": "float32", "fedet-finetune": "float32", "fedprox": "float32"}


def _fed(method: str, **wire: object) -> FederationSpec:
    return FederationSpec(name="wd", method=method, wire=WireSpec(**wire))


@pytest.mark.parametrize("method, dtype", sorted(CHOSEN.items()))
def test_unset_dtype_is_the_methods_choice(method: str, dtype: str) -> None:
    _, _, fed = methods.resolve(_fed(method))
    assert fed.wire.value_dtype == dtype == methods.lookup(method).value_dtype
    assert fed.value_coding.dtype == dtype


@pytest.mark.parametrize("method", sorted(CHOSEN))
@pytest.mark.parametrize("dtype", ["float32", "float16", "int8"])
def test_a_scenarios_own_dtype_wins(method: str, dtype: str) -> None:
    _, _, fed = methods.resolve(_fed(method, value_dtype=dtype))
    assert fed.wire.value_dtype == dtype


def test_every_method_declares_a_dtype_and_only_the_chosen_ones_leave_float32() -> None:
    leaving = {name for name in methods.names() if methods.lookup(name).value_dtype != "float32"}
    assert {"confedmade", "fedet"} <= leaving
    assert not leaving & {"fedavg", "fedcl-finetune", "fedet-finetune", "fedet-replay", "fedweit-made-star"}


def test_the_quickstart_compares_int8_confedmade_with_float32_fedavg() -> None:
    for method, dtype in (("confedmade", "int8"), ("fedavg", "float32")):
        sc = load_config(Scenario, QUICKSTART, ["compare=[]", f"federation.method={method}"])
        assert sc.federation.wire.value_dtype is None  # the scenario leaves it to the method
        _, _, fed = methods.resolve(sc.run_federation(), str(QUICKSTART))
        assert fed.wire.value_dtype == dtype


@pytest.mark.parametrize("method", ["confedmade", "fedavg", "fedet"])
def test_what_the_aggregator_announces_its_devices_resolve_to_the_same_settings(method: str) -> None:
    _, _, fed = methods.resolve(_fed(method))
    announced = to_dict(fed)  # the round message's "federation" and the state fingerprint's input
    assert announced["wire"]["value_dtype"] == CHOSEN[method]
    _, _, device = methods.resolve(from_dict(FederationSpec, announced, "round message", "federation"))
    assert to_dict(device) == announced


def test_a_float32_methods_fingerprint_is_what_it_was_when_float32_was_the_default() -> None:
    """A state dir written before the default moved to the method resumes: same JSON, same hash."""
    _, _, unset = methods.resolve(_fed("fedavg"))
    _, _, explicit = methods.resolve(_fed("fedavg", value_dtype="float32"))
    assert fingerprint(to_dict(unset), 64) == fingerprint(to_dict(explicit), 64)
    _, _, confedmade = methods.resolve(_fed("confedmade"))
    _, _, float32 = methods.resolve(_fed("confedmade", value_dtype="float32"))
    assert fingerprint(to_dict(confedmade), 64) != fingerprint(to_dict(float32), 64)  # int8 is another run


def test_an_unresolved_federation_has_no_value_coding() -> None:
    with pytest.raises(ValueError, match="wire.value_dtype: unset"):
        _ = _fed("fedavg").value_coding


def test_a_method_must_declare_a_dtype_the_codec_writes() -> None:
    spec = dataclasses.replace(methods.lookup("fedavg"), name="fedavg-int4", value_dtype="int4")
    with pytest.raises(ValueError, match="value_dtype 'int4'"):
        register(spec)
    assert "fedavg-int4" not in methods.names()


@pytest.mark.parametrize("method", ["confedmade", "fedavg"])
def test_a_device_reads_a_round_message_without_a_dtype_as_the_aggregator_would(method: str) -> None:
    """``check_downlink`` hands the device the resolved federation: even a message that left
    the dtype out (null) is read with the method's, never with none."""
    federation = to_dict(_fed(method))
    assert federation["wire"]["value_dtype"] is None
    meta = {
        "run": "000000000000000a-00000001",
        "federation": federation,
        "input_dim": 64,
        "schedule": {"task": 0, "task_start": True, "task_end": False},
    }
    payload = encode(Frame(Header(Kind.ROUND, "wd", 0, 0, topics.AGGREGATOR_ID, 1), meta, {}))
    _, fed = check_downlink(payload, "wd", CodecLimits(), lambda h: True, None, 64, None)
    assert fed.wire.value_dtype == CHOSEN[method] and fed.value_coding.dtype == CHOSEN[method]


def test_help_method_says_the_methods_dtype() -> None:
    assert "wire values int8 unless federation.wire.value_dtype says" in methods.describe("confedmade")
    assert "wire values float32 unless" in methods.describe("fedavg")
