"""What an in-process text-tasks export holds (issue 40: FedSeIT's daemon peaked over its 700 MB
budget, the export's copies of the model growing with every task): a frozen table never goes
through the tracer, the file is the same as tracing it whole, the seal reads one weight at a
time, and the serving thread lets a written model's snapshot go."""

from __future__ import annotations

import contextlib
import gc
import hashlib
import weakref

import numpy as np
import onnx
import pytest
import torch
from support.tiny_models import tiny_text_tasks_with_table

import export.onnx_text_tasks as ott
from edge_client.serving import ServedModelWriter
from export._proto import weights_digest, weights_digest_in_order
from export.formats import export_with_snapshot
from export.publish import ExportError, seal
from export.splice import sealed_chunks

torch.set_num_threads(1)
PARITY = np.random.default_rng(0).integers(1, 30522, (6, 9)).astype(np.int64)


def _sha(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.mark.parametrize("buffer", [True, False])
def test_a_frozen_buffer_is_a_stand_in_while_tracing_and_the_file_is_the_same(tmp_path, monkeypatch, buffer):
    served = tiny_text_tasks_with_table(tmp_path / "shipped", buffer=buffer)
    table = served.frozen[0].array
    traced_shapes = []
    build = ott.build_text_tasks_onnx

    def spying_build(module, n_tasks, max_length):
        traced_shapes.extend(tuple(b.shape) for b in module.buffers())
        return build(module, n_tasks, max_length)

    monkeypatch.setattr(ott, "build_text_tasks_onnx", spying_build)
    export_with_snapshot(served, tmp_path / "lean.onnx", tmp_path / "lean.npz", parity_inputs=PARITY)
    assert table.shape not in traced_shapes
    if buffer:  # the buffer was a one-row stand-in while tracing, and the module has its own table back
        assert (1, table.shape[1]) in traced_shapes and served.module.table.data_ptr() == table.ctypes.data

    monkeypatch.setattr(ott, "_stand_ins", lambda module, tables: contextlib.nullcontext({}))
    export_with_snapshot(served, tmp_path / "whole.onnx", tmp_path / "whole.npz", parity_inputs=PARITY)
    assert _sha(tmp_path / "lean.onnx") == _sha(tmp_path / "whole.onnx")
    assert _sha(tmp_path / "lean.npz") == _sha(tmp_path / "whole.npz")
    inits = {t.name: tuple(t.dims) for t in onnx.load(str(tmp_path / "lean.onnx")).graph.initializer}
    assert table.shape in inits.values()  # the published file holds the whole table


def test_splicing_a_table_into_the_sealed_file_gives_the_bytes_the_proto_path_gives(tmp_path):
    served = tiny_text_tasks_with_table(tmp_path / "shipped", buffer=True)
    stage = ott.stage_text_tasks(served, parity_inputs=PARITY)
    (ref,) = stage.frozen
    meta = {"format": "test", "task": 1}
    filled = onnx.load_from_string(stage.graph)
    (init,) = [t for t in filled.graph.initializer if t.name == ref.initializer]
    init.raw_data = ref.array.tobytes()
    whole = seal(filled, meta).SerializeToString()
    chunks = sealed_chunks(onnx.load_from_string(stage.graph), meta, {ref.initializer: ref.array})
    assert b"".join(bytes(c) for c in chunks) == whole
    assert any(isinstance(c, memoryview) and c.obj is not None and len(c) == ref.array.nbytes for c in chunks)
    with pytest.raises(ExportError, match="no empty"):
        sealed_chunks(onnx.load_from_string(stage.graph), meta, {"no-such-weight": ref.array})
    with pytest.raises(ExportError, match="no empty"):  # a table of another shape
        sealed_chunks(onnx.load_from_string(stage.graph), meta, {ref.initializer: ref.array[:-1]})


def test_the_seal_digest_in_order_is_the_sorted_digest():
    records = [("b", 1, [2], b"\x01" * 8), ("a", 1, [1], b"\x02" * 4), ("c", 7, [], b"")]
    assert weights_digest_in_order(sorted(records)) == weights_digest(records)
    assert weights_digest_in_order(records) != weights_digest(records)  # the order is the caller's


class _Learner:
    def __init__(self, served) -> None:
        self.served = served

    def served_model(self, task: int, binarize: str = ""):
        return self.served


def test_the_serving_thread_lets_a_written_snapshot_go(tmp_path):
    served = tiny_text_tasks_with_table(tmp_path / "shipped", buffer=True)
    module = weakref.ref(served.module)
    writer = ServedModelWriter(tmp_path / "out", "bbc", int8=False)
    writer.submit(writer.snapshot(_Learner(served), 1, PARITY))
    del served
    assert writer.wait(120) and writer.model_path.is_file()
    gc.collect()
    assert module() is None  # the worker waits for the next export without holding this one
    writer.close()


def test_the_stage_graph_bytes_are_freed_before_onnxruntime_loads_the_file(tmp_path, monkeypatch):
    """export_with_snapshot hands publish_text_tasks its only reference to the stage, whose
    graph bytes (58 MB at FedSeIT's fifth task) then go once parsed, not after the check."""
    import sys

    import export.text_tasks_publish as ttp

    served = tiny_text_tasks_with_table(tmp_path / "shipped", buffer=True)
    graphs, holders = [], []
    stage_fn, open_fn = ott.stage_text_tasks, ttp.scaffold.open_written

    def spying_stage(*args, **kwargs):
        stage = stage_fn(*args, **kwargs)
        graphs.append(stage.graph)
        return stage

    def spying_open(*args, **kwargs):
        holders.append(sys.getrefcount(graphs[0]) - 2)  # less the list's and the call's references
        return open_fn(*args, **kwargs)

    monkeypatch.setattr(ott, "stage_text_tasks", spying_stage)
    monkeypatch.setattr(ttp.scaffold, "open_written", spying_open)
    report, problem = export_with_snapshot(served, tmp_path / "m.onnx", tmp_path / "m.npz", parity_inputs=PARITY)
    assert problem is None and report["file_sha256"] == _sha(tmp_path / "m.onnx")
    assert holders == [0]
