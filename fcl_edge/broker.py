"""The embedded broker for the zero-config demo (amqtt).  Production and tests use Mosquitto."""

from __future__ import annotations

import asyncio
import logging
import signal
import socket

from fclcore.exitcodes import ExitCode

log = logging.getLogger(__name__)


def run_embedded_broker(host: str = "127.0.0.1", port: int = 1883) -> int:
    """Serve MQTT on host:port until SIGTERM/SIGINT."""
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
        broker = Broker(config)
        await broker.start()
        log.info("embedded broker listening on %s:%d", host, port)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        await broker.shutdown()

    asyncio.run(serve())
    return int(ExitCode.OK)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def wait_for_port(host: str, port: int, timeout: float) -> bool:
    """True once something accepts TCP connections on host:port."""
    import time
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((host, port), timeout=0.5):
                return True
        except OSError:
            time.sleep(0.1)
    return False
