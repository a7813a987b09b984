"""``served.npz`` for every served format (export.snapshot, export.snapshot_formats): a round
trip per format, hostile files refused with a clear error, ``fcl export`` on each format's
snapshot giving a verified ONNX file whose outputs match the model's, and the dataset's class
names in what ``fcl infer`` prints."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from support.timescale import scaled
from support.tiny_models import (
    BBC_NAMES,
    TASK_LABELS,
    tiny_image,
    tiny_text_groups,
    tiny_text_tasks,
    tiny_text_tasks_with_table,
    write_safetensors,
)

from edge_client.serving import ServedModelWriter
from export.cli import main as cli_main
from export.formats import export_with_snapshot
from export.image_runtime import ImageClassifierRuntime
from export.publish import published_mode
from export.snapshot import SnapshotError, load_snapshot, read_npz, save_snapshot, write_npz
from export.snapshot_formats import TextGroupsSnapshot, TextTasksStage
from export.text_runtime import TextClassifierRuntime
from export.text_tasks_runtime import TextTasksRuntime
from fclcore.data import dataset_class_names
from fclcore.exitcodes import ExitCode
from fclcore.made_spec import MadeConfig, init_params
from fclcore.served import ServedModel, with_class_names

torch.set_num_threads(1)
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def groups(tmp_path_factory):
    return tiny_text_groups(tmp_path_factory.mktemp("backbone") / "model")


@pytest.fixture(scope="module")
def tasks_snapshot(tmp_path_factory):
    """(the served text-tasks model, the snapshot and model files a device writes for it)."""
    served = tiny_text_tasks()
    d = tmp_path_factory.mktemp("tasks")
    ids = np.array([[101, 2023, 2003, 102, 0], [101, 7592, 102, 0, 0]], np.int64)
    report, problem = export_with_snapshot(served, d / "model.onnx", d / "served.npz", parity_inputs=ids)
    assert problem is None and report["parity_data"] == "parity_ids:2"
    return served, d / "served.npz", d / "model.onnx"


def _torch_logits(module, ids, mask):
    with torch.no_grad():
        return module(torch.from_numpy(ids), torch.from_numpy(mask)).numpy()


# ------------------------------------------------------------------ round trips


def test_made_and_image_round_trip(tmp_path):
    cfg = MadeConfig(6, (8,))
    made = ServedModel(cfg, init_params(cfg, 0), 1, "fedavg", 2, "value>7")
    save_snapshot(made, tmp_path / "made.npz")
    back = load_snapshot(tmp_path / "made.npz")
    assert back.made == cfg and all(np.array_equal(back.params[k], v) for k, v in made.params.items())
    image = tiny_image()
    save_snapshot(image, tmp_path / "image.npz")
    back = load_snapshot(tmp_path / "image.npz")
    assert back.format == "image-classifier" and back.class_names == image.class_names
    assert (back.image_side, back.method, back.task) == (8, "filver", 1)
    x = np.random.default_rng(0).random((5, 64))
    np.testing.assert_array_equal(back.logits(x), image.logits(x))  # the same weights, bit for bit
    assert not list(tmp_path.glob(".*.tmp"))  # written atomically, nothing left behind
    assert (tmp_path / "image.npz").stat().st_mode & 0o777 == published_mode()  # readable as model.onnx is


def test_text_groups_round_trip_names_the_backbone(groups, tmp_path):
    served, _ = groups
    served = with_class_names(served, BBC_NAMES)
    save_snapshot(served, tmp_path / "served.npz")
    meta, arrays = read_npz(tmp_path / "served.npz")
    assert meta["backbone"]["dir"] == str(Path(served.backbone_source).resolve())
    assert len(meta["backbone"]["sha256"]) == 64 and not any("embeddings" in n for n in arrays)  # named, not copied
    back = load_snapshot(tmp_path / "served.npz")
    assert isinstance(back, TextGroupsSnapshot) and back.class_names == BBC_NAMES
    assert back.group_of == {0: 0, 1: 0, 2: 2} and sorted(back.tensors) == [0, 2]
    rebuilt = back.served()
    for old, new in zip(served.groups, rebuilt.groups):
        assert old.classes == new.classes
        if not old.classes:
            continue  # an empty group is left out of the graph (and out of the snapshot)
        for (n, a), (m, b) in zip(old.state_dict().items(), new.state_dict().items()):
            assert n == m and torch.equal(a, b)
    assert all(np.array_equal(rebuilt.prototypes[c], served.prototypes[c]) for c in served.prototypes)


def test_text_tasks_round_trip_holds_no_device_rows(tasks_snapshot):
    served, path, _ = tasks_snapshot
    back = load_snapshot(path)
    assert isinstance(back, TextTasksStage) and back.labels == tuple(map(tuple, TASK_LABELS))
    assert back.desc.startswith("random_tokens") and not np.isin(back.ids, [2023, 7592]).all(axis=1).any()
    np.testing.assert_array_equal(back.reference, _torch_logits(served.module, back.ids, back.mask))
    assert back.graph[:2] and back.method == "fedseit" and back.task == 1


# ------------------------------------------------------------------ hostile snapshots


def _edit(src: Path, dst: Path, meta_changes=None, arrays_changes=None, raw_meta=None) -> Path:
    meta, arrays = read_npz(src)
    meta.update(meta_changes or {})
    arrays.update(arrays_changes or {})
    if raw_meta is None:
        write_npz(dst, meta, arrays)
    else:
        np.savez(dst, **arrays, __meta__=raw_meta)
    return dst


@pytest.fixture(scope="module")
def snapshots(groups, tasks_snapshot, tmp_path_factory):
    d = tmp_path_factory.mktemp("good")
    save_snapshot(tiny_image(), d / "image.npz")
    save_snapshot(groups[0], d / "groups.npz")
    return {"image": d / "image.npz", "groups": d / "groups.npz", "tasks": tasks_snapshot[1]}


HOSTILE = {
    "image": [
        ("pickled", {"arrays_changes": {"layer0.weight": np.array([object()] * 4, dtype=object)}}, "pickled"),
        ("shape", {"arrays_changes": {"layer4.bias": np.zeros(7)}}, "bias must have shape"),
        ("nan", {"arrays_changes": {"layer0.bias": np.array([np.nan, 0.0])}}, "NaN"),
        ("json", {"raw_meta": np.array("{not json")}, "not valid JSON"),
        ("meta", {"meta_changes": {"layers": "conv"}}, "layers must be a list"),
        ("stray", {"arrays_changes": {"payload": np.zeros(3)}}, "unexpected arrays"),
        ("format", {"meta_changes": {"format": "fcl-served-video/1"}}, "is not one of"),
    ],
    "groups": [
        ("pickled", {"arrays_changes": {"prototypes": np.array([object()], dtype=object)}}, "pickled"),
        ("shape", {"arrays_changes": {"prototypes": np.zeros((3, 5), np.float32)}}, "prototypes must be float"),
        ("nan", {"arrays_changes": {"group0/head.bias": np.array([np.nan, 1.0], np.float32)}}, "NaN"),
        ("json", {"raw_meta": np.array('["a", "list"]')}, "must be a JSON object"),
        ("routing", {"meta_changes": {"group_of": [[0, 1]]}}, "does not hold it"),
        ("missing", {"meta_changes": {"enhancer": None}}, "enhancer must be"),
    ],
    "tasks": [
        ("pickled", {"arrays_changes": {"reference": np.array([object()], dtype=object)}}, "pickled"),
        ("shape", {"arrays_changes": {"reference": np.zeros((3, 2, 3), np.float32)}}, "reference must be float32"),
        ("nan", {"arrays_changes": {"reference": np.full((32, 2, 3), np.nan, np.float32)}}, "must be finite"),
        ("ids", {"arrays_changes": {"parity_ids": np.full((32, 32), 10**6, np.int64)}}, r"ids in \[0, 30522\)"),
        ("json", {"raw_meta": np.array(["{}", "{}"])}, "one JSON string"),
        ("labels", {"meta_changes": {"labels": [[0, 9]]}}, "distinct class ids"),
    ],
}


@pytest.mark.parametrize("fmt,name,edit,match", [(f, *case) for f, cases in HOSTILE.items() for case in cases])
def test_hostile_snapshots_are_refused_naming_the_file(snapshots, tmp_path, fmt, name, edit, match):
    path = _edit(snapshots[fmt], tmp_path / f"{fmt}-{name}.npz", **edit)
    with pytest.raises(SnapshotError, match=match) as info:
        load_snapshot(path)
    assert str(path) in str(info.value)


def test_group_tensor_of_the_wrong_shape_is_refused_when_rebuilt(snapshots, tmp_path):
    path = _edit(snapshots["groups"], tmp_path / "g.npz", arrays_changes={"group0/head.bias": np.zeros(5, np.float32)})
    with pytest.raises(SnapshotError, match=r"head.bias: expected shape \(2,\)") as info:
        load_snapshot(path).served()
    assert str(path) in str(info.value)


def test_text_groups_snapshot_without_its_backbone_exits_2(snapshots, tmp_path, capsys):
    meta, _ = read_npz(snapshots["groups"])
    path = _edit(snapshots["groups"], tmp_path / "g.npz", {"backbone": {**meta["backbone"], "sha256": "0" * 64}})
    rc = cli_main(["export", str(path), "--out", str(tmp_path / "m.onnx")])
    err = capsys.readouterr().err
    assert rc == ExitCode.BAD_INPUT and "no backbone with sha256 0000" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "m.onnx").exists()


# ------------------------------------------------------------------ fcl export of each format


def test_fcl_export_image_snapshot(snapshots, tmp_path, capsys):
    out = tmp_path / "image.onnx"
    assert cli_main(["export", str(snapshots["image"]), "--out", str(out), "--int8"]) == ExitCode.OK
    report = json.loads(capsys.readouterr().out)
    assert report["max_scaled_err"] <= 1e-4 and (tmp_path / "image.int8.onnx").is_file()
    x = np.random.default_rng(1).random((7, 64), dtype=np.float32)
    got, _ = ImageClassifierRuntime(out).classify(x)
    np.testing.assert_allclose(got, tiny_image().logits(x), rtol=1e-4, atol=1e-4)
    assert cli_main(["export", str(snapshots["image"]), "--out", str(out), "--parity-data", "mnist"]) == 2
    assert "for MADE snapshots" in capsys.readouterr().err


def test_fcl_export_text_tasks_snapshot_matches_the_device_model(tasks_snapshot, tmp_path, capsys):
    served, path, device_model = tasks_snapshot
    out = tmp_path / "tasks.onnx"
    assert cli_main(["export", str(path), "--out", str(out), "--int8"]) == ExitCode.OK
    report = json.loads(capsys.readouterr().out)
    assert report["parity_data"] == "random_tokens:32" and report["label_agreement"] == 1.0
    ids = np.random.default_rng(2).integers(1, 30522, (9, 12)).astype(np.int64)
    mask = np.ones_like(ids)
    want = _torch_logits(served.module, ids, mask)
    for model in (out, device_model):
        got = TextTasksRuntime(model, tokenizer=False).predict_ids(ids, mask)
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def test_fcl_export_of_a_text_tasks_snapshot_needs_no_torch(tasks_snapshot, tmp_path):
    code = (
        "import sys\n"
        "sys.modules['torch'] = None  # importing it now raises ImportError\n"
        "from export.cli import main\n"
        f"sys.exit(main(['export', {str(tasks_snapshot[1])!r}, '--out', {str(tmp_path / 'm.onnx')!r}]))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=scaled(120), cwd=REPO)
    assert done.returncode == 0, done.stderr[-2000:]
    assert TextTasksRuntime(tmp_path / "m.onnx").metadata["class_names"] == ["0", "1", "2", "3", "4"]


def test_a_text_tasks_snapshot_with_other_weights_fails_its_check(tasks_snapshot, tmp_path, capsys):
    other = tmp_path / "other"
    other.mkdir()
    export_with_snapshot(tiny_text_tasks(seed=1), other / "m.onnx", other / "served.npz")
    _, graph = read_npz(other / "served.npz")
    path = _edit(tasks_snapshot[1], tmp_path / "mixed.npz", arrays_changes={"graph": graph["graph"]})
    assert cli_main(["export", str(path), "--out", str(tmp_path / "x.onnx")]) == ExitCode.FAILURE
    assert "parity check failed" in capsys.readouterr().err and not (tmp_path / "x.onnx").exists()
    path = _edit(tasks_snapshot[1], tmp_path / "junk.npz", arrays_changes={"graph": np.arange(9, dtype=np.uint8)})
    assert cli_main(["export", str(path), "--out", str(tmp_path / "x.onnx")]) == ExitCode.FAILURE
    assert "ONNX model" in capsys.readouterr().err


def test_fcl_export_text_groups_snapshot(snapshots, groups, tmp_path, capsys):
    from export.onnx_text_groups import export_text_groups

    served, ids = groups
    direct = tmp_path / "direct.onnx"
    export_text_groups(served, direct, parity_inputs=ids)
    out = tmp_path / "groups.onnx"
    assert cli_main(["export", str(snapshots["groups"]), "--out", str(out)]) == ExitCode.OK
    assert json.loads(capsys.readouterr().out)["parity_data"].startswith("random_tokens")
    mask = (ids != 0).astype(np.int64)
    a, b = TextClassifierRuntime(out, tokenizer=False), TextClassifierRuntime(direct, tokenizer=False)
    assert a.metadata["weights_sha256"] == b.metadata["weights_sha256"]
    for x, y in zip(a.predict_ids(ids, mask), b.predict_ids(ids, mask)):
        np.testing.assert_array_equal(x, y)
    assert a.class_names is None  # this snapshot's model names no classes


def test_text_groups_class_names_travel_through_the_snapshot(groups, tmp_path):
    served, ids = groups
    save_snapshot(with_class_names(served, BBC_NAMES), tmp_path / "served.npz")
    assert cli_main(["export", str(tmp_path / "served.npz"), "--out", str(tmp_path / "m.onnx")]) == ExitCode.OK
    rt = TextClassifierRuntime(tmp_path / "m.onnx", tokenizer=False)
    assert rt.class_names == list(BBC_NAMES[:3])  # one per exported class (0, 1, 2), in class-id order


# ------------------------------------------------------------------ class names


def test_bbc_class_names_are_the_sorted_folder_names(tmp_path):
    for name in ("tech", "business", "sports", "politics", "entertainment", ".hidden"):
        (tmp_path / name).mkdir()
    assert dataset_class_names("bbc", str(tmp_path)) == BBC_NAMES
    assert dataset_class_names("mnist") is None and dataset_class_names("digits") is None


def test_with_class_names_replaces_only_numbers(groups):
    tasks = tiny_text_tasks()
    assert with_class_names(tasks, BBC_NAMES).class_names == BBC_NAMES
    named = dataclasses.replace(tasks, class_names=list("abcde"))
    assert with_class_names(named, BBC_NAMES).class_names == tuple("abcde")
    assert with_class_names(tasks, BBC_NAMES[:3]).class_names == tasks.class_names  # too few names: numbers stay
    assert with_class_names(tiny_image(), None).class_names == tiny_image().class_names
    assert with_class_names(groups[0], BBC_NAMES).class_names == BBC_NAMES
    assert with_class_names(None, BBC_NAMES) is None


class _Learner:
    def __init__(self, served) -> None:
        self.served = served

    def served_model(self, task: int, binarize: str = ""):
        return self.served


def test_device_serves_bbc_names_and_fcl_infer_prints_them(tmp_path, capsys):
    """The daemon's writer names the classes from the dataset (not the CLI by method): the text
    model it serves, and the one ``fcl export`` makes from its snapshot, print BBC names."""
    writer = ServedModelWriter(tmp_path / "out", "bbc", int8=False, class_names=BBC_NAMES)
    job = writer.snapshot(_Learner(tiny_text_tasks()), 1, np.array([[101, 2023, 102]], np.int64))
    assert job.served.class_names == BBC_NAMES and writer.write(job) is not None
    assert writer.snapshot_path.is_file()
    again = tmp_path / "again.onnx"
    assert cli_main(["export", str(writer.snapshot_path), "--out", str(again)]) == ExitCode.OK
    capsys.readouterr()
    for model in (writer.model_path, again):
        assert cli_main(["infer", str(model), "--text", "Shares fell after the results", "--task", "0"]) == 0
        answer = json.loads(capsys.readouterr().out)
        assert answer["class"] in ("sports", "business", "tech") and answer["label"] in TASK_LABELS[0]
        assert answer["class"] == BBC_NAMES[answer["label"]]


# ------------------------------------------------------------------ frozen tables named, not copied


@pytest.fixture(scope="module", params=["parameter", "buffer"])
def table_snapshot(request, tmp_path_factory):
    d = tmp_path_factory.mktemp("frozen")
    served = tiny_text_tasks_with_table(d / "shipped", buffer=request.param == "buffer")
    report, problem = export_with_snapshot(served, d / "model.onnx", d / "served.npz")
    assert problem is None and report["label_agreement"] == 1.0
    return served, d


def test_a_frozen_table_is_named_by_its_source_not_copied(table_snapshot, tmp_path, capsys):
    served, d = table_snapshot
    table = served.frozen[0].array
    meta, arrays = read_npz(d / "served.npz")
    (ref,) = meta["frozen"]
    assert ref["model_dir"] == str(d / "shipped") and ref["tensor"] == "emb" and ref["zero_rows"] == [0]
    assert arrays["graph"].nbytes < (d / "model.onnx").stat().st_size - table.nbytes  # the table's bytes are not in it
    assert sorted(arrays) == ["graph", "parity_ids", "parity_mask", "reference"]
    out = tmp_path / "m.onnx"
    assert cli_main(["export", str(d / "served.npz"), "--out", str(out)]) == ExitCode.OK  # rebuilt from the source
    capsys.readouterr()
    ids = np.random.default_rng(3).integers(1, 30522, (5, 9)).astype(np.int64)
    mask = np.ones_like(ids)
    got = TextTasksRuntime(out, tokenizer=False).predict_ids(ids, mask)
    np.testing.assert_allclose(got, _torch_logits(served.module, ids, mask), rtol=1e-4, atol=1e-5)


def test_a_frozen_table_whose_source_changed_is_refused(table_snapshot, tmp_path, capsys):
    _, d = table_snapshot
    meta, arrays = read_npz(d / "served.npz")
    elsewhere = tmp_path / "shipped"
    elsewhere.mkdir()
    other = np.random.default_rng(9).normal(0, 1, (30522, 8)).astype(np.float32)
    write_safetensors(elsewhere / "model.safetensors", {"emb": other})  # another file under the same name
    meta["frozen"][0]["model_dir"] = str(elsewhere)
    write_npz(tmp_path / "served.npz", meta, arrays)
    assert cli_main(["export", str(tmp_path / "served.npz"), "--out", str(tmp_path / "m.onnx")]) == ExitCode.BAD_INPUT
    err = capsys.readouterr().err
    assert "no emb of sha256" in err and str(elsewhere) in err and not (tmp_path / "m.onnx").exists()


def test_a_frozen_table_its_source_cannot_rebuild_is_copied(tmp_path):
    served = tiny_text_tasks_with_table(tmp_path / "shipped")
    (tmp_path / "shipped" / "model.safetensors").unlink()  # the device's copy has no source now
    export_with_snapshot(served, tmp_path / "model.onnx", tmp_path / "served.npz")
    back = load_snapshot(tmp_path / "served.npz")
    (ref,) = back.frozen
    np.testing.assert_array_equal(ref.array, served.module.embed.weight.detach().numpy())
    assert cli_main(["export", str(tmp_path / "served.npz"), "--out", str(tmp_path / "m.onnx")]) == ExitCode.OK
