"""systemd's readiness/watchdog protocol (``Type=notify``) without libsystemd.

The protocol is one AF_UNIX datagram of ``KEY=VALUE`` lines sent to the socket named by
``$NOTIFY_SOCKET``: a filesystem path, or an abstract-namespace name written with a
leading ``@``.  Outside systemd the variable is unset and every call is a no-op, so the
daemons call these unconditionally.  Sending never raises: a lost notification must not
take a daemon down (systemd then times the unit out, which is the right failure).

Wiring (see the report of issue 7)::

    notifier = Notifier()
    watchdog = WatchdogThread(notifier).start()   # no thread unless WatchdogSec= is set
    link.start(); notifier.ready("connected")
    ... loop: watchdog.beat(); notifier.status("round 3 task 0") ...
    on stop: notifier.stopping("checkpointing"); ...; watchdog.stop()
"""

from __future__ import annotations

import logging
import math
import os
import socket
import threading
import time
from typing import Mapping

log = logging.getLogger(__name__)


def notify_address(value: str | None) -> str | None:
    """The socket address ``$NOTIFY_SOCKET`` names, or None if it names none we can use."""
    if not value:
        return None
    if value.startswith("@"):
        return "\0" + value[1:]  # abstract namespace: leading NUL instead of '@'
    if value.startswith("/"):
        return value
    log.warning("NOTIFY_SOCKET=%r is neither a path nor an @abstract name; not notifying", value)
    return None


def watchdog_seconds(environ: Mapping[str, str], pid: int) -> float | None:
    """``$WATCHDOG_USEC`` in seconds if the watchdog is meant for process ``pid``, else None."""
    raw = environ.get("WATCHDOG_USEC")
    if not raw:
        return None
    owner = environ.get("WATCHDOG_PID")
    if owner and owner.strip() != str(pid):
        return None  # inherited from a parent: the pings are that process's job
    try:
        usec = int(raw)
    except ValueError:
        log.warning("WATCHDOG_USEC=%r is not an integer; watchdog disabled", raw)
        return None
    return usec / 1e6 if usec > 0 else None


class Notifier:
    """Sends sd_notify messages for this process; every method returns whether it was sent."""

    def __init__(self, environ: Mapping[str, str] | None = None, pid: int | None = None) -> None:
        env = os.environ if environ is None else environ
        self.address = notify_address(env.get("NOTIFY_SOCKET"))
        self._watchdog_s = watchdog_seconds(env, os.getpid() if pid is None else pid)
        self._warned = False

    @property
    def enabled(self) -> bool:
        return self.address is not None

    def notify(self, *fields: str) -> bool:
        """Send ``KEY=VALUE`` fields in one datagram (the unit of the protocol)."""
        if self.address is None or not fields:
            return False
        data = "\n".join(fields).encode("utf-8")
        try:
            # Non-blocking: a manager that stopped reading must never stall the service loop.
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC | socket.SOCK_NONBLOCK) as sock:
                sock.sendto(data, self.address)
        except OSError as exc:
            if not self._warned:  # once: a dead manager socket would otherwise flood the log
                log.warning("sd_notify to %r failed: %s", self.address.replace("\0", "@"), exc)
                self._warned = True
            return False
        return True

    def ready(self, status: str | None = None) -> bool:
        """The service is up (for ``Type=notify``, systemd holds dependent units until this)."""
        return self.notify("READY=1", *_status_field(status))

    def stopping(self, status: str | None = None) -> bool:
        """A graceful stop has begun; systemd shows the unit as deactivating."""
        return self.notify("STOPPING=1", *_status_field(status))

    def status(self, text: str) -> bool:
        """Free-form one-line status, shown by ``systemctl status``."""
        return self.notify(*_status_field(text))

    def watchdog(self) -> bool:
        """Keep-alive ping; needed more often than ``WatchdogSec=`` when the watchdog is on."""
        return self.notify("WATCHDOG=1")

    def extend_timeout(self, seconds: float) -> bool:
        """Ask for ``seconds`` more before the start/stop timeout fires (a long checkpoint)."""
        return self.notify(f"EXTEND_TIMEOUT_USEC={max(0, int(seconds * 1e6))}")

    def watchdog_interval(self) -> float | None:
        """``WatchdogSec=`` in seconds if systemd expects pings from this process, else None."""
        return self._watchdog_s if self.enabled else None


def _status_field(text: str | None) -> tuple[str, ...]:
    if text is None:
        return ()
    return ("STATUS=" + " ".join(str(text).split()),)  # one line: a newline would start a new field


class WatchdogThread:
    """Pings the watchdog at half its interval while the daemon's loop keeps beating.

    A thread that pings unconditionally would keep a wedged daemon alive forever, so a
    ping is sent only if :meth:`beat` was called within ``stall_s`` (default: the
    watchdog interval).  Pass ``stall_s=math.inf`` to ping unconditionally.  Without a
    watchdog (no ``WatchdogSec=``, or outside systemd) no thread is started.
    """

    def __init__(self, notifier: Notifier, interval_s: float | None = None, stall_s: float | None = None) -> None:
        self.notifier = notifier
        self.interval_s = interval_s if interval_s is not None else notifier.watchdog_interval()
        self.stall_s = stall_s if stall_s is not None else self.interval_s
        self.pings = 0
        self.skipped = 0
        self._last_beat = time.monotonic()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def beat(self) -> None:
        """Called by the daemon's main loop: 'I am still making progress'."""
        self._last_beat = time.monotonic()

    def start(self) -> WatchdogThread:
        if self.interval_s is None or self.interval_s <= 0 or self.running:
            return self
        self.beat()
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="sd-watchdog", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout: float = 2.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None

    def _run(self) -> None:
        period = self.interval_s / 2
        while not self._stop.wait(period):
            stalled_for = time.monotonic() - self._last_beat
            if self.stall_s is not None and not math.isinf(self.stall_s) and stalled_for > self.stall_s:
                self.skipped += 1
                log.error("main loop silent for %.0f s; withholding the watchdog ping", stalled_for)
                continue
            if self.notifier.watchdog():
                self.pings += 1
