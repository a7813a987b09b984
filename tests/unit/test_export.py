"""ONNX export of served MADE models: parity with torch, autoregressive property, int8, snapshots."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from conftest import run_fcl

import export.onnx_made as onnx_made
from export.cli import main as cli_main
from export.onnx_made import ExportError, ServedModel, build_onnx, export_served_model, int8_path_for
from export.runtime import MadeRuntime
from export.snapshot import SnapshotError, load_snapshot, save_snapshot
from fclcore.exitcodes import ExitCode
from fclcore.made_spec import MadeConfig, init_params, input_degrees, input_order
from fclcore.models.made import MADE

# (config, order_index): mask seeds, natural/seeded orders, several order indices (incl. wrap-around),
# direct on/off, one and two hidden layers, D in 8..20.
CASES = {
    "natural_1layer": (MadeConfig(12, (32,), direct=True, natural_order=True, mask_seed=0), 0),
    "natural_2layer_nodirect": (MadeConfig(10, (24, 24), direct=False, natural_order=True, mask_seed=1), 0),
    "seeded_1layer": (MadeConfig(16, (32,), direct=True, natural_order=False, mask_seed=7), 0),
    "seeded_2layer": (MadeConfig(14, (24, 24), direct=True, natural_order=False, mask_seed=123), 0),
    "multi_order_natural_k3": (MadeConfig(12, (32,), direct=True, natural_order=True, num_orders=4, mask_seed=3), 3),
    "multi_order_wraps": (MadeConfig(8, (16,), direct=False, natural_order=True, num_orders=4, mask_seed=9), 6),
    "multi_order_seeded_2layer": (
        MadeConfig(20, (24, 24), direct=False, natural_order=False, num_orders=3, mask_seed=42),
        2,
    ),
    "multi_order_seeded_direct_k1": (
        MadeConfig(18, (40,), direct=True, natural_order=False, num_orders=5, mask_seed=2024),
        1,
    ),
}


def served(
    cfg: MadeConfig, order_index: int = 0, seed: int = 0, *, big: bool = False, method: str = "fedavg", task: int = 0
) -> ServedModel:
    """A ServedModel with nn.Linear-scale weights, or (big) random non-zero weights of magnitude >= 0.1."""
    params = init_params(cfg, seed)
    if big:
        rng = np.random.default_rng(seed)
        params = {
            n: ((np.abs(rng.standard_normal(p.shape)) + 0.1) * rng.choice([-1.0, 1.0], p.shape)).astype(np.float32)
            for n, p in params.items()
        }
    return ServedModel(cfg, params, order_index, method, task, "value>7")


def torch_made(model: ServedModel) -> MADE:
    net = MADE(model.made)
    net.set_params(dict(model.params))
    net.set_order(model.order_index)
    return net.eval()


def binary(n: int, d: int, seed: int = 0) -> np.ndarray:
    return (np.random.default_rng(seed).random((n, d)) < 0.5).astype(np.float32)


@pytest.mark.parametrize("case", list(CASES))
def test_parity_loglik_conditionals_and_metadata(case: str, tmp_path: Path) -> None:
    cfg, k = CASES[case]
    model = served(cfg, k, seed=len(case), method="confedmade", task=2)
    x = binary(48, cfg.input_dim, seed=1)
    report = export_served_model(model, tmp_path / "m.onnx", parity_inputs=x)
    assert report["max_abs_err"] <= 1e-5 and report["max_scaled_err"] <= 1e-5 and report["parity_rows"] == 48
    assert report["bytes"] == (tmp_path / "m.onnx").stat().st_size

    rt = MadeRuntime.load(tmp_path / "m.onnx")
    net = torch_made(model)
    real = np.random.default_rng(2).standard_normal((16, cfg.input_dim)).astype(np.float32)
    for inputs in (x, real):  # binary and real-valued inputs
        with torch.no_grad():
            ref = net(torch.from_numpy(inputs)).numpy()
        assert np.max(np.abs(rt.logits(inputs) - ref)) <= 1e-5
    with torch.no_grad():
        ref_ll = -net.nll(torch.from_numpy(x)).numpy()
        ref_logits = net(torch.from_numpy(x)).numpy().astype(np.float64)
    np.testing.assert_allclose(rt.log_likelihood(x), ref_ll, rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(rt.conditionals(x), 1 / (1 + np.exp(-ref_logits)), atol=1e-6)

    m = rt.metadata
    kk = k % cfg.num_orders
    assert m["format"] == "fcl-made/1" and m["method"] == "confedmade" and m["task"] == 2
    assert m["order_index"] == kk and m["mask_seed"] == cfg.mask_seed and m["direct"] == cfg.direct
    assert m["input_dim"] == cfg.input_dim and m["hidden_sizes"] == list(cfg.hidden_sizes)
    assert m["input_order"] == input_order(cfg, kk).tolist() and np.array_equal(rt.order, input_order(cfg, kk))
    assert m["binarize"] == "value>7" and m["toolkit_version"] == "0.1.0" and m["quantization"] == "none"
    assert m["weights_sha256"] == report["sha256"]


@pytest.mark.parametrize("case", list(CASES))
def test_onnx_graph_is_autoregressive(case: str) -> None:
    """Flip input j on the ONNX model itself: output d may move only if deg(j) < deg(d)."""
    cfg, k = CASES[case]
    model = served(cfg, k, seed=5, big=True)
    sess = ort.InferenceSession(build_onnx(model, "test").SerializeToString(), providers=["CPUExecutionProvider"])
    d = cfg.input_dim
    deg = input_degrees(input_order(cfg, k % cfg.num_orders))
    allowed = deg[None, :] < deg[:, None]  # allowed[out, in]
    moved = np.zeros((d, d), dtype=bool)
    base = binary(8, d, seed=3)
    out0 = sess.run(None, {"x": base})[0]
    for j in range(d):
        flipped = base.copy()
        flipped[:, j] = 1 - flipped[:, j]
        moved[:, j] = (sess.run(None, {"x": flipped})[0] != out0).any(axis=0)
    assert not moved[~allowed].any(), f"outputs depend on later inputs: {np.argwhere(moved & ~allowed)[:5]}"
    assert not moved[int(input_order(cfg, k % cfg.num_orders)[0])].any(), "first output must be constant"
    frac = moved[allowed].mean()
    assert frac > (0.99 if cfg.direct else 0.3), f"only {frac:.2f} of the allowed dependencies move"


def test_export_structure_and_opset(tmp_path: Path) -> None:
    cfg, _ = CASES["seeded_2layer"]
    proto = build_onnx(served(cfg), "9.9.9")
    onnx.checker.check_model(proto, full_check=True)
    assert [o.version for o in proto.opset_import if o.domain in ("", "ai.onnx")] == [17]
    assert {n.op_type for n in proto.graph.node} == {"MatMul", "Add", "Relu"}
    assert [i.name for i in proto.graph.input] == ["x"] and [o.name for o in proto.graph.output] == ["logits"]
    dims = proto.graph.input[0].type.tensor_type.shape.dim
    assert dims[0].dim_param == "batch" and dims[1].dim_value == cfg.input_dim
    props = {p.key: p.value for p in proto.metadata_props}
    for key in (
        "fcl.method",
        "fcl.task",
        "fcl.mask_seed",
        "fcl.order_index",
        "fcl.input_order",
        "fcl.input_dim",
        "fcl.hidden_sizes",
        "fcl.direct",
        "fcl.binarize",
        "fcl.toolkit_version",
        "fcl.weights_sha256",
    ):
        assert key in props, key
    assert props["fcl.format"] == "fcl-made/1" and props["fcl.toolkit_version"] == "9.9.9"
    assert json.loads(props["fcl.input_order"]) == input_order(cfg, 0).tolist()
    # Dynamic batch: batch sizes 1 and 7 run.
    sess = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    for n in (1, 7):
        assert sess.run(None, {"x": binary(n, cfg.input_dim)})[0].shape == (n, cfg.input_dim)
    # Building twice gives the same bytes (hashes are reproducible).
    assert build_onnx(served(cfg), "9.9.9").SerializeToString() == proto.SerializeToString()


def test_parity_violation_raises_and_leaves_target_untouched(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg, k = CASES["natural_1layer"]
    target = tmp_path / "m.onnx"
    export_served_model(served(cfg, k, seed=1), target)
    before = target.read_bytes()
    real = onnx_made._torch_logits
    monkeypatch.setattr(onnx_made, "_torch_logits", lambda m, x: real(m, x) + np.float32(3e-4))
    with pytest.raises(ExportError, match=r"parity check failed: .* logit error 0.0003"):
        export_served_model(served(cfg, k, seed=2), target, int8=True)
    assert target.read_bytes() == before
    assert not int8_path_for(target).exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.onnx"], "temp files left behind"


@pytest.mark.parametrize("rel, passes", [(3e-6, True), (3e-5, False)])
def test_parity_tolerance_scales_with_large_logits(
    rel: float, passes: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """|onnx - torch| <= 1e-5 * max(1, |torch|): float32 noise on logits near -30 passes, a real error does not."""
    cfg, _ = CASES["natural_1layer"]
    model = served(cfg, seed=1)
    model = ServedModel(cfg, {**model.params, "output.bias": np.full(12, -30.0, np.float32)}, 0, "fedavg", 0)
    real = onnx_made._torch_logits
    monkeypatch.setattr(onnx_made, "_torch_logits", lambda m, x: real(m, x) * np.float32(1 + rel))
    if passes:
        report = export_served_model(model, tmp_path / "m.onnx")
        assert report["max_abs_err"] > 1e-5 and report["max_scaled_err"] <= 1e-5
    else:
        with pytest.raises(ExportError, match="parity check failed"):
            export_served_model(model, tmp_path / "m.onnx")


def test_export_rejects_bad_parity_inputs_and_missing_dir(tmp_path: Path) -> None:
    cfg, _ = CASES["natural_1layer"]
    with pytest.raises(ExportError, match="shape"):
        export_served_model(served(cfg), tmp_path / "m.onnx", parity_inputs=np.zeros((4, 3), np.float32))
    with pytest.raises(ExportError, match="only 0 and 1"):
        export_served_model(served(cfg), tmp_path / "m.onnx", parity_inputs=np.full((4, 12), 0.5, np.float32))
    with pytest.raises(ExportError, match="does not exist"):
        export_served_model(served(cfg), tmp_path / "nope" / "m.onnx")


@pytest.mark.parametrize(
    "bad, match",
    [
        (lambda p: p.pop("output.bias"), "missing"),
        (lambda p: p.update({"extra": np.zeros(3, np.float32)}), "unexpected"),
        (lambda p: p.update({"hidden.0.weight": np.zeros((3, 3), np.float32)}), "expected shape"),
        (lambda p: p["output.bias"].__setitem__(0, np.nan), "NaN"),
    ],
)
def test_served_model_validates_params(bad, match: str) -> None:
    cfg, _ = CASES["natural_1layer"]
    params = {n: a.copy() for n, a in init_params(cfg, 0).items()}
    bad(params)
    with pytest.raises(ValueError, match=match):
        ServedModel(cfg, params, 0, "fedavg", 0, "")


def test_int8_smaller_and_nll_delta_recorded(tmp_path: Path) -> None:
    cfg = MadeConfig(20, (256, 256), direct=True, natural_order=False, mask_seed=4)
    model = served(cfg, seed=3)
    x = binary(64, cfg.input_dim, seed=9)
    report = export_served_model(model, tmp_path / "m.onnx", parity_inputs=x, int8=True)
    q = tmp_path / "m.int8.onnx"
    assert report["int8_path"] == str(q) and q.exists()
    fp32_size, q_size = (tmp_path / "m.onnx").stat().st_size, q.stat().st_size
    assert report["int8_bytes"] == q_size and q_size <= 0.3 * fp32_size, (q_size, fp32_size)
    rt, rq = MadeRuntime.load(tmp_path / "m.onnx"), MadeRuntime.load(q)
    assert rq.metadata["quantization"] == "int8-dynamic" and rq.metadata["int8_eval"] == "parity_inputs:64"
    delta = float(np.mean(rt.log_likelihood(x) - rq.log_likelihood(x)))  # NLL(int8) - NLL(fp32)
    assert rq.metadata["int8_nll_delta"] == pytest.approx(report["int8_nll_delta"])
    assert rq.metadata["int8_nll_delta"] == pytest.approx(delta, abs=1e-6)
    assert abs(delta) < 0.5
    # Same provenance metadata as the fp32 file; row results do not depend on the batch.
    for key in ("method", "task", "order_index", "input_order", "input_dim", "hidden_sizes", "mask_seed"):
        assert rq.metadata[key] == rt.metadata[key]
    ll = rq.log_likelihood(x)
    assert np.array_equal(ll[5:6], rq.log_likelihood(x[5:6]))
    assert np.array_equal(ll[:3], rq.log_likelihood(x[:3]))


def test_snapshot_round_trip_and_cli_export(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    cfg, k = CASES["multi_order_seeded_direct_k1"]
    model = served(cfg, k, seed=8, method="fedet", task=3)
    save_snapshot(model, tmp_path / "served.npz")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["served.npz"]
    back = load_snapshot(tmp_path / "served.npz")
    assert back.made == cfg and (back.order_index, back.method, back.task, back.binarize) == (k, "fedet", 3, "value>7")
    assert back.params.keys() == model.params.keys()
    for n in model.params:
        assert np.array_equal(back.params[n], model.params[n])

    rc = cli_main(
        ["export", str(tmp_path / "served.npz"), "--out", str(tmp_path / "m.onnx"), "--int8", "--parity-data", "none"]
    )
    out = capsys.readouterr().out
    assert rc == ExitCode.OK
    report = json.loads(out)
    assert report["max_abs_err"] <= 1e-5 and os.path.exists(report["int8_path"])
    assert MadeRuntime.load(tmp_path / "m.onnx").metadata["method"] == "fedet"


def test_cli_export_says_which_file_is_which_quietly_and_readable(tmp_path: Path) -> None:
    """--int8 keeps float32 at --out and names the int8 copy; onnxruntime's INFO chatter stays
    out; the files get the umask's mode, not mkstemp's 0600."""
    cfg, k = CASES["multi_order_seeded_direct_k1"]
    save_snapshot(served(cfg, k, seed=8), tmp_path / "served.npz")
    out = tmp_path / "m-int8.onnx"
    done = run_fcl("export", str(tmp_path / "served.npz"), "--out", str(out), "--int8", "--parity-data", "none")
    assert done.returncode == 0, done.stderr
    int8 = tmp_path / "m-int8.int8.onnx"
    assert done.stderr.strip().splitlines() == [f"fcl export: wrote {out} (float32) and {int8} (int8 weights)"]
    assert MadeRuntime.load(int8).metadata["quantization"] == "int8-dynamic"
    assert MadeRuntime.load(out).metadata["quantization"] == "none"
    umask = os.umask(0o022)
    os.umask(umask)
    assert {stat.S_IMODE(p.stat().st_mode) for p in (out, int8)} == {0o666 & ~umask}


def test_cli_export_digits_parity_data(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    cfg = MadeConfig(64, (32,), direct=True, mask_seed=1)
    save_snapshot(served(cfg), tmp_path / "served.npz")
    rc = cli_main(
        [
            "export",
            str(tmp_path / "served.npz"),
            "--out",
            str(tmp_path / "m.onnx"),
            "--parity-data",
            "digits",
            "--parity-rows",
            "100",
        ]
    )
    assert rc == ExitCode.OK
    assert json.loads(capsys.readouterr().out)["parity_data"] == "parity_inputs:100"
    # Dataset whose dimension does not match the model: bad input, one line.
    rc = cli_main(
        ["export", str(tmp_path / "served.npz"), "--out", str(tmp_path / "m2.onnx"), "--parity-data", "mnist"]
    )
    err = capsys.readouterr().err
    assert rc == ExitCode.BAD_INPUT and "784" in err and len(err.strip().splitlines()) == 1


def _npz_with(path: Path, arrays: dict[str, np.ndarray]) -> Path:
    with open(path, "wb") as fh:
        np.savez(fh, allow_pickle=True, **arrays)
    return path


def _snapshot_arrays(model: ServedModel, **meta_changes: object) -> dict[str, np.ndarray]:
    meta = {
        "input_dim": model.made.input_dim,
        "hidden_sizes": list(model.made.hidden_sizes),
        "direct": model.made.direct,
        "natural_order": model.made.natural_order,
        "num_orders": model.made.num_orders,
        "mask_seed": model.made.mask_seed,
        "order_index": model.order_index,
        "method": model.method,
        "task": model.task,
        "binarize": model.binarize,
    }
    meta.update(meta_changes)
    return {**{n: np.array(a) for n, a in model.params.items()}, "__meta__": np.array(json.dumps(meta))}


def test_snapshot_rejections(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    cfg, _ = CASES["natural_1layer"]
    model = served(cfg)
    ok = _snapshot_arrays(model)
    assert load_snapshot(_npz_with(tmp_path / "ok.npz", ok)).made == cfg  # the hand-written format loads

    cases: dict[str, tuple[dict[str, np.ndarray], str]] = {
        "wrong_shape": ({**ok, "output.bias": np.zeros(5, np.float32)}, "expected shape"),
        "missing_param": ({n: a for n, a in ok.items() if n != "direct.weight"}, "missing"),
        "pickled_param": ({**ok, "output.bias": np.array([object()] * 12, dtype=object)}, "pickle"),
        "pickled_meta": ({**ok, "__meta__": np.array([{"input_dim": 12}], dtype=object)}, "pickle"),
        "no_meta": ({n: a for n, a in ok.items() if n != "__meta__"}, "__meta__"),
        "meta_not_json": ({**ok, "__meta__": np.array("{nope")}, "JSON"),
        "meta_missing_field": (
            _snapshot_arrays(model, order_index=None) | {"__meta__": np.array(json.dumps({"input_dim": 12}))},
            "missing",
        ),
        "bad_config": (_snapshot_arrays(model, hidden_sizes=[0]), "hidden_sizes"),
        "bad_task": (_snapshot_arrays(model, task=-1), "task"),
        "int_params": ({**ok, "output.bias": np.zeros(12, np.int64)}, "float"),
    }
    for name, (arrays, match) in cases.items():
        path = _npz_with(tmp_path / f"{name}.npz", arrays)
        with pytest.raises(SnapshotError, match=match) as info:
            load_snapshot(path)
        assert str(path) in str(info.value), name
    (tmp_path / "text.npz").write_text("not a zip")
    np.save(tmp_path / "single.npy", np.zeros(3))
    good = (tmp_path / "ok.npz").read_bytes()
    (tmp_path / "trunc.npz").write_bytes(good[: len(good) // 2])
    for name in ("text.npz", "single.npy", "trunc.npz", "missing.npz"):
        with pytest.raises(SnapshotError):
            load_snapshot(tmp_path / name)
    # Through the CLI: exit 2 and one line naming the file.
    rc = cli_main(["export", str(tmp_path / "pickled_param.npz"), "--out", str(tmp_path / "x.onnx")])
    err = capsys.readouterr().err
    assert rc == ExitCode.BAD_INPUT and "pickled_param.npz" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "x.onnx").exists()
