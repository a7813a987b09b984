"""export.formats.export_served: one entry point, dispatched on the served model's format."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from support.timescale import scaled

from export.formats import FORMATS, export_served
from export.publish import ExportError, int8_path_for
from fclcore.made_spec import MadeConfig, init_params
from fclcore.served import ImageClassifierServed, ServedModel, TextGroupsServed, TextTasksServed

REPO = Path(__file__).resolve().parents[2]


def test_formats_match_the_served_classes():
    assert FORMATS == ("made", "text-groups", "text-tasks", "image-classifier")
    classes = (ServedModel, TextGroupsServed, TextTasksServed, ImageClassifierServed)
    assert tuple(c.format for c in classes) == FORMATS


def test_each_registered_format_names_its_exporter_and_runtime():
    """The registry's references resolve, and each format's files carry its runtime's format."""
    from export import _meta, image_runtime, text_runtime, text_tasks_runtime
    from export.formats import REGISTRY, ServedFormat, register
    from export.image_runtime import ImageClassifierRuntime
    from export.runtime import MadeRuntime
    from export.text_runtime import TextClassifierRuntime
    from export.text_tasks_runtime import TextTasksRuntime

    runtimes = {
        "made": (MadeRuntime, _meta.FORMAT),
        "text-groups": (TextClassifierRuntime, text_runtime.FORMAT),
        "text-tasks": (TextTasksRuntime, text_tasks_runtime.FORMAT),
        "image-classifier": (ImageClassifierRuntime, image_runtime.FORMAT),
    }
    assert tuple(REGISTRY) == FORMATS == tuple(runtimes)
    for name, fmt in REGISTRY.items():
        assert fmt.name == name and callable(fmt.load_exporter())
        assert (fmt.load_runtime(), fmt.file_format) == runtimes[name]
    with pytest.raises(ValueError, match="already registered"):
        register(ServedFormat("made", "x", "export.onnx_made:export_served_model", "export.runtime:MadeRuntime"))


def test_exporters_refuse_unknown_options(tmp_path):
    from export.onnx_made import export_served_model

    cfg = MadeConfig(6, (8,))
    with pytest.raises(TypeError, match="parity_rows"):
        export_served_model(ServedModel(cfg, init_params(cfg, 0), 1, "fedavg", 2), tmp_path / "m.onnx", parity_rows=3)
    assert list(tmp_path.iterdir()) == []


def test_made_export(tmp_path):
    from export.runtime import MadeRuntime

    cfg = MadeConfig(6, (8,))
    served = ServedModel(cfg, init_params(cfg, 0), 1, "fedavg", 2)
    x = (np.random.default_rng(0).random((5, 6)) < 0.5).astype(np.float32)
    report = export_served(served, tmp_path / "m.onnx", parity_inputs=x, toolkit_version="9.9.9")
    assert report["path"] == str(tmp_path / "m.onnx") and report["parity_rows"] == 5
    assert report["max_scaled_err"] <= 1e-5 and report["parity_data"] == "parity_inputs:5"
    rt = MadeRuntime.load(tmp_path / "m.onnx")
    assert rt.metadata["toolkit_version"] == "9.9.9" and rt.metadata["task"] == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.onnx"]


def test_unknown_format_raises_and_writes_nothing(tmp_path):
    class Odd:
        format = "wavelets"

    with pytest.raises(ExportError, match=r"'wavelets'.*made, text-groups, text-tasks, image-classifier"):
        export_served(Odd(), tmp_path / "m.onnx")
    with pytest.raises(ExportError, match="None"):
        export_served(object(), tmp_path / "m.onnx")
    assert list(tmp_path.iterdir()) == []


def test_text_groups_export(tmp_path):
    import torch

    from export.text_runtime import TextClassifierRuntime
    from fclbases.minilm.backbone import BertEncoder, FrozenBackbone, pooled_embeddings, tiny_config
    from fclbases.minilm.enhancer import EnhancerConfig, EnhancerGroup

    torch.manual_seed(0)
    backbone = FrozenBackbone(BertEncoder(tiny_config()))
    ecfg = EnhancerConfig(hidden=32, bottleneck=8, blocks=2)
    groups = [EnhancerGroup(ecfg, [0, 1], seed=1), EnhancerGroup(ecfg), EnhancerGroup(ecfg, [2], seed=2)]
    rng = np.random.default_rng(0)
    ids = np.zeros((6, 10), np.int64)
    for r, n in enumerate([10, 7, 4, 10, 5, 8]):  # [CLS] tokens [SEP], right-padded with 0
        ids[r, :n] = np.concatenate([[2], rng.integers(4, 40, n - 2), [3]])
    pooled = pooled_embeddings(backbone, ids, (ids != 0).astype(np.int64))
    served = TextGroupsServed(
        backbone,
        groups,
        {0: pooled[0], 1: pooled[1], 2: pooled[2]},
        {0: 0, 1: 0, 2: 2},
        task=1,
        max_length=16,
        method="toy",
    )
    report = export_served(served, tmp_path / "t.onnx", parity_inputs=ids, int8=True)
    assert report["classes"] == [0, 1, 2] and report["groups"] == [0, 2]
    assert report["parity_data"] == "parity_ids:6" and report["float32_ties"] == 0
    assert Path(report["int8_path"]) == int8_path_for(tmp_path / "t.onnx")
    rt = TextClassifierRuntime(tmp_path / "t.onnx", tokenizer=False)
    assert (rt.metadata["method"], rt.metadata["task"], rt.metadata["max_length"]) == ("toy", 1, 16)
    _, routes, _ = rt.predict_ids(ids[:3], (ids[:3] != 0).astype(np.int64))
    assert routes.tolist() == [0, 0, 2]  # each of the first rows is its class's prototype
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.int8.onnx", "t.onnx"]

    with pytest.raises(ExportError, match="parity"):  # token ids must be integers
        export_served(served, tmp_path / "f.onnx", parity_inputs=ids.astype(np.float32))
    assert not (tmp_path / "f.onnx").exists()

    import dataclasses

    unnamed = dataclasses.replace(served, method="")  # the learner must name its method: no default
    with pytest.raises(ExportError, match="names no method"):
        export_served(unnamed, tmp_path / "u.onnx", parity_inputs=ids)
    assert not (tmp_path / "u.onnx").exists()


def test_importing_formats_is_cheap():
    code = (
        "import sys\nimport export.formats\n"
        "print(sorted(m for m in ('torch', 'onnx', 'onnxruntime', 'export.onnx_made', 'export.onnx_image') "
        "if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=scaled(60))
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stderr
