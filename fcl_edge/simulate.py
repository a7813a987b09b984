"""``fcl simulate``: one scenario file -> a broker, an aggregator and N client processes.

Each participant runs as its own OS process with its own MQTT connection, exactly as on a
fleet; this module only writes their configs, starts them, follows ``metrics.jsonl`` to
draw progress, and collects exit codes.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Sequence
from urllib.parse import urlsplit

import numpy as np
import yaml
from tqdm import tqdm

import methods
from fcl_edge.attribution import attribute
from fcl_edge.broker import free_port, probe_broker
from fcl_edge.compare import headline, run_compare
from fcl_edge.links import Links, check_can_shape, profiles_of
from fcl_edge.rundir import RUN_ENTRIES, prepare_out
from fclcore.config import ConfigError, from_dict, load_config, to_dict
from fclcore.data import (
    DataError,
    Dataset,
    client_task_split,
    domain_task_split,
    incremental_client_tasks,
    load_dataset,
    pool_task_split,
    random_client_tasks,
)
from fclcore.errors import BrokerUnreachable
from fclcore.exitcodes import ExitCode
from fclcore.membership import Membership, preset
from fclcore.schedule import TaskSchedule
from fclcore.schema import (
    AggregatorConfig,
    BrokerSpec,
    ClientConfig,
    ClientDataSpec,
    Scenario,
    ServeSpec,
    TrainPlacement,
    parse_broker_url,
)
from fclcore.signing import write_key
from fclcore.text import bbc_split, class_incremental_tasks, client_class_subsets

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Plan:
    scenario: Scenario
    client_tasks: list[list[list[int]]]
    input_dim: int
    test_tasks: list[list[list[int]]] | None = None  # per client, with label skew: the federation's tasks
    pool_ids: list[list[int]] | None = None  # per client, with tasks.pool: its pool task ids in task order

    @property
    def client_ids(self) -> list[str]:
        return _client_ids(self.scenario.clients)

    @property
    def split_seed(self) -> int:
        """The seed of the dataset split and of the document parts: data.split_seed or the federation's."""
        return _split_seed(self.scenario)


def plan(scenario_path: str, overrides: Sequence[str] = ()) -> Plan:
    """Load and check everything up front, so a bad scenario fails before any process starts."""
    sc = load_config(Scenario, scenario_path, overrides)
    _check_method_options(sc, scenario_path)
    if sc.device != "cpu":  # the coordinator loads torch only to ask it for CUDA
        from fclcore.device import resolve as resolve_device

        resolve_device(sc.device)  # ConfigError: a CUDA device this machine lacks
    spec, options, fed = methods.resolve(sc.run_federation(), scenario_path)
    sc = dataclasses.replace(sc, federation=fed)
    pool_ids = None
    domains = sc.tasks.domains  # domain-incremental: grayscale images, rotated / permuted per task
    if domains is not None and (sc.data.dataset not in ("mnist", "digits") or sc.data.class_fraction < 1):
        raise ConfigError(
            f"{scenario_path}: tasks.domains: expected data.dataset mnist or digits and data.class_fraction 1 "
            f"(every task holds every class), got {sc.data.dataset!r} and {sc.data.class_fraction}"
        )
    try:
        train, test = load_dataset(
            sc.data.dataset, sc.data.path, _split_seed(sc), _text_length(spec, options), gray=domains is not None
        )
        classes = sorted(int(c) for c in np.unique(train.y))
        if sc.tasks.pool is not None:
            pool_ids = _pool_allocation(sc, scenario_path)
            client_tasks = [[list(sc.tasks.pool.tasks[i]) for i in ids] for ids in pool_ids]
        elif sc.tasks.random is not None:
            r = sc.tasks.random
            client_tasks = random_client_tasks(sc.clients, fed.num_tasks, r.classes, r.classes_per_task, fed.seed)
        elif sc.tasks.sizes is not None:
            tasks = [[classes[i] for i in t] for t in class_incremental_tasks(len(classes), sc.tasks.sizes, fed.seed)]
            client_tasks = [tasks] * sc.clients
        elif domains is not None:
            client_tasks = [[list(domains.classes)] * domains.tasks] * sc.clients
        elif sc.tasks.incremental is not None:
            inc = sc.tasks.incremental
            client_tasks = incremental_client_tasks(inc.base, inc.pools, sc.clients, inc.share, fed.seed)
        else:
            client_tasks = sc.tasks.per_client or [sc.tasks.shared] * sc.clients
        lengths = {len(t) for t in client_tasks}
        if len(lengths) != 1:
            raise ConfigError(
                f"{scenario_path}: tasks: every client needs the same number of tasks, got {sorted(lengths)}"
            )
        sc = dataclasses.replace(sc, federation=dataclasses.replace(fed, num_tasks=lengths.pop()))
        try:
            sc.federation.check_schedule()
        except ValueError as exc:
            raise ConfigError(f"{scenario_path}: federation.{exc}") from None
        test_tasks = None
        if sc.tasks.incremental is not None:  # every device tests each task on all of its classes
            every = [list(t) for t in [sc.tasks.incremental.base, *sc.tasks.incremental.pools]]
            test_tasks = [every for _ in range(sc.clients)]
        _check_arrivals(sc, spec, scenario_path)
        if sc.data.class_fraction < 1:  # label skew: each device holds a seeded share of the classes
            held = [
                [classes[i] for i in s]
                for s in client_class_subsets(len(classes), sc.clients, sc.data.class_fraction, fed.seed)
            ]
            test_tasks = [[list(t) for t in c] for c in client_tasks]
            client_tasks = [[[c for c in t if c in held[i]] for t in tasks] for i, tasks in enumerate(client_tasks)]
        _check_splits(sc, train, test, client_tasks, test_tasks, pool_ids)
    except DataError as exc:
        raise ConfigError(f"{scenario_path}: data: {exc}") from None
    sc = _expand_membership(sc, scenario_path)
    return Plan(sc, [[list(t) for t in c] for c in client_tasks], int(train.x.shape[1]), test_tasks, pool_ids)


def _check_method_options(sc: Scenario, scenario_path: str) -> None:
    """Every ``method_options`` entry names a registered method and only options it has, checked
    whichever method this run is (a misspelled entry would otherwise be ignored until it runs)."""
    for name, raw in sc.method_options.items():
        if name not in methods.names():
            known = ", ".join(methods.names())
            raise ConfigError(f"{scenario_path}: method_options: unknown method {name!r} (expected one of: {known})")
        from_dict(methods.lookup(name).options, raw, scenario_path, f"method_options.{name}")


def _check_arrivals(sc: Scenario, spec: methods.MethodSpec, scenario_path: str) -> None:
    """``tasks.arrivals``: one row of rounds per client, one entry per task, for an own-clock method."""
    arrivals = sc.tasks.arrivals
    if arrivals is None:
        return
    if not spec.own_clock:
        raise ConfigError(
            f"{scenario_path}: tasks.arrivals: method {spec.name!r} runs every device on the federation's "
            "task clock; per-device arrivals need a method whose devices keep their own (e.g. ngfl)"
        )
    fed = sc.federation
    if len(arrivals) != sc.clients or any(len(row) != fed.num_tasks for row in arrivals):
        raise ConfigError(
            f"{scenario_path}: tasks.arrivals: expected {sc.clients} rows (one per client) of "
            f"{fed.num_tasks} entries (one per task)"
        )
    if any(r is not None and r >= fed.total_rounds for row in arrivals for r in row):
        raise ConfigError(f"{scenario_path}: tasks.arrivals: rounds must be below total_rounds {fed.total_rounds}")


def _client_ids(clients: int) -> list[str]:
    return [f"client-{i}" for i in range(clients)]


def _expand_membership(sc: Scenario, scenario_path: str) -> Scenario:
    """``membership: <preset>`` becomes ``federation.membership`` for client-0..N-1; either form
    is checked against those ids and the task count (the scenario keeps only the table)."""
    fed, clients = sc.federation, _client_ids(sc.clients)
    table = fed.membership
    where = "federation.membership"
    if sc.membership is not None:
        if table is not None:
            raise ConfigError(f"{scenario_path}: membership: expected a preset or federation.membership, not both")
        where = f"membership: preset {sc.membership!r} for {sc.clients} clients and {fed.num_tasks} tasks"
        try:
            table = preset(sc.membership, clients, fed.num_tasks)
        except ValueError as exc:
            raise ConfigError(f"{scenario_path}: {exc}") from None
    if table is None:
        return sc
    try:
        Membership(table, fed.num_tasks, clients)
    except ValueError as exc:
        raise ConfigError(f"{scenario_path}: {where}: {str(exc).removeprefix('membership: ')}") from None
    return dataclasses.replace(sc, membership=None, federation=dataclasses.replace(fed, membership=table))


def _late_starts(p: Plan) -> dict[str, int]:
    """Clients whose first active task t is after task 0 -> the last round of task t - 1: they
    start when the run log shows that round closed."""
    fed = p.scenario.federation
    table = Membership.of(fed)
    if table is None:
        return {}
    schedule = TaskSchedule.from_federation(fed)
    return {c: schedule.last_round(table.first_task(c) - 1) for c in p.client_ids if table.first_task(c) > 0}


def _split_seed(sc: Scenario) -> int:
    return sc.federation.seed if sc.data.split_seed is None else sc.data.split_seed


def _pool_allocation(sc: Scenario, scenario_path: str) -> list[list[int]]:
    """FedSeIT's allocation: client c takes ids ``perm[c*k:(c+1)*k]`` of a permutation of the
    pool drawn with the federation seed (the split has its own, ``data.split_seed``)."""
    pool, clients = sc.tasks.pool, sc.clients
    k, size = pool.per_client, len(pool.tasks)
    if clients * k > size:
        raise ConfigError(
            f"{scenario_path}: tasks.pool: {clients} clients x per_client {k} = {clients * k} "
            f"distinct tasks needed, the pool has {size}"
        )
    if sc.data.class_fraction < 1:
        raise ConfigError(
            f"{scenario_path}: data.class_fraction: expected 1 with tasks.pool "
            f"(the pool gives each client its labels), got {sc.data.class_fraction}"
        )
    perm = np.random.default_rng(sc.federation.seed).permutation(size)
    return [[int(i) for i in perm[c * k : (c + 1) * k]] for c in range(clients)]


def _check_splits(
    sc: Scenario,
    train: Dataset,
    test: Dataset,
    client_tasks: list[list[list[int]]],
    test_tasks: list[list[list[int]]] | None,
    pool_ids: list[list[int]] | None,
) -> None:
    """Every client's shard, computed as its device will: a bad plan fails here, not on a device."""
    data, seed = sc.data, _split_seed(sc)
    for index in range(sc.clients):
        if sc.tasks.domains is not None:
            domain_task_split(
                train, test, sc.tasks.domains, index, sc.clients, seed, data.per_class, data.test_per_class
            )
        elif pool_ids is not None:
            pool_task_split(
                train, test, sc.tasks.pool.tasks, pool_ids[index], seed, data.per_class, data.test_per_class
            )
        else:
            own_test = test_tasks[index] if test_tasks else None
            client_task_split(train, test, client_tasks, index, seed, own_test, data.per_class, data.test_per_class)


def _text_length(spec: methods.MethodSpec, options: object) -> int:
    """Tokens per text for a text dataset: the method's input length (64 if it has none)."""
    length = spec.data_length(options)
    return 64 if length is None else int(length)


def simulate(
    scenario_path: str,
    out: str,
    *,
    broker: str | None = None,
    overrides: Sequence[str] = (),
    timeout: float = 3600.0,
    in_process: bool = False,
    force: bool = False,
) -> int:
    """Everything that can be checked is checked before any process starts: the scenario, the
    run directory and the broker; a participant that fails stops the others."""
    p = plan(scenario_path, overrides)
    if p.scenario.links:  # shaped links: checked before anything starts
        if in_process:
            raise ConfigError("links: shaped links need a process per device; drop --in-process")
        profiles_of(p.scenario.links, p.client_ids)
        check_can_shape()
    if broker:  # before anything is written: a broker that is not there leaves no run directory
        probe_broker(broker)
    if p.scenario.compare:
        return run_compare(
            p.scenario.compare,
            out,
            force=force,
            check=lambda method: plan(scenario_path, [*overrides, *_only(method)]),
            run_one=lambda method, run_dir: simulate(
                scenario_path,
                run_dir,
                broker=broker,
                overrides=[*overrides, *_only(method)],
                timeout=timeout,
                in_process=in_process,
            ),
        )
    out_dir = prepare_out(Path(out), force, RUN_ENTRIES)
    (out_dir / "logs").mkdir(parents=True, exist_ok=True)
    _start_afresh(out_dir)
    (out_dir / "scenario.yaml").write_text(yaml.safe_dump(to_dict(p.scenario), sort_keys=False))
    if in_process:
        return _simulate_in_process(p, out_dir, timeout)
    broker_proc, url = _start_broker(broker, out_dir)
    procs, shaped = {}, None
    try:
        shaped = _shaped_links(p, url)
        configs = write_configs(p, out_dir, url, shaped.url if shaped else None)
        wrap = shaped.wrap if shaped else None
        late = _late_starts(p)
        procs = {
            name: _spawn(name, kind, path, out_dir, wrap=wrap)
            for name, (kind, path) in configs.items()
            if name not in late
        }
        starts = {
            name: (after, lambda n=name, k=configs[name][0], c=configs[name][1]: _spawn(n, k, c, out_dir, wrap=wrap))
            for name, after in late.items()
        }
        return _follow(p, out_dir, procs, timeout, starts)
    finally:
        for proc in procs.values():
            _stop(proc)
        if shaped is not None:
            shaped.close()
        if broker_proc is not None:
            _stop(broker_proc)


def _shaped_links(p: Plan, url: str) -> Links | None:
    """The devices' links (``links:``): a namespace and a relay per shaped device, or None."""
    profiles = profiles_of(p.scenario.links, p.client_ids)
    if not profiles:
        return None
    where = urlsplit(url)
    links = Links(profiles, where.port or 1883, p.scenario.federation.seed)
    for client, profile in sorted(profiles.items()):
        log.info("%s: behind a %s link (%s)", client, profile.name, profile.describe)
    return links


def _only(method: str) -> list[str]:
    """The overrides that turn a ``compare:`` scenario into one run of ``method``."""
    return ["compare=[]", f"federation.method={method}"]


def _simulate_in_process(p: Plan, out_dir: Path, timeout: float) -> int:
    """The same services as threads over the in-process transport (``fcl_edge.inprocess``)."""
    from fcl_edge.inprocess import build_participants, logging_to
    from fclcore.inproc import InProcessBroker

    broker = InProcessBroker()
    participants = {}  # the started ones: _follow adds the late clients as it starts them
    with logging_to(out_dir / "logs" / "in-process.log"):
        try:
            built = build_participants(write_configs(p, out_dir, "mqtt://in-process:1883"), broker)
            late = _late_starts(p)
            participants = {name: part.start() for name, part in built.items() if name not in late}
            starts = {name: (after, built[name].start) for name, after in late.items()}
            return _follow(p, out_dir, participants, timeout, starts)
        finally:
            for participant in participants.values():
                _stop(participant)
            broker.stop()


def _start_afresh(out_dir: Path) -> None:
    """A simulation always starts a new federation: earlier metrics and saved state go."""
    (out_dir / "metrics.jsonl").unlink(missing_ok=True)
    for state in [out_dir / "state", out_dir / "keys", *(out_dir / "clients").glob("*/state")]:
        shutil.rmtree(state, ignore_errors=True)


def _start_broker(broker: str | None, out_dir: Path) -> tuple[subprocess.Popen | None, str]:
    if broker:
        try:
            parse_broker_url(broker)
        except ValueError as exc:
            raise ConfigError(f"--broker: {exc}") from None
        return None, broker
    port = free_port()
    ready = out_dir / "logs" / "broker.ready"
    ready.unlink(missing_ok=True)
    proc = _spawn("broker", "broker", None, out_dir, extra=["--port", str(port), "--ready-file", str(ready)])
    deadline = time.monotonic() + 20
    while not ready.exists():  # written once it listens (a bare TCP probe would log as a failed session)
        if proc.poll() is not None or time.monotonic() > deadline:
            _stop(proc)
            raise BrokerUnreachable(f"embedded broker did not start: {last_reason(out_dir / 'logs' / 'broker.log')}")
        time.sleep(0.05)
    ready.unlink()
    return proc, f"mqtt://127.0.0.1:{port}"


def write_configs(
    p: Plan, out_dir: Path, url: str, client_url: Callable[[str, str], str] | None = None
) -> dict[str, tuple[str, Path]]:
    """Every participant's config file; ``client_url(client, url)`` is the broker URL a device
    uses when it differs from the aggregator's (a shaped link's relay)."""
    fed = p.scenario.federation
    cfg_dir = out_dir / "configs"
    cfg_dir.mkdir(exist_ok=True)
    broker = BrokerSpec(url=url)
    keys_dir = out_dir / "keys" if p.scenario.sign_updates else None
    for cid in p.client_ids if keys_dir else ():
        write_key(keys_dir / f"{cid}.key")
    method, options, _ = methods.resolve(fed)
    aux_dir = _write_aux_texts(p, out_dir / "aux") if method.needs_aux_data else None
    configs = {
        "aggregator": AggregatorConfig(
            federation=fed,
            expected_clients=p.client_ids,
            out_dir=str(out_dir),
            broker=broker,
            input_dim=p.input_dim,
            keys_dir=str(keys_dir) if keys_dir else None,
            aux_dir=aux_dir,
        )
    }
    for index, cid in enumerate(p.client_ids):
        spec = p.scenario.data
        data = ClientDataSpec(
            dataset=spec.dataset,
            path=spec.path,
            client_tasks=p.client_tasks,
            client_index=index,
            seed=fed.seed,
            test_tasks=p.test_tasks[index] if p.test_tasks else None,
            per_class=spec.per_class,
            test_per_class=spec.test_per_class,
            max_length=_text_length(method, options),
            split_seed=spec.split_seed,
            pool_tasks=p.scenario.tasks.pool.tasks if p.pool_ids is not None else None,
            pool_ids=p.pool_ids[index] if p.pool_ids is not None else None,
            domains=p.scenario.tasks.domains,
            arrivals=p.scenario.tasks.arrivals[index] if p.scenario.tasks.arrivals else None,
            fleet=method.fleet_data,
        )
        configs[cid] = ClientConfig(
            client_id=cid,
            federation=fed.name,
            data=data,
            broker=broker if client_url is None else BrokerSpec(url=client_url(cid, url)),
            out_dir=str(out_dir / "clients" / cid),
            key_file=str(keys_dir / f"{cid}.key") if keys_dir else None,
            allow_embedding_upload=p.scenario.allow_embedding_upload,
            train=TrainPlacement(p.scenario.device, p.scenario.amp),
        )
    written = {}
    for name, cfg in configs.items():
        path = cfg_dir / f"{name}.yaml"
        path.write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
        written[name] = ("aggregator" if name == "aggregator" else "client", path)
    return written


def _write_aux_texts(p: Plan, aux_dir: Path) -> str:
    """A server-side pool for methods that read ``aux_dir``: the corpus's auxiliary split as
    unlabelled .txt files (the aggregator reads a folder of texts, as on a real deployment)."""
    if p.scenario.data.dataset != "bbc":
        raise ConfigError(f"{p.scenario.federation.method}: needs a text dataset (data.dataset: bbc)")
    corpus, _, _, aux = bbc_split(p.scenario.data.path, p.split_seed)
    shutil.rmtree(aux_dir, ignore_errors=True)
    aux_dir.mkdir(parents=True)
    for n, row in enumerate(aux):
        (aux_dir / f"{n:05d}.txt").write_text(corpus.texts[row], encoding="utf-8")
    return str(aux_dir)


def _spawn(
    name: str,
    kind: str,
    config: Path | None,
    out_dir: Path,
    extra: Sequence[str] = (),
    wrap: Callable[[str, list[str]], list[str]] | None = None,
) -> subprocess.Popen:
    """``fcl KIND --config CONFIG`` logging to ``logs/NAME.log``; ``wrap`` puts a shaped device
    in its network namespace."""
    cmd = [sys.executable, "-m", "fcl_edge.cli", kind, *(["--config", str(config)] if config else []), *extra]
    cmd = wrap(name, cmd) if wrap else cmd
    logfile = open(out_dir / "logs" / f"{name}.log", "w")
    return subprocess.Popen(cmd, stdout=logfile, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)


def _follow(
    p: Plan,
    out_dir: Path,
    procs: dict[str, subprocess.Popen],
    timeout: float,
    late: dict[str, tuple[int, Callable[[], Any]]] | None = None,
) -> int:
    """Draw progress from metrics.jsonl until the aggregator exits.  ``late``: name -> (round,
    start): a participant started (and added to ``procs``) once that round has closed."""
    late = dict(late or {})
    fed = p.scenario.federation
    tail = _Tail(out_dir / "metrics.jsonl")
    rounds: dict[int, dict] = {}
    deadline = time.monotonic() + timeout
    accuracy = methods.lookup(fed.method).metric == "accuracy"
    score = "task acc" if accuracy else "task NLL"
    tqdm.write(
        f"{fed.method} on {fed.name}: {p.scenario.clients} clients, {fed.num_tasks} tasks, {fed.total_rounds} rounds"
        f"\n(per round: the global model's mean {'accuracy' if accuracy else 'NLL'} over the devices on the test data"
        " of the round's task, then the bytes that round moved, summed over the devices)"
    )
    tqdm.write(f"{'round':>5} {'task':>4} {score:>9} {'bytes up':>10} {'bytes down':>11}")
    failed: list[str] = []  # the participants that failed on their own, before any was stopped
    with tqdm(total=fed.total_rounds, unit="round", dynamic_ncols=True, disable=not sys.stderr.isatty()) as bar:
        while procs["aggregator"].poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
            for event in tail.read():
                _show(event, rounds, bar)
                _start_late(event, late, procs)
            if _failed(procs):
                break
        for event in tail.read():
            _show(event, rounds, bar)
    failed = _failed(procs)
    if failed:  # one failed: the run cannot finish, so the others are stopped now, not waited for
        for proc in procs.values():
            if proc.poll() is None:
                proc.terminate()
    return _outcome(out_dir, procs, deadline, failed)


def _failed(procs: dict) -> list[str]:
    return [name for name, proc in procs.items() if proc.poll() not in (None, 0)]


def _start_late(event: dict, late: dict[str, tuple[int, Callable[[], Any]]], procs: dict) -> None:
    """Start the participants waiting for the round this ``round`` event closed (or an earlier one)."""
    if event.get("event") != "round":
        return
    for name, (after, start) in list(late.items()):
        if event["round"] >= after:
            log.info("starting %s: round %d closed, its first task is next", name, event["round"])
            procs[name] = start()
            del late[name]


def _show(event: dict, rounds: dict[int, dict], bar: tqdm) -> None:
    kind = event.get("event")
    if kind == "round_client":
        row = rounds.setdefault(event["round"], {"task": event["task"], "up": 0, "down": 0})
        row["up"] += event["bytes_up"]
        row["down"] += event["bytes_down"]
    elif kind == "round":
        bar.update(1)
    elif kind == "round_summary" and event["round"] in rounds:
        row = rounds[event["round"]]
        score = event.get("mean_nll", event.get("mean_accuracy"))
        tqdm.write(f"{event['round']:>5} {row['task']:>4} {score:>9.3f} {row['up']:>10,} {row['down']:>11,}")


# After the aggregator ends, a device may still be exporting its final served model: it is given
# as long as its own export may take (the export child's timeout), plus time to exit.
FINAL_GRACE_S = ServeSpec().export_timeout_s + 30.0


def _outcome(out_dir: Path, procs: dict[str, subprocess.Popen], deadline: float, failed: Sequence[str] = ()) -> int:
    codes = {}
    grace = 30.0 if failed else FINAL_GRACE_S
    until = min(deadline, time.monotonic() + grace)  # one bound for all of them
    for name, proc in procs.items():
        try:
            codes[name] = proc.wait(timeout=max(1.0, until - time.monotonic()))
        except subprocess.TimeoutExpired:
            codes[name] = None
    summary_path = out_dir / "summary.json"
    if summary_path.exists() and not failed:
        if all(code == 0 for code in codes.values()):  # every device has written its meter
            attribute(out_dir)
        _print_result(out_dir, summary_path)
    if failed:
        first = failed[0]
        also = f" (also failed: {', '.join(failed[1:])})" if len(failed) > 1 else ""
        print(
            f"fcl: error: {first} exited {codes[first]}: {_reason(out_dir, first, procs[first])}{also}", file=sys.stderr
        )
        return int(ExitCode.CLIENT_FAILED)
    unfinished = {n: c for n, c in codes.items() if c != 0}  # after the aggregator ended (or the timeout)
    if unfinished:
        name, code = next(iter(unfinished.items()))
        if code is None:
            when = "within --timeout" if until == deadline else f"{grace:.0f} s after the run ended"
            print(f"fcl: error: {name} did not finish {when}; stopped it", file=sys.stderr)
        else:
            print(f"fcl: error: {name} exited {code}: {_reason(out_dir, name, procs[name])}", file=sys.stderr)
        return int(ExitCode.CLIENT_FAILED)
    return int(ExitCode.OK)


def _vs_dense(b: dict) -> str:
    """The run's bytes against its reference, both ways, as summary.json has them."""
    if b.get("up_vs_dense") is None or b.get("down_vs_dense") is None:
        return ""
    return f"  up / down vs dense: {b['up_vs_dense']:.1%} / {b['down_vs_dense']:.1%} ({b['reference']})"


def _print_result(out_dir: Path, summary_path: Path) -> None:
    summary = json.loads(summary_path.read_text())
    b = summary["bytes"]
    name, value, from_fleet = headline(summary)
    final = (summary.get("fleet") if from_fleet else summary.get("final")) or {}
    score = ("fleet " if from_fleet else "") + f"{name} {value}"
    print(
        f"{summary['method']}: {score}  forgetting {final.get('forgetting')}  "
        f"bytes up {b['up_total']:,}  down {b['down_total']:,}  (dense fp32 up {b['dense_fp32_up_total']:,}"
        f"  down {b.get('dense_fp32_down_total', b['dense_fp32_up_total']):,})" + _vs_dense(b)
    )
    if b.get("up_vs_full_finetune") is not None and b.get("down_vs_full_finetune") is not None:
        print(
            f"{summary['method']}: up / down vs full fine-tuning: {b['up_vs_full_finetune']:.2%} / "
            f"{b['down_vs_full_finetune']:.2%} ({b['reference_full_finetune']})"
        )
    if run := b.get("run_level"):
        print(
            f"run-level bytes (no round row counts them: status, EVAL, FINISH, re-sends, ...): up "
            f"{run['up_total']:,}  down {run['down_total']:,}  ({run['share']:.1%} of the devices' bytes)"
        )
    print(f"wrote {out_dir / 'metrics.jsonl'} and {summary_path}")


def _reason(out_dir: Path, name: str, proc: object) -> str:
    """A participant's own one-line reason: what it recorded (in-process), else its log's."""
    reason = getattr(proc, "reason", None)
    if reason:
        return reason
    shared = out_dir / "logs" / "in-process.log"  # --in-process: one log, each line names its thread
    if shared.exists():
        return last_reason(shared, only=f" {name} ")
    return last_reason(out_dir / "logs" / f"{name}.log")


_LOGGED_ERROR = re.compile(r" (?:ERROR|CRITICAL) [\w.]+: (.*)$")
_FCL_ERROR = re.compile(r"fcl[\w ]*: error: (.*)$")


def last_reason(log_path: Path, limit: int = 300, only: str = "") -> str:
    """The line of a log that says why its process ended: its ``fcl: error:`` line, else its
    last ERROR record, else (a crash) the traceback's exception line, else its last line."""
    try:
        with open(log_path, "rb") as handle:
            handle.seek(max(0, handle.seek(0, 2) - 65536))
            text = handle.read().decode("utf-8", "replace")
        lines = [line.strip() for line in text.splitlines() if line.strip() and only in line]
    except OSError as exc:
        return f"(no log: {exc.strerror or exc})"
    if not lines:
        return f"(nothing in {log_path})"
    found = next((m.group(1) for line in reversed(lines) if (m := _FCL_ERROR.match(line))), None)
    if found is None and any(line.startswith("Traceback (") for line in lines):
        found = lines[-1]
    if found is None:
        found = next((m.group(1) for line in reversed(lines) if (m := _LOGGED_ERROR.search(line))), lines[-1])
    return found if len(found) <= limit else found[: limit - 3] + "..."


def _stop(proc: subprocess.Popen, grace: float = 10.0) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


class _Tail:
    """Yields complete new JSON lines of a growing file."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = 0
        self.partial = b""

    def read(self) -> list[dict]:
        if not self.path.exists():
            return []
        with open(self.path, "rb") as handle:
            handle.seek(self.offset)
            chunk = handle.read()
        self.offset += len(chunk)
        lines = (self.partial + chunk).split(b"\n")
        self.partial = lines.pop()
        return [json.loads(line) for line in lines if line.strip()]
