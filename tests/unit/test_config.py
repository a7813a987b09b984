"""Tests for the typed YAML configuration (fclcore.config + fclcore.schema)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from fclcore.config import ConfigError, apply_overrides, from_dict, load_config, to_dict
from fclcore.schema import (
    AggregatorConfig,
    BrokerSpec,
    ClientConfig,
    FederationSpec,
    Scenario,
    TasksSpec,
)

QUICKSTART = Path(__file__).resolve().parents[2] / "configs" / "scenarios" / "quickstart.yaml"

# A minimal valid scenario; every bad case below differs from it in one place.
BASE = "federation:\n  name: t\nclients: 2\ntasks:\n  shared: [[0], [1]]\n"
AGG = "federation:\n  name: t\nexpected_clients: [a, b]\n"
CLIENT = "client_id: a\nfederation: t\ndata: {}\n"


def write(tmp_path: Path, text: str, name: str = "cfg.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


def config_error(cls, path: Path, overrides=()) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(cls, path, overrides)
    message = str(info.value)
    assert "\n" not in message and "\r" not in message, f"not one line: {message!r}"
    assert str(path) in message, f"file path missing: {message!r}"
    return message


# --------------------------------------------------------------- valid files


def test_quickstart_loads_as_scenario():
    sc = load_config(Scenario, QUICKSTART)
    assert isinstance(sc, Scenario)
    assert isinstance(sc.federation, FederationSpec)
    assert sc.federation.name == "quickstart"
    assert sc.federation.method == "fedavg"
    assert sc.federation.rounds_per_task == 8
    assert sc.federation.model.hidden_sizes == [128]
    assert sc.federation.model.num_orders == 4
    assert sc.federation.train.lr == pytest.approx(0.003)
    assert isinstance(sc.federation.train.lr, float)
    assert sc.federation.rounds.deadline_s == 60.0
    assert isinstance(sc.federation.rounds.deadline_s, float)  # YAML int coerced to float
    assert sc.federation.wire.value_dtype is None  # unset: each method's own (methods.resolve)
    assert sc.clients == 3
    assert sc.data.dataset == "digits"
    assert isinstance(sc.tasks, TasksSpec)
    assert sc.tasks.shared == [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9]]
    assert sc.tasks.per_client is None and sc.tasks.random is None


def test_minimal_files_use_defaults(tmp_path):
    sc = load_config(Scenario, write(tmp_path, BASE))
    assert sc.federation.rounds_per_task == 10 and sc.federation.train.optimizer == "adam"
    agg = load_config(AggregatorConfig, write(tmp_path, AGG, "agg.yaml"))
    assert agg.expected_clients == ["a", "b"] and agg.broker.url == "mqtt://127.0.0.1:1883"
    cl = load_config(ClientConfig, write(tmp_path, CLIENT, "client.yaml"))
    assert cl.client_id == "a" and cl.data.client_tasks == []


def test_exponent_string_is_read_as_float(tmp_path):
    # YAML 1.1 reads 1e-3 (no dot) as a string; the loader accepts it as the number it is.
    text = BASE.replace("name: t", "name: t\n  train: {lr: 1e-3}")
    sc = load_config(Scenario, write(tmp_path, text))
    assert sc.federation.train.lr == pytest.approx(1e-3)


# ----------------------------------------------------------------- bad files

# (id, class, file text, substrings the one-line message must contain)
BAD = [
    ("unknown-top", Scenario, BASE + "clinets: 3\n", ["clinets", "unknown key", "expected one of", "clients"]),
    (
        "unknown-nested",
        Scenario,
        BASE.replace("name: t", "name: t\n  modle: {}"),
        ["federation.modle", "unknown key", "model"],
    ),
    (
        "unknown-deep",
        Scenario,
        BASE.replace("name: t", "name: t\n  train: {lrr: 1}"),
        ["federation.train.lrr", "unknown key", "lr"],
    ),
    ("type-clients-str", Scenario, BASE.replace("clients: 2", "clients: three"), ["clients", "expected int", "three"]),
    ("type-clients-float", Scenario, BASE.replace("clients: 2", "clients: 2.5"), ["clients", "expected int", "2.5"]),
    (
        "type-lr-list",
        Scenario,
        BASE.replace("name: t", "name: t\n  train: {lr: [1]}"),
        ["federation.train.lr", "expected float", "list"],
    ),
    (
        "type-lr-word",
        Scenario,
        BASE.replace("name: t", "name: t\n  train: {lr: fast}"),
        ["federation.train.lr", "expected float", "fast"],
    ),
    (
        "type-bool-for-int",
        Scenario,
        BASE.replace("name: t", "name: t\n  rounds_per_task: true"),
        ["federation.rounds_per_task", "expected int", "bool"],
    ),
    ("type-bool-clients", Scenario, BASE.replace("clients: 2", "clients: yes"), ["clients", "expected int", "bool"]),
    (
        "type-list-item",
        Scenario,
        BASE.replace("name: t", "name: t\n  model: {hidden_sizes: [8, x]}"),
        ["federation.model.hidden_sizes[1]", "expected int", "'x'"],
    ),
    (
        "type-list-expected",
        Scenario,
        BASE.replace("name: t", "name: t\n  model: {hidden_sizes: 8}"),
        ["federation.model.hidden_sizes", "expected a list", "int"],
    ),
    (
        "type-mapping-expected",
        Scenario,
        BASE.replace("federation:\n  name: t", "federation: fed"),
        ["federation", "expected a mapping", "str"],
    ),
    ("type-str-expected", Scenario, BASE.replace("name: t", "name: 12"), ["federation.name", "expected str", "int"]),
    (
        "type-tasks-nested",
        Scenario,
        BASE.replace("[[0], [1]]", "[[0], [one]]"),
        ["tasks.shared[1][0]", "expected int", "one"],
    ),
    ("missing-clients", Scenario, BASE.replace("clients: 2\n", ""), ["clients", "missing value", "int required"]),
    (
        "missing-nested",
        Scenario,
        BASE.replace("name: t", "seed: 1"),
        ["federation.name", "missing value", "str required"],
    ),
    ("missing-everything", Scenario, "", ["federation", "missing value"]),
    ("invalid-yaml", Scenario, "federation: [unclosed\n", ["not valid YAML", "line"]),
    ("invalid-yaml-tab", Scenario, "federation:\n\tname: t\n", ["not valid YAML"]),
    ("top-list", Scenario, "- a\n- b\n", ["expected a mapping at the top level", "list"]),
    ("top-scalar", Scenario, "42\n", ["expected a mapping at the top level", "int"]),
    (
        "literal-dtype",
        Scenario,
        BASE.replace("name: t", "name: t\n  wire: {value_dtype: float8}"),
        ["federation.wire.value_dtype", "expected one of", "float32", "float16", "float8"],
    ),
    (
        "int8-block-zero",
        Scenario,
        BASE.replace("name: t", "name: t\n  wire: {value_dtype: int8, int8_block: 0}"),
        ["int8_block", "1 <= values per scale <= 65535", "got 0"],
    ),
    (
        "int8-rounding",
        Scenario,
        BASE.replace("name: t", "name: t\n  wire: {value_dtype: int8, int8_rounding: up}"),
        ["federation.wire.int8_rounding", "nearest", "stochastic", "up"],
    ),
    (
        "literal-optimizer",
        Scenario,
        BASE.replace("name: t", "name: t\n  train: {optimizer: rmsprop}"),
        ["federation.train.optimizer", "adam", "sgd", "rmsprop"],
    ),
    ("literal-dataset", Scenario, BASE + "data: {dataset: cifar}\n", ["data.dataset", "digits", "mnist", "cifar"]),
    (
        "tasks-two-kinds",
        Scenario,
        BASE.replace("shared: [[0], [1]]", "shared: [[0], [1]]\n  random: {}"),
        ["tasks", "exactly one of shared, per_client, random", "random"],
    ),
    (
        "tasks-shared-and-per-client",
        Scenario,
        BASE.replace("shared: [[0], [1]]", "shared: [[0], [1]]\n  per_client: [[[0]], [[1]]]"),
        ["tasks", "exactly one of shared, per_client, random", "per_client"],
    ),
    (
        "tasks-none",
        Scenario,
        BASE.replace("tasks:\n  shared: [[0], [1]]", "tasks: {}"),
        ["tasks", "exactly one of", "none"],
    ),
    (
        "tasks-per-client-count",
        Scenario,
        BASE.replace("shared: [[0], [1]]", "per_client: [[[0]], [[1]], [[2]]]"),
        ["tasks.per_client", "expected 2 client sequences", "got 3"],
    ),
    ("clients-zero", Scenario, BASE.replace("clients: 2", "clients: 0"), ["clients", ">= 1", "0"]),
    ("federation-name", Scenario, BASE.replace("name: t", "name: a/b"), ["federation", "federation name", "'a/b'"]),
    ("federation-name-newline", Scenario, BASE.replace("name: t", 'name: "a\\nb"'), ["federation", "federation name"]),
    (
        "quorum",
        Scenario,
        BASE.replace("name: t", "name: t\n  rounds: {quorum: 1.5}"),
        ["federation.rounds", "quorum", "1.5"],
    ),
    (
        "train-lr-negative",
        Scenario,
        BASE.replace("name: t", "name: t\n  train: {lr: -1}"),
        ["federation.train", "lr > 0"],
    ),
    (
        "broker-scheme",
        AggregatorConfig,
        AGG + "broker: {url: 'http://host:1883'}\n",
        ["broker", "url", "mqtt://host[:port]", "http://host:1883"],
    ),
    ("broker-no-host", AggregatorConfig, AGG + "broker: {url: 'mqtt://'}\n", ["broker", "url", "mqtt://host[:port]"]),
    (
        "broker-port",
        ClientConfig,
        CLIENT + "broker: {url: 'mqtt://host:port'}\n",
        ["broker", "url", "bad port", "mqtt://host:port"],
    ),
    # docs/protocol.md P-2.4
    ("broker-keepalive", AggregatorConfig, AGG + "broker: {keepalive_s: 1}\n", ["broker", "keepalive_s", ">= 5"]),
    (
        "broker-reconnect",
        AggregatorConfig,
        AGG + "broker: {reconnect_min_s: 5, reconnect_max_s: 1}\n",
        ["broker", "reconnect_min_s <= reconnect_max_s"],
    ),
    ("agg-no-clients", AggregatorConfig, AGG.replace("[a, b]", "[]"), ["expected_clients", "at least one"]),
    ("agg-dup-clients", AggregatorConfig, AGG.replace("[a, b]", "[a, a]"), ["expected_clients", "duplicate"]),
    ("agg-bad-client-id", AggregatorConfig, AGG.replace("[a, b]", "['a+', b]"), ["client id", "'a+'"]),
    ("client-missing-data", ClientConfig, "client_id: a\nfederation: t\n", ["data, data_dir", "exactly one"]),
    ("client-two-data-sources", ClientConfig, CLIENT + "data_dir: /tmp/tasks\n", ["data, data_dir", "exactly one"]),
    ("client-bad-id", ClientConfig, CLIENT.replace("client_id: a", "client_id: 'a#'"), ["client_id", "'a#'"]),
]


@pytest.mark.parametrize("cls, text, expected", [c[1:] for c in BAD], ids=[c[0] for c in BAD])
def test_bad_file_gives_one_line_error(tmp_path, cls, text, expected):
    message = config_error(cls, write(tmp_path, text))
    for part in expected:
        assert part in message, f"{part!r} not in {message!r}"


def test_unreadable_file(tmp_path):
    path = tmp_path / "missing.yaml"
    message = config_error(Scenario, path)
    assert "cannot read file" in message


def test_config_error_is_value_error():
    assert issubclass(ConfigError, ValueError)


def test_unknown_key_with_newline_is_still_one_line(tmp_path):
    message = config_error(Scenario, write(tmp_path, BASE + '"x\\ny": 1\n'))
    assert "unknown key" in message


@pytest.mark.parametrize(
    "setting",
    [
        "rounds: {deadline_s: .nan}",
        "rounds: {start_timeout_s: .nan}",
        "wire: {max_frame_mb: -1}",
        "wire: {max_frame_mb: .nan}",
        "wire: {max_frame_mb: 0}",
        "train: {lr: .inf}",
        "rounds: {quorum: .nan}",
    ],
)
def test_nonsense_numbers_are_rejected(tmp_path, setting):
    """NaN/negative sizes and deadlines must fail at load, not break the round loop later."""
    key = setting.split(":")[0]
    message = config_error(Scenario, write(tmp_path, BASE.replace("name: t", f"name: t\n  {setting}")))
    assert f"federation.{key}" in message, message


# ----------------------------------------------------------------- overrides


def test_override_on_quickstart():
    sc = load_config(Scenario, QUICKSTART, ["federation.rounds_per_task=3"])
    assert sc.federation.rounds_per_task == 3
    assert load_config(Scenario, QUICKSTART).federation.rounds_per_task == 8


def test_override_values_are_yaml():
    sc = load_config(
        Scenario,
        QUICKSTART,
        [
            "federation.model.hidden_sizes=[16, 8]",
            "federation.train.optimizer=sgd",
            "clients=5",
            "federation.wire.value_dtype=float16",
        ],
    )
    assert sc.federation.model.hidden_sizes == [16, 8]
    assert sc.federation.train.optimizer == "sgd"
    assert sc.clients == 5
    assert sc.federation.wire.value_dtype == "float16"


def test_int8_wire_option_reaches_the_codec():
    sc = load_config(
        Scenario,
        QUICKSTART,
        ["federation.wire.value_dtype=int8", "federation.wire.int8_rounding=stochastic", "federation.seed=9"],
    )
    coding = sc.federation.value_coding
    assert (coding.dtype, coding.block, coding.rounding, coding.seed) == ("int8", 64, "stochastic", 9)


def test_override_later_wins():
    sc = load_config(Scenario, QUICKSTART, ["clients=4", "clients=6"])
    assert sc.clients == 6


def test_override_creates_nested_mappings_and_copies():
    raw = {"a": 1, "b": {"c": 2}, "n": None}
    out = apply_overrides(raw, ["x.y.z=5", "b.d=hello", "n.k=true"])
    assert out == {"a": 1, "b": {"c": 2, "d": "hello"}, "x": {"y": {"z": 5}}, "n": {"k": True}}
    assert raw == {"a": 1, "b": {"c": 2}, "n": None}  # input untouched (deep copy)


def test_override_empty_value_is_empty_string():
    assert apply_overrides({}, ["a="]) == {"a": ""}
    assert apply_overrides({}, ["a=b=c"]) == {"a": "b=c"}


def test_override_creates_missing_section_in_file(tmp_path):
    sc = load_config(Scenario, write(tmp_path, BASE), ["federation.train.batch_size=7", "data.dataset=mnist"])
    assert sc.federation.train.batch_size == 7
    assert sc.data.dataset == "mnist"


@pytest.mark.parametrize("item", ["nokey", "a..b=1", "=1", ".a=1", "a.=1", ""])
def test_malformed_override(item):
    with pytest.raises(ConfigError) as info:
        apply_overrides({"a": {"b": 0}}, [item])
    message = str(info.value)
    assert "\n" not in message
    assert "dotted.key=value" in message


def test_override_through_non_mapping():
    with pytest.raises(ConfigError, match="not a mapping"):
        apply_overrides({"a": 1}, ["a.b=2"])
    with pytest.raises(ConfigError, match="not a mapping"):
        apply_overrides({"a": [1, 2]}, ["a.0=2"])


def test_override_value_not_yaml():
    with pytest.raises(ConfigError, match="not valid YAML"):
        apply_overrides({}, ["a=[1"])


def test_override_result_is_validated(tmp_path):
    path = write(tmp_path, BASE)
    message = config_error(Scenario, path, ["federation.modle=1"])
    assert "federation.modle" in message and "unknown key" in message
    message = config_error(Scenario, path, ["clients=three"])
    assert "clients" in message and "expected int" in message
    message = config_error(Scenario, path, ["federation.wire.value_dtype=float8"])
    assert "federation.wire.value_dtype" in message


# -------------------------------------------------------------------- secrets


def test_env_reference_resolves(tmp_path, monkeypatch):
    monkeypatch.setenv("FCL_TEST_BROKER_PW", "s3cret")
    monkeypatch.setenv("FCL_TEST_BROKER_USER", "device-1")
    text = AGG + "broker:\n  username: ${env:FCL_TEST_BROKER_USER}\n  password: ${env:FCL_TEST_BROKER_PW}\n"
    cfg = load_config(AggregatorConfig, write(tmp_path, text))
    assert cfg.broker.username == "device-1"
    assert cfg.broker.password == "s3cret"


def test_env_reference_in_override(tmp_path, monkeypatch):
    monkeypatch.setenv("FCL_TEST_DATA", "/data/mnist")
    sc = load_config(Scenario, write(tmp_path, BASE), ["data.path=${env:FCL_TEST_DATA}"])
    assert sc.data.path == "/data/mnist"


def test_env_reference_missing_variable(tmp_path, monkeypatch):
    monkeypatch.delenv("FCL_TEST_MISSING_PW", raising=False)
    text = AGG + "broker:\n  password: ${env:FCL_TEST_MISSING_PW}\n"
    message = config_error(AggregatorConfig, write(tmp_path, text))
    assert "FCL_TEST_MISSING_PW" in message
    assert "broker.password" in message
    assert "not set" in message


def test_env_reference_must_be_whole_value(tmp_path, monkeypatch):
    monkeypatch.setenv("FCL_TEST_X", "value")
    text = AGG + "broker:\n  password: 'pre-${env:FCL_TEST_X}'\n"
    cfg = load_config(AggregatorConfig, write(tmp_path, text))
    assert cfg.broker.password == "pre-${env:FCL_TEST_X}"


def test_env_value_is_validated(tmp_path, monkeypatch):
    monkeypatch.setenv("FCL_TEST_FED", "not/valid")
    text = BASE.replace("name: t", "name: ${env:FCL_TEST_FED}")
    message = config_error(Scenario, write(tmp_path, text))
    assert "federation name" in message


def test_broker_redacted_hides_password():
    spec = BrokerSpec(url="mqtt://broker.local:1884", username="dev", password="s3cret")
    red = spec.redacted()
    assert red["password"] == "***"
    assert red["url"] == "mqtt://broker.local:1884" and red["username"] == "dev"
    assert "s3cret" not in repr(red)
    assert BrokerSpec().redacted()["password"] is None


# ------------------------------------------------------------------ round trip


def test_scenario_round_trips_through_to_dict():
    sc = load_config(Scenario, QUICKSTART)
    data = to_dict(sc)
    assert isinstance(data, dict) and isinstance(data["federation"]["model"], dict)
    assert from_dict(Scenario, data, "roundtrip") == sc
    # and through YAML text, as fcl simulate writes it
    assert from_dict(Scenario, yaml.safe_load(yaml.safe_dump(data)), "roundtrip") == sc


def test_other_configs_round_trip(tmp_path):
    per_client = from_dict(
        Scenario, {"federation": {"name": "f"}, "clients": 2, "tasks": {"per_client": [[[0], [1]], [[2], [3]]]}}, "x"
    )
    randomised = from_dict(
        Scenario, {"federation": {"name": "f"}, "clients": 2, "tasks": {"random": {"classes_per_task": 2}}}, "x"
    )
    agg = load_config(AggregatorConfig, write(tmp_path, AGG + "broker: {password: pw}\n"))
    client = load_config(ClientConfig, write(tmp_path, CLIENT, "c.yaml"))
    for obj in (per_client, randomised, agg, client):
        assert from_dict(type(obj), to_dict(obj), "roundtrip") == obj


def test_from_dict_prefix_in_messages():
    with pytest.raises(ConfigError) as info:
        from_dict(FederationSpec, {"name": "f", "seed": "x"}, "src.yaml", "federation")
    assert str(info.value).startswith("src.yaml: federation.seed: expected int")
    with pytest.raises(ConfigError, match=r"src.yaml: <top>: expected a mapping"):
        from_dict(Scenario, [1], "src.yaml")
