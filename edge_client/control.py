"""A local control socket of the running client: its status, and inference with the model it serves.

The daemon listens on a Unix socket (``state_dir/control.sock``, mode 0600: only the
service user and root can talk to it).  One JSON object per line in, one per line out:

    {"op": "status"}                      -> {"ok": true, "status": {...}}
    {"op": "loglik", "x": [[0, 1, ...]]}  -> {"ok": true, "loglik": [...]}  (nats per row)

Inference runs the served ONNX model (``out_dir/model.onnx``) through the torch-free
runtime, reloaded when the daemon replaces it, so it never touches the model in training.
Every problem is an answer ``{"ok": false, "error": "..."}``; the daemon is never at risk.
``fcl ctl`` is the command-line side.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import socketserver
import threading
from pathlib import Path
from typing import Callable

import numpy as np

log = logging.getLogger(__name__)
MAX_REQUEST_BYTES = 4 * 2**20
MAX_ROWS = 4096


class ControlServer:
    def __init__(
        self, path: str | os.PathLike, status: Callable[[], dict], model_path: Path, providers: list[str]
    ) -> None:
        """``providers``: ``serve.providers``, the onnxruntime execution providers in order of preference."""
        self.providers = providers
        self.path = Path(path)
        self.status = status
        self.model_path = model_path
        self._runtime = None
        self._runtime_key: tuple | None = None
        self._lock = threading.Lock()
        self._server: socketserver.UnixStreamServer | None = None

    def start(self) -> "ControlServer":
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.unlink(missing_ok=True)  # a socket left by a killed daemon
        owner = self

        class Handler(socketserver.StreamRequestHandler):
            def handle(self) -> None:
                line = self.rfile.readline(MAX_REQUEST_BYTES + 1)
                reply = owner.answer(line)
                self.wfile.write(json.dumps(reply).encode() + b"\n")

        old = os.umask(0o177)
        try:
            self._server = socketserver.ThreadingUnixStreamServer(str(self.path), Handler)
        finally:
            os.umask(old)
        self._server.daemon_threads = True
        threading.Thread(target=self._server.serve_forever, name="control", daemon=True).start()
        log.info("control socket at %s", self.path)
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self.path.unlink(missing_ok=True)

    def answer(self, line: bytes) -> dict:
        if len(line) > MAX_REQUEST_BYTES:
            return {"ok": False, "error": f"request larger than {MAX_REQUEST_BYTES} bytes"}
        try:
            request = json.loads(line)
        except (ValueError, RecursionError):
            return {"ok": False, "error": "expected one JSON object per line"}
        op = request.get("op") if isinstance(request, dict) else None
        if op == "status":
            return {"ok": True, "status": self.status()}
        if op == "loglik":
            try:
                return {"ok": True, "loglik": self._loglik(request.get("x")).tolist()}
            except ValueError as exc:
                return {"ok": False, "error": str(exc)}
        return {"ok": False, "error": f"op: expected 'status' or 'loglik', got {op!r}"}

    def _loglik(self, x: object) -> np.ndarray:
        try:
            rows = np.asarray(x, dtype=np.float32)
        except (TypeError, ValueError):
            raise ValueError("x: expected a list of rows of numbers") from None
        if rows.ndim != 2 or not 1 <= len(rows) <= MAX_ROWS:
            raise ValueError(f"x: expected 1 to {MAX_ROWS} rows of numbers, got shape {rows.shape}")
        return self._model().log_likelihood(rows)

    @property
    def provider(self) -> str:
        """The provider the served model runs on, once loaded (onnxruntime is imported on first use)."""
        runtime = self._runtime
        return runtime.provider if runtime is not None else f"none loaded yet (wants {self.providers[0]})"

    def _model(self):
        """The served model, loaded again when its file changes."""
        from export.runtime import MadeRuntime, ModelFileError  # onnxruntime: imported on first use

        try:
            st = self.model_path.stat()
        except FileNotFoundError:
            raise ValueError("no model served yet (the first one is written after the first task)") from None
        key = (st.st_ino, st.st_size, st.st_mtime_ns)
        with self._lock:
            if key != self._runtime_key:
                try:
                    self._runtime = MadeRuntime.load(self.model_path, providers=self.providers)
                except ModelFileError as exc:
                    raise ValueError(f"served model unusable: {exc}") from None
                self._runtime_key = key
            return self._runtime


def request(path: str | os.PathLike, message: dict, timeout: float = 30.0) -> dict:
    """Send one request to a running client's control socket and return its answer."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout)
        sock.connect(str(path))
        sock.sendall(json.dumps(message).encode() + b"\n")
        data = b""
        while not data.endswith(b"\n"):
            chunk = sock.recv(65536)
            if not chunk:
                break
            data += chunk
    return json.loads(data)
