"""The ``image-classifier`` served format: the description and its NumPy reference
(``fclcore.served.ImageClassifierServed``), the ONNX export (``export.onnx_image``), the
torch-free runtime (``export.image_runtime``), ``fcl infer --input images.npy`` and the
daemon's background export (``edge_client.serving``).

The model is FIL-VER's served shape at 28x28: conv 1->4 k5, relu, maxpool2, conv 4->8 k5,
relu, maxpool2, flatten, linear 128->32, relu, linear 32->10, with random weights.
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from support.timescale import scaled
from torch import nn

from export.cli import main
from export.formats import FORMATS, export_served
from export.image_runtime import FORMAT, ImageClassifierRuntime
from export.onnx_image import PARITY_TOL, export_image_classifier
from export.publish import ExportError, int8_path_for
from export.runtime import InputError, ModelFileError
from export.snapshot import load_snapshot
from fclcore.served import ImageClassifierServed

torch.set_num_threads(1)
SIDE = 28
NAMES = [f"digit-{i}" for i in range(10)]


def torch_net(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Conv2d(1, 4, 5),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(4, 8, 5),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(128, 32),
        nn.ReLU(),
        nn.Linear(32, 10),
    ).eval()


def layers_of(net: nn.Sequential) -> list:
    """The (kind, params) description of a torch Sequential (what a learner builds)."""
    out = []
    for m in net:
        if isinstance(m, nn.Conv2d):
            params = {"weight": m.weight.detach().numpy(), "bias": m.bias.detach().numpy(), "padding": m.padding[0]}
            out.append(("conv2d", params))
        elif isinstance(m, nn.Linear):
            out.append(("linear", {"weight": m.weight.detach().numpy(), "bias": m.bias.detach().numpy()}))
        else:
            out.append(({nn.ReLU: "relu", nn.MaxPool2d: "maxpool2", nn.Flatten: "flatten"}[type(m)], {}))
    return out


@pytest.fixture(scope="module")
def net() -> nn.Sequential:
    return torch_net()


@pytest.fixture(scope="module")
def served(net) -> ImageClassifierServed:
    return ImageClassifierServed(SIDE, layers_of(net), NAMES, method="filver", task=2)


@pytest.fixture(scope="module")
def images() -> np.ndarray:
    """Rows (N, 784) in [0, 1], as grayscale device data."""
    return np.random.default_rng(0).random((48, SIDE * SIDE), dtype=np.float32)


@pytest.fixture(scope="module")
def exported(served, images, tmp_path_factory) -> tuple[Path, dict]:
    path = tmp_path_factory.mktemp("image") / "model.onnx"
    report = export_served(served, path, parity_inputs=images, int8=True, toolkit_version="9.9.9")
    return path, report


# ------------------------------------------------------------------ the description


def test_numpy_reference_matches_torch(served, net, images):
    with torch.no_grad():
        want = net(torch.from_numpy(images).reshape(-1, 1, SIDE, SIDE)).double().numpy()
    got = served.logits(images)
    assert got.shape == (48, 10) and got.dtype == np.float64
    np.testing.assert_allclose(got, want, atol=1e-5)
    assert (got.argmax(1) == want.argmax(1)).all()


def test_reference_with_padding_and_odd_sides_matches_torch():
    """padding=2 keeps 28x28; 7x7 -> maxpool drops the odd row and column, as torch does."""
    torch.manual_seed(1)
    net = nn.Sequential(
        nn.Conv2d(1, 3, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2), nn.MaxPool2d(2), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(27, 4),
    ).eval()  # fmt: skip
    s = ImageClassifierServed(SIDE, layers_of(net), list("abcd"), method="m", task=0)
    x = np.random.default_rng(1).random((5, SIDE * SIDE), dtype=np.float32)
    with torch.no_grad():
        want = net(torch.from_numpy(x).reshape(-1, 1, SIDE, SIDE)).double().numpy()
    np.testing.assert_allclose(s.logits(x), want, atol=1e-5)
    assert s.layer_summary() == [
        "conv2d 1->3 k5 p2",
        "relu",
        "maxpool2",
        "maxpool2",
        "maxpool2",
        "flatten",
        "linear 27->4",
    ]


def test_description_is_validated_and_read_only(served, net):
    assert served.format == "image-classifier" and served.input_dim == 784 and served.num_classes == 10
    assert served.class_names == tuple(NAMES) and isinstance(served.layers, tuple)
    w = served.layers[0][1]["weight"]
    assert w.dtype == np.float32 and not w.flags.writeable
    assert not np.shares_memory(w, net[0].weight.detach().numpy())  # a copy: training goes on
    with pytest.raises(dataclasses.FrozenInstanceError):
        served.task = 3


def _bad(layers, **changes):
    kw = dict(image_side=SIDE, layers=layers, class_names=NAMES, method="filver", task=0)
    kw.update(changes)
    return ImageClassifierServed(**kw)


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        (lambda L: L.__setitem__(3, ("conv2d", dict(L[3][1], weight=np.zeros((8, 3, 5, 5), np.float32)))),
         r"layers\[3\] \(conv2d\): weight \(8, 3, 5, 5\) takes 3 channels, the previous layer gives 4"),
        (lambda L: L.__setitem__(7, ("linear", dict(L[7][1], weight=np.zeros((32, 100), np.float32)))),
         r"layers\[7\] \(linear\): weight \(32, 100\) takes 100 inputs, the previous layer gives 128"),
        (lambda L: L.__setitem__(7, ("linear", dict(L[7][1], bias=np.zeros(31, np.float32)))),
         r"layers\[7\] \(linear\): bias must have shape \(32,\)"),
        (lambda L: L.pop(6), r"layers\[6\] \(linear\): needs a flattened input.*add a flatten layer"),
        (lambda L: L.pop(), r"the last layer must be linear"),
        (lambda L: L.insert(7, ("maxpool2", {})), r"layers\[7\] \(maxpool2\): needs a \(C, H, W\) input"),
        (lambda L: L.__setitem__(9, ("linear", dict(L[9][1], weight=np.zeros((9, 32), np.float32),
                                                    bias=np.zeros(9, np.float32)))),
         r"the last linear layer has 9 outputs but there are 10 class_names"),
        (lambda L: L.__setitem__(0, ("conv2d", dict(L[0][1], padding=-1))), r"padding must be an int >= 0"),
        (lambda L: L.__setitem__(0, ("conv", L[0][1])), r"unknown kind 'conv'"),
        (lambda L: L.__setitem__(1, ("relu", {"weight": 1})), r"layers\[1\] \(relu\): params must be \{\}"),
        (lambda L: L.__setitem__(9, ("linear", dict(L[9][1], bias=np.full(10, np.nan, np.float32)))),
         r"layers\[9\] \(linear\): bias contains NaN"),
    ],
)  # fmt: skip
def test_non_chaining_layers_are_refused(served, edit, match):
    layers = [(k, dict(p)) for k, p in served.layers]
    edit(layers)
    with pytest.raises(ValueError, match=match):
        _bad(layers)


def test_other_fields_are_validated(served):
    layers = list(served.layers)
    with pytest.raises(ValueError, match="image_side must be an int >= 1"):
        _bad(layers, image_side=0)
    with pytest.raises(ValueError, match="5x5 kernel with padding 0 does not fit a 4x4 input"):
        _bad(layers, image_side=4)
    with pytest.raises(ValueError, match="method must be a non-empty string"):
        _bad(layers, method=" ")
    with pytest.raises(ValueError, match="task must be an int >= 0"):
        _bad(layers, task=-1)
    with pytest.raises(ValueError, match="class_names must be a sequence of strings"):
        _bad(layers, class_names="0123456789")
    with pytest.raises(ValueError, match="layers must be a non-empty sequence"):
        _bad([])


# ------------------------------------------------------------------ export + runtime


def test_export_report_and_metadata(exported, served):
    path, report = exported
    assert FORMATS[-1] == "image-classifier" == served.format
    assert report["path"] == str(path) and report["parity_rows"] == 48 and report["parity_data"] == "parity_inputs:48"
    assert report["max_scaled_err"] <= PARITY_TOL and report["label_agreement"] == 1.0
    rt = ImageClassifierRuntime(path)
    m = rt.metadata
    assert (m["format"], m["method"], m["task"], m["image_side"]) == (FORMAT, "filver", 2, SIDE)
    assert m["class_names"] == NAMES and m["toolkit_version"] == "9.9.9" and m["quantization"] == "none"
    assert m["layers"] == served.layer_summary()
    assert sorted(p.name for p in path.parent.iterdir()) == ["model.int8.onnx", "model.onnx"]  # no temporaries


def test_runtime_classifies_every_input_shape(exported, served, images):
    path, _ = exported
    rt = ImageClassifierRuntime.load(path)
    want = served.logits(images)
    for x in (images, images.reshape(-1, SIDE, SIDE), images.reshape(-1, 1, SIDE, SIDE)):
        logits, labels = rt.classify(x)
        assert logits.shape == (48, 10) and labels.dtype == np.int64
        np.testing.assert_allclose(logits, want, atol=1e-4)
        np.testing.assert_array_equal(labels, want.argmax(1))
    pixels = (images * 255).round().astype(np.uint8)  # uint8 images are scaled to [0, 1]
    np.testing.assert_array_equal(rt.classify(pixels)[1], served.logits(pixels / 255.0).argmax(1))
    assert rt.classify(np.zeros((0, SIDE, SIDE), np.float32))[0].shape == (0, 10)
    for bad in (images[:, :-1], images.reshape(-1, 1, 1, SIDE, SIDE), images.reshape(-1, 2, 14, SIDE), images[0]):
        with pytest.raises(InputError, match=r"images must have shape \(N, 784\), \(N, 28, 28\) or \(N, 1, 28, 28\)"):
            rt.classify(bad)
    assert issubclass(InputError, ValueError)
    with pytest.raises(InputError, match="NaN"):
        rt.classify(np.full((1, 784), np.nan, np.float32))


def test_int8_copy_agrees_on_most_rows(exported, served, images):
    path, report = exported
    q = int8_path_for(path)
    assert report["int8_path"] == str(q) and report["int8_size_ratio"] < 0.8
    assert report["int8_label_agreement"] >= 0.9
    rt = ImageClassifierRuntime(q)
    assert rt.quantized and rt.metadata["int8_label_agreement"] == report["int8_label_agreement"]
    labels = rt.classify(images)[1]
    assert (labels == served.logits(images).argmax(1)).mean() >= 0.9


def test_runtime_refuses_other_formats_and_tampering(exported, tmp_path):
    from fclcore.made_spec import MadeConfig, init_params
    from fclcore.served import ServedModel

    cfg = MadeConfig(6, (8,))
    export_served(ServedModel(cfg, init_params(cfg, 0), 0, "fedavg", 0), tmp_path / "made.onnx")
    with pytest.raises(ModelFileError, match="this image-classifier runtime reads.*a MADE model"):
        ImageClassifierRuntime(tmp_path / "made.onnx")
    data = bytearray(exported[0].read_bytes())
    data[len(data) // 2] ^= 1
    (tmp_path / "bad.onnx").write_bytes(bytes(data))
    with pytest.raises(ModelFileError, match="bad.onnx"):
        ImageClassifierRuntime(tmp_path / "bad.onnx")


def test_failed_parity_publishes_nothing(served, images, tmp_path, monkeypatch):
    import export.onnx_image as onnx_image

    (tmp_path / "model.onnx").write_bytes(b"previous")
    off = ImageClassifierServed.logits  # the reference disagrees with the graph by 1e-2
    monkeypatch.setattr(ImageClassifierServed, "logits", lambda self, x: off(self, x) + 1e-2)
    with pytest.raises(ExportError, match="parity check failed"):
        onnx_image.export_image_classifier(served, tmp_path / "model.onnx", parity_inputs=images, int8=True)
    assert (tmp_path / "model.onnx").read_bytes() == b"previous"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.onnx"]


def test_bad_parity_inputs_and_defaults(served, tmp_path):
    with pytest.raises(ExportError, match=r"parity_inputs must have shape \(N >= 1, 784\)"):
        export_image_classifier(served, tmp_path / "m.onnx", parity_inputs=np.zeros((3, 10), np.float32))
    with pytest.raises(ExportError, match="does not exist"):
        export_image_classifier(served, tmp_path / "nope" / "m.onnx")
    report = export_image_classifier(served, tmp_path / "m.onnx")  # seeded random rows
    assert report["parity_data"] == "random_uniform:64"


# ------------------------------------------------------------------ fcl infer


def test_fcl_infer_prints_one_line_per_image(exported, served, images, tmp_path, capsys):
    path, _ = exported
    np.save(tmp_path / "images.npy", images[:5].reshape(-1, SIDE, SIDE))
    assert main(["infer", str(path), "--input", str(tmp_path / "images.npy")]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    want = served.logits(images[:5]).argmax(1)
    assert [d["index"] for d in lines] == list(range(5))
    assert [d["label"] for d in lines] == want.tolist()
    assert [d["class"] for d in lines] == [NAMES[c] for c in want]
    assert all(0.0 < d["score"] <= 1.0 for d in lines)


def test_fcl_infer_bad_inputs_exit_2(exported, tmp_path, capsys):
    path = str(exported[0])
    np.save(tmp_path / "pickled.npy", np.array([{"a": 1}, None], dtype=object), allow_pickle=True)
    np.save(tmp_path / "wrong.npy", np.zeros((2, 27, 27), np.float32))
    (tmp_path / "junk.npy").write_bytes(b"not a numpy file")
    cases = [
        (["--input", str(tmp_path / "missing.npy")], "no such input file"),
        (["--input", str(tmp_path / "pickled.npy")], "not a plain numeric .npy file"),
        (["--input", str(tmp_path / "junk.npy")], "not a plain numeric .npy file"),
        (["--input", str(tmp_path / "wrong.npy")], r"images must have shape .* got \(2, 27, 27\)"),
        ([], "needs --input IMAGES.npy"),
        (["--op", "loglik", "--input", str(tmp_path / "wrong.npy")], "is an image classifier.*drop --op"),
        (["--task", "0", "--input", str(tmp_path / "wrong.npy")], "drop --task"),
    ]
    for extra, match in cases:
        assert main(["infer", path, *extra]) == 2, extra
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and err.startswith("fcl infer: error:"), err
        assert re.search(match, err), (extra, err)


def test_fcl_infer_help_documents_images(capsys):
    with pytest.raises(SystemExit):
        main(["infer", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "Image classifiers" in out and "IMAGES.npy" in out and "uint8" in out


# ------------------------------------------------------------------ the daemon's background export


def test_serving_exports_the_image_format_in_the_background(served, images, tmp_path):
    from edge_client.serving import ServedModelWriter

    class Learner:  # what a method's learner returns from served_model
        def served_model(self, task: int, binarize: str = ""):
            return served

    writer = ServedModelWriter(tmp_path / "out", "mnist", int8=False)
    writer.submit(writer.snapshot(Learner(), 2, images))  # the task's test rows (N, D) float32
    assert writer.wait(120)
    writer.close()
    rt = ImageClassifierRuntime(writer.model_path)
    assert rt.metadata["task"] == 2 and rt.class_names == NAMES
    back = load_snapshot(tmp_path / "out" / "served.npz")  # the snapshot beside it, for `fcl export`
    assert back.format == "image-classifier" and back.layer_summary() == served.layer_summary()
    np.testing.assert_array_equal(rt.classify(images)[1], served.logits(images).argmax(1))


def test_the_runtime_imports_neither_torch_nor_onnx():
    import subprocess
    import sys

    code = "import sys, export.image_runtime; print(sorted(m for m in ('torch', 'onnx') if m in sys.modules))"
    repo = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "-c", code], cwd=repo, capture_output=True, text=True, timeout=scaled(60))
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stderr
