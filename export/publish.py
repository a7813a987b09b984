"""The publish path every exporter shares: seal, write, verify, then replace atomically.

An exporter builds an ONNX graph, :func:`seal` s it (``fcl.*`` metadata plus the weights and
integrity hashes the runtimes check), writes it with :func:`write_synced` to a
:func:`temp_path` next to its destination, verifies the written bytes, and only then
:func:`publish` es every temporary file over its target (``os.replace`` + a directory fsync).
Whatever is left is cleaned up with :func:`remove_temps`.  int8 copies live at
:func:`int8_path_for`; :func:`quiet_quantizer` keeps onnxruntime's ``quantize_dynamic`` from
configuring the root logger or printing its pre-processing hint, and :func:`quantize_int8` runs
it that way for the text exporters.

Only the standard library is imported here (onnx lazily, inside :func:`seal`; onnxruntime's
quantiser inside :func:`quantize_int8`).
"""

from __future__ import annotations

import hashlib
import logging
import os
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator, Mapping, Sequence

from export import _meta
from export._proto import INTEGRITY_KEY, PLACEHOLDER, integrity_digest, parse_model, weights_digest_in_order
from fclcore.checkpoint import fsync_dir
from fclcore.errors import FclError

if TYPE_CHECKING:
    import onnx

__all__ = [
    "ExportError",
    "OPSET",
    "seal",
    "seal_props",
    "temp_path",
    "write_synced",
    "file_sha256",
    "int8_path_for",
    "quiet_quantizer",
    "quantize_int8",
    "published_mode",
    "publish",
    "remove_temps",
]

OPSET = 17


class ExportError(FclError, RuntimeError):
    """The model could not be exported, or the exported file failed verification."""


def seal(proto: "onnx.ModelProto", metadata: dict[str, Any]) -> "onnx.ModelProto":
    """Set the ``fcl.*`` metadata (``metadata`` without the hashes) and both hashes, in place.

    Initializers are first rewritten with ``raw_data`` (quantisers sometimes use typed
    fields) so the runtime can hash exactly what it reads.  The integrity hash is computed on
    the serialisation with a placeholder value of the same length, then patched in, so the
    final bytes differ from the hashed ones only inside that value.
    """
    seal_props(proto, metadata)
    data = proto.SerializeToString()
    span = parse_model(data).metadata_spans[INTEGRITY_KEY]
    whole = integrity_digest(data, span)
    for entry in proto.metadata_props:
        if entry.key == INTEGRITY_KEY:
            entry.value = whole
    return proto


def seal_props(proto: "onnx.ModelProto", metadata: dict[str, Any], raws: Mapping[str, Any] | None = None) -> None:
    """What :func:`seal` sets before the integrity hash (whose placeholder it leaves): every
    initializer in ``raw_data``, the ``fcl.*`` metadata and the weights hash.  ``raws``: the
    bytes of initializers the proto holds empty (``export.splice`` writes them in)."""
    from onnx import TensorProto, helper, numpy_helper

    raws = raws or {}
    inits = list(proto.graph.initializer)
    for i, t in enumerate(inits):
        if t.data_location != TensorProto.DEFAULT:
            raise ExportError(f"initializer {t.name!r} uses external data")
        if t.name in raws:
            continue
        if not t.HasField("raw_data") or len(t.float_data) or len(t.int32_data) or len(t.int64_data):
            proto.graph.initializer[i].CopyFrom(numpy_helper.from_array(numpy_helper.to_array(t), t.name))
    ordered = sorted(proto.graph.initializer, key=lambda t: t.name)
    digest = weights_digest_in_order(
        (t.name, t.data_type, list(t.dims), raws[t.name] if t.name in raws else t.raw_data) for t in ordered
    )
    props = _meta.encode(metadata)
    props[_meta.PREFIX + "weights_sha256"] = digest
    props[INTEGRITY_KEY] = PLACEHOLDER.decode()
    helper.set_model_props(proto, props)


def _umask() -> int:
    mask = os.umask(0o022)  # read once, at import: os.umask can only be read by setting it
    os.umask(mask)
    return mask


_UMASK = _umask()


def published_mode() -> int:
    """The mode a published file gets: what ``open`` would give it under this process's umask
    (``mkstemp``'s 0600 would make it unreadable to the service's other users)."""
    return 0o666 & ~_UMASK


def int8_path_for(path: str | os.PathLike) -> Path:
    """``model.onnx`` -> ``model.int8.onnx`` (same directory)."""
    p = Path(path)
    stem = p.name[: -len(".onnx")] if p.name.endswith(".onnx") else p.name
    return p.with_name(stem + ".int8.onnx")


def temp_path(path: str | os.PathLike) -> Path:
    """A new empty hidden temporary file next to ``path`` (same directory, so ``os.replace`` is atomic)."""
    path = Path(path)
    fd, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp.onnx")
    os.close(fd)
    os.chmod(name, published_mode())
    return Path(name)


def write_synced(path: str | os.PathLike, data: bytes) -> None:
    """Write ``data`` to ``path`` (truncating it) and fsync the file."""
    with open(path, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())


def file_sha256(path: str | os.PathLike) -> str:
    """Hex sha256 of the file's bytes."""
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


class _DropPreprocessHint(logging.Filter):
    """The quantiser always suggests shape-inference pre-processing (the exported graphs need
    none) and logs an INFO line per tensor without quantisation parameters (dynamic
    quantisation needs none): neither is news to the user of ``fcl export``."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.WARNING and "pre-processing before quantization" not in record.getMessage()


@contextmanager
def quiet_quantizer() -> Iterator[None]:
    """Around ``quantize_dynamic``: a root-logger NullHandler (so ``logging.warning()`` inside the
    quantiser does not call ``basicConfig()``) and a filter dropping its pre-processing hint."""
    root = logging.getLogger()
    quiet, hint = logging.NullHandler(), _DropPreprocessHint()
    root.addHandler(quiet)
    root.addFilter(hint)
    try:
        yield
    finally:
        root.removeFilter(hint)
        root.removeHandler(quiet)


def quantize_int8(
    src: str | os.PathLike, dst: str | os.PathLike, exclude: Sequence[str] = (), per_channel: bool = True
) -> None:
    """onnxruntime's ``quantize_dynamic`` (int8 weights) of ``src`` into ``dst``, quietly; the
    nodes named in ``exclude`` stay fp32.  Raises :class:`ExportError`."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

    try:
        with quiet_quantizer():
            quantize_dynamic(
                src, dst, weight_type=QuantType.QInt8, per_channel=per_channel, nodes_to_exclude=list(exclude)
            )
    except Exception as exc:
        raise ExportError(f"int8 quantisation failed: {exc}") from exc


def publish(pairs: list[tuple[Path, Path]], directory: Path) -> None:
    """``os.replace`` every ``(temp, target)`` pair in order, then fsync ``directory``."""
    for src, dst in pairs:
        os.replace(src, dst)
    fsync_dir(directory)


def publish_export(
    tmp: Path, path: Path, temps: list[Path], report: dict[str, Any], int8: Callable[[Path, Path], dict] | None
) -> dict[str, Any]:
    """Publish a verified fp32 file ``tmp`` as ``path`` and, with ``int8``, its int8 copy:
    ``int8(q_tmp, q_path)`` writes and checks it and returns its report fields.  Both go out
    together (``publish``); ``q_tmp`` joins ``temps`` so the caller's cleanup removes it on
    failure.  Returns ``report`` with the fp32 file's hash."""
    pairs = [(tmp, path)]
    if int8 is not None:
        q_path = int8_path_for(path)
        q_tmp = temp_path(q_path)
        temps.append(q_tmp)
        report.update(int8(q_tmp, q_path))
        pairs.append((q_tmp, q_path))
    report["file_sha256"] = file_sha256(tmp)
    publish(pairs, path.parent)
    return report


def remove_temps(paths: Iterable[Path]) -> None:
    """Delete the given temporary files; already missing ones (published or never made) are fine."""
    for t in paths:
        try:
            Path(t).unlink()
        except FileNotFoundError:
            pass
