"""The steps every served format's exporter takes, written once.

An exporter checks its destination (:func:`check_destination`, :func:`check_min_agreement`),
writes the sealed fp32 graph to a temporary file next to it (:func:`staged`), reloads it with
its format's torch-free runtime (:func:`open_written`: the metadata must round-trip), compares
its logits with a reference (:func:`logit_errors`, :func:`check_logit_parity`) and publishes it
with ``export.publish.publish_export``.  A classifier's int8 copy is an :class:`Int8Copy`:
quantised, sealed provisionally so that its own runtime measures its label agreement, sealed
again with that agreement and checked once more.  What differs between the formats (the graph,
the reference, the runtime, what "agreement" counts) stays in each format's module.

Only numpy and the standard library at import (onnx inside :class:`Int8Copy`, onnxruntime
through the runtimes); the staged text-groups half imports this in a process without torch.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, TypedDict, TypeVar

import numpy as np

from export.publish import OPSET, ExportError, quantize_int8, remove_temps, seal, temp_path, write_synced

__all__ = [
    "ExportOptions",
    "export_options",
    "check_destination",
    "check_min_agreement",
    "staged",
    "load_verified",
    "open_written",
    "logit_errors",
    "check_logit_parity",
    "fp32_report",
    "label_report",
    "int8_sizes",
    "Int8Copy",
    "IR_VERSION",
    "model_proto",
]

R = TypeVar("R")
IR_VERSION = 8  # the IR version that introduced opset 17: readable by older device runtimes


class ExportOptions(TypedDict, total=False):
    """The keyword options every format's exporter takes (what ``export.formats.export_served``
    passes on); an exporter adds its own keywords before them."""

    parity_inputs: Any  # the format's parity rows; None: its seeded random ones
    int8: bool  # also write <stem>.int8.onnx, once it passes its check (default False)
    toolkit_version: str  # recorded as fcl.toolkit_version (default "0.1.0")


def export_options(given: Mapping[str, Any]) -> tuple[Any, bool, str]:
    """(parity_inputs, int8, toolkit_version) of an exporter's ``**options``, with their defaults;
    TypeError for a keyword no exporter takes."""
    unknown = sorted(set(given) - set(ExportOptions.__annotations__))
    if unknown:
        raise TypeError(f"unexpected export options {unknown}")
    return given.get("parity_inputs"), given.get("int8", False), given.get("toolkit_version", "0.1.0")


def model_proto(graph: Any, toolkit_version: str) -> Any:
    """An ``onnx.helper``-built graph as an opset-:data:`~export.publish.OPSET` model of IR
    version :data:`IR_VERSION`, produced by fcl-edge (the graphs not traced from torch)."""
    from onnx import helper

    return helper.make_model(
        graph,
        opset_imports=[helper.make_opsetid("", OPSET)],
        ir_version=IR_VERSION,
        producer_name="fcl-edge",
        producer_version=str(toolkit_version),
    )


def check_destination(path: str | os.PathLike) -> Path:
    """``path`` as a Path whose directory exists (an export never creates directories)."""
    path = Path(path)
    if not path.parent.is_dir():
        raise ExportError(f"output directory {path.parent} does not exist")
    return path


def check_min_agreement(value: float) -> None:
    """The int8 label-agreement threshold is a fraction."""
    if not 0.0 <= value <= 1.0:
        raise ExportError(f"int8_min_agreement must be in [0, 1], got {value}")


@contextmanager
def staged(path: Path) -> Iterator[tuple[Path, list[Path]]]:
    """(temporary file next to ``path``, the list of temporaries) for one export; every
    temporary still in the list (not published) is removed on the way out."""
    temps: list[Path] = []
    try:
        tmp = temp_path(path)
        temps.append(tmp)
        yield tmp, temps
    finally:
        remove_temps(temps)


def load_verified(runtime: Callable[[Path], R], path: Path, what: str) -> R:
    """``runtime(path)``: the written file as its format's runtime validates it; a file it
    refuses is an :class:`ExportError` (``what``: fp32 or int8)."""
    from export.runtime import ModelFileError

    try:
        return runtime(path)
    except ModelFileError as exc:
        raise ExportError(f"the exported {what} model failed validation: {exc}") from None


def open_written(runtime: Callable[[Path], R], tmp: Path, metadata: dict[str, Any]) -> R:
    """The fp32 file just written, loaded by its runtime, with every metadata entry read back
    as it was written."""
    rt = load_verified(runtime, tmp, "fp32")
    wrong = [k for k, v in metadata.items() if rt.metadata.get(k) != v]  # type: ignore[attr-defined]
    if wrong:
        raise ExportError(f"exported metadata does not round-trip: {wrong}")
    return rt


def logit_errors(got: np.ndarray, ref: np.ndarray) -> tuple[float, float]:
    """(max |got - ref|, max |got - ref| / max(1, |ref|)) in float64; 0 for no values.  NaN
    stays NaN, so a ``not scaled <= tol`` test refuses it."""
    g, r = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    diff = np.abs(g - r)
    if not diff.size:
        return 0.0, 0.0
    return float(diff.max()), float((diff / np.maximum(1.0, np.abs(r))).max())


def check_logit_parity(
    got: np.ndarray, ref: np.ndarray, tol: float, *, rows: int, desc: str, what: str = "", against: str = "torch"
) -> tuple[float, float]:
    """:func:`logit_errors` of the written file's logits, which must be within ``tol`` scaled;
    ``against``: what computed the reference, ``what``: which file (prefix of the message)."""
    err, scaled = logit_errors(got, ref)
    if not scaled <= tol:  # also catches NaN
        lead = f"{what} parity check failed" if what else "parity check failed"
        raise ExportError(
            f"{lead}: max |onnx - {against}| / max(1, |{against}|) = {scaled:.3g} > "
            f"{tol:g} (max abs logit error {err:.3g}) on {rows} rows ({desc})"
        )
    return err, scaled


def fp32_report(
    path: Path, tmp: Path, fields: dict[str, Any], rows: int, desc: str, parity: dict[str, Any], rt: Any
) -> dict[str, Any]:
    """A classifier export's report on its verified fp32 file ``tmp`` (published as ``path``):
    the format's ``fields``, the parity rows and the ``parity`` check's fields, the weights hash."""
    return {
        "path": str(path),
        "bytes": tmp.stat().st_size,
        **fields,
        "parity_rows": rows,
        "parity_data": desc,
        **parity,
        "sha256": rt.metadata["weights_sha256"],
    }


def label_report(err: float, scaled: float, have: np.ndarray, want: np.ndarray, tie: np.ndarray) -> dict[str, Any]:
    """The parity fields of a classifier's report: the logit errors, the share of labels equal to
    the reference's and how many differ only where the reference itself is a float32 tie."""
    return {
        "max_abs_err": err,
        "max_scaled_err": scaled,
        "label_agreement": float((have == want).mean()),
        "float32_ties": int((tie & (have != want)).sum()),
    }


def int8_sizes(fp32_tmp: Path, q_tmp: Path, q_path: Path) -> dict[str, Any]:
    """The first fields of every int8 report: where the copy goes, its size and its ratio to fp32."""
    size_fp32, size_q = fp32_tmp.stat().st_size, q_tmp.stat().st_size
    return {"int8_path": str(q_path), "int8_bytes": size_q, "int8_size_ratio": size_q / size_fp32}


class Int8Copy:
    """The int8 copy of a classifier export, called by ``publish_export`` as ``copy(q_tmp, q_path)``.

    It quantises the verified fp32 file, seals the copy provisionally (its agreements 0) so
    that the format's own runtime measures it, refuses it below ``min_agreement``, seals it
    again with the measured agreements and checks that the sealed file answers as the measured
    one did.  A format names its runtime (:meth:`load`), what it measures (:meth:`measure`:
    the answers, then the agreements, the gating one first), the refusal's wording
    (:meth:`refusal`) and any report fields of its own (:meth:`extras`)."""

    agreements: tuple[str, ...] = ("int8_label_agreement",)  # metadata keys, gating one first

    def __init__(self, fp32_tmp: Path, metadata: dict[str, Any], desc: str, min_agreement: float) -> None:
        self.fp32_tmp, self.metadata, self.desc, self.min_agreement = fp32_tmp, metadata, desc, min_agreement

    def quantize(self, q_tmp: Path) -> None:
        quantize_int8(self.fp32_tmp, q_tmp)

    def load(self, path: Path) -> Any:
        raise NotImplementedError

    def measure(self, rt: Any) -> tuple[tuple[np.ndarray, ...], dict[str, float]]:
        raise NotImplementedError

    def refusal(self, agree: float) -> str:
        raise NotImplementedError

    def extras(self, proto: Any, answers: tuple[np.ndarray, ...]) -> dict[str, Any]:
        return {}

    def __call__(self, q_tmp: Path, q_path: Path) -> dict[str, Any]:
        import onnx

        self.quantize(q_tmp)
        proto = onnx.load(q_tmp)
        meta = dict(self.metadata, quantization="int8-dynamic", **{k: 0.0 for k in self.agreements})
        meta.update(int8_min_agreement=self.min_agreement, int8_eval=self.desc)
        write_synced(q_tmp, seal(proto, meta).SerializeToString())  # provisional, to measure with the real runtime
        answers, measured = self.measure(load_verified(self.load, q_tmp, "int8"))
        agree = measured[self.agreements[0]]
        if not agree >= self.min_agreement:
            raise ExportError(self.refusal(agree))
        meta.update(measured)
        write_synced(q_tmp, seal(proto, meta).SerializeToString())
        rt = load_verified(self.load, q_tmp, "int8")
        again, _ = self.measure(rt)
        if not all(np.array_equal(a, b) for a, b in zip(again, answers)):
            raise ExportError("the sealed int8 model disagrees with the measured one")
        return {
            **int8_sizes(self.fp32_tmp, q_tmp, q_path),
            **measured,
            "int8_min_agreement": self.min_agreement,
            **self.extras(proto, answers),
            "int8_sha256": rt.metadata["weights_sha256"],
        }
