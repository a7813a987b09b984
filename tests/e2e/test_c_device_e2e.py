"""The conformance proof of docs/protocol.md: interop/c-device/, a FedAvg device in C11 on
libmosquitto written from the spec and the vectors, is built here and joins a federation of
the real aggregator and a Python device over a real Mosquitto, unsigned and signed (one
run with 8-bit values both ways, one with sparse deltas on the downlink).  The run must
finish with every update accepted, the model digest verified at every announcement and not a
message of the C device rejected, nor one dropped by it.  It also decodes every golden vector, and a changed vector
makes it fail.

Skipped, with the reason, only where no C compiler or no ``mosquitto.h`` exists (``.ci/run``
installs both); a build error fails."""

from __future__ import annotations

import collections
import json
import shutil
import subprocess
import threading
from pathlib import Path

import paho.mqtt.client as mqtt
import pytest
from support.timescale import scaled

from fclcore.codec import SparseTensor, decode
from tests.support.fleet import Fleet

ROOT = Path(__file__).resolve().parents[2]
SOURCE = ROOT / "interop" / "c-device"
VECTORS = ROOT / "docs" / "protocol-vectors"
C_CLIENT = "client-1"  # the second of two devices (QUICK) is the C one, the first a Python device


def _compiler() -> str | None:
    return shutil.which("cc") or shutil.which("gcc")


@pytest.fixture(scope="module")
def c_device(tmp_path_factory) -> Path:
    compiler = _compiler()
    if compiler is None:
        pytest.skip("no C compiler (cc or gcc): .ci/run installs gcc")
    if not Path("/usr/include/mosquitto.h").exists():
        pytest.skip("no /usr/include/mosquitto.h: .ci/run installs libmosquitto-dev")
    binary = tmp_path_factory.mktemp("c-device") / "fcl-c-device"
    sources = sorted(str(p) for p in (SOURCE / "src").glob("*.c"))
    flags = ["-std=c11", "-O2", "-Wall", "-Wextra", "-Werror", "-D_POSIX_C_SOURCE=200809L"]
    built = subprocess.run(
        [compiler, *flags, "-o", str(binary), *sources, "-lmosquitto", "-lm"], capture_output=True, text=True
    )
    assert built.returncode == 0, built.stderr
    return binary


def test_the_c_device_decodes_every_vector(c_device: Path, tmp_path: Path) -> None:
    """Section 15: every frame decodes to its JSON, every invalid one is rejected, the digest
    (P-7.6) and SplitMix64 (P-7.8) match."""
    run = subprocess.run([str(c_device), "--vectors", str(VECTORS)], capture_output=True, text=True, timeout=scaled(60))
    assert run.returncode == 0, run.stdout + run.stderr
    frames = json.loads((VECTORS / "frames.json").read_text())
    invalid = json.loads((VECTORS / "invalid.json").read_text())
    assert run.stdout.count("\nok   frame ") + run.stdout.startswith("ok   frame ") == len(frames)
    assert run.stdout.count("ok   invalid ") == len(invalid)
    assert "model-digest" in run.stdout and "all passed" in run.stdout

    changed = tmp_path / "vectors"
    shutil.copytree(VECTORS, changed)
    frames[0]["decoded"]["tensors"]["net.0.weight"]["values"][0] += 1.0  # the C decoder must notice
    invalid[0]["hex"] = frames[1]["hex"]  # a valid frame among the invalid ones must be reported
    (changed / "frames.json").write_text(json.dumps(frames))
    (changed / "invalid.json").write_text(json.dumps(invalid))
    failing = subprocess.run(
        [str(c_device), "--vectors", str(changed)], capture_output=True, text=True, timeout=scaled(60)
    )
    assert failing.returncode == 1
    assert f"FAIL frame {frames[0]['name']}" in failing.stdout
    assert f"FAIL invalid {invalid[0]['name']}: accepted" in failing.stdout


class RoundRecorder:
    """The announcements on the C device's own topic (it declares no derived positions and no
    chunks: P-CAP-2), as the broker delivers them (a stock MQTT client)."""

    def __init__(self, port: int, federation: str) -> None:
        self.frames: list = []
        self.lock = threading.Lock()
        self.client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="round-recorder")
        self.client.on_connect = lambda c, *_: c.subscribe(f"fcl/{federation}/down/{C_CLIENT}", qos=1)
        self.client.on_message = self._on_message
        self.client.connect("127.0.0.1", port)
        self.client.loop_start()

    def _on_message(self, client, userdata, message) -> None:
        if message.payload:
            with self.lock:
                self.frames.append(decode(bytes(message.payload)))

    def stop(self) -> None:
        self.client.loop_stop()
        self.client.disconnect()


QUICK = ["compare=[]", "federation.rounds_per_task=3", "clients=2"]
RUNS = {
    # 8-bit values both ways: every delta is dense; in 4 KiB chunks, which the C device gets whole (P-CHK-6)
    "unsigned-int8": ["federation.wire.value_dtype=int8", "federation.wire.chunk_bytes=4096"],
    # float32 and one input order: the Python device never changes the entries MADE's mask cuts,
    # and the C device moves one entry in eight, so the announcements are sparse deltas
    "signed-sparse": ["sign_updates=true", "federation.model.num_orders=1"],
}


@pytest.mark.parametrize("run", list(RUNS))
def test_the_c_device_completes_a_fedavg_federation(run: str, c_device: Path, mosquitto, tmp_path: Path) -> None:
    """P-2.2, P-2.3, P-6.3, P-7.2, P-7.3, P-11.1, P-11.3, P-SEQ-7 (numbered on the aggregator's clock) on the wire."""
    overrides = [*QUICK, *RUNS[run]]
    fleet = Fleet(ROOT / "configs/scenarios/quickstart.yaml", tmp_path / "run", mosquitto.url, overrides)
    assert C_CLIENT in fleet.configs
    recorder = RoundRecorder(mosquitto.port, "quickstart")
    command = [str(c_device), "--host", "127.0.0.1", "--port", str(mosquitto.port)]
    command += ["--federation", "quickstart", "--client", C_CLIENT, "--samples", "40", "--timeout", "400"]
    if "sign_updates=true" in RUNS[run]:
        command += ["--key", str(tmp_path / "run" / "keys" / f"{C_CLIENT}.key")]
    c_log = tmp_path / "c-device.log"
    try:
        fleet.start("aggregator")
        for name in fleet.configs:
            if name not in ("aggregator", C_CLIENT):
                fleet.start(name)
        with open(c_log, "w") as err:
            device = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=err, text=True)
            codes = fleet.wait(timeout=scaled(420))
            out, _ = device.communicate(timeout=scaled(60))
    finally:
        fleet.stop()
        recorder.stop()
    logs = fleet.logs() + "\n--- c-device\n" + c_log.read_text()[-3000:]
    rounds = fleet.plan.scenario.federation.total_rounds
    assert device.returncode == 0, logs
    assert set(codes.values()) == {0}, (codes, logs)

    counts = dict(item.split("=") for item in out.split())
    assert int(counts["updates"]) == rounds, out
    assert int(counts["verified"]) == rounds + 1, out  # every ROUND and the FINISH: the digest checked
    assert int(counts["full_fetches"]) == 0, out  # online from round 0: the full model came with it, deltas after
    assert all(v == "0" for k, v in counts.items() if k.startswith("dropped_")), out

    per_round = collections.Counter(e["round"] for e in fleet.events("round_client") if e["client"] == C_CLIENT)
    assert per_round == {r: 1 for r in range(rounds)}, per_round
    assert all(e["status"] == "accepted" for e in fleet.events("round_client")), logs
    mine = [e for e in fleet.events("rejected") if e.get("client") == C_CLIENT]
    assert mine == [], mine  # no frame of the C device was rejected, not even as a duplicate
    assert C_CLIENT not in fleet.summary()["rejected_by_client"]  # and it dropped nothing (its updates say)

    announcements = [
        f for f in recorder.frames if f.header.kind.name == "ROUND" and f.meta["model"]["base"] is not None
    ]
    assert announcements and all(len(f.meta["model"]["digest"]) == 64 for f in announcements)
    sparse = any(isinstance(t, SparseTensor) for f in announcements for t in f.tensors.values())
    assert sparse == (run == "signed-sparse")  # there, the C device applied sparse deltas


def test_a_restarted_c_device_fetches_the_full_model_and_finishes(c_device: Path, mosquitto, tmp_path: Path) -> None:
    """P-2.3 (its last will), P-7.3 (holding no model, it fetches model/full before it acts on
    the announcement), P-11.1: killed after round 1 and started again, it keeps no state, yet
    every round ends with one accepted update from it and the run finishes."""
    fleet = Fleet(ROOT / "configs/scenarios/quickstart.yaml", tmp_path / "run", mosquitto.url, QUICK)
    command = [str(c_device), "--host", "127.0.0.1", "--port", str(mosquitto.port)]
    command += ["--federation", "quickstart", "--client", C_CLIENT, "--timeout", "400"]
    try:
        fleet.start("aggregator")
        for name in fleet.configs:
            if name not in ("aggregator", C_CLIENT):
                fleet.start(name)
        with open(tmp_path / "c-device.1.log", "w") as err:
            first = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=err)
            fleet.wait_for_round(1, timeout=scaled(300))
            first.kill()
            first.wait(10)
        with open(tmp_path / "c-device.2.log", "w") as err:
            second = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=err, text=True)
            codes = fleet.wait(timeout=scaled(420))
            out, _ = second.communicate(timeout=scaled(60))
    finally:
        fleet.stop()
    logs = fleet.logs() + "\n--- c-device (restarted)\n" + (tmp_path / "c-device.2.log").read_text()[-3000:]
    assert second.returncode == 0 and set(codes.values()) == {0}, (codes, logs)
    counts = dict(item.split("=") for item in out.split())
    assert int(counts["full_fetches"]) == 1 and int(counts["updates"]) >= 1, out
    # the full model (for the first round it answers), a delta for each later round, the FINISH
    assert int(counts["verified"]) == int(counts["updates"]) + 1, out
    rounds = fleet.plan.scenario.federation.total_rounds
    accepted = collections.Counter(
        e["round"] for e in fleet.events("round_client") if e["client"] == C_CLIENT and e["status"] == "accepted"
    )
    assert accepted == {r: 1 for r in range(rounds)}, accepted
