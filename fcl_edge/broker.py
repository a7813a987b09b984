"""The embedded broker for the zero-config demo (amqtt).  Production and tests use Mosquitto."""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

from fclcore.errors import BrokerUnreachable, ConfigError
from fclcore.exitcodes import ExitCode

log = logging.getLogger(__name__)


def run_embedded_broker(host: str = "127.0.0.1", port: int = 1883, ready_file: str | None = None) -> int:
    """Serve MQTT on host:port until SIGTERM/SIGINT.  ``ready_file`` is written once the
    broker listens, so a parent waits for it instead of probing the port with a bare TCP
    connection (which the broker logs as a failed MQTT session)."""
    try:
        from amqtt.broker import Broker
    except ImportError:
        log.error("the embedded broker needs amqtt: pip install 'fcl-edge[broker]', or pass --broker")
        return int(ExitCode.BAD_INPUT)
    logging.getLogger("amqtt").setLevel(logging.WARNING)
    logging.getLogger("transitions").setLevel(logging.WARNING)
    config = {
        "listeners": {"default": {"type": "tcp", "bind": f"{host}:{port}"}},
        "plugins": {"amqtt.plugins.authentication.AnonymousAuthPlugin": {"allow_anonymous": True}},
    }

    async def serve() -> None:
        broker = _subscribed_retained_only(Broker)(config)
        await broker.start()
        log.info("embedded broker listening on %s:%d", host, port)
        if ready_file:
            Path(ready_file).write_text(f"{host}:{port}\n")
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        await broker.shutdown()

    asyncio.run(serve())
    return int(ExitCode.OK)


def _subscribed_retained_only(broker_class: type) -> type:
    """amqtt 0.12's Broker, delivering retained messages only to sessions that subscribed to them.

    On every CONNECT, amqtt 0.12 walks the broker-wide subscription table (every session's
    filters) and sends the connecting session the retained messages matching *any* of them: a
    device then received the other devices' retained JSON status (matched by the aggregator's
    ``status/+``) on a topic it never subscribed to, and dropped it as a corrupt frame.  The
    walk also awaits inside the loop, so a concurrent SUBSCRIBE ends it with "dictionary
    changed size during iteration" and the connection is dropped.  MQTT 3.1.1 (3.3.1.3) sends
    retained messages on a new subscription only, which is what this keeps."""

    class Broker(broker_class):
        async def _publish_retained_messages_for_subscription(self, subscription, session) -> None:
            holders = self._subscriptions.get(subscription[0], ())
            if any(holder.client_id == session.client_id for holder, _ in holders):
                await super()._publish_retained_messages_for_subscription(subscription, session)

    return Broker


def probe_broker(url: str, timeout: float = 5.0) -> None:
    """Raise ``BrokerUnreachable`` unless an MQTT broker at ``url`` accepts a connection
    (CONNECT answered by a successful CONNACK) within ``timeout`` seconds."""
    import paho.mqtt.client as mqtt

    from fclcore.schema import parse_broker_url

    try:
        host, port = parse_broker_url(url)
    except ValueError as exc:
        raise ConfigError(f"--broker: {exc}") from None
    client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=f"fcl-probe-{os.getpid()}", clean_session=True)
    client.connect_timeout = timeout
    answered: list = []
    client.on_connect = lambda _c, _u, _f, reason, _p: answered.append(reason)
    try:
        if url.startswith("mqtts://"):
            client.tls_set()
        client.connect(host, port, keepalive=max(5, int(timeout)))
        deadline = time.monotonic() + timeout
        while not answered and time.monotonic() < deadline:
            client.loop(0.1)
    except OSError as exc:  # refused, unresolvable, TLS failure (ssl.SSLError is an OSError)
        raise BrokerUnreachable(f"could not connect to {url}: {exc.strerror or exc}") from None
    finally:
        if answered and not answered[0].is_failure:
            client.disconnect()
            client.loop(0.1)
        sock = client.socket()
        if sock is not None:
            sock.close()
    if not answered:
        raise BrokerUnreachable(f"broker {url} did not answer an MQTT CONNECT within {timeout:.0f} s")
    if answered[0].is_failure:
        raise BrokerUnreachable(f"broker {url} refused the connection: {answered[0]}")


SITE_BRIDGE = Path(__file__).resolve().parents[1] / "deploy" / "mosquitto" / "site-bridge.conf"


def site_bridge_config(federation: str, site: str, root_host: str, root_port: int, template: Path = SITE_BRIDGE) -> str:
    """The shipped site-to-root bridge (deploy/mosquitto/site-bridge.conf) with its placeholders filled in."""
    text = template.read_text()
    values = {"@FEDERATION@": federation, "@SITE_ID@": site, "@ROOT_HOST@": root_host, "@ROOT_PORT@": str(root_port)}
    for key, value in values.items():
        text = text.replace(key, value)
    return text


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def wait_for_port(host: str, port: int, timeout: float) -> bool:
    """True once something accepts TCP connections on host:port."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((host, port), timeout=0.5):
                return True
        except OSError:
            time.sleep(0.1)
    return False


class MosquittoProcess:
    """A Mosquitto broker on a free loopback port, for tests and benchmarks.

    The plain listener (``port``, ``url``) is always there.  Optional: ``password_file``
    (anonymous clients are then refused), ``acl_file``, a TLS listener on a second port
    (``tls=(cafile, certfile, keyfile)``, ``tls_port``, ``tls_url``; ``require_certificate``
    makes it demand a client certificate) and ``persistence_dir`` (retained messages and
    sessions survive ``restart()``; after ``kill()`` only what the last autosave wrote).
    """

    def __init__(
        self,
        workdir: Path,
        extra_config: str = "",
        *,
        password_file: str | Path | None = None,
        acl_file: str | Path | None = None,
        tls: tuple[str | Path, str | Path, str | Path] | None = None,
        require_certificate: bool = False,
        persistence_dir: str | Path | None = None,
        autosave_interval: int = 1,
    ) -> None:
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.extra_config = extra_config
        self.proc: subprocess.Popen | None = None
        self.log_path = self.workdir / "mosquitto.log"
        self.password_file = Path(password_file) if password_file is not None else None
        self.acl_file = Path(acl_file) if acl_file is not None else None
        self.tls = tuple(Path(f) for f in tls) if tls is not None else None
        if self.tls is not None and len(self.tls) != 3:
            raise ValueError(f"tls: expected (cafile, certfile, keyfile), got {tls!r}")
        self.require_certificate = require_certificate
        self.tls_port = free_port() if self.tls is not None else None
        self.persistence_dir = Path(persistence_dir) if persistence_dir is not None else None
        self.autosave_interval = autosave_interval

    @property
    def url(self) -> str:
        return f"mqtt://127.0.0.1:{self.port}"

    @property
    def tls_url(self) -> str:
        if self.tls_port is None:
            raise RuntimeError("this broker has no TLS listener: pass tls=(cafile, certfile, keyfile)")
        return f"mqtts://127.0.0.1:{self.tls_port}"

    def config_text(self) -> str:
        """The mosquitto.conf that start() writes (the listener-specific TLS block goes last)."""
        secured = any(x is not None for x in (self.password_file, self.acl_file, self.tls, self.persistence_dir))
        lines = [
            f"listener {self.port} 127.0.0.1",
            f"allow_anonymous {'false' if self.password_file is not None else 'true'}",
        ]
        if self.persistence_dir is not None:
            lines += [
                "persistence true",
                f"persistence_location {self.persistence_dir}",
                f"autosave_interval {self.autosave_interval}",
            ]
        else:
            lines.append("persistence false")
        lines += ["max_queued_messages 0", "log_dest stdout"]
        if self.password_file is not None:
            lines.append(f"password_file {self.password_file}")
        if self.acl_file is not None:
            lines.append(f"acl_file {self.acl_file}")
        if secured and os.geteuid() == 0:
            lines.append("user root")  # run as root it would drop to "mosquitto", who cannot read test tmp dirs
        lines.append(self.extra_config)
        if self.tls is not None:
            cafile, certfile, keyfile = self.tls
            lines += [
                f"listener {self.tls_port} 127.0.0.1",
                f"cafile {cafile}",
                f"certfile {certfile}",
                f"keyfile {keyfile}",
                f"require_certificate {str(self.require_certificate).lower()}",
            ]
        return "\n".join(lines) + "\n"

    def start(self, timeout: float = 10.0) -> "MosquittoProcess":
        binary = shutil.which("mosquitto") or "/usr/sbin/mosquitto"
        conf = self.workdir / "mosquitto.conf"
        if self.persistence_dir is not None:
            self.persistence_dir.mkdir(parents=True, exist_ok=True)
        conf.write_text(self.config_text())
        with open(self.log_path, "a") as log_file:
            self.proc = subprocess.Popen([binary, "-c", str(conf)], stdout=log_file, stderr=subprocess.STDOUT)
        ports = [self.port] + ([self.tls_port] if self.tls_port is not None else [])
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"mosquitto exited: {self.log_path.read_text()}")
            if all(wait_for_port("127.0.0.1", port, 0.2) for port in ports):
                return self
        raise RuntimeError("mosquitto did not start listening")

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def kill(self) -> None:
        """SIGKILL, as a power cut would: no DISCONNECTs sent, no final persistence save."""
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def restart(self, timeout: float = 10.0) -> "MosquittoProcess":
        """Stop if still running, then start again on the same port(s) with the same config."""
        self.stop()
        return self.start(timeout)

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None
