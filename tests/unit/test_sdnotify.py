"""sd_notify against a real AF_UNIX datagram socket standing in for systemd."""

from __future__ import annotations

import math
import os
import socket
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from support.timescale import scaled

from fclcore.sdnotify import Notifier, WatchdogThread, notify_address, watchdog_seconds


@pytest.fixture
def manager(tmp_path: Path):
    """A bound datagram socket in tmp_path: what systemd listens on; yields (path, socket)."""
    path = tmp_path / "notify"
    if len(str(path)) >= 100:  # sun_path holds 108 bytes
        pytest.skip(f"tmp_path too long for an AF_UNIX address: {path}")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(path))
    sock.settimeout(5)
    yield str(path), sock
    sock.close()


def received(sock: socket.socket) -> list[str]:
    return sock.recv(4096).decode().split("\n")


@pytest.mark.parametrize(
    "call, fields",
    [
        (lambda n: n.ready(), ["READY=1"]),
        (lambda n: n.ready("connected to mqtt://b:1883"), ["READY=1", "STATUS=connected to mqtt://b:1883"]),
        (lambda n: n.stopping("checkpointing"), ["STOPPING=1", "STATUS=checkpointing"]),
        (lambda n: n.status("round 3\ntask 1"), ["STATUS=round 3 task 1"]),  # one line, never a 2nd field
        (lambda n: n.watchdog(), ["WATCHDOG=1"]),
        (lambda n: n.extend_timeout(2.5), ["EXTEND_TIMEOUT_USEC=2500000"]),
    ],
)
def test_messages_reach_the_manager_socket(manager, call, fields):
    path, sock = manager
    notifier = Notifier({"NOTIFY_SOCKET": path})
    assert notifier.enabled and call(notifier) is True
    assert received(sock) == fields


def test_abstract_namespace_socket():
    name = f"fcl-test-{uuid.uuid4().hex}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind("\0" + name)
        sock.settimeout(5)
        assert Notifier({"NOTIFY_SOCKET": "@" + name}).ready() is True
        assert received(sock) == ["READY=1"]


def test_reads_the_process_environment(manager):
    path, sock = manager
    code = "from fclcore.sdnotify import Notifier; import sys; sys.exit(0 if Notifier().ready('up') else 1)"
    env = {**os.environ, "NOTIFY_SOCKET": path}
    subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=scaled(60))
    assert received(sock) == ["READY=1", "STATUS=up"]


@pytest.mark.parametrize("env", [{}, {"NOTIFY_SOCKET": ""}, {"NOTIFY_SOCKET": "relative/path"}])
def test_no_socket_is_a_no_op(env):
    notifier = Notifier(env)
    assert not notifier.enabled
    assert notifier.ready() is False and notifier.watchdog() is False and notifier.stopping() is False
    assert notifier.watchdog_interval() is None


def test_a_missing_socket_never_raises(tmp_path):
    notifier = Notifier({"NOTIFY_SOCKET": str(tmp_path / "gone")})
    assert notifier.enabled
    assert notifier.ready() is False
    assert notifier.status("still fine") is False


def test_notify_address():
    assert notify_address("@x/y") == "\0x/y"
    assert notify_address("/run/systemd/notify") == "/run/systemd/notify"
    assert notify_address("vsock:2:1234") is None and notify_address(None) is None


@pytest.mark.parametrize(
    "env, seconds",
    [
        ({"WATCHDOG_USEC": "30000000"}, 30.0),
        ({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": "4242"}, 30.0),  # ours
        ({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": "1"}, None),  # another process's watchdog
        ({"WATCHDOG_USEC": "0"}, None),
        ({"WATCHDOG_USEC": "soon"}, None),
        ({}, None),
    ],
)
def test_watchdog_seconds(env, seconds):
    assert watchdog_seconds(env, pid=4242) == seconds


def test_watchdog_interval_needs_a_socket(manager):
    path, _ = manager
    assert Notifier({"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "500000"}).watchdog_interval() == 0.5
    assert Notifier({"WATCHDOG_USEC": "500000"}).watchdog_interval() is None


def test_watchdog_thread_pings_while_the_loop_beats(manager):
    path, sock = manager
    notifier = Notifier({"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "200000", "WATCHDOG_PID": str(os.getpid())})
    dog = WatchdogThread(notifier, stall_s=math.inf).start()
    try:
        assert dog.running
        assert received(sock) == ["WATCHDOG=1"]
        assert received(sock) == ["WATCHDOG=1"]
    finally:
        dog.stop()
    assert not dog.running and dog.pings >= 2


def test_watchdog_thread_withholds_pings_when_the_loop_stalls(manager):
    path, sock = manager
    notifier = Notifier({"NOTIFY_SOCKET": path})
    dog = WatchdogThread(notifier, interval_s=0.2, stall_s=0.05).start()  # checks every 0.1 s
    try:
        sock.settimeout(0.5)
        with pytest.raises(socket.timeout):
            sock.recv(4096)  # never beaten after start: every check finds the loop stalled
        assert dog.skipped >= 2 and dog.pings == 0
        dog.stall_s = 10.0
        dog.beat()
        sock.settimeout(5)
        assert received(sock) == ["WATCHDOG=1"]
    finally:
        dog.stop()


def test_no_watchdog_no_thread():
    dog = WatchdogThread(Notifier({})).start()
    assert not dog.running
    dog.stop()


def test_a_manager_that_stops_reading_never_blocks_the_service(tmp_path: Path) -> None:
    path = tmp_path / "full.sock"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(path))  # bound, never read: its queue fills after a few datagrams
    notifier = Notifier({"NOTIFY_SOCKET": str(path)})
    results = [notifier.watchdog() for _ in range(5000)]
    assert results[0] is True and results[-1] is False  # later ones dropped, none blocked
    sock.close()
