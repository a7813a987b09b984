"""Serve the newest valid MADE model file: a model swapped in when its file changes, a broken
file logged and the previous model kept (``fcl infer --watch``; numpy + onnxruntime only)."""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any

from export.runtime import MadeRuntime, ModelFileError

log = logging.getLogger("fcl.export.runtime")  # the log lines it wrote before it had a module of its own


class ModelWatcher:
    """Serve the model at ``path`` and swap in a new one when the file changes.

    A change is noticed from ``os.stat`` (inode, mtime_ns, size), at most every ``interval``
    seconds, by :meth:`current` itself (``interval=0``: on every call) or by a background
    thread (:meth:`start`).  A new file is validated completely before it replaces the
    current model; a file that fails is logged and the previous model is kept (it is retried
    only when the file changes again).  Writers must use ``os.replace`` (the exporter does),
    so a reader opens either the old or the new file, never a half-written one; an in-place
    writer is caught by the hashes and, via ``fstat``, by a size/mtime change during the read.

    :meth:`current` is thread-safe; the returned runtime stays valid after a swap, so a
    request that started on the old model finishes on it.
    """

    def __init__(self, path: str | os.PathLike, *, interval: float = 1.0, **load_kwargs: Any) -> None:
        self.path = os.fspath(path)
        self.interval = float(interval)
        self._load_kwargs = load_kwargs
        self._lock = threading.Lock()
        self._reload_lock = threading.Lock()
        self._model = MadeRuntime.load(self.path, **load_kwargs)  # the first model must be valid
        self._failed_key: tuple[int, int, int] | None = None
        self._last_check = time.monotonic()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.generation = 0  # number of successful swaps
        self.errors = 0  # number of rejected files
        self.last_error: str | None = None

    def current(self) -> MadeRuntime:
        """The model to use for the next request (checks the file first if ``interval`` elapsed)."""
        if self._thread is None and time.monotonic() - self._last_check >= self.interval:
            self.poll()
        with self._lock:
            return self._model

    def poll(self) -> bool:
        """Check the file now; return True if a new model was swapped in."""
        if not self._reload_lock.acquire(blocking=False):
            return False  # another thread is already reloading; keep serving the current model
        try:
            self._last_check = time.monotonic()
            try:
                st = os.stat(self.path)
            except OSError as exc:
                msg = f"{self.path}: cannot stat model file: {exc.strerror or exc}"
                if msg != self.last_error:
                    log.warning("%s; keeping the current model", msg)
                    self.errors += 1
                    self.last_error = msg
                return False
            key = (st.st_ino, st.st_mtime_ns, st.st_size)
            with self._lock:
                current_key = self._model.stat_key
            if key == current_key or key == self._failed_key:
                return False
            try:
                model = MadeRuntime.load(self.path, **self._load_kwargs)
            except ModelFileError as exc:
                self._failed_key = key
                self.errors += 1
                self.last_error = str(exc)
                log.warning("rejected new model file, keeping the current model: %s", exc)
                return False
            with self._lock:
                self._model = model
                self.generation += 1
            self._failed_key = None
            log.info(
                "swapped in model %s (method %s, task %s, weights %s...)",
                self.path,
                model.metadata["method"],
                model.metadata["task"],
                model.metadata["weights_sha256"][:12],
            )
            return True
        finally:
            self._reload_lock.release()

    def start(self) -> "ModelWatcher":
        """Poll from a daemon thread every ``interval`` seconds (then :meth:`current` never stats)."""
        if self._thread is None:
            self._stop.clear()
            self._thread = threading.Thread(target=self._loop, name="fcl-model-watcher", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None

    def _loop(self) -> None:
        while not self._stop.wait(max(self.interval, 0.01)):
            try:
                self.poll()
            except Exception:  # never let the watcher thread die silently
                log.exception("model watcher poll failed")

    def __enter__(self) -> "ModelWatcher":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
