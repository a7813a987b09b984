"""The torch-free runtime: file validation, sampling, inputs, hot swap and the ``fcl infer`` command."""

from __future__ import annotations

import io
import itertools
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import numpy_helper
from support.timescale import scaled

from export.onnx_made import ServedModel, base_metadata, build_onnx, export_served_model
from export.publish import seal
from export.runtime import InputError, MadeRuntime, ModelFileError, load_inputs, parse_row
from export.watcher import ModelWatcher
from fclcore.made_spec import MadeConfig, init_params

REPO = Path(__file__).resolve().parents[2]
CFG = MadeConfig(12, (24,), direct=True, natural_order=False, num_orders=2, mask_seed=11)


def served(cfg: MadeConfig = CFG, seed: int = 0, order_index: int = 1, scale: float = 1.0) -> ServedModel:
    params = {n: (a * scale).astype(np.float32) for n, a in init_params(cfg, seed).items()}
    return ServedModel(cfg, params, order_index, "fedavg", seed, "value>7")


def binary(n: int, d: int, seed: int = 0) -> np.ndarray:
    return (np.random.default_rng(seed).random((n, d)) < 0.5).astype(np.float32)


@pytest.fixture
def model_file(tmp_path: Path) -> Path:
    path = tmp_path / "model.onnx"
    export_served_model(served(), path)
    return path


def _resealed(model: ServedModel, **meta: object) -> bytes:
    """A correctly hashed file whose metadata was changed (tests checks other than the hashes)."""
    proto = build_onnx(model, "0.1.0")
    return seal(proto, {**base_metadata(model, "0.1.0"), **meta}).SerializeToString()


# ------------------------------------------------------------------ rejected files
def test_truncated_files_rejected(model_file: Path, tmp_path: Path) -> None:
    data = model_file.read_bytes()
    bad = tmp_path / "bad.onnx"
    for cut in (0, 1, 10, len(data) // 3, len(data) // 2, len(data) - 100, len(data) - 1):
        bad.write_bytes(data[:cut])
        with pytest.raises(ModelFileError) as info:
            MadeRuntime.load(bad)
        msg = str(info.value)
        assert str(bad) in msg and "\n" not in msg, msg


def test_every_byte_corruption_rejected(model_file: Path, tmp_path: Path) -> None:
    """Flipping any single byte (sampled across the whole file) is caught before serving."""
    data = bytearray(model_file.read_bytes())
    bad = tmp_path / "bad.onnx"
    positions = sorted(set(range(0, len(data), max(1, len(data) // 300))) | {len(data) - 1, len(data) // 2})
    for pos in positions:
        corrupted = bytearray(data)
        corrupted[pos] ^= 0x5A
        bad.write_bytes(bytes(corrupted))
        with pytest.raises(ModelFileError, match=str(bad)):
            MadeRuntime.load(bad)


@pytest.mark.parametrize(
    "content",
    [
        b"hello, this is not an ONNX model\n",
        os.urandom(4096),
        b"\x08\x08" + b"\x00" * 100,
        b"PK\x03\x04" + b"\x00" * 60,
    ],
)
def test_non_onnx_files_rejected(content: bytes, tmp_path: Path) -> None:
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(content)
    with pytest.raises(ModelFileError, match=str(bad)):
        MadeRuntime.load(bad)


def test_missing_file_directory_and_npz_rejected(tmp_path: Path) -> None:
    with pytest.raises(ModelFileError, match="no such model file"):
        MadeRuntime.load(tmp_path / "nope.onnx")
    with pytest.raises(ModelFileError, match="directory"):
        MadeRuntime.load(tmp_path)
    np.savez(tmp_path / "served.npz", a=np.zeros(3))
    with pytest.raises(ModelFileError):
        MadeRuntime.load(tmp_path / "served.npz")


def _plain_onnx(model: ServedModel) -> onnx.ModelProto:
    proto = build_onnx(model, "0.1.0")
    del proto.metadata_props[:]
    return proto


@pytest.mark.parametrize(
    "name, make, match",
    [
        ("plain_onnx_no_metadata", lambda m: _plain_onnx(m).SerializeToString(), "fcl.format"),
        ("other_format", lambda m: _resealed(m, format="fcl-made/2"), "fcl.format"),
        ("bad_task", lambda m: _resealed(m, task=-3), "fcl.task"),
        ("order_not_permutation", lambda m: _resealed(m, input_order=[0] * 12), "permutation"),
        ("hidden_not_list", lambda m: _resealed(m, hidden_sizes="24"), "hidden_sizes"),
        ("direct_not_bool", lambda m: _resealed(m, direct="yes"), "fcl.direct"),
        ("order_index_out_of_range", lambda m: _resealed(m, order_index=5), "order_index"),
        ("wrong_input_dim", lambda m: _resealed(m, input_dim=13, input_order=list(range(13))), "input_dim 13"),
        ("int8_without_delta", lambda m: _resealed(m, quantization="int8-dynamic"), "int8_nll_delta"),
    ],
)
def test_bad_metadata_rejected(name: str, make, match: str, tmp_path: Path) -> None:
    bad = tmp_path / f"{name}.onnx"
    bad.write_bytes(make(served()))
    with pytest.raises(ModelFileError, match=match) as info:
        MadeRuntime.load(bad)
    assert str(bad) in str(info.value)


def test_missing_metadata_key_rejected(model_file: Path, tmp_path: Path) -> None:
    proto = onnx.load(model_file)
    kept = [(p.key, p.value) for p in proto.metadata_props if p.key != "fcl.method"]
    del proto.metadata_props[:]
    for k, v in kept:
        proto.metadata_props.add(key=k, value=v)
    bad = tmp_path / "bad.onnx"
    onnx.save(proto, bad)
    with pytest.raises(ModelFileError, match="missing metadata fcl.method"):
        MadeRuntime.load(bad)


def test_tampered_weights_rejected(model_file: Path, tmp_path: Path) -> None:
    proto = onnx.load(model_file)
    init = proto.graph.initializer[0]
    w = numpy_helper.to_array(init).copy()
    w.flat[0] += 0.5
    init.CopyFrom(numpy_helper.from_array(w, init.name))
    bad = tmp_path / "tampered.onnx"
    onnx.save(proto, bad)
    with pytest.raises(ModelFileError, match="weights hash mismatch"):
        MadeRuntime.load(bad)
    # Weights hash recomputed by the tamperer but not the whole-file hash: still rejected.
    from export._proto import weights_digest

    for p in proto.metadata_props:
        if p.key == "fcl.weights_sha256":
            p.value = weights_digest((t.name, t.data_type, list(t.dims), t.raw_data) for t in proto.graph.initializer)
    onnx.save(proto, bad)
    with pytest.raises(ModelFileError, match="integrity hash mismatch"):
        MadeRuntime.load(bad)


def test_original_file_still_loads_after_onnx_round_trip(model_file: Path, tmp_path: Path) -> None:
    """onnx.load + onnx.save without changes keeps the file valid (the hashes are canonical)."""
    onnx.save(onnx.load(model_file), tmp_path / "copy.onnx")
    assert MadeRuntime.load(tmp_path / "copy.onnx").metadata == MadeRuntime.load(model_file).metadata


# ------------------------------------------------------------------ inference API
def test_inference_input_validation(model_file: Path) -> None:
    rt = MadeRuntime.load(model_file)
    x = binary(4, 12)
    for bad, match in [
        (x[:, :5], r"shape \(N, 12\)"),
        (x[0], r"shape \(N, 12\)"),
        (x * 0.5, "only 0 and 1"),
        (np.full((2, 12), np.nan), "NaN"),
        (np.array([["a"] * 12]), "numeric"),
    ]:
        with pytest.raises(InputError, match=match):
            rt.log_likelihood(bad)
    with pytest.raises(InputError):
        rt.conditionals(x * 2)
    assert rt.log_likelihood(np.zeros((0, 12))).shape == (0,)
    assert rt.log_likelihood(x.astype(bool)).shape == (4,) and rt.log_likelihood(x.astype(np.int64)).shape == (4,)
    for n, seed in [(-1, 0), (2, -1), (1.5, 0), (True, 0)]:
        with pytest.raises(InputError):
            rt.sample(n, seed)


def test_sample_is_binary_deterministic_and_follows_order(model_file: Path) -> None:
    rt = MadeRuntime.load(model_file)
    a, b, c = rt.sample(64, seed=3), rt.sample(64, seed=3), rt.sample(64, seed=4)
    assert a.shape == (64, 12) and set(np.unique(a)) <= {0.0, 1.0}
    assert np.array_equal(a, b) and not np.array_equal(a, c)
    assert rt.sample(0, 1).shape == (0, 12)


@pytest.mark.parametrize("natural", [True, False])
def test_tiny_model_sample_distribution_matches_likelihood(natural: bool, tmp_path: Path) -> None:
    cfg = MadeConfig(3, (8,), direct=True, natural_order=natural, mask_seed=5)
    export_served_model(served(cfg, seed=2, order_index=0, scale=6.0), tmp_path / "tiny.onnx")
    rt = MadeRuntime.load(tmp_path / "tiny.onnx")
    allx = np.array(list(itertools.product([0, 1], repeat=3)), dtype=np.float32)
    p = np.exp(rt.log_likelihood(allx))
    assert p.sum() == pytest.approx(1.0, abs=1e-6)  # an autoregressive model is normalised
    assert p.max() - p.min() > 0.1, "weights too small for a meaningful check"
    n = 40_000
    s = rt.sample(n, seed=7)
    emp = np.array([np.all(s == v, axis=1).mean() for v in allx])
    # Binomial std <= sqrt(0.25 / n) = 0.0025; allow ~5 sigma.
    np.testing.assert_allclose(emp, p, atol=0.0125)
    # The conditionals of the first dimension in the order are the marginal of that dimension.
    first = int(rt.order[0])
    assert rt.conditionals(allx)[:, first] == pytest.approx(p[allx[:, first] == 1].sum(), abs=1e-6)


# ------------------------------------------------------------------ inputs
def test_load_inputs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    x = binary(5, 12)
    np.save(tmp_path / "x.npy", x)
    np.savetxt(tmp_path / "x.csv", x, delimiter=",", fmt="%d", header="a comment")
    assert np.array_equal(load_inputs(str(tmp_path / "x.npy"), 12), x)
    assert np.array_equal(load_inputs(str(tmp_path / "x.csv"), 12), x)
    monkeypatch.setattr(sys, "stdin", io.StringIO("\n".join(",".join(str(int(v)) for v in r) for r in x) + "\n"))
    assert np.array_equal(load_inputs("-", 12), x)
    np.save(tmp_path / "row.npy", x[0])
    assert load_inputs(str(tmp_path / "row.npy"), 12).shape == (1, 12)
    assert parse_row("1,0,1,0,1,0,1,0,1,0,1,0", 12).shape == (1, 12)

    np.save(tmp_path / "obj.npy", np.array([{"a": 1}], dtype=object), allow_pickle=True)
    np.save(tmp_path / "wide.npy", binary(2, 13))
    np.save(tmp_path / "half.npy", x * 0.5)
    (tmp_path / "text.csv").write_text("1,0,a\n")
    (tmp_path / "ragged.csv").write_text("1,0,1\n1,0\n")
    (tmp_path / "x.txt").write_text("1,0\n")
    for name, match in [
        ("obj.npy", "pickle"),
        ("wide.npy", r"shape \(N, 12\)"),
        ("half.npy", "0 or 1"),
        ("text.csv", "not numeric"),
        ("ragged.csv", "not numeric"),
        ("x.txt", "unsupported"),
        ("missing.npy", "no such"),
    ]:
        with pytest.raises(InputError, match=match) as info:
            load_inputs(str(tmp_path / name), 12)
        assert name in str(info.value)


# ------------------------------------------------------------------ hot swap
def _wait_until(predicate, timeout: float = 20.0, pause: float = 0.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        if pause:
            time.sleep(pause)


def test_hot_swap_under_concurrent_reads(tmp_path: Path) -> None:
    models = [served(seed=s) for s in range(3)]
    x = binary(32, 12, seed=1)
    expected = []
    for i, m in enumerate(models):
        export_served_model(m, tmp_path / f"ref{i}.onnx")
        expected.append(MadeRuntime.load(tmp_path / f"ref{i}.onnx").log_likelihood(x))
    assert all(not np.allclose(expected[0], e) for e in expected[1:])

    path = tmp_path / "live.onnx"
    export_served_model(models[0], path)
    watcher = ModelWatcher(path, interval=0.0)
    results: list[np.ndarray] = []
    errors: list[BaseException] = []
    stop = threading.Event()

    def reader() -> None:
        try:
            while not stop.is_set():
                results.append(watcher.current().log_likelihood(x))
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            errors.append(exc)

    threads = [threading.Thread(target=reader) for _ in range(2)]
    for t in threads:
        t.start()
    seen = set()
    for i in [1, 2, 0, 2, 1]:
        export_served_model(models[i], path)
        _wait_until(lambda: watcher.current().metadata["task"] == i)  # task == seed: identifies the model
        seen.add(i)
    # A corrupted replacement (atomically renamed in) is rejected; the previous model keeps serving.
    rejected_before = watcher.errors  # read before the swap: a reader thread may notice it first
    bad = tmp_path / "bad.tmp"
    bad.write_bytes(b"garbage")
    os.replace(bad, path)
    _wait_until(lambda: watcher.current() is not None and watcher.errors > rejected_before)
    assert watcher.current().metadata["task"] == 1 and "not a valid ONNX" in watcher.last_error
    stop.set()
    for t in threads:
        t.join()
    assert not errors, errors
    assert len(results) > 20 and watcher.generation == 5 and seen == {0, 1, 2}
    for r in results:
        assert any(np.array_equal(r, e) for e in expected), "a result matches none of the models"
    # A new valid file after the bad one is picked up again.
    export_served_model(models[2], path)
    watcher.poll()
    assert watcher.current().metadata["task"] == 2


def test_watcher_background_thread_and_invalid_first_model(tmp_path: Path) -> None:
    path = tmp_path / "m.onnx"
    path.write_bytes(b"nope")
    with pytest.raises(ModelFileError):
        ModelWatcher(path)
    export_served_model(served(seed=0), path)
    with ModelWatcher(path, interval=0.02).start() as watcher:
        export_served_model(served(seed=1), path)
        _wait_until(lambda: watcher.current().metadata["task"] == 1, pause=0.01)


# ------------------------------------------------------------------ fcl infer (torch-free subprocess)
_RUNNER = (
    "import json, sys\n"
    "from export.cli import main\n"
    "rc = main(sys.argv[1:])\n"
    "heavy = sorted(m for m in ('torch', 'onnx', 'yaml', 'paho') if m in sys.modules)\n"
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


def test_cli_infer_ops_torch_free(model_file: Path, tmp_path: Path) -> None:
    x = binary(6, 12, seed=2)
    np.save(tmp_path / "x.npy", x)
    rt = MadeRuntime.load(model_file)

    proc = _infer(str(model_file), "--op", "loglik", "--input", str(tmp_path / "x.npy"))
    assert proc.returncode == 0, proc.stderr
    assert _heavy(proc) == []
    out = json.loads(proc.stdout)
    np.testing.assert_allclose(out["log_likelihood"], rt.log_likelihood(x), rtol=1e-12)
    assert out["model"]["weights_sha256"] == rt.metadata["weights_sha256"]

    csv = "\n".join(",".join(str(int(v)) for v in r) for r in x)
    proc = _infer(str(model_file), "--op", "conditionals", "--input", "-", stdin=csv)
    assert proc.returncode == 0 and _heavy(proc) == []
    np.testing.assert_allclose(json.loads(proc.stdout)["conditionals"], rt.conditionals(x), rtol=1e-12)

    proc = _infer(str(model_file), "--op", "sample", "--n", "5", "--seed", "9")
    assert proc.returncode == 0 and _heavy(proc) == []
    assert np.array_equal(np.array(json.loads(proc.stdout)["samples"]), rt.sample(5, 9))


def test_cli_infer_bad_inputs_exit_2(model_file: Path, tmp_path: Path) -> None:
    (tmp_path / "bad.onnx").write_bytes(model_file.read_bytes()[:-20])
    np.save(tmp_path / "wide.npy", binary(2, 13))
    for args in (
        [str(tmp_path / "bad.onnx"), "--op", "sample"],
        [str(model_file), "--op", "loglik"],
        [str(model_file), "--op", "loglik", "--input", str(tmp_path / "wide.npy")],
        [str(tmp_path / "missing.onnx"), "--op", "sample"],
    ):
        proc = _infer(*args)
        errs = [ln for ln in proc.stderr.splitlines() if not ln.startswith("HEAVY_MODULES=")]
        assert proc.returncode == 2 and len(errs) == 1 and errs[0].startswith("fcl infer: error:"), proc.stderr


def test_cli_infer_watch_hot_swaps(model_file: Path, tmp_path: Path) -> None:
    """--watch: one JSON line per stdin row; a replaced file is picked up, a corrupt one is not."""
    proc = subprocess.Popen(
        [sys.executable, "-c", _RUNNER, "infer", str(model_file), "--op", "loglik", "--watch", "--interval", "0"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO,
    )
    row = ",".join(str(int(v)) for v in binary(1, 12, seed=4)[0])
    try:

        def ask(line: str) -> dict:
            proc.stdin.write(line + "\n")
            proc.stdin.flush()
            return json.loads(proc.stdout.readline())

        first = ask(row)
        export_served_model(served(seed=5), model_file)
        second = ask(row)
        assert first["model"]["task"] == 0 and second["model"]["task"] == 5
        assert first["log_likelihood"] != second["log_likelihood"]
        assert "error" in ask("1,0,2")  # a bad request is answered, the server keeps going
        (tmp_path / "junk").write_bytes(b"junk")
        os.replace(tmp_path / "junk", model_file)
        assert ask(row) == second  # corrupt file rejected, previous model still serving
        proc.stdin.close()
        assert proc.wait(timeout=scaled(30)) == 0
        stderr = proc.stderr.read()
        assert "rejected new model file" in stderr and _heavy(subprocess.CompletedProcess([], 0, "", stderr)) == []
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_samples_piped_from_op_sample_are_scored(monkeypatch: pytest.MonkeyPatch) -> None:
    """``fcl infer --op sample | fcl infer --op loglik --input -``: the sample JSON is read as rows."""
    rows = [[0, 1, 1, 0], [1, 1, 0, 0]]
    monkeypatch.setattr(sys, "stdin", io.StringIO(json.dumps({"op": "sample", "samples": rows})))
    assert np.array_equal(load_inputs("-", 4), np.array(rows, np.float32))
    for bad in ('{"op": "sample"}', '{"samples": [[0, 1], [1]]}', "{not json"):
        monkeypatch.setattr(sys, "stdin", io.StringIO(bad))
        with pytest.raises(InputError, match="stdin"):
            load_inputs("-", 2)


def test_raw_pixels_are_refused_with_the_way_to_binarise(tmp_path: Path) -> None:
    np.save(tmp_path / "raw.npy", np.full((2, 4), 12.0, np.float32))
    with pytest.raises(InputError, match=r"column 0 is 12\); the model scores binarised rows: threshold"):
        load_inputs(str(tmp_path / "raw.npy"), 4)
