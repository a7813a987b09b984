"""The ``fcl`` command: one entry point, one subcommand per job, ``--help`` on each.

Heavy imports (torch, the aggregator, the client) happen inside the subcommand that needs
them, so ``fcl --help`` and ``fcl status`` stay fast on a small device.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import textwrap
import threading
from typing import Callable, Sequence

from fclcore.errors import ConfigError, FclError
from fclcore.exitcodes import ExitCode

log = logging.getLogger("fcl")


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=getattr(logging, args.log_level), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        code = int(args.run(args))
        sys.stdout.flush()  # a reader that went away shows here, not at interpreter exit
        return code
    except FclError as exc:  # the toolkit's own errors: one line, the documented exit code
        print(f"fcl: error: {exc}", file=sys.stderr)
        return int(exc.exit_code)
    except BrokenPipeError:  # the reader of stdout went away (``fcl infer ... | head -1``): done
        _quiet_stdout()
        return int(ExitCode.OK)
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError, PermissionError) as exc:
        where = f"{exc.filename}: " if exc.filename else ""
        print(f"fcl: error: {where}{exc.strerror or exc}", file=sys.stderr)
        return int(ExitCode.BAD_INPUT)
    except KeyboardInterrupt:
        return int(ExitCode.INTERRUPTED)


def _quiet_stdout() -> None:
    """Point stdout at /dev/null so the interpreter's final flush of a closed pipe stays silent."""
    import os

    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fcl", description="Federated continual learning on edge devices over MQTT.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    parser.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=_Parser)

    p = sub.add_parser(
        "simulate",
        help="run a scenario: broker + aggregator + N clients as processes",
        description="Run a continual federated scenario through an MQTT broker. Starts an "
        "embedded broker unless --broker is given. The scenario, the run directory and the "
        "broker are checked before any process starts.",
        lazy_epilog=lambda: f"methods (federation.method): {', '.join(_method_names())}",
        formatter_class=_NamesFormatter,
    )
    p.add_argument(
        "--help-method",
        action=_HelpMethod,
        metavar="NAME",
        help="show a method's summary and its federation.options (type, default, what each does) and exit",
    )
    p.add_argument("scenario", help="scenario YAML (see configs/scenarios/)")
    p.add_argument("--out", required=True, help="run directory for metrics.jsonl, summary.json, logs (new or empty)")
    p.add_argument(
        "--force", action="store_true", help="--out may hold an earlier run: what that run wrote is removed first"
    )
    p.add_argument("--broker", help="mqtt://host:port of an existing broker (default: start an embedded one)")
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a scenario key, e.g. --set federation.rounds_per_task=5 (repeatable)",
    )
    p.add_argument("--timeout", type=float, default=3600.0, help="give up after this many seconds")
    p.add_argument(
        "--in-process",
        action="store_true",
        help="run the aggregator and clients as threads of this process over the in-process "
        "transport (no broker; for benchmarks and quick experiments)",
    )
    p.set_defaults(run=_simulate)

    p = sub.add_parser("aggregator", help="run the aggregator service", description="Run the aggregator service.")
    p.add_argument("--config", required=True, help="aggregator YAML (see configs/services/aggregator.yaml)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config key")
    p.set_defaults(run=_aggregator)

    p = sub.add_parser(
        "site",
        help="run a site aggregator (one level of a hierarchy)",
        description="Run a site aggregator: it collects the updates of its own devices on its own broker "
        "(bridged to the root's: deploy/mosquitto/site-bridge.conf) for each round the root announces, and "
        "forwards one partial sum per round to the root (docs/scaling-out.md).",
    )
    p.add_argument("--config", required=True, help="site YAML (see configs/services/site.yaml)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config key")
    p.set_defaults(run=_site)

    p = sub.add_parser("client", help="run the edge client daemon", description="Run the edge client daemon.")
    p.add_argument("--config", required=True, help="client YAML (see configs/services/client.yaml)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config key")
    p.set_defaults(run=_client)

    from export.cli import add_export_parser, add_infer_parser

    add_export_parser(sub)
    sub.choices["export"].set_defaults(state_loader=_served_from_state)
    add_infer_parser(sub)

    p = sub.add_parser(
        "report",
        help="plots and a table from one or more run directories",
        description="Write NLL-per-task, bytes-per-round and attention plots plus a markdown "
        "table for run directories (or a directory holding several runs).",
    )
    p.add_argument("runs", nargs="+", help="run directories written by fcl simulate or the aggregator")
    p.add_argument("--out", help="where to write the report (default: RUN/report for one run, else ./report)")
    p.set_defaults(run=_report)

    p = sub.add_parser(
        "status",
        help="the fleet as the broker's retained status topics show it",
        description="Connect to the broker, collect the retained status of every daemon and the "
        "round announcement, and print per client: state, task, last round, bytes "
        "up/down, last seen; plus the aggregator and the round in progress. "
        "The password, if the broker needs one, is read from $FCL_MQTT_PASSWORD.",
    )
    p.add_argument(
        "--broker",
        default="mqtt://127.0.0.1:1883",
        help="mqtt://host:port or mqtts://host:port (default: a broker on this machine, mqtt://127.0.0.1:1883)",
    )
    p.add_argument("--federation", help="only this federation (default: every one on the broker)")
    p.add_argument(
        "--wait",
        type=float,
        default=1.0,
        metavar="S",
        help="seconds to collect messages after subscribing (default: %(default)s)",
    )
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument(
        "--device",
        metavar="ID",
        help="only this device (needs --federation): its memory, CPU, resyncs, bytes by kind, version",
    )
    p.add_argument("--username", help="broker user name")
    p.add_argument("--ca-file", help="CA bundle for mqtts:// (default: the system CAs)")
    p.add_argument("--connect-timeout", type=float, default=5.0, metavar="S", help="default: %(default)s")
    p.set_defaults(run=_status)

    p = sub.add_parser(
        "ctl",
        help="ask a running client daemon for its status or for inference",
        description="Talk to a running `fcl client` through its control socket "
        "(state_dir/control.sock, default out_dir/state/control.sock). "
        "`status` prints its state as JSON; `loglik` scores rows with the model "
        "it serves now (log-likelihood in nats, one line per row).",
    )
    p.add_argument("socket", help="the client's control socket")
    p.add_argument("op", choices=["status", "loglik"])
    p.add_argument("--input", help="loglik: rows as .npy or .csv (0/1 values), '-' for CSV on stdin")
    p.set_defaults(run=_ctl)

    p = sub.add_parser(
        "keygen",
        help="provision per-device signing keys",
        description="Write a new random 32-byte key DIR/<client>.key (hex, mode 0600) for each "
        "client. Copy each key to its device (client config: key_file) and point the "
        "aggregator's keys_dir at DIR. Existing keys are never overwritten.",
    )
    p.add_argument("dir", help="key directory (the aggregator's keys_dir)")
    p.add_argument("clients", nargs="+", help="client ids")
    p.set_defaults(run=_keygen)

    p = sub.add_parser(
        "broker",
        help="run the embedded MQTT broker (demo use; run Mosquitto in production)",
        description="Run an embedded amqtt broker on a loopback port.",
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=1883)
    p.add_argument("--ready-file", help="write this file once the broker listens (for a parent process)")
    p.set_defaults(run=_broker)
    return parser


class _Parser(argparse.ArgumentParser):
    """A subcommand's parser whose epilog is computed only when its help is shown (the method
    list needs the registry; ``fcl status`` on a small device should not pay for it)."""

    def __init__(self, *args, lazy_epilog: Callable[[], str] | None = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.lazy_epilog = lazy_epilog

    def format_help(self) -> str:
        if self.lazy_epilog is not None:
            self.epilog = self.lazy_epilog()
        return super().format_help()


class _NamesFormatter(argparse.HelpFormatter):
    """Wraps the epilog between names, never inside one at its hyphen (``fedcl-cumulative-replay``)."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        words = " ".join(text.split())
        return textwrap.fill(words, width, initial_indent=indent, subsequent_indent=indent, break_on_hyphens=False)


class _HelpMethod(argparse.Action):
    """``--help-method NAME``: like ``--help``, answered before the required arguments are checked."""

    def __init__(self, option_strings: Sequence[str], dest: str, **kwargs) -> None:
        super().__init__(option_strings, dest, nargs=1, default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        import methods

        try:
            text = methods.describe(values[0])
        except ConfigError as exc:
            parser.error(str(exc))
        sys.stdout.write(text)
        parser.exit()


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("fcl-edge")
    except PackageNotFoundError:  # run from a checkout that was never installed
        return "unknown (not installed)"


def _method_names() -> list[str]:
    """The registry's names (importing the method packages is cheap: learners load lazily)."""
    import methods

    return methods.names()


def _served_from_state(state_dir: str) -> object:
    from edge_client.state import served_from_state

    return served_from_state(state_dir)


def _simulate(args: argparse.Namespace) -> int:
    from fcl_edge.simulate import simulate

    if args.in_process and args.broker:
        raise ConfigError("--in-process and --broker: choose one")
    if not args.timeout > 0:
        raise ConfigError(f"--timeout: expected seconds > 0, got {args.timeout}")
    previous = signal.signal(signal.SIGTERM, _terminate_as_interrupt)
    try:
        return simulate(
            args.scenario,
            args.out,
            broker=args.broker,
            overrides=args.set,
            timeout=args.timeout,
            in_process=args.in_process,
            force=args.force,
        )
    finally:
        signal.signal(signal.SIGTERM, previous)


def _terminate_as_interrupt(signum: int, frame: object) -> None:
    """SIGTERM stops ``fcl simulate`` as Ctrl-C does: its ``finally`` stops the broker, the
    aggregator and the devices it started (a second SIGTERM meanwhile is ignored), exit 130."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    raise KeyboardInterrupt


def _aggregator(args: argparse.Namespace) -> int:
    import methods
    from aggregator.service import AggregatorService
    from fclcore.config import load_config
    from fclcore.schema import AggregatorConfig

    cfg = load_config(AggregatorConfig, args.config, args.set)
    methods.resolve(cfg.federation, args.config)  # an unknown method or option: one line, exit 2
    return _serve(lambda stop: AggregatorService(cfg, stop).run())


def _site(args: argparse.Namespace) -> int:
    from aggregator.site import SiteAggregator
    from fclcore.config import load_config
    from fclcore.schema import SiteConfig

    cfg = load_config(SiteConfig, args.config, args.set)
    return _serve(lambda stop: SiteAggregator(cfg, stop).run())


def _client(args: argparse.Namespace) -> int:
    from edge_client.daemon import ClientDaemon
    from fclcore.config import load_config
    from fclcore.data import DataError
    from fclcore.schema import ClientConfig

    cfg = load_config(ClientConfig, args.config, args.set)
    try:
        return _serve(lambda stop: ClientDaemon(cfg, stop).run())
    except DataError as exc:
        print(f"fcl: error: {args.config}: data: {exc}", file=sys.stderr)
        return int(ExitCode.BAD_INPUT)


def _report(args: argparse.Namespace) -> int:
    from fcl_edge.report import report

    out = args.out or (f"{args.runs[0]}/report" if len(args.runs) == 1 else "report")
    for path in report(args.runs, out):
        print(path)
    return int(ExitCode.OK)


def _status(args: argparse.Namespace) -> int:
    from fcl_edge.status import BrokerOptions, StatusError, password_from_env, status
    from fclcore.topics import validate_id

    try:
        if args.federation is not None:
            validate_id(args.federation, "--federation")
        if not args.wait >= 0 or not args.connect_timeout > 0:
            raise ValueError("--wait: expected >= 0 and --connect-timeout > 0")
        options = BrokerOptions(args.broker, args.username, password_from_env(), args.ca_file, args.connect_timeout)
        if args.device is not None:
            return _device_status(args, options)
        status(options, args.federation, args.wait, args.json, sys.stdout)
    except ValueError as exc:
        print(f"fcl status: error: {exc}", file=sys.stderr)
        return int(ExitCode.BAD_INPUT)
    except StatusError as exc:
        print(f"fcl status: error: {exc}", file=sys.stderr)
        return int(ExitCode.BROKER_UNREACHABLE)
    return int(ExitCode.OK)


def _device_status(args: argparse.Namespace, options) -> int:
    """``fcl status --device``: ValueError on bad arguments, StatusError when the broker is out of reach."""
    import time

    from fcl_edge.device_view import device_status
    from fclcore.topics import validate_id

    if args.federation is None:
        raise ValueError("--device needs --federation")
    validate_id(args.device, "--device")
    found = device_status(options, args.federation, args.device, args.wait, args.json, sys.stdout, time.time())
    return int(ExitCode.OK if found else ExitCode.BAD_INPUT)


def _ctl(args: argparse.Namespace) -> int:
    import json

    from edge_client.control import request

    message: dict = {"op": args.op}
    if args.op == "loglik":
        import numpy as np

        if not args.input:
            print("fcl ctl: error: loglik needs --input", file=sys.stderr)
            return int(ExitCode.BAD_INPUT)
        try:
            x = _read_rows(args.input)
        except (OSError, ValueError) as exc:
            print(f"fcl ctl: error: {exc}", file=sys.stderr)
            return int(ExitCode.BAD_INPUT)
        message["x"] = np.asarray(x).tolist()
    try:
        reply = request(args.socket, message)
    except OSError as exc:
        print(f"fcl ctl: error: no client answers on {args.socket}: {exc}", file=sys.stderr)
        return int(ExitCode.FAILURE)
    if not reply.get("ok"):
        print(f"fcl ctl: error: {reply.get('error')}", file=sys.stderr)
        return int(ExitCode.BAD_INPUT)
    if args.op == "status":
        print(json.dumps(reply["status"], indent=2))
    else:
        print("\n".join(f"{v:.6f}" for v in reply["loglik"]))
    return int(ExitCode.OK)


def _read_rows(source: str):
    """Rows of 0/1 values from .npy / .csv / stdin (the width is the served model's, checked there)."""
    import io

    import numpy as np

    if source.endswith(".npy"):
        return np.load(source, allow_pickle=False)
    text = sys.stdin.read() if source == "-" else open(source, encoding="utf-8").read()
    return np.loadtxt(io.StringIO(text), delimiter=",", ndmin=2)


def _keygen(args: argparse.Namespace) -> int:
    from pathlib import Path

    from fclcore.signing import write_key
    from fclcore.topics import validate_id

    try:
        for client in args.clients:
            validate_id(client, "client id")
    except ValueError as exc:
        print(f"fcl keygen: error: {exc}", file=sys.stderr)
        return int(ExitCode.BAD_INPUT)
    for client in args.clients:
        path = Path(args.dir) / f"{client}.key"
        try:
            write_key(path)
        except FileExistsError:
            print(f"fcl keygen: {path} exists; kept", file=sys.stderr)
            continue
        print(path)
    return int(ExitCode.OK)


def _broker(args: argparse.Namespace) -> int:
    from fcl_edge.broker import run_embedded_broker

    return run_embedded_broker(args.host, args.port, args.ready_file)


def _ignore_stop_signals() -> None:
    """From the last ``atexit`` call on, a stop signal changes nothing: the exit code is decided."""
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN)


def _serve(run: Callable[[threading.Event], int]) -> int:
    """Run a daemon; SIGTERM/SIGINT only set an event that its loop checks.  A directory it
    cannot write (out_dir, state_dir: permissions, a read-only or full disk) is STATE_ERROR.
    The handlers stay until the process exits (the interpreter's teardown would otherwise
    restore the default action, and a late SIGTERM would end it as 143): a stop that came
    during the daemon's own teardown makes a clean exit INTERRUPTED."""
    import atexit
    import errno

    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    atexit.register(_ignore_stop_signals)
    try:
        code = int(run(stop))
        return int(ExitCode.INTERRUPTED) if stop.is_set() and code == ExitCode.OK else code
    except OSError as exc:
        if exc.errno not in (errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOSPC, errno.EDQUOT):
            raise
        where = f"{exc.filename}: " if exc.filename else ""
        print(f"fcl: error: cannot write the state: {where}{exc.strerror or exc}", file=sys.stderr)
        return int(ExitCode.STATE_ERROR)


if __name__ == "__main__":
    sys.exit(main())
