"""Bad input, table-driven (issue 21): every row runs a real ``fcl`` command (or the install
script) as a user would and checks the documented exit code, a reason of at most a few lines
on stderr that names the problem, and no traceback.  Each row fails in about a second, before
any training, except the diverging run (a tiny in-process run that stops at its first round).
How long each row takes is measured by ``benchmarks/bench_bad_inputs.py`` against each row's
``seconds``; the test itself only guards against a hang (``HANG_S``)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from support.timescale import scaled

from fcl_edge.broker import free_port

REPO = Path(__file__).resolve().parents[2]
QUICKSTART = str(REPO / "configs/scenarios/quickstart.yaml")
TINY = [
    "--set",
    "compare=[]",
    "--set",
    "clients=2",
    "--set",
    "federation.rounds_per_task=1",
    "--set",
    "federation.model.hidden_sizes=[16]",
]
MAX_STDERR_LINES = 3
HANG_S = 60  # a row still running then is hung, not slow
# argparse wraps help at $COLUMNS (a terminal's width, the caller's): every run gets one width,
# wide enough that no line of a help text wraps (a hyphenated method name would wrap at its hyphen)
FIXED_WIDTH = {**os.environ, "COLUMNS": "1000"}


@dataclass(frozen=True)
class Case:
    argv: tuple[str, ...]  # after ``python -m fcl_edge.cli``; {w} is the work directory, {closed} a closed port
    code: int
    says: str  # a fragment stderr must contain (stdout for a successful row)
    shell: str | None = None  # instead of argv: a bash pipeline (``{fcl}`` is the fcl command)
    seconds: float = 8.0  # the row's time budget, checked by benchmarks/bench_bad_inputs.py


def _sim(*extra: str, out: str = "{run}") -> tuple[str, ...]:
    return ("simulate", QUICKSTART, "--out", out, *extra)


CASES = {
    # the scenario file and its keys
    "misspelled method": Case(_sim("--set", "federation.method=fedavgg"), 2, "unknown method 'fedavgg'"),
    "misspelled key in the file": Case(("simulate", "{w}/typo.yaml", "--out", "{w}/run"), 2, "federation.metod"),
    "unknown method option": Case(_sim("--set", "federation.options.bogus=1"), 2, "federation.options.bogus"),
    "unknown --set key": Case(_sim("--set", "federation.train.lrr=0.1"), 2, "federation.train.lrr"),
    "wrong type for lr": Case(_sim("--set", "federation.train.lr=fast"), 2, "expected float"),
    "wrong type for clients": Case(_sim("--set", "clients=many"), 2, "clients"),
    "--set without a value": Case(_sim("--set", "federation.train.lr"), 2, "expected dotted.key=value"),
    "zero rounds per task": Case(_sim("--set", "federation.rounds_per_task=0"), 2, "rounds_per_task >= 1"),
    "a class the data lacks": Case(_sim("--set", "tasks.shared=[[0, 1], [2, 99]]"), 2, "class 99"),
    "missing scenario file": Case(("simulate", "{w}/nope.yaml", "--out", "{w}/run"), 2, "No such file"),
    "scenario that is binary": Case(("simulate", "{w}/binary.yaml", "--out", "{w}/run"), 2, "not UTF-8"),
    "scenario that is a directory": Case(("simulate", "{w}", "--out", "{w}/run"), 2, "Is a directory"),
    "missing data directory": Case(
        _sim("--set", "data.dataset=mnist", "--set", "data.path={w}/no-mnist"), 2, "MNIST directory not found"
    ),
    "negative --timeout": Case(_sim("--timeout", "-1"), 2, "--timeout"),
    # the broker
    "unreachable broker": Case(_sim("--broker", "mqtt://127.0.0.1:{closed}"), 3, "Connection refused"),
    "broker url that is not mqtt": Case(_sim("--broker", "http://127.0.0.1:1"), 2, "expected mqtt://"),
    "status of an unreachable broker": Case(("status", "--broker", "mqtt://127.0.0.1:{closed}"), 3, "refused"),
    # the run directory
    "--out that is a file": Case(_sim(out="{w}/typo.yaml"), 2, "not a directory"),
    "--out through a file": Case(_sim(out="{w}/typo.yaml/run"), 2, "cannot create it"),
    "--out holding an earlier run": Case(_sim(out="{w}/earlier"), 2, "pass --force"),
    "--out on a read-only file system": Case(_sim(out="/sys/fcl-edge-run"), 6, "cannot write there"),
    "--out under /proc": Case(_sim(out="/proc/fcl-edge-run"), 6, "cannot write there"),
    # training that diverges: the device stops at its first round and says so
    "diverging training": Case(
        _sim("--in-process", *TINY, "--set", "federation.train.lr=1e30"),
        5,
        "training diverged at round 0 (loss=nan): lower `federation.train.lr`",
        seconds=20.0,
    ),
    # export and infer
    "export of a non-model .npz": Case(("export", "{w}/plain.npz", "--out", "{w}/m.onnx"), 2, "not a served-model"),
    "export of a pickled .npz": Case(("export", "{w}/pickled.npz", "--out", "{w}/m.onnx"), 2, "never loaded"),
    "export of a text file": Case(("export", "{w}/typo.yaml", "--out", "{w}/m.onnx"), 2, "never loaded"),
    "export of a missing file": Case(("export", "{w}/nope.npz", "--out", "{w}/m.onnx"), 2, "no such snapshot"),
    "export into a missing directory": Case(
        ("export", "{w}/snapshot.npz", "--out", "{w}/missing/m.onnx"), 2, "does not exist"
    ),
    "export onto a directory": Case(("export", "{w}/snapshot.npz", "--out", "{w}"), 2, "is a directory"),
    "infer with a non-model file": Case(("infer", "{w}/plain.npz", "--op", "sample"), 2, "plain.npz"),
    "infer into a pipe closed early": Case(
        (), 0, "", shell="{fcl} infer {w}/model.onnx --op sample --n 20000 | head -c 64 >/dev/null"
    ),
    # the services
    "aggregator with a misspelled method": Case(
        ("aggregator", "--config", "{w}/configs/aggregator.yaml", "--set", "federation.method=fedavgg"),
        2,
        "unknown method",
    ),
    "aggregator with an unwritable out_dir": Case(
        ("aggregator", "--config", "{w}/configs/aggregator.yaml", "--set", "out_dir=/sys/fcl-edge-state"),
        6,
        "cannot write the state",
    ),
    "aggregator with an unreachable broker": Case(
        (
            "aggregator",
            "--config",
            "{w}/configs/aggregator.yaml",
            "--set",
            "broker.url=mqtt://127.0.0.1:{closed}",
            "--set",
            "broker.connect_timeout_s=1",
        ),
        3,
        "could not connect",
    ),
    "compare with a misspelled method": Case(_sim("--set", "compare=[confedmade, fedavgg]"), 2, "unknown method"),
    "client with an unknown dataset": Case(
        ("client", "--config", "{w}/configs/client-0.yaml", "--set", "data.dataset=nope"), 2, "data.dataset"
    ),
    "client id that is not a topic level": Case(
        ("client", "--config", "{w}/configs/client-0.yaml", "--set", "client_id=a/b"), 2, "client_id"
    ),
    # small things that must just work
    "version": Case(("--version",), 0, "fcl "),
    "methods listed in simulate --help": Case(("simulate", "--help"), 0, "confedmade, fedavg,"),
    "install script help": Case((), 0, "Options:", shell=f"bash {REPO}/scripts/install-client.sh --help"),
    "a tiny clean run, no progress bar off a terminal": Case(_sim("--in-process", *TINY), 0, "avg NLL", seconds=20.0),
}


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return make_work(tmp_path_factory.mktemp("bad"))


def make_work(w: Path) -> Path:
    """The files the rows point at, in ``w``: a scenario typo, non-model files, a served-model
    snapshot and its ONNX file, service configs, and a run directory holding an earlier run."""
    import numpy as np

    from export.onnx_made import ServedModel, export_served_model
    from export.snapshot import save_snapshot
    from fcl_edge.simulate import plan, write_configs
    from fclcore.made_spec import MadeConfig, init_params

    (w / "typo.yaml").write_text(Path(QUICKSTART).read_text().replace("method: fedavg", "metod: fedavg"))
    (w / "binary.yaml").write_bytes(bytes(range(128, 256)))
    np.savez(w / "plain.npz", weights=np.zeros(3))
    np.savez(w / "pickled.npz", __meta__=np.array("{}"), table=np.array([{"a": 1}], dtype=object))
    cfg = MadeConfig(8, (16,), direct=True, natural_order=True, mask_seed=0)
    model = ServedModel(cfg, init_params(cfg, 0), 0, "fedavg", 0, "value>7")
    save_snapshot(model, w / "snapshot.npz")
    export_served_model(model, w / "model.onnx", parity_inputs=None)
    write_configs(plan(QUICKSTART, ["clients=2"]), w, "mqtt://127.0.0.1:1")
    (w / "earlier").mkdir()
    (w / "earlier" / "summary.json").write_text("{}")
    return w


def run_case(name: str, work: Path, attempt: int = 0) -> tuple[subprocess.CompletedProcess, float]:
    """Run one row as a user would (``attempt`` > 0: again, into a run directory of its own);
    its result and its wall seconds."""
    case = CASES[name]
    run = work / (name.replace(" ", "-") + (f"-{attempt}" if attempt else ""))
    fill = {"w": str(work), "run": str(run), "closed": str(free_port())}
    fill["fcl"] = f"{sys.executable} -m fcl_edge.cli"
    started = time.monotonic()
    if case.shell is not None:
        script = f"set -o pipefail; {case.shell.format(**fill)}"
        result = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=HANG_S, env=FIXED_WIDTH)
    else:
        argv = [a.format(**fill) for a in case.argv]
        cmd = [sys.executable, "-m", "fcl_edge.cli", *argv]
        result = subprocess.run(
            cmd, capture_output=True, text=True, timeout=HANG_S, stdin=subprocess.DEVNULL, env=FIXED_WIDTH
        )
    return result, time.monotonic() - started


@pytest.mark.parametrize("name", list(CASES))
def test_bad_input_exits_with_its_code_and_one_reason(name: str, work: Path) -> None:
    case = CASES[name]
    result, _ = run_case(name, work)
    shown = f"exit {result.returncode}\nstdout: {result.stdout[-2000:]}\nstderr: {result.stderr[-2000:]}"
    assert result.returncode == case.code, shown
    assert "Traceback" not in result.stdout + result.stderr, shown
    assert "allow_pickle" not in result.stderr, shown
    assert len(result.stderr.strip().splitlines()) <= MAX_STDERR_LINES, shown
    assert case.says in (result.stderr if case.code else result.stdout), shown
    assert "%|" not in result.stderr, shown  # tqdm draws its bar on a terminal only
    if name == "install script help":
        assert "set -euo" not in result.stdout and result.stdout.startswith("Install"), shown


def test_force_replaces_an_earlier_run_and_keeps_other_files(tmp_path: Path) -> None:
    """--force removes what a run wrote (a stale report with it), nothing else."""
    out = tmp_path / "run"
    (out / "report").mkdir(parents=True)
    (out / "report" / "stale.png").write_bytes(b"x")
    (out / "notes.txt").write_text("mine")
    cmd = [sys.executable, "-m", "fcl_edge.cli", "simulate", QUICKSTART, "--out", str(out), "--in-process", *TINY]
    result = subprocess.run([*cmd, "--force"], capture_output=True, text=True, timeout=scaled(60))
    assert result.returncode == 0, result.stderr
    assert not (out / "report").exists() and (out / "notes.txt").read_text() == "mine"
    assert (out / "summary.json").exists()


def test_what_fails_before_it_starts_leaves_nothing_behind(tmp_path: Path) -> None:
    """A broker that is not there (a compare scenario: before its first method's folder) and a
    report with no run to draw write no directory; `fcl status` defaults to a local broker."""
    fcl = [sys.executable, "-m", "fcl_edge.cli"]
    run = tmp_path / "run"
    closed = f"mqtt://127.0.0.1:{free_port()}"
    done = subprocess.run([*fcl, "simulate", QUICKSTART, "--out", str(run), "--broker", closed], capture_output=True)
    assert done.returncode == 3 and not run.exists(), done.stderr
    empty = tmp_path / "empty"
    empty.mkdir()
    done = subprocess.run([*fcl, "report", str(empty)], capture_output=True, text=True, timeout=scaled(60))
    assert done.returncode == 2 and not (empty / "report").exists(), done.stderr
    done = subprocess.run([*fcl, "status", "--help"], capture_output=True, text=True, timeout=scaled(60))
    assert "default: a broker on this machine, mqtt://127.0.0.1:1883" in " ".join(done.stdout.split()), done.stdout


@pytest.mark.parametrize(
    "log, reason",
    [
        ("a INFO x: started\nfcl: error: training diverged at round 3 (loss=inf): lower lr\n", "training diverged"),
        (
            "a INFO x: started\na ERROR edge_client.daemon: could not connect to mqtt://h:1\na INFO x: bye\n",
            "could not",
        ),
        (
            "a ERROR x: earlier\nTraceback (most recent call last):\n  File 'x'\nKeyError: 'round'\n",
            "KeyError: 'round'",
        ),
        ("a INFO x: only this\n", "a INFO x: only this"),
        ("", "nothing in"),
    ],
)
def test_a_failed_participant_is_named_by_its_own_last_words(log: str, reason: str, tmp_path: Path) -> None:
    from fcl_edge.simulate import last_reason

    path = tmp_path / "client-0.log"
    path.write_text(log)
    assert reason in last_reason(path)
    assert "\n" not in last_reason(path)


@pytest.mark.parametrize("columns", ["60", "80", "120"])  # wherever argparse wraps, never inside a hyphenated name
def test_simulate_help_lists_exactly_the_registered_methods(columns: str) -> None:
    import methods

    result = subprocess.run(
        [sys.executable, "-m", "fcl_edge.cli", "simulate", "--help"],
        capture_output=True,
        text=True,
        timeout=scaled(60),
        env={**FIXED_WIDTH, "COLUMNS": columns},
    )
    listed = result.stdout.split("methods (federation.method): ", 1)[1].split("\n\n", 1)[0]
    assert " ".join(listed.split()).split(", ") == methods.names()
