"""Torch-free inference runtime for exported MADE models (numpy + onnxruntime + json only).

This is what runs on a device: it never imports torch, onnx, yaml or paho.  A model file is
validated completely before onnxruntime sees it -- protobuf structure, ``fcl.*`` metadata,
the weights hash and the whole-file integrity hash (see ``export._proto``) -- so a
truncated, corrupted, foreign or tampered file is rejected with :class:`ModelFileError`
and a one-line message naming the path.

Semantics (binary MADE, Germain et al. 2015): ``logits[:, d]`` is the Bernoulli logit of
``p(x_d = 1 | x_<d)`` where ``<d`` means "earlier in ``order``" (``metadata["input_order"]``).

int8 models (``fcl.quantization = int8-dynamic``) quantise activations with one scale per
*tensor*, so a row's result would depend on the other rows of the batch (and, through the
scale, slightly on later inputs).  The runtime therefore evaluates int8 models one row at a
time; fp32 models run batched.
"""

from __future__ import annotations

import io
import json
import logging
import os
import sys
from typing import Any, Callable, Iterator, Sequence

import numpy as np
import onnxruntime as ort

from export import _meta
from export._proto import INTEGRITY_KEY, ProtoError, integrity_digest, parse_model, weights_digest
from export.providers import CPU, usable
from fclcore.errors import BadInput
from fclcore.npfile import refusal

__all__ = [
    "ModelFileError",
    "InputError",
    "MadeRuntime",
    "identity",
    "load_inputs",
    "parse_row",
    "session_options",
]

log = logging.getLogger("fcl.export.runtime")

CHUNK_ROWS = 32  # rows per onnxruntime call: bounds activation memory (1000 rows at once: +26 MB peak RSS
#                  for D=784, H=500; 32 rows: +0.3 MB) at no measurable cost in throughput
MAX_MODEL_BYTES = 1 << 31  # protobuf's 2 GiB limit; anything larger is not a single-file ONNX model


class ModelFileError(BadInput):
    """A model file that must not be served: unreadable, not ONNX, bad metadata, hash mismatch."""


class InputError(BadInput):
    """Inference inputs with the wrong shape, type or values."""


def session_options(
    intra_op_threads: int | None = 1, cpu_mem_arena: bool = False, mem_pattern: bool = False
) -> ort.SessionOptions:
    """onnxruntime options tuned for a small device (see benchmarks/results/inference.md).

    One intra-op thread is fastest for batch-1 MADE and keeps the thread pool's stacks out of
    the RSS; the CPU memory arena and memory patterns trade RSS for speed on repeated shapes.
    ``None`` threads = onnxruntime's default (one per physical core).
    """
    so = ort.SessionOptions()
    if intra_op_threads is not None:
        so.intra_op_num_threads = int(intra_op_threads)
    so.inter_op_num_threads = 1
    so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    so.enable_cpu_mem_arena = bool(cpu_mem_arena)
    so.enable_mem_pattern = bool(mem_pattern)
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    so.log_severity_level = 3  # errors only: quantised models warn about nothing useful
    return so


def validate_model_bytes(
    data: bytes, path: str, parse_meta: Callable[[dict[str, str]], dict[str, Any]] = _meta.parse
) -> dict[str, Any]:
    """Structure, ``fcl.*`` metadata (read by ``parse_meta``: a format's own schema), weights
    hash and whole-file hash; return the parsed metadata."""
    if len(data) == 0:
        raise ModelFileError(f"{path}: empty file")
    try:
        parsed = parse_model(data)
    except ProtoError as exc:
        raise ModelFileError(f"{path}: not a valid ONNX model file ({exc}); truncated or corrupted?") from None
    if not parsed.has_graph:
        raise ModelFileError(f"{path}: not an ONNX model (no graph)")
    try:
        meta = parse_meta(parsed.metadata)
    except _meta.MetadataError as exc:
        raise ModelFileError(f"{path}: {exc}") from None
    got = weights_digest((t.name, t.data_type, t.dims, t.raw) for t in parsed.initializers)
    if got != meta["weights_sha256"]:
        raise ModelFileError(
            f"{path}: weights hash mismatch (metadata {meta['weights_sha256'][:12]}..., "
            f"weights {got[:12]}...): tampered or corrupted"
        )
    try:
        whole = integrity_digest(data, parsed.metadata_spans[INTEGRITY_KEY])
    except ProtoError as exc:
        raise ModelFileError(f"{path}: {exc}") from None
    if whole != meta["integrity_sha256"]:
        raise ModelFileError(f"{path}: file integrity hash mismatch: modified or corrupted after export")
    return meta


def _session(
    source: str | bytes, options: ort.SessionOptions, path: str, providers: Sequence[str] = (CPU,)
) -> ort.InferenceSession:
    chosen = list(usable(tuple(providers)))  # ConfigError for an unknown name, before the try below
    try:
        session = ort.InferenceSession(source, sess_options=options, providers=chosen)
    except Exception as exc:  # noqa: BLE001 - onnxruntime raises several private exception types
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ModelFileError(f"{path}: onnxruntime cannot load the model: {first[:200]}") from None
    if session.get_providers() == [CPU] and getattr(session, "_model_bytes", None) is source:
        # onnxruntime keeps the bytes only to re-create the session on a provider fallback, which a
        # CPU-only session never does; holding them would double the model's memory for its lifetime.
        session._model_bytes = None
    return session


def _check_io(session: ort.InferenceSession, meta: dict[str, Any], path: str) -> None:
    d = meta["input_dim"]
    ins, outs = session.get_inputs(), session.get_outputs()
    if len(ins) != 1 or ins[0].name != "x" or ins[0].type != "tensor(float)":
        raise ModelFileError(
            f"{path}: expected one float input 'x', got " + ", ".join(f"{i.name}:{i.type}" for i in ins)
        )
    if len(ins[0].shape) != 2 or ins[0].shape[1] != d:
        raise ModelFileError(f"{path}: input 'x' has shape {ins[0].shape}, metadata says input_dim {d}")
    if len(outs) != 1 or outs[0].name != "logits" or len(outs[0].shape) != 2 or outs[0].shape[1] != d:
        raise ModelFileError(
            f"{path}: expected one output 'logits' of shape [batch, {d}], got "
            + ", ".join(f"{o.name}{o.shape}" for o in outs)
        )


def identity(path: str, metadata: dict[str, Any], *entries: str | tuple[str, Any]) -> dict[str, Any]:
    """What a runtime's ``describe()`` says of its model, in order: the path, then per entry a
    metadata key (its value) or a ``(name, value)`` pair the runtime computes."""
    out: dict[str, Any] = {"path": path}
    for entry in entries:
        name, value = (entry, metadata[entry]) if isinstance(entry, str) else entry
        out[name] = value
    return out


def _sigmoid(z: np.ndarray) -> np.ndarray:
    return np.exp(-np.logaddexp(0.0, -z))


def open_validated(
    path: str,
    options: ort.SessionOptions,
    validate: Callable[[bytes, str], dict[str, Any]],
    providers: Sequence[str] = (CPU,),
) -> tuple[ort.InferenceSession, dict[str, Any], tuple[int, int, int]]:
    """Open ``path`` once, check its bytes with ``validate``, and let onnxruntime read the
    same open file; (session, metadata, (inode, mtime_ns, size)).  Shared by every runtime."""
    try:
        fh = open(path, "rb")
    except FileNotFoundError:
        raise ModelFileError(f"{path}: no such model file") from None
    except IsADirectoryError:
        raise ModelFileError(f"{path}: is a directory, not a model file") from None
    except OSError as exc:
        raise ModelFileError(f"{path}: cannot open model file: {exc.strerror or exc}") from None
    with fh:
        try:
            st = os.fstat(fh.fileno())
            if st.st_size > MAX_MODEL_BYTES:
                raise ModelFileError(f"{path}: {st.st_size} bytes is too large for a single-file ONNX model")
            data = fh.read()
        except OSError as exc:
            raise ModelFileError(f"{path}: cannot read model file: {exc.strerror or exc}") from None
        if len(data) != st.st_size:
            raise ModelFileError(f"{path}: file changed while being read (writers must use os.replace)")
        meta = validate(data, path)
        fd_path = f"/proc/self/fd/{fh.fileno()}"
        if os.path.exists(fd_path):
            del data
            session = _session(fd_path, options, path, providers)
        else:  # pragma: no cover - non-Linux
            session = _session(data, options, path, providers)
            del data
        after = os.fstat(fh.fileno())
        if (after.st_mtime_ns, after.st_size) != (st.st_mtime_ns, st.st_size):
            raise ModelFileError(f"{path}: file changed while being loaded (writers must use os.replace)")
    return session, meta, (st.st_ino, st.st_mtime_ns, st.st_size)


class MadeRuntime:
    """A validated, loaded MADE model.  Create with :meth:`load`."""

    def __init__(
        self,
        session: ort.InferenceSession,
        metadata: dict[str, Any],
        path: str,
        stat_key: tuple[int, int, int] | None = None,
    ) -> None:
        self._session = session
        self.metadata = metadata
        self.path = path
        self.input_dim: int = metadata["input_dim"]
        self.order = np.asarray(metadata["input_order"], dtype=np.int64)
        self.quantized = metadata["quantization"] != "none"
        self.stat_key = stat_key
        self.provider: str = session.get_providers()[0]  # the one running it (after any fallback)

    # ------------------------------------------------------------------ loading
    @classmethod
    def load(
        cls,
        path: str | os.PathLike,
        *,
        intra_op_threads: int | None = 1,
        cpu_mem_arena: bool = False,
        mem_pattern: bool = False,
        providers: Sequence[str] = (CPU,),
    ) -> "MadeRuntime":
        """Read, validate and load ``path``; raise :class:`ModelFileError` with a one-line reason.

        The file is opened once.  Its bytes are validated, then dropped, and onnxruntime reads
        the *same open file* through ``/proc/self/fd/N`` (so a concurrent ``os.replace`` cannot
        slip an unvalidated file in, and the validated bytes and onnxruntime's own copies are
        never in memory together).  Without ``/proc`` the validated bytes are handed over.
        """
        path = os.fspath(path)
        options = session_options(intra_op_threads, cpu_mem_arena, mem_pattern)
        session, meta, key = open_validated(path, options, validate_model_bytes, providers)
        _check_io(session, meta, path)
        return cls(session, meta, path, key)

    @classmethod
    def from_bytes(
        cls,
        data: bytes,
        path: str = "<bytes>",
        *,
        stat_key: tuple[int, int, int] | None = None,
        options: ort.SessionOptions | None = None,
    ) -> "MadeRuntime":
        """Validate and load model bytes (the same checks as :meth:`load`)."""
        meta = validate_model_bytes(data, path)
        session = _session(data, options or session_options(), path)
        _check_io(session, meta, path)
        return cls(session, meta, path, stat_key)

    # ---------------------------------------------------------------- inference
    def _check(self, x: Any, binary: bool) -> np.ndarray:
        a = np.asarray(x)
        if a.dtype == object or not (np.issubdtype(a.dtype, np.number) or a.dtype == np.bool_):
            raise InputError(f"x must be a numeric array, got dtype {a.dtype}")
        if a.ndim != 2 or a.shape[1] != self.input_dim:
            raise InputError(f"x must have shape (N, {self.input_dim}), got {a.shape}")
        a = np.ascontiguousarray(a, dtype=np.float32)
        if not np.isfinite(a).all():
            raise InputError("x contains NaN or infinite values")
        if binary and not np.isin(a, (0.0, 1.0)).all():
            raise InputError("x must contain only 0 and 1")
        return a

    def _chunks(self, n: int) -> Iterator[slice]:
        step = 1 if self.quantized else CHUNK_ROWS
        return (slice(i, min(i + step, n)) for i in range(0, n, step))

    def _run(self, x: np.ndarray) -> np.ndarray:
        """Logits for validated x, in chunks of rows (bounded activation memory; int8: one row at a time)."""
        out = np.empty((x.shape[0], self.input_dim), dtype=np.float32)
        for s in self._chunks(x.shape[0]):
            out[s] = self._session.run(None, {"x": x[s]})[0]
        return out

    def logits(self, x: np.ndarray) -> np.ndarray:
        """Bernoulli logits (N, D) float32 for real-valued x (N, D)."""
        return self._run(self._check(x, binary=False))

    def log_likelihood(self, x: np.ndarray) -> np.ndarray:
        """log p(x) per sample in nats, shape (N,) float64; x must be {0,1} of shape (N, D)."""
        a = self._check(x, binary=True)
        ll = np.empty(a.shape[0], dtype=np.float64)
        for s in self._chunks(a.shape[0]):
            z = self._session.run(None, {"x": a[s]})[0].astype(np.float64)
            # log sigmoid(z) if x=1, log sigmoid(-z) if x=0  ==  x*z - softplus(z)
            ll[s] = (a[s] * z - np.logaddexp(0.0, z)).sum(axis=1)
        return ll

    def conditionals(self, x: np.ndarray) -> np.ndarray:
        """p(x_d = 1 | x_<d) for every d (order = ``self.order``), shape (N, D) float64; x in {0,1}."""
        return _sigmoid(self._run(self._check(x, binary=True)).astype(np.float64))

    def sample(self, n: int, seed: int) -> np.ndarray:
        """``n`` samples (n, D) float32 in {0,1}, drawn one dimension at a time in ``self.order``.

        Deterministic in ``seed`` (numpy ``default_rng``).
        """
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 0:
            raise InputError(f"n must be an int >= 0, got {n!r}")
        if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
            raise InputError(f"seed must be an int >= 0, got {seed!r}")
        rng = np.random.default_rng(int(seed))
        x = np.zeros((int(n), self.input_dim), dtype=np.float32)
        for d in self.order:
            p = _sigmoid(self._run(x)[:, d].astype(np.float64))
            x[:, d] = rng.random(int(n)) < p
        return x

    def describe(self) -> dict[str, Any]:
        """Identity of the loaded model, for logs and JSON answers."""
        return identity(self.path, self.metadata, "method", "task", "order_index", "quantization", "weights_sha256")


def _validate_inputs(a: np.ndarray, input_dim: int, where: str, binary: bool) -> np.ndarray:
    if a.dtype == object or not (np.issubdtype(a.dtype, np.number) or a.dtype == np.bool_):
        raise InputError(f"{where}: expected numbers, got dtype {a.dtype}")
    if a.ndim == 1 and a.shape[0] == input_dim:
        a = a[None, :]
    if a.ndim != 2 or a.shape[1] != input_dim:
        raise InputError(f"{where}: expected shape (N, {input_dim}), got {a.shape}")
    a = np.ascontiguousarray(a, dtype=np.float32)
    if not np.isfinite(a).all():
        raise InputError(f"{where}: contains NaN or infinite values")
    if binary and not np.isin(a, (0.0, 1.0)).all():
        bad = np.argwhere(~np.isin(a, (0.0, 1.0)))[0]
        raise InputError(
            f"{where}: values must be 0 or 1 (row {bad[0]}, column {bad[1]} is {a[bad[0], bad[1]]:g}); the model "
            "scores binarised rows: threshold raw pixels first, as its metadata's 'binarize' says (e.g. value>7)"
        )
    return a


def _parse_csv(text: str, input_dim: int, where: str, binary: bool) -> np.ndarray:
    lines = [ln for ln in text.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
    if not lines:
        return np.zeros((0, input_dim), dtype=np.float32)
    try:
        a = np.loadtxt(io.StringIO("\n".join(lines)), delimiter=",", ndmin=2, dtype=np.float64)
    except ValueError as exc:
        raise InputError(f"{where}: not numeric CSV: {str(exc).splitlines()[0][:160]}") from None
    return _validate_inputs(a, input_dim, where, binary)


def _samples_of(text: str) -> np.ndarray:
    """The ``samples`` rows of one JSON object (``fcl infer --op sample`` output)."""
    try:
        samples = json.loads(text).get("samples")
    except (ValueError, AttributeError):
        samples = None
    if not isinstance(samples, list):
        raise InputError("stdin: JSON input must be an object with a 'samples' list (the output of --op sample)")
    try:
        return np.asarray(samples, dtype=np.float64)
    except (TypeError, ValueError):
        raise InputError("stdin: 'samples' must be a list of equal-length rows of numbers") from None


def parse_row(line: str, input_dim: int, *, binary: bool = True) -> np.ndarray:
    """One CSV line -> (1, input_dim) float32 (used by ``fcl infer --watch``)."""
    return _parse_csv(line, input_dim, "input line", binary).reshape(-1, input_dim)


def load_inputs(source: str, input_dim: int, *, binary: bool = True) -> np.ndarray:
    """Inputs (N, input_dim) float32 from ``.npy`` (no pickles), ``.csv`` (numeric) or ``-`` (CSV on stdin).

    A single row of length ``input_dim`` is accepted as N = 1.  With ``binary`` (the default,
    as every MADE operation needs it) values must be 0 or 1.  Raises :class:`InputError`.
    """
    if source == "-":
        text = sys.stdin.read()
        if text.lstrip().startswith("{"):  # the JSON answer of ``fcl infer --op sample``, piped on
            return _validate_inputs(_samples_of(text), input_dim, "stdin", binary)
        return _parse_csv(text, input_dim, "stdin", binary)
    low = source.lower()
    try:
        if low.endswith(".npy"):
            try:
                a = np.load(source, allow_pickle=False)
            except ValueError as exc:  # object arrays, bad header
                raise InputError(f"{source}: not a plain numeric .npy file: {refusal(exc)}") from None
            if not isinstance(a, np.ndarray):
                raise InputError(f"{source}: expected one array in a .npy file")
            return _validate_inputs(a, input_dim, source, binary)
        if low.endswith(".csv"):
            with open(source, encoding="utf-8") as fh:
                text = fh.read()
            return _parse_csv(text, input_dim, source, binary)
    except FileNotFoundError:
        raise InputError(f"{source}: no such input file") from None
    except UnicodeDecodeError:
        raise InputError(f"{source}: CSV input is not UTF-8 text") from None
    except (OSError, EOFError) as exc:
        raise InputError(f"{source}: cannot read input: {getattr(exc, 'strerror', None) or exc}") from None
    raise InputError(f"{source}: unsupported input; use a .npy file, a .csv file or - for CSV on stdin")
