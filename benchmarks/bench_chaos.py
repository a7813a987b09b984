"""Chaos: seeded fault schedules against a real federation, to show that a fleet never wedges.

Every schedule runs the same small scenario (quickstart's 8x8 digits, 3 devices, 2 tasks of 2
rounds, fedavg) as separate ``fcl aggregator`` / ``fcl client`` processes over a real Mosquitto
WITH persistence (its own mosquitto.conf in the schedule's folder: persistence on, autosave
every second, a free loopback port), and injects one kind of fault at seeded points:

  aggregator_kill       kill -9 the aggregator at a random point of a round (or of the final
                        evaluation), once or twice; restart it on the same config and state
  device_kill_training  kill -9 a device while it trains a round; restart it
  device_kill_upload    kill -9 a device right around its upload (just before, or as soon as the
                        update is seen on the wire); restart it
  broker_kill           kill -9 Mosquitto mid-round, once or twice; restart it on the same port
                        from its persistence file (so retained messages are what autosave kept)
  stale_retained        before the run the broker holds the retained messages of an earlier run
                        of the same federation (one that finished, or one killed mid-run); the
                        aggregator and devices start on fresh state directories
  duplicate_delayed     every genuine update/eval frame seen on fcl/<fed>/update/+ may be
                        re-published at once and again later (0.3-6 s), up to 3 copies
  forged_replayed       frames on a device's update topic that the protocol must reject: a
                        consistent header with a sequence ~31 years ahead, an older sequence than
                        the device's last accepted one (taken from this run or an earlier run,
                        with other tensors), and verbatim replays of frames already accepted
  device_clock_training one device's wall clock steps by +3600 s or -3600 s while it trains a
                        round (as a Raspberry Pi's does when NTP first syncs after boot)
  device_clock_upload   the same step just before or just after its update crosses the broker
  aggregator_clock      the aggregator's wall clock steps by -120 s or +3600 s at a random point
                        of a round (or of the final evaluation)
  end_interrupted       the aggregator killed (-9) or stopped (SIGTERM) between FINISH and its end
                        commit: one device is paused (SIGSTOP) as its last update crosses, the
                        others' final evaluations come in, the aggregator goes down, the paused
                        device evaluates meanwhile, then the aggregator restarts (issue 42)
  forged_run            unsigned downlink, no ACL: a ROUND with a forged run id (far in the
                        future, or a newer one within the clock skew) published next to a genuine
                        announcement; no device may leave the genuine run
  late_device           after the run has ended, one more device starts on a fresh state
                        directory: it must exit RUN_ENDED (9) after run_over_s, not wait forever
  garbage_retained      garbage published retained on the round topic mid-round, and a device
                        killed and restarted right after: the aggregator must publish the
                        round's announcement again before the round's deadline (else the
                        round is "stalled": the device would wait for the next attempt)

In the clock schedules every process runs under benchmarks/clock_shim.py, which adds the
number of seconds in a file of the schedule's folder to ``time.time`` / ``time.time_ns``;
only the stepped process's file changes (monotonic clocks stay, as with a real step).

Final evaluations are data too: a finished run must have every device's final evaluation
(``summary.json`` ``status: complete``, no ``missing_final_evaluations``: else they count as
lost) and the reference's final avg NLL (else it counts as a hash mismatch).

A quarter of the device kills are permanent (the device stays dead during rounds 1..R-2): with
a quorum of 1.0 finishing is then impossible, and the documented ending is the aggregator
exiting 4 (NOT_ENOUGH_CLIENTS) and every device exiting 7 (FEDERATION_FAILED), the dead one
included once it is started again after the aggregator gave up.

Checked per schedule, against one undisturbed reference run of the same scenario:

  outcome          finished (every process exited 0) | failed_as_documented (the codes above,
                   where the schedule makes finishing impossible) | failed (other exit codes)
                   | hung (a process still running at --timeout: everything is killed)
  lost updates     (round, client) pairs the reference accepted that this run recorded as
                   "missing", or (for a finished run) never recorded
  double counted   (round, client) pairs with more than one accepted round_client row, plus
                   every accepted row that is not a genuine update: a forged marker in
                   n_samples, a (n_samples, train_nll) other than the reference's where frames
                   were injected, or a committed per-device sequence mark at or beyond a forged
                   far-future sequence
  hash mismatch    a finished run whose committed global model (state/committed.npz) differs
                   from the reference's: every fault kind here is deterministic when the
                   protocol is right (restarts resume from checkpoints, duplicates and forged
                   frames are rejected, a fresh run on stale retained state is a fresh run)

    python benchmarks/bench_chaos.py                      # 60 schedules over all kinds
    python benchmarks/bench_chaos.py --schedules 7 --seed 3 --kinds broker_kill,forged_replayed
    python benchmarks/bench_chaos.py --schedule forged_replayed:6   # one schedule again

Writes benchmarks/results/chaos.json and chaos.md.
"""

from __future__ import annotations

import argparse
import collections
import hashlib
import json
import os
import platform
import random
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import yaml
from tqdm import tqdm

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # allow `python benchmarks/bench_chaos.py` without installing
    sys.path.insert(0, str(ROOT))

import paho.mqtt.client as mqtt  # noqa: E402

from fcl_edge.broker import MosquittoProcess  # noqa: E402
from fcl_edge.simulate import Plan, plan, write_configs  # noqa: E402
from fclcore import checkpoint, topics  # noqa: E402
from fclcore.codec import CodecError, Frame, Header, Kind, decode, encode  # noqa: E402
from fclcore.exitcodes import ExitCode  # noqa: E402

KINDS = (
    "aggregator_kill",
    "device_kill_training",
    "device_kill_upload",
    "broker_kill",
    "stale_retained",
    "duplicate_delayed",
    "forged_replayed",
    "device_clock_training",
    "device_clock_upload",
    "aggregator_clock",
    "end_interrupted",
    "forged_run",
    "late_device",
    "garbage_retained",
)
CLOCK_KINDS = ("device_clock_training", "device_clock_upload", "aggregator_clock")
CLOCK_SHIM = ROOT / "benchmarks" / "clock_shim.py"
SCENARIO = ROOT / "configs/scenarios/quickstart.yaml"
# 2 tasks x 2 rounds; a round that misses an update asks for it again every second and gives up
# after 2 attempts of 8 s (a killed device restarts in ~3-5 s, so 16 s is ample).
OVERRIDES = (
    "federation.method=fedavg",
    "federation.rounds_per_task=2",
    "federation.rounds.quorum=1.0",
    "federation.rounds.deadline_s=8",
    "federation.rounds.max_attempts=2",
    "federation.rounds.resend_after_s=1",
    "federation.rounds.start_timeout_s=30",
)
BROKER = {"reconnect_min_s": 0.2, "reconnect_max_s": 2.0}  # back within ~2 s of a broker restart
# devices hold their final evaluation (and wait after an ended run) this long: longer than an
# aggregator takes to restart under load; the late device gives up sooner
RUN_OVER_S = 45
LATE_RUN_OVER_S = 5
RUN_ENDED = int(getattr(ExitCode, "RUN_ENDED", 9))
FAR_FUTURE_RUN = "7fffffffffffffff-00000000"
OVERRIDE_DEADLINE_S = 8.0  # federation.rounds.deadline_s above: a round's next attempt comes after it
NOT_ENOUGH_CLIENTS = int(ExitCode.NOT_ENOUGH_CLIENTS)
FEDERATION_FAILED = int(getattr(ExitCode, "FEDERATION_FAILED", 7))  # new in the protocol change
FORGED_SAMPLES = 7777  # n_samples of every frame this harness forges: an accepted one shows in metrics
FUTURE_US = 31 * 365 * 86400 * 10**6  # 31 years in microseconds (device sequences are microsecond clocks)
DEFAULT_TIMEOUT = 90.0


# ---------------------------------------------------------------------------- schedules
@dataclass(frozen=True)
class Schedule:
    kind: str
    seed: int
    params: dict

    @property
    def name(self) -> str:
        return f"{self.kind}:{self.seed}"

    @property
    def expect(self) -> str:
        """Either "finish", or "fail" where the schedule makes finishing impossible (a device gone for good)."""
        return "fail" if self.params.get("permanent") else "finish"


def make_schedule(kind: str, seed: int, rounds: int, clients: list[str], **force: object) -> Schedule:
    """The schedule of ``kind`` drawn from ``seed`` (the same seed gives the same schedule).
    ``force``: parameters to set regardless of the draw (tests pick a variant this way)."""
    if kind not in KINDS:
        raise ValueError(f"unknown fault kind {kind!r}; expected one of {', '.join(KINDS)}")
    rng = random.Random(f"chaos:{kind}:{seed}")
    p: dict = {}
    if kind in ("aggregator_kill", "broker_kill"):
        picks = sorted(rng.sample(range(rounds + 1), rng.choice((1, 2))))  # round == rounds: the final evaluation
        p["kills"] = [
            {
                "round": r,
                "frac": round(rng.uniform(0.0, 1.0), 3),
                "down_s": round(rng.uniform(0.0, 2.0) if kind == "aggregator_kill" else rng.uniform(0.2, 3.0), 3),
            }
            for r in picks
        ]
    elif kind in ("device_kill_training", "device_kill_upload"):
        permanent = rounds >= 3 and rng.random() < 0.25
        p["client"] = rng.choice(clients)
        p["round"] = rng.randint(1, rounds - 2) if permanent else rng.randint(0, rounds - 1)
        p["permanent"] = permanent
        p["down_s"] = round(rng.uniform(0.0, 2.0), 3)
        if kind == "device_kill_training":
            p["frac"] = round(rng.uniform(0.05, 0.7), 3)  # of the reference's training time
        else:
            p["when"] = rng.choice(("before", "after"))
            p["lead_s"] = round(rng.uniform(0.0, 0.05), 3)  # "before": this long before the reference upload
    elif kind in ("device_clock_training", "device_clock_upload"):
        p["client"] = rng.choice(clients)
        p["round"] = rng.randint(0, rounds - 1)
        p["step_s"] = rng.choice((3600, -3600))
        if kind == "device_clock_training":
            p["frac"] = round(rng.uniform(0.05, 0.7), 3)  # of the reference's training time
        else:
            p["when"] = rng.choice(("before", "after"))
            p["lead_s"] = round(rng.uniform(0.0, 0.05), 3)
    elif kind == "aggregator_clock":
        p["round"] = rng.randint(0, rounds)  # rounds: the final evaluation
        p["frac"] = round(rng.uniform(0.0, 1.0), 3)
        p["step_s"] = rng.choice((-120, 3600))
    elif kind == "stale_retained":
        p["old"] = rng.choice(("finished", "aborted"))
        p["abort_round"] = rng.randint(0, rounds - 1)
        p["abort_frac"] = round(rng.uniform(0.0, 1.0), 3)
        p["broker_restart"] = rng.random() < 0.5  # kill -9 + restart from persistence between the runs
        p["devices_first"] = rng.random() < 0.5  # devices see the stale retained frames before any new one
        p["aggregator_delay_s"] = round(rng.uniform(0.0, 2.0), 3)
    elif kind == "duplicate_delayed":
        p["p_now"] = round(rng.uniform(0.5, 1.0), 3)
        p["p_later"] = round(rng.uniform(0.5, 1.0), 3)
        p["delay_s"] = [0.3, round(rng.uniform(1.0, 6.0), 3)]
        p["copies_max"] = rng.randint(1, 3)
    elif kind == "forged_replayed":
        p["future_rounds"] = sorted(rng.sample(range(rounds), rng.randint(1, rounds)))
        p["old_seq_rounds"] = sorted(rng.sample(range(1, rounds), rng.randint(1, rounds - 1)))
        p["old_seq_source"] = rng.choice(("this_run", "earlier_run"))
        p["future_eval"] = rng.random() < 0.5  # a far-future EVAL frame when the final evaluation opens
        p["p_replay"] = round(rng.uniform(0.3, 1.0), 3)  # per genuine frame: a verbatim replay later
        p["replay_delay_s"] = [0.2, round(rng.uniform(2.0, 6.0), 3)]
    elif kind == "end_interrupted":
        p["signal"] = rng.choice(("kill", "term"))
        p["client"] = rng.choice(clients)  # paused: its final evaluation comes while the aggregator is down
        p["down_s"] = round(rng.uniform(0.0, 2.0), 3)
    elif kind == "forged_run":
        p["round"] = rng.randint(0, rounds - 1)
        p["run"] = rng.choice(("far_future", "newer"))
        p["copies"] = rng.randint(1, 3)
    elif kind == "late_device":
        p["client"] = rng.choice(clients)  # whose data and id the late device has
    elif kind == "garbage_retained":
        p["round"] = rng.randint(1, rounds - 1)
        p["client"] = rng.choice(clients)
        p["frac"] = round(rng.uniform(0.05, 0.5), 3)  # of the reference's training time: the kill
        p["garbage_bytes"] = rng.randint(1, 256)
    p.update(force)
    return Schedule(kind, seed, p)


def schedules_for(count: int, seed: int, kinds: tuple[str, ...], rounds: int, clients: list[str]) -> list[Schedule]:
    """``count`` schedules spread round-robin over ``kinds``; schedule i has seed ``seed * 1000 + i``."""
    return [make_schedule(kinds[i % len(kinds)], seed * 1000 + i, rounds, clients) for i in range(count)]


def _decision(seed: int, *key: object) -> random.Random:
    """A generator for one decision keyed by what it is about, not by when it is taken (arrival
    order varies between runs; the decisions of a schedule must not)."""
    return random.Random(":".join(str(k) for k in (seed, *key)))


# ---------------------------------------------------------------------------- the wire
@dataclass
class Seen:
    t: float
    topic: str
    frame: Frame
    payload: bytes


class Wire:
    """A paho subscriber on every topic of the federation (it reconnects after a broker restart)
    that records genuine frames and announcements, and publishes injected frames."""

    def __init__(self, port: int, fed: str, name: str = "chaos-wire") -> None:
        self.fed = fed
        self.lock = threading.Condition()
        self.announced: dict[tuple[Kind, int], float] = {}  # first live (non-retained) ROUND / FINISH
        self.round_frames: dict[int, Frame] = {}  # the first live ROUND / FINISH frame of each round
        self.updates: dict[tuple[int, str, Kind], Seen] = {}  # first genuine UPDATE / EVAL per (round, client)
        self.genuine: list[Seen] = []
        self.injected: set[bytes] = set()  # digests of what this harness published
        self.injections = collections.Counter()  # what was injected, by label
        self.runs: set[str] = set()  # meta "run" ids seen on live downlink frames
        self.hooks: list[Callable[[str, Seen], None]] = []  # ("announce" | "update", Seen), paho's thread
        self.round_payloads: list[tuple[float, bytes]] = []  # every live frame on the round topic
        self.timers: list[threading.Timer] = []
        self.closed = False
        self.client = mqtt.Client(
            mqtt.CallbackAPIVersion.VERSION2, client_id=f"{name}-{os.getpid()}-{id(self)}", clean_session=True
        )
        self.client.reconnect_delay_set(1, 1)
        self.client.on_connect = self._on_connect
        self.client.on_message = self._on_message
        self.client.connect("127.0.0.1", port, keepalive=10)
        self.client.loop_start()

    def _on_connect(self, client, userdata, flags, reason_code, properties) -> None:
        client.subscribe([(f"{topics.ROOT}/{self.fed}/#", 1)])

    def _on_message(self, client, userdata, msg) -> None:
        if not msg.payload:
            return
        try:
            frame = decode(msg.payload)
        except CodecError:
            return
        seen = Seen(time.monotonic(), msg.topic, frame, bytes(msg.payload))
        h = frame.header
        events = []
        with self.lock:
            if msg.topic == topics.round_topic(self.fed) and not msg.retain:
                self.round_payloads.append((seen.t, seen.payload))
            if msg.topic == topics.round_topic(self.fed) and h.kind in (Kind.ROUND, Kind.FINISH) and not msg.retain:
                if isinstance(frame.meta.get("run"), str):
                    self.runs.add(frame.meta["run"])
                if (h.kind, h.round) not in self.announced:
                    self.announced[(h.kind, h.round)] = seen.t
                    self.round_frames[h.round] = frame
                    events.append("announce")
            elif topics.parse_update_topic(self.fed, msg.topic) is not None and h.kind in (Kind.UPDATE, Kind.EVAL):
                digest = hashlib.sha1(seen.payload).digest()
                if digest not in self.injected:
                    self.injected.add(digest)  # a later identical frame is a re-send or a copy: not new
                    self.genuine.append(seen)
                    self.updates.setdefault((h.round, h.client, h.kind), seen)
                    events.append("update")
            self.lock.notify_all()
        for event in events:
            for hook in list(self.hooks):
                hook(event, seen)

    # -- waiting ----------------------------------------------------------------------------
    def wait(self, predicate: Callable[[], object], timeout: float) -> object:
        """The predicate's first truthy value (checked under the lock), or None at the timeout."""
        deadline = time.monotonic() + timeout
        with self.lock:
            while True:
                value = predicate()
                if value or time.monotonic() >= deadline:
                    return value or None
                self.lock.wait(min(0.1, max(0.0, deadline - time.monotonic())))

    def announcement(self, rnd: int, rounds: int) -> float | None:
        """When round ``rnd`` was first announced (``rnd == rounds``: the FINISH)."""
        return self.announced.get((Kind.FINISH if rnd >= rounds else Kind.ROUND, rnd))

    def last_announced(self) -> int:
        return max((r for _, r in self.announced), default=-1)

    # -- injecting --------------------------------------------------------------------------
    def inject(self, topic: str, payload: bytes, label: str, delay: float = 0.0, retain: bool = False) -> None:
        """Publish ``payload`` on ``topic`` now (from any thread, paho's included) or after ``delay`` s."""
        if delay > 0:
            timer = threading.Timer(delay, self.inject, (topic, payload, label))
            timer.daemon = True
            with self.lock:
                if self.closed:
                    return
                self.timers.append(timer)
            timer.start()
            return
        with self.lock:
            if self.closed:
                return
            self.injected.add(hashlib.sha1(payload).digest())
            self.injections[label] += 1
        self.client.publish(topic, payload, qos=1, retain=retain)

    def close(self) -> None:
        with self.lock:
            self.closed = True
            timers, self.timers = self.timers, []
        for timer in timers:
            timer.cancel()
        self.client.loop_stop()
        self.client.disconnect()


# ---------------------------------------------------------------------------- processes
class Procs:
    """The aggregator and device processes of one run directory, started as on a fleet."""

    def __init__(self, p: Plan, out: Path, url: str, clocks: Path | None = None) -> None:
        """``clocks``: run every process under the clock shim, its offset in ``clocks/<name>.offset``."""
        self.out, self.clocks = out, clocks
        (out / "logs").mkdir(parents=True, exist_ok=True)
        self.configs = write_configs(p, out, url)
        for _, path in self.configs.values():  # reconnect quickly after a broker restart
            cfg = yaml.safe_load(path.read_text())
            cfg["broker"] = {**cfg.get("broker", {}), **BROKER}
            if "client_id" in cfg:
                cfg["run_over_s"] = RUN_OVER_S
            path.write_text(yaml.safe_dump(cfg, sort_keys=False))
        self.procs: dict[str, subprocess.Popen] = {}
        self.starts: collections.Counter = collections.Counter()
        self.killed: list[str] = []

    @property
    def names(self) -> list[str]:
        return list(self.configs)

    def start(self, name: str) -> None:
        kind, path = self.configs[name]
        self.starts[name] += 1
        command = [sys.executable, "-m", "fcl_edge.cli", kind, "--config", str(path)]
        if self.clocks is not None:
            command[1:3] = [str(CLOCK_SHIM), str(self.clock_file(name))]
        with open(self.out / "logs" / f"{name}.{self.starts[name]}.log", "w") as log:
            self.procs[name] = subprocess.Popen(
                command,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                cwd=ROOT,
            )

    def clock_file(self, name: str) -> Path:
        return self.clocks / f"{name}.offset"

    def step_clock(self, name: str, seconds: float) -> None:
        """Step ``name``'s wall clock by ``seconds`` (the shim reads the file within 20 ms)."""
        path = self.clock_file(name)
        offset = float(path.read_text()) if path.exists() else 0.0
        tmp = path.with_suffix(".tmp")
        tmp.write_text(f"{offset + seconds}\n")
        os.replace(tmp, path)

    def kill(self, name: str) -> bool:
        """SIGKILL (no handler runs, nothing is flushed); False if it had exited already."""
        proc = self.procs.get(name)
        if proc is None or proc.poll() is not None:
            return False
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
        self.killed.append(name)
        return True

    def add_late(self, name: str, like: str, run_over_s: float) -> None:
        """A device config like ``like``'s on a fresh state directory, started later as ``name``."""
        kind, path = self.configs[like]
        cfg = yaml.safe_load(path.read_text())
        folder = self.out / "late" / name
        cfg.update(out_dir=str(folder), state_dir=str(folder / "state"), run_over_s=run_over_s)
        late = path.with_name(f"{name}.yaml")
        late.write_text(yaml.safe_dump(cfg, sort_keys=False))
        self.configs[name] = (kind, late)

    def pause(self, name: str, paused: bool) -> None:
        """SIGSTOP / SIGCONT (its connection stays up; it acts on nothing meanwhile)."""
        if self.alive(name):
            os.kill(self.procs[name].pid, signal.SIGSTOP if paused else signal.SIGCONT)

    def alive(self, name: str) -> bool:
        return name in self.procs and self.procs[name].poll() is None

    def running(self) -> list[str]:
        return [n for n in self.procs if self.alive(n)]

    def codes(self) -> dict[str, int | None]:
        return {n: p.poll() for n, p in self.procs.items()}

    def kill_all(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)

    def log_tail(self, name: str, lines: int = 12) -> str:
        path = self.out / "logs" / f"{name}.{self.starts[name]}.log"
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.exists() else ""


def make_broker(folder: Path) -> MosquittoProcess:
    """Mosquitto on a free loopback port with persistence in ``folder/db``, saved every second."""
    return MosquittoProcess(folder, persistence_dir=folder / "db", autosave_interval=1)


# ---------------------------------------------------------------------------- results
def events(out: Path, kind: str | None = None) -> list[dict]:
    path = out / "metrics.jsonl"
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except ValueError:
            continue  # a line cut by a kill -9
    return [e for e in rows if kind is None or e.get("event") == kind]


def committed(out: Path) -> tuple[str | None, dict]:
    """(hash of the committed global model, the commit's metadata); (None, {}) if none."""
    path = out / "state" / "committed.npz"
    if not path.exists():
        return None, {}
    try:
        meta, arrays = checkpoint.load(path)
    except checkpoint.CheckpointError:
        return None, {}
    digest = hashlib.sha256()
    for name in sorted(k for k in arrays if k.startswith("global/")):
        array = np.ascontiguousarray(arrays[name])
        digest.update(f"{name}|{array.dtype.str}|{array.shape}|".encode())
        digest.update(array.tobytes())
    return digest.hexdigest()[:16], meta


@dataclass
class Reference:
    """The undisturbed run every schedule is compared with."""

    accepted: dict[tuple[int, str], tuple]  # (round, client) -> (n_samples, train_nll)
    model_hash: str
    rounds: int
    clients: list[str]
    announce: dict[int, float]  # round -> seconds after the first announcement
    round_s: dict[int, float]  # round -> seconds from its announcement to the next (or FINISH)
    train_s: dict[tuple[int, str], float]  # (round, client) -> seconds from announcement to the update
    frames: dict[tuple[int, str], bytes]  # (round, client) -> the genuine UPDATE payload
    broker_db: Path | None  # the reference broker's persistence folder (stopped cleanly)
    seconds: float
    final_avg_nll: float | None = None  # summary.json final.avg_nll


def run_reference(p: Plan, work: Path, timeout: float = DEFAULT_TIMEOUT) -> Reference:
    """One undisturbed run: what every schedule must reproduce, and the timings of its rounds."""
    work.mkdir(parents=True, exist_ok=True)
    fed, rounds = p.scenario.federation.name, p.scenario.federation.total_rounds
    broker = make_broker(work / "broker").start()
    wire = Wire(broker.port, fed, "chaos-reference")
    procs = Procs(p, work / "run", broker.url)
    started = time.monotonic()
    try:
        for name in procs.names:
            procs.start(name)
        deadline = started + timeout
        while procs.running() and time.monotonic() < deadline:
            time.sleep(0.1)
        codes = procs.codes()
        if any(c != 0 for c in codes.values()):
            tails = "\n".join(f"--- {n}\n{procs.log_tail(n)}" for n in procs.names)
            raise RuntimeError(f"the undisturbed reference run did not finish: exit codes {codes}\n{tails}")
    finally:
        procs.kill_all()
        wire.close()
        broker.stop()  # a clean stop writes the persistence file: the stale_retained "finished" state
    seconds = time.monotonic() - started
    rows = events(procs.out, "round_client")
    accepted = {(e["round"], e["client"]): (e.get("n_samples"), e.get("train_nll")) for e in rows}
    model_hash, meta = committed(procs.out)
    if model_hash is None or len(accepted) != rounds * len(p.client_ids):
        raise RuntimeError(f"the reference run left no committed model or {len(accepted)} accepted updates")
    t0 = wire.announcement(0, rounds)
    announce = {r: wire.announcement(r, rounds) - t0 for r in range(rounds + 1) if wire.announcement(r, rounds)}
    round_s = {r: announce[r + 1] - announce[r] for r in range(rounds) if r in announce and r + 1 in announce}
    train_s, frames = {}, {}
    for (r, client, kind), seen in wire.updates.items():
        if kind is Kind.UPDATE and r in announce:
            train_s[(r, client)] = seen.t - t0 - announce[r]
            frames[(r, client)] = seen.payload
    final = json.loads((procs.out / "summary.json").read_text())["final"].get("avg_nll")
    return Reference(
        accepted,
        model_hash,
        rounds,
        p.client_ids,
        announce,
        round_s,
        train_s,
        frames,
        broker.persistence_dir,
        seconds,
        final,
    )


@dataclass
class Result:
    schedule: Schedule
    outcome: str = "hung"  # finished | failed_as_documented | failed | hung
    codes: dict = field(default_factory=dict)
    expected_codes: dict = field(default_factory=dict)
    lost: list = field(default_factory=list)
    double: list = field(default_factory=list)
    hash_match: bool | None = None
    stalled: list = field(default_factory=list)  # rounds whose genuine announcement garbage replaced for good
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # what was done, where the faults landed
    landed: list[str] = field(default_factory=list)  # where each device kill landed: before-upload | after-upload
    rejected: dict = field(default_factory=dict)
    injected: dict = field(default_factory=dict)
    seconds: float = 0.0
    folder: str = ""

    @property
    def ok(self) -> bool:
        wanted = "finished" if self.schedule.expect == "finish" else "failed_as_documented"
        return (
            self.outcome == wanted
            and not self.lost
            and not self.double
            and not self.stalled
            and self.hash_match is not False
        )

    def to_json(self) -> dict:
        return {
            "kind": self.schedule.kind,
            "seed": self.schedule.seed,
            "params": self.schedule.params,
            "expect": self.schedule.expect,
            "outcome": self.outcome,
            "ok": self.ok,
            "codes": self.codes,
            "expected_codes": self.expected_codes,
            "lost_updates": len(self.lost),
            "double_counted": len(self.double),
            "hash_match": self.hash_match,
            "stalled_rounds": self.stalled,
            "problems": self.problems,
            "notes": self.notes,
            "landed": self.landed,
            "rejected": self.rejected,
            "injected": self.injected,
            "seconds": round(self.seconds, 1),
            "folder": self.folder,
        }


# ---------------------------------------------------------------------------- one schedule
class Chaos:
    """Runs one schedule in ``folder``: broker, wire, processes, the faults, then the checks."""

    def __init__(self, schedule: Schedule, p: Plan, ref: Reference, folder: Path, timeout: float) -> None:
        self.s, self.p, self.ref, self.folder, self.timeout = schedule, p, ref, folder, timeout
        self.fed = p.scenario.federation.name
        self.rounds = p.scenario.federation.total_rounds
        self.result = Result(schedule, folder=str(folder))
        self.late_start: list[str] = []  # devices to start again once the aggregator has exited
        self.broker: MosquittoProcess | None = None
        self.wire: Wire | None = None
        self.procs: Procs | None = None
        self.deadline = 0.0
        self.paused: str | None = None  # a device stopped by SIGSTOP (end_interrupted)

    def note(self, text: str) -> None:
        self.result.notes.append(f"{time.monotonic() - self.started:6.2f}s {text}")

    def left(self) -> float:
        return max(0.0, self.deadline - time.monotonic())

    def run(self) -> Result:
        shutil.rmtree(self.folder, ignore_errors=True)
        self.folder.mkdir(parents=True)
        self.started = time.monotonic()
        self.deadline = self.started + self.timeout
        try:
            self.broker = make_broker(self.folder / "broker")
            if self.s.kind == "stale_retained":
                self._stale_state()
            else:
                self.broker.start()
            self.wire = Wire(self.broker.port, self.fed)
            clocks = self.folder / "clocks" if self.s.kind in CLOCK_KINDS else None
            if clocks is not None:
                clocks.mkdir(parents=True)
            self.procs = Procs(self.p, self.folder / "run", self.broker.url, clocks)
            self._install_hooks()
            self._start()
            self._faults()
            self._wait_end()
        except (RuntimeError, OSError, ValueError, subprocess.SubprocessError) as exc:  # the harness's own
            self.result.outcome = "failed"
            self.result.problems.append(f"harness error: {exc!r}")
        finally:
            self._stop()
        self.result.seconds = time.monotonic() - self.started
        self._check()
        (self.folder / "result.json").write_text(json.dumps(self.result.to_json(), indent=2) + "\n")
        return self.result

    # -- start and stop ---------------------------------------------------------------------
    def _start(self) -> None:
        devices = [n for n in self.procs.names if n != "aggregator"]  # (the late device is added later)
        if self.s.kind == "stale_retained" and self.s.params["devices_first"]:
            for name in devices:
                self.procs.start(name)
            self._wait_logged(devices, "connected to", 30)
            time.sleep(self.s.params["aggregator_delay_s"])
            self.procs.start("aggregator")
            self.note("devices started first (they see the stale retained frames), then the aggregator")
            return
        self.procs.start("aggregator")
        if self.s.kind == "stale_retained":
            time.sleep(self.s.params["aggregator_delay_s"])
        for name in devices:
            self.procs.start(name)

    def _wait_logged(self, names: list[str], text: str, timeout: float) -> None:
        deadline = time.monotonic() + min(timeout, self.left())
        while time.monotonic() < deadline:
            logs = [self.procs.out / "logs" / f"{n}.{self.procs.starts[n]}.log" for n in names]
            if all(p.exists() and text in p.read_text(errors="replace") for p in logs):
                return
            time.sleep(0.05)

    def _wait_end(self) -> None:
        """Until every process has exited (the dead device is started again once the aggregator
        has exited), or the schedule's timeout: then everything still running is hung."""
        while time.monotonic() < self.deadline:
            if self.late_start and not self.procs.alive("aggregator"):
                for name in self.late_start:
                    self.note(f"aggregator exited {self.procs.procs['aggregator'].poll()}; starting {name} again")
                    self.procs.start(name)
                self.late_start = []
            if not self.procs.running() and not self.late_start:
                break
            time.sleep(0.1)
        codes = self.procs.codes()
        self.result.codes = {n: c for n, c in codes.items()}
        hung = [n for n, c in codes.items() if c is None] + self.late_start
        if self.s.expect == "finish":
            self.result.expected_codes = {n: RUN_ENDED if n == "late" else 0 for n in self.procs.names}
        else:
            self.result.expected_codes = {
                n: NOT_ENOUGH_CLIENTS if n == "aggregator" else FEDERATION_FAILED for n in self.procs.names
            }
        if hung:
            self.result.outcome = "hung"
            ended = {n: c for n, c in codes.items() if c is not None}
            self.result.problems.append(
                f"hung: {', '.join(hung)} still running after {self.timeout:.0f} s (exited: {ended or 'none'})"
            )
            for name in hung:
                if name in self.procs.procs:
                    self.result.notes.append(f"last lines of {name}:\n{self.procs.log_tail(name, 6)}")
        elif self.result.codes == self.result.expected_codes:
            self.result.outcome = "finished" if self.s.expect == "finish" else "failed_as_documented"
        else:
            self.result.outcome = "failed"
            self.result.problems.append(f"exit codes {self.result.codes}, expected {self.result.expected_codes}")
            for name, code in codes.items():
                if code != self.result.expected_codes.get(name):
                    self.result.notes.append(f"last lines of {name}:\n{self.procs.log_tail(name, 6)}")

    def _stop(self) -> None:
        if self.procs is not None:
            if self.paused:
                self.procs.pause(self.paused, False)
            self.procs.kill_all()
        if self.wire is not None:
            self.result.injected = dict(self.wire.injections)
            self.wire.close()
        if self.broker is not None:
            self.broker.stop()

    # -- faults -----------------------------------------------------------------------------
    def _faults(self) -> None:
        kind = self.s.kind
        if kind in ("aggregator_kill", "broker_kill"):
            for kill in self.s.params["kills"]:
                self._kill_mid_round(kind, kill)
        elif kind == "device_kill_training":
            self._kill_device_training()
        elif kind == "device_kill_upload":
            self._kill_device_upload()
        elif kind in ("device_clock_training", "device_clock_upload"):
            self._step_device_clock()
        elif kind == "aggregator_clock":
            self._step_aggregator_clock()
        elif kind == "end_interrupted":
            self._interrupt_the_end()
        elif kind == "late_device":
            self._late_device()
        elif kind == "garbage_retained":
            self._garbage_and_restart()

    def _at(self, rnd: int, offset: float) -> float | None:
        """Wait until ``offset`` s after round ``rnd``'s announcement; when it was announced, or None."""
        t0 = self.wire.wait(lambda: self.wire.announcement(rnd, self.rounds), self.left())
        if t0 is None:
            self.note(f"round {rnd} was never announced: fault not applied")
            return None
        time.sleep(max(0.0, min(t0 + offset - time.monotonic(), self.left())))
        return t0

    def _kill_mid_round(self, kind: str, kill: dict) -> None:
        rnd = kill["round"]
        span = self.ref.round_s.get(rnd, 1.0)
        if self._at(rnd, kill["frac"] * span) is None:
            return
        where = f"round {self.wire.last_announced()} open" if rnd < self.rounds else "final evaluation"
        if kind == "aggregator_kill":
            if not self.procs.kill("aggregator"):
                self.note("aggregator had exited already: nothing to kill")
                return
            self.note(f"kill -9 aggregator ({where}); down {kill['down_s']} s")
            time.sleep(kill["down_s"])
            self.procs.start("aggregator")
        else:
            self.broker.kill()
            self.note(f"kill -9 mosquitto ({where}); down {kill['down_s']} s")
            time.sleep(kill["down_s"])
            for attempt in range(3):  # the port may take a moment to be free again
                try:
                    self.broker.start()
                    break
                except RuntimeError:
                    if attempt == 2:
                        raise
                    time.sleep(0.5)
            self.note("mosquitto restarted from its persistence file")

    # -- the end of the run, late devices, retained garbage -------------------------------------
    def _interrupt_the_end(self) -> None:
        pr, client = self.s.params, self.s.params["client"]
        others = [c for c in self.ref.clients if c != client]
        got = self.wire.wait(
            lambda: all((self.rounds, c, Kind.EVAL) in self.wire.updates for c in others) and self.paused, self.left()
        )
        if got is None:
            self.note("the others' final evaluations never came (or the device was never paused): fault not applied")
            self.procs.pause(client, False)
            return
        early = (self.rounds, client, Kind.EVAL) in self.wire.updates
        agg = self.procs.procs["aggregator"]
        if pr["signal"] == "kill":
            self.procs.kill("aggregator")
        else:
            agg.send_signal(signal.SIGTERM)
            code = agg.wait(min(60.0, self.left()))
            if code != int(ExitCode.INTERRUPTED):
                self.result.problems.append(f"SIGTERM in the final evaluation: aggregator exited {code}, not 130")
        where = "its final evaluation had crossed already" if early else "its final evaluation not sent"
        self.note(f"{pr['signal']} aggregator between FINISH and the end commit ({client} paused, {where})")
        self.procs.pause(client, False)
        self.paused = None
        time.sleep(pr["down_s"])
        self.procs.start("aggregator")
        self.note(f"aggregator restarted after {pr['down_s']} s")

    def _late_device(self) -> None:
        """Once the run is over, a device on a fresh state directory: it must give up (RUN_ENDED)."""
        agg = self.procs.procs["aggregator"]
        try:
            agg.wait(self.left())
        except subprocess.TimeoutExpired:
            return
        self.wire.wait(lambda: not any(self.procs.alive(c) for c in self.ref.clients), self.left())
        self.procs.add_late("late", self.s.params["client"], LATE_RUN_OVER_S)
        self.procs.start("late")
        self.note(f"the run is over (aggregator exited {agg.poll()}); a late device started on fresh state")

    def _garbage_and_restart(self) -> None:
        pr, client, rnd = self.s.params, self.s.params["client"], self.s.params["round"]
        if self._at(rnd, pr["frac"] * self.ref.train_s.get((rnd, client), 0.3)) is None:
            return
        garbage = random.Random(self.s.seed).randbytes(pr["garbage_bytes"])
        with self.wire.lock:
            announced = self.wire.round_frames[rnd]
            genuine = next(p for _, p in self.wire.round_payloads if decode(p).header == announced.header)
        self.procs.kill(client)
        at = time.monotonic()
        self.wire.inject(topics.round_topic(self.fed), garbage, "garbage-retained", retain=True)
        self.note(f"kill -9 {client} in round {rnd}; {len(garbage)} bytes of garbage retained on the round topic")
        time.sleep(0.3)  # the broker holds the garbage when the device subscribes again
        self.procs.start(client)
        self.note(f"{client} restarted")
        repaired = self.wire.wait(
            lambda: next((t for t, p in self.wire.round_payloads if t > at and p == genuine), None),
            min(self.left(), OVERRIDE_DEADLINE_S),
        )
        if repaired is None:  # the device would wait for the round's next attempt
            self.result.stalled.append(rnd)
            self.result.problems.append(f"round {rnd}'s announcement was not published again after the garbage")
        else:
            self.note(f"round {rnd}'s announcement published again {repaired - at:.2f} s after the garbage")

    def _kill_device_training(self) -> None:
        pr = self.s.params
        client, rnd = pr["client"], pr["round"]
        offset = pr["frac"] * self.ref.train_s.get((rnd, client), 0.3)
        if self._at(rnd, offset) is None:
            return
        self._kill_device(client, rnd)

    def _kill_device_upload(self) -> None:
        pr = self.s.params
        client, rnd = pr["client"], pr["round"]
        if pr["when"] == "before":
            offset = max(0.0, self.ref.train_s.get((rnd, client), 0.3) - pr["lead_s"])
            if self._at(rnd, offset) is None:
                return
            self._kill_device(client, rnd)
            return
        fired = threading.Event()

        def on_update(event: str, seen: Seen) -> None:  # paho's thread: kill at once
            h = seen.frame.header
            if event == "update" and h.kind is Kind.UPDATE and h.client == client and h.round == rnd:
                if not fired.is_set() and self.procs.alive(client):
                    os.kill(self.procs.procs[client].pid, signal.SIGKILL)
                fired.set()

        self.wire.hooks.append(on_update)
        with self.wire.lock:
            early = self.wire.updates.get((rnd, client, Kind.UPDATE))
        if early is not None:  # it crossed before the hook was in place
            on_update("update", early)
        if not fired.wait(self.left()):
            self.note(f"{client}'s update for round {rnd} never seen: fault not applied")
            return
        self.wire.hooks.remove(on_update)
        self.procs.procs[client].wait(10)
        self.procs.killed.append(client)
        self.result.landed.append("after-upload")
        self.note(f"kill -9 {client} as its round {rnd} update crossed the broker")
        self._after_device_kill(client)

    def _kill_device(self, client: str, rnd: int) -> None:
        with self.wire.lock:
            uploaded = (rnd, client, Kind.UPDATE) in self.wire.updates
        if not self.procs.kill(client):
            self.note(f"{client} had exited already: nothing to kill")
            return
        landed = "after its upload" if uploaded else "before its upload (training or checkpointing)"
        self.result.landed.append("after-upload" if uploaded else "before-upload")
        self.note(f"kill -9 {client} in round {rnd}, {landed}")
        self._after_device_kill(client)

    def _after_device_kill(self, client: str) -> None:
        if self.s.params["permanent"]:
            self.late_start.append(client)
            self.note(f"{client} stays dead until the aggregator has exited")
            return
        time.sleep(self.s.params["down_s"])
        self.procs.start(client)
        self.note(f"{client} restarted after {self.s.params['down_s']} s")

    # -- clock steps ------------------------------------------------------------------------
    def _step_device_clock(self) -> None:
        pr = self.s.params
        client, rnd = pr["client"], pr["round"]
        if self.s.kind == "device_clock_training" or pr["when"] == "before":
            train_s = self.ref.train_s.get((rnd, client), 0.3)
            offset = pr["frac"] * train_s if "frac" in pr else max(0.0, train_s - pr["lead_s"])
            if self._at(rnd, offset) is None:
                return
            with self.wire.lock:
                uploaded = (rnd, client, Kind.UPDATE) in self.wire.updates
            landed = "after-upload" if uploaded else "before-upload"
            where = "after its upload" if uploaded else "before its upload (training or checkpointing)"
        else:
            crossed = self.wire.wait(lambda: self.wire.updates.get((rnd, client, Kind.UPDATE)), self.left())
            if crossed is None:
                self.note(f"{client}'s update for round {rnd} never seen: clock not stepped")
                return
            landed, where = "after-upload", "as its update crossed the broker"
        self.procs.step_clock(client, pr["step_s"])
        self.result.landed.append(landed)
        self.note(f"{client}'s wall clock stepped {pr['step_s']:+d} s in round {rnd}, {where}")

    def _step_aggregator_clock(self) -> None:
        pr = self.s.params
        if self._at(pr["round"], pr["frac"] * self.ref.round_s.get(pr["round"], 1.0)) is None:
            return
        where = f"round {self.wire.last_announced()} open" if pr["round"] < self.rounds else "final evaluation"
        self.procs.step_clock("aggregator", pr["step_s"])
        self.note(f"aggregator's wall clock stepped {pr['step_s']:+d} s ({where})")

    # -- injected frames (paho's thread) -----------------------------------------------------
    def _install_hooks(self) -> None:
        if self.s.kind == "duplicate_delayed":
            self.wire.hooks.append(self._duplicate)
        elif self.s.kind == "forged_replayed":
            self.wire.hooks.append(self._forge)
        elif self.s.kind == "forged_run":
            self.wire.hooks.append(self._forge_run)
        elif self.s.kind == "end_interrupted":
            self.wire.hooks.append(self._pause_at_last_update)

    def _forge_run(self, event: str, seen: Seen) -> None:
        """Next to round ``round``'s genuine announcement: copies under a forged run id."""
        pr, h = self.s.params, seen.frame.header
        if event != "announce" or h.kind is not Kind.ROUND or h.round != pr["round"]:
            return
        run = FAR_FUTURE_RUN if pr["run"] == "far_future" else f"{_now_us() + 5_000_000:016x}-00000000"
        forged = encode(Frame(h, {**seen.frame.meta, "run": run}, seen.frame.tensors))
        for _ in range(pr["copies"]):
            self.wire.inject(topics.round_topic(self.fed), forged, f"forged-run-{pr['run']}")

    def _pause_at_last_update(self, event: str, seen: Seen) -> None:
        """SIGSTOP the chosen device as its last update crosses: it evaluates the final model later."""
        h, client = seen.frame.header, self.s.params["client"]
        if event == "update" and h.kind is Kind.UPDATE and h.client == client and h.round == self.rounds - 1:
            self.procs.pause(client, True)
            self.paused = client

    def _duplicate(self, event: str, seen: Seen) -> None:
        if event != "update":
            return
        pr, h = self.s.params, seen.frame.header
        rng = _decision(self.s.seed, "dup", h.kind.name, h.round, h.client)
        for _ in range(rng.randint(1, pr["copies_max"])):
            if rng.random() < pr["p_now"]:
                self.wire.inject(seen.topic, seen.payload, "duplicate-now")
            if rng.random() < pr["p_later"]:
                self.wire.inject(seen.topic, seen.payload, "duplicate-later", rng.uniform(*pr["delay_s"]))

    def _forge(self, event: str, seen: Seen) -> None:
        pr, h = self.s.params, seen.frame.header
        if event == "update":
            rng = _decision(self.s.seed, "replay", h.kind.name, h.round, h.client)
            if rng.random() < pr["p_replay"]:  # already accepted (or about to be): a verbatim replay later
                self.wire.inject(seen.topic, seen.payload, "replay-verbatim", rng.uniform(*pr["replay_delay_s"]))
            return
        rnd = h.round
        rng = _decision(self.s.seed, "forge", rnd)
        if h.kind is Kind.FINISH:
            if pr["future_eval"]:
                client = rng.choice(self.ref.clients)
                header = Header(Kind.EVAL, self.fed, rnd, h.task, client, _now_us() + FUTURE_US)
                self._inject_forged(client, encode(Frame(header, {}, {})), "forged-future-eval")
            return
        if rnd in pr["future_rounds"]:  # before the genuine update: the device is still training
            client = rng.choice(self.ref.clients)
            self._inject_forged(client, _forged(seen.frame, client, _now_us() + FUTURE_US, rng), "forged-future")
        if rnd in pr["old_seq_rounds"]:
            client = rng.choice(self.ref.clients)
            sequence = self._old_sequence(rnd, client)
            if sequence is not None:
                self._inject_forged(client, _forged(seen.frame, client, sequence, rng), "forged-old-sequence")
        for (r, client), payload in sorted(self.ref.frames.items()):  # an earlier run's frames of closed rounds
            if r < rnd and rng.random() < 0.3:
                self.wire.inject(topics.update_topic(self.fed, client), payload, "replay-earlier-run")

    def _old_sequence(self, rnd: int, client: str) -> int | None:
        """A sequence the aggregator has accepted from ``client`` already (or an older one)."""
        if self.s.params["old_seq_source"] == "earlier_run" and (rnd, client) in self.ref.frames:
            return decode(self.ref.frames[(rnd, client)]).header.sequence
        seen = self.wire.updates.get((rnd - 1, client, Kind.UPDATE))
        return seen.frame.header.sequence if seen is not None else None

    def _inject_forged(self, client: str, payload: bytes, label: str) -> None:
        self.wire.inject(topics.update_topic(self.fed, client), payload, label)

    # -- stale retained state -----------------------------------------------------------------
    def _stale_state(self) -> None:
        """Leave the broker holding an earlier run's retained messages, then start it for the new run."""
        pr = self.s.params
        db = self.broker.persistence_dir
        if pr["old"] == "finished":
            shutil.copytree(self.ref.broker_db, db)
            self.broker.start()
            self.note("broker started from the persistence file of the finished reference run")
            return
        self.broker.start()
        wire = Wire(self.broker.port, self.fed, "chaos-old-run")
        old = Procs(self.p, self.folder / "old-run", self.broker.url)
        try:
            for name in old.names:
                old.start(name)
            rnd = pr["abort_round"]
            t0 = wire.wait(lambda: wire.announcement(rnd, self.rounds), self.left())
            if t0 is not None:
                time.sleep(max(0.0, t0 + pr["abort_frac"] * self.ref.round_s.get(rnd, 1.0) - time.monotonic()))
            for name in old.names:
                old.kill(name)
            self.note(f"earlier run killed (kill -9, every process) with round {wire.last_announced()} open")
        finally:
            old.kill_all()
            wire.close()
        if pr["broker_restart"]:
            time.sleep(1.5)  # one autosave
            self.broker.kill()
            self.broker.start()
            self.note("broker killed -9 and restarted from its persistence file")

    # -- checks -----------------------------------------------------------------------------
    def _check(self) -> None:
        r, out = self.result, self.procs.out if self.procs else self.folder / "run"
        rows = events(out, "round_client")
        summary_path = out / "summary.json"
        if summary_path.exists():
            try:
                r.rejected = json.loads(summary_path.read_text()).get("rejected", {})
            except ValueError:
                pass
        if not r.rejected:
            r.rejected = dict(collections.Counter(e.get("reason") for e in events(out, "rejected")))
        accepted = collections.Counter((e["round"], e["client"]) for e in rows if e.get("status") == "accepted")
        missing = {(e["round"], e["client"]) for e in rows if e.get("status") != "accepted"}
        lost = set(self.ref.accepted) & missing
        if r.outcome == "finished":
            lost |= set(self.ref.accepted) - set(accepted)
        r.lost = sorted(lost)
        if r.lost:
            r.problems.append(f"lost updates (round, client): {r.lost}")
        double = [(pair, n) for pair, n in sorted(accepted.items()) if n > 1]
        if double:
            r.problems.append(f"accepted more than once (round, client) x times: {double}")
        foreign = []
        injecting = self.s.kind in ("duplicate_delayed", "forged_replayed", "stale_retained")
        for e in rows:
            pair = (e["round"], e["client"])
            if e.get("status") != "accepted":
                continue
            if e.get("n_samples") == FORGED_SAMPLES:
                foreign.append((pair, "a forged frame (its n_samples marker)"))
            elif (
                injecting
                and pair in self.ref.accepted
                and (e.get("n_samples"), e.get("train_nll")) != (self.ref.accepted[pair])
            ):
                foreign.append((pair, f"not the genuine update (n_samples, train_nll {e.get('train_nll')})"))
        model_hash, meta = committed(out)
        floor = _now_us() + FUTURE_US // 2
        for client, seq in sorted((meta.get("last_seq") or {}).items()):
            if isinstance(seq, int) and seq >= floor:
                foreign.append(((meta.get("round"), client), f"committed sequence mark {seq} is a forged future one"))
        if foreign:
            r.problems.append(f"foreign frames accepted: {foreign}")
        r.double = [pair for pair, n in double for _ in range(n - 1)] + [pair for pair, _ in foreign]
        if r.outcome == "finished":
            r.hash_match = model_hash == self.ref.model_hash
            if not r.hash_match:
                got = f"committed global model {model_hash} (round {meta.get('round')})"
                r.problems.append(f"{got} != reference {self.ref.model_hash}")
            self._check_end(summary_path)

    def _check_end(self, summary_path: Path) -> None:
        """Final evaluations are data: every device's is in, and the final metrics are the reference's."""
        r = self.result
        try:
            summary = json.loads(summary_path.read_text())
        except (OSError, ValueError):
            summary = {}
        missing = summary.get("missing_final_evaluations")
        if summary.get("status") != "complete" or missing:
            r.lost += [("final", c) for c in (missing or ["?"])]
            r.problems.append(f"summary status {summary.get('status')!r}, final evaluations missing: {missing}")
        final = (summary.get("final") or {}).get("avg_nll")
        if final is None or self.ref.final_avg_nll is None or round(final, 4) != round(self.ref.final_avg_nll, 4):
            r.hash_match = False
            r.problems.append(f"final avg NLL {final} != reference {self.ref.final_avg_nll}")


def _now_us() -> int:
    return time.time_ns() // 1000


def _forged(round_frame: Frame, client: str, sequence: int, rng: random.Random) -> bytes:
    """An UPDATE for the announced round with a consistent header, the marker n_samples and
    tensors that would move the model (the announced global model plus noise)."""
    h = round_frame.header
    noise = np.random.default_rng(rng.randrange(2**32))
    tensors = {
        name: (np.asarray(value, np.float32) + noise.normal(0, 0.05, np.shape(value))).astype(np.float32)
        for name, value in round_frame.tensors.items()
        if isinstance(value, np.ndarray)
    }
    header = Header(Kind.UPDATE, h.federation, h.round, h.task, client, sequence)
    return encode(Frame(header, {"n_samples": FORGED_SAMPLES, "train_nll": 9.9999}, tensors))


def run_schedule(schedule: Schedule, p: Plan, ref: Reference, folder: Path, timeout: float = DEFAULT_TIMEOUT) -> Result:
    return Chaos(schedule, p, ref, folder, timeout).run()


def chaos_plan() -> Plan:
    return plan(str(SCENARIO), list(OVERRIDES))


# ---------------------------------------------------------------------------- report
def _counts(rs: list[Result]) -> dict:
    """Outcomes and check failures over some results (the whole run, or one fault kind)."""
    return {
        "finished": sum(r.outcome == "finished" for r in rs),
        "failed_as_documented": sum(r.outcome == "failed_as_documented" for r in rs),
        "failed": sum(r.outcome == "failed" for r in rs),
        "hung": sum(r.outcome == "hung" for r in rs),
        "lost_updates": sum(len(r.lost) for r in rs),
        "double_counted": sum(len(r.double) for r in rs),
        "hash_mismatches": sum(r.hash_match is False for r in rs),
        "stalled_rounds": sum(len(r.stalled) for r in rs),
        "ok": sum(r.ok for r in rs),
    }


def summarize(results: list[Result], minutes: float, command: str) -> dict:
    by_fault = {}
    for kind in dict.fromkeys(r.schedule.kind for r in results):
        rs = [r for r in results if r.schedule.kind == kind]
        by_fault[kind] = {
            "runs": len(rs),
            **_counts(rs),
            **(
                {"landed": dict(collections.Counter(x for r in rs for x in r.landed))}
                if kind.startswith("device")
                else {}
            ),
            "seconds_median": round(statistics.median(r.seconds for r in rs), 1),
            "seconds_max": round(max(r.seconds for r in rs), 1),
        }
    return {
        "schedules": len(results),
        **_counts(results),
        "by_fault": by_fault,
        "minutes": round(minutes, 2),
        "machine": {
            "platform": platform.platform(),
            "machine": platform.machine(),
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "mosquitto": _mosquitto_version(),
        },
        "command": command,
        "scenario": {"file": str(SCENARIO.relative_to(ROOT)), "overrides": list(OVERRIDES)},
        "failing": [r.to_json() for r in results if not r.ok],
    }


def _mosquitto_version() -> str | None:
    binary = shutil.which("mosquitto") or "/usr/sbin/mosquitto"
    try:
        out = subprocess.run([binary, "-h"], capture_output=True, text=True, timeout=5).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return out.splitlines()[0].strip() if out else None


def markdown(res: dict) -> str:
    m = res["machine"]
    lines = [
        "# Chaos: seeded fault schedules over a persistent Mosquitto",
        "",
        f"`{res['command']}`: {res['schedules']} schedules in {res['minutes']} min on {m['cpus']} CPUs "
        f"({m['platform']}, {m.get('mosquitto')}).  Scenario: {res['scenario']['file']} with "
        f"{', '.join(res['scenario']['overrides'])}.",
        "",
        f"Finished {res['finished']}, failed as documented {res['failed_as_documented']}, failed {res['failed']}, "
        f"hung {res['hung']}; lost updates {res['lost_updates']}, double counted {res['double_counted']}, "
        f"hash mismatches {res['hash_mismatches']}; {res['ok']}/{res['schedules']} schedules as expected.",
        "",
        "| fault | runs | finished | failed as documented | failed | hung | lost | double counted | "
        "hash mismatches | as expected | median s | max s |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for kind, f in res["by_fault"].items():
        lines.append(
            f"| {kind} | {f['runs']} | {f['finished']} | {f['failed_as_documented']} | {f['failed']} | {f['hung']} | "
            f"{f['lost_updates']} | {f['double_counted']} | {f['hash_mismatches']} | {f['ok']}/{f['runs']} | "
            f"{f['seconds_median']} | {f['seconds_max']} |"
        )
    landed = [f"{kind}: {json.dumps(f['landed'])}" for kind, f in res["by_fault"].items() if f.get("landed")]
    if landed:
        lines += [
            "",
            "Where the device faults (kills, clock steps) landed, relative to its update crossing the broker:",
        ]
        lines += [f"- {x}" for x in landed]
    lines += ["", "## Failing schedules", ""]
    if not res["failing"]:
        lines.append("None.")
    for f in res["failing"]:
        lines += [
            f"### {f['kind']} seed {f['seed']}: {f['outcome']} (expected: {f['expect']})",
            "",
            f"Reproduce: `python benchmarks/bench_chaos.py --schedule {f['kind']}:{f['seed']}`",
            "",
            f"- parameters: `{json.dumps(f['params'])}`",
            *[f"- {p}" for p in f["problems"]],
            f"- rejected by the aggregator: `{json.dumps(f['rejected'])}`; injected: `{json.dumps(f['injected'])}`",
            "",
            "```",
            *f["notes"],
            "```",
            "",
        ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Seeded fault schedules (kills of the aggregator, devices and broker; stale retained state; "
        "duplicated, delayed, forged and replayed frames) against a federation on a persistent Mosquitto.",
    )
    parser.add_argument("--schedules", type=int, default=60, help="how many schedules, spread over the kinds")
    parser.add_argument("--seed", type=int, default=0, help="schedule i has seed SEED * 1000 + i")
    parser.add_argument("--kinds", default=",".join(KINDS), help=f"comma-separated subset of {', '.join(KINDS)}")
    parser.add_argument(
        "--schedule", action="append", default=[], metavar="KIND:SEED", help="run exactly this schedule (repeatable)"
    )
    parser.add_argument("--work", help="keep every run's folder here (default: a temporary folder, kept on failure)")
    parser.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT, help="seconds before a schedule is hung")
    parser.add_argument("--out", default=str(ROOT / "benchmarks/results/chaos"), help="results path without suffix")
    args = parser.parse_args(argv)
    if shutil.which("mosquitto") is None and not Path("/usr/sbin/mosquitto").exists():
        parser.error("mosquitto is not installed (apt-get install mosquitto)")
    kinds = tuple(k.strip() for k in args.kinds.split(",") if k.strip())
    unknown = [k for k in kinds if k not in KINDS]
    if unknown or not kinds:
        parser.error(f"--kinds: unknown {unknown}; expected some of {', '.join(KINDS)}")

    p = chaos_plan()
    rounds, clients = p.scenario.federation.total_rounds, p.client_ids
    if args.schedule:
        todo = []
        for spec in args.schedule:
            kind, _, seed = spec.partition(":")
            if kind not in KINDS or not seed.lstrip("-").isdigit():
                parser.error(f"--schedule: expected KIND:SEED, got {spec!r}")
            todo.append(make_schedule(kind, int(seed), rounds, clients))
    else:
        todo = schedules_for(args.schedules, args.seed, kinds, rounds, clients)
    keep = args.work is not None
    work = Path(args.work) if keep else Path(tempfile.mkdtemp(prefix="fcl-chaos-"))
    work.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    print(f"reference run (undisturbed) in {work / 'reference'}", flush=True)
    ref = run_reference(p, work / "reference", args.timeout)
    print(f"reference: {ref.seconds:.1f} s, committed model {ref.model_hash}", flush=True)
    results: list[Result] = []
    bar = tqdm(todo, unit="schedule", dynamic_ncols=True)
    for schedule in bar:
        bar.set_description(schedule.name)
        folder = work / f"{schedule.kind}-{schedule.seed}"
        result = run_schedule(schedule, p, ref, folder, args.timeout)
        results.append(result)
        if result.ok and not keep:
            shutil.rmtree(folder, ignore_errors=True)
        if not result.ok:
            tqdm.write(f"{schedule.name}: {result.outcome}: {'; '.join(result.problems)}")
        bar.set_postfix(ok=sum(r.ok for r in results), failing=sum(not r.ok for r in results))
    bar.close()
    command = "python benchmarks/bench_chaos.py" + "".join(f" {shlex.quote(a)}" for a in (argv or sys.argv[1:]))
    res = summarize(results, (time.monotonic() - started) / 60, command)
    res["reference"] = {"seconds": round(ref.seconds, 1), "model_hash": ref.model_hash, "rounds": rounds}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(res, indent=2) + "\n")
    out.with_suffix(".md").write_text(markdown(res))
    print(json.dumps({k: v for k, v in res.items() if k not in ("failing", "machine")}, indent=2))
    print(f"wrote {out.with_suffix('.json')} and {out.with_suffix('.md')}")
    if not keep and all(r.ok for r in results):
        shutil.rmtree(work, ignore_errors=True)
    elif not keep:
        print(f"folders of the failing schedules are kept in {work}")
    return 0 if all(r.ok for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
