"""``fcl simulate --in-process``: the same aggregator service and device daemons, as threads of
one process over ``fclcore.inproc`` (retained messages, last will, QoS 1 semantics) instead of
OS processes over an MQTT broker.

Nothing here re-implements the protocol: each participant is the real ``AggregatorService``
or ``ClientDaemon`` with its link built by ``fclcore.inproc.link_factory``.  Benchmarks and
quick experiments use this; the wire protocol itself is tested against Mosquitto.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from pathlib import Path
from typing import Callable, Iterator

from fclcore.config import load_config
from fclcore.errors import FclError
from fclcore.exitcodes import ExitCode
from fclcore.inproc import InProcessBroker, link_factory
from fclcore.schema import AggregatorConfig, ClientConfig

log = logging.getLogger(__name__)


class Participant:
    """A service running in a thread, with the subset of ``subprocess.Popen`` that
    ``fcl_edge.simulate`` uses (poll, wait, terminate, kill)."""

    def __init__(self, name: str, build: Callable[[threading.Event], object]) -> None:
        self.name = name
        self.stop = threading.Event()
        self.returncode: int | None = None
        self.reason: str | None = None  # why it failed, in one line (fcl simulate prints it)
        self._service = None
        self._build = build
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> "Participant":
        self._thread.start()
        return self

    def _run(self) -> None:
        try:
            self._service = self._build(self.stop)
            self.returncode = int(self._service.run())
        except FclError as exc:  # the toolkit's own errors: one line, their exit code (as fcl does)
            log.error("%s: %s", self.name, exc)
            self.reason, self.returncode = str(exc), int(exc.exit_code)
        except Exception as exc:
            log.exception("%s failed", self.name)
            self.reason, self.returncode = f"{type(exc).__name__}: {exc}", int(ExitCode.FAILURE)

    def poll(self) -> int | None:
        return None if self._thread.is_alive() else self.returncode

    def wait(self, timeout: float | None = None) -> int | None:
        self._thread.join(timeout)
        if self._thread.is_alive():
            import subprocess

            raise subprocess.TimeoutExpired(self.name, timeout)
        return self.returncode

    def terminate(self) -> None:
        self.stop.set()

    kill = terminate


def start_participants(configs: dict[str, tuple[str, Path]], broker: InProcessBroker) -> dict[str, Participant]:
    """One thread per written config (``fcl_edge.simulate.write_configs``), clients first."""
    return {name: participant.start() for name, participant in build_participants(configs, broker).items()}


def build_participants(configs: dict[str, tuple[str, Path]], broker: InProcessBroker) -> dict[str, Participant]:
    """``start_participants`` without the start: each is started when its ``start()`` is called
    (``fcl simulate`` starts a device that enrolls late when its task comes)."""
    from aggregator.service import AggregatorService
    from edge_client.daemon import ClientDaemon

    factory = link_factory(broker)
    out: dict[str, Participant] = {}
    for name, (kind, path) in sorted(configs.items(), key=lambda item: item[1][0] == "aggregator"):
        if kind == "aggregator":
            cfg = load_config(AggregatorConfig, path)
            out[name] = Participant(name, lambda stop, c=cfg: AggregatorService(c, stop, link_factory=factory))
        else:
            cfg = load_config(ClientConfig, path)
            out[name] = Participant(name, lambda stop, c=cfg: ClientDaemon(c, stop, link_factory=factory))
    return out


@contextlib.contextmanager
def logging_to(path: Path) -> Iterator[None]:
    """Every participant's log lines into one file, and only there (as each process of a
    multi-process run has its own log): stderr keeps ``fcl simulate``'s own lines."""
    handler = logging.FileHandler(path, encoding="utf-8")
    handler.setFormatter(logging.Formatter("%(asctime)s %(threadName)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    before = root.handlers[:]
    root.handlers = [handler]
    try:
        yield
    finally:
        root.handlers = before
        handler.close()
