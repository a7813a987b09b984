"""A relay driven by its caller's own availability trace (``LinkRelay.set_online``, used by
benchmarks/bench_async.py): offline it cuts the connection and refuses new ones, back online it
relays again.  Loopback only: no namespace, no shaping, no root."""

from __future__ import annotations

import socket
import threading

import pytest
from support.timescale import scaled

from fcl_edge.links import LinkProfile, LinkRelay

DIRECT = LinkProfile("direct", up_kbit=0, down_kbit=0, rtt_ms=0)  # no cycle of its own


def _echo_server() -> socket.socket:
    server = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            threading.Thread(target=_echo, args=(conn,), daemon=True).start()

    threading.Thread(target=serve, daemon=True).start()
    return server


def _echo(conn: socket.socket) -> None:
    with conn:
        try:
            while chunk := conn.recv(4096):
                conn.sendall(chunk)
        except OSError:
            pass


def _connect(relay: LinkRelay) -> socket.socket:
    conn = socket.create_connection(("127.0.0.1", relay.port), timeout=scaled(10))
    conn.settimeout(scaled(10))
    return conn


@pytest.mark.filterwarnings("error::pytest.PytestUnhandledThreadExceptionWarning")  # a pump cut mid-select
def test_a_relay_goes_offline_and_back_when_its_caller_says() -> None:
    server = _echo_server()
    relay = LinkRelay("127.0.0.1", server.getsockname(), DIRECT)
    try:
        conn = _connect(relay)
        conn.sendall(b"ping")
        assert conn.recv(4) == b"ping"
        relay.set_online(False)
        assert conn.recv(1) == b""  # cut
        assert relay.offline_cuts == 1
        assert _connect(relay).recv(1) == b""  # refused while offline
        relay.set_online(True)
        again = _connect(relay)
        again.sendall(b"pong")
        assert again.recv(4) == b"pong"
        assert relay.online and relay.offline_cuts == 1
    finally:
        relay.close()
        server.close()
