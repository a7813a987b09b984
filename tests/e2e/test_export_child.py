"""The daemon exports a MADE in a short-lived child (edge_client.serving + export.child): same
verified model as in process, the daemon never imports onnx, and a child that fails or hangs
leaves the served model in place."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
from support.timescale import scaled
from support.tiny_models import tiny_text_groups

from edge_client.serving import ServedModelWriter, ServeJob
from export.runtime import MadeRuntime
from export.text_runtime import TextClassifierRuntime
from fclcore.made_spec import MadeConfig, init_params
from fclcore.models.made import served_logits
from fclcore.served import ServedModel

CFG = MadeConfig(12, (32,), direct=True, natural_order=False, mask_seed=3, num_orders=2)


def _job(seed: int, task: int = 0) -> ServeJob:
    served = ServedModel(CFG, init_params(CFG, seed), 1, "fedavg", task, "value>7")
    x = (np.random.default_rng(seed).random((16, 12)) < 0.5).astype(np.float32)
    return ServeJob(served, x, served_logits(served, x))


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> Path:
    """One child export, shared: the served model the other tests must leave in place."""
    out = tmp_path_factory.mktemp("served")
    writer = ServedModelWriter(out, "digits", int8=True)
    job = _job(0)
    report = writer.write(job)
    assert report is not None and report["parity_rows"] == 16 and report["max_scaled_err"] <= 1e-5
    assert writer.child_peak_rss_mb > 0
    return out


def _serving_dir(exported: Path, tmp_path: Path) -> Path:
    (tmp_path / "model.onnx").write_bytes((exported / "model.onnx").read_bytes())
    return tmp_path


def test_child_exports_the_verified_model(exported):
    job = _job(0)
    rt = MadeRuntime.load(exported / "model.onnx")
    np.testing.assert_allclose(rt.logits(job.parity_inputs), job.reference, rtol=1e-5, atol=1e-5)
    assert (exported / "model.int8.onnx").is_file() and (exported / "served.npz").is_file()
    assert not list(exported.glob(".export-*"))  # the job directory is gone


def test_a_wrong_reference_fails_the_parity_check(exported, tmp_path):
    writer = ServedModelWriter(_serving_dir(exported, tmp_path), "digits", int8=False)
    before = (tmp_path / "model.onnx").read_bytes()
    job = _job(1, task=1)
    bad = ServeJob(job.served, job.parity_inputs, job.reference + 1.0)
    assert writer.write(bad) is None
    assert (tmp_path / "model.onnx").read_bytes() == before


@pytest.mark.parametrize(
    "command,timeout",
    [
        ([sys.executable, "-c", "import sys; sys.exit(3)"], 60.0),  # fails without a report
        ([sys.executable, "-c", "import time; time.sleep(60)"], 1.0),  # hangs: killed
    ],
    ids=["fails", "times-out"],
)
def test_a_failing_or_hanging_child_leaves_the_old_model(exported, tmp_path, command, timeout, caplog):
    _serving_dir(exported, tmp_path)
    before = (tmp_path / "model.onnx").read_bytes()
    writer = ServedModelWriter(tmp_path, "digits", int8=False, timeout_s=timeout, child_command=command)
    started = time.monotonic()
    assert writer.write(_job(2, task=1)) is None
    assert time.monotonic() - started < 30
    assert (tmp_path / "model.onnx").read_bytes() == before
    assert "previous model stays in service" in caplog.text
    assert not list(tmp_path.glob(".export-*"))


def test_malformed_job_is_refused(tmp_path):
    (tmp_path / "job.json").write_text(json.dumps({"path": str(tmp_path / "m.onnx"), "int8": "yes"}))
    done = subprocess.run([sys.executable, "-m", "export.child", str(tmp_path)], capture_output=True, text=True)
    assert done.returncode == 2
    doc = json.loads((tmp_path / "report.json").read_text())
    assert doc["ok"] is False and "malformed job" in doc["error"]
    assert not (tmp_path / "m.onnx").exists()


def test_the_daemon_process_never_imports_onnx(tmp_path):
    """Snapshot and export from a process like the daemon's: onnx stays out of it."""
    code = textwrap.dedent(
        f"""
        import sys
        sys.path.insert(0, {str(Path(__file__).resolve().parents[2])!r})
        import numpy as np
        from pathlib import Path
        import edge_client.daemon  # noqa: F401  (what the daemon imports)
        from edge_client.serving import ServedModelWriter
        from fclcore.made_spec import MadeConfig, init_params
        from fclcore.served import ServedModel

        class Learner:
            def served_model(self, task, binarize):
                cfg = MadeConfig(8, (16,), direct=True, natural_order=True, mask_seed=0)
                return ServedModel(cfg, init_params(cfg, 0), 0, "fedavg", task, binarize)

        writer = ServedModelWriter(Path({str(tmp_path)!r}), "digits", int8=False)
        job = writer.snapshot(Learner(), 0, (np.arange(64 * 8).reshape(64, 8) % 3 == 0).astype(np.float32))
        assert writer.write(job) is not None
        print(sorted(m for m in ("onnx", "onnxruntime") if m in sys.modules))
        """
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=scaled(300))
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "[]"
    assert (tmp_path / "model.onnx").is_file()


# -- a text-groups model (FedET's): the child loads the frozen backbone from its directory ------


@pytest.fixture(scope="module")
def text_job(tmp_path_factory):
    """(a tiny text-groups model whose backbone was loaded from a directory, parity token rows)."""
    return tiny_text_groups(tmp_path_factory.mktemp("backbone") / "model")


def test_child_exports_the_text_groups_model_the_daemon_would(text_job, tmp_path):
    served, ids = text_job
    job = ServeJob(served, ids)
    assert job.in_child and not ServeJob(dataclasses.replace(served, backbone_source=""), ids).in_child
    child = ServedModelWriter(tmp_path / "child", "bbc", int8=True)
    report = child.write(job)
    assert report is not None and report["parity_rows"] == 6 and child.child_peak_rss_mb > 0
    in_process = ServedModelWriter(tmp_path / "here", "bbc", int8=False)
    reference = in_process.write(ServeJob(dataclasses.replace(served, backbone_source=""), ids))
    assert reference is not None and in_process.child_peak_rss_mb == 0
    assert report["sha256"] == reference["sha256"]  # the same weights, backbone loaded again
    assert (tmp_path / "child" / "model.int8.onnx").is_file() and not list((tmp_path / "child").glob(".export-*"))
    # the child's snapshot (served.npz, next to the model) is what `fcl export` re-exports: the same file
    assert sorted(p.name for p in (tmp_path / "child").iterdir()) == ["model.int8.onnx", "model.onnx", "served.npz"]
    again = tmp_path / "again.onnx"
    done = subprocess.run(
        [sys.executable, "-m", "export.cli", "export", str(tmp_path / "child" / "served.npz"), "--out", str(again)],
        capture_output=True,
        text=True,
        timeout=scaled(300),
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout)["parity_data"].startswith("random_tokens")
    assert (
        TextClassifierRuntime(again).metadata["weights_sha256"]
        == TextClassifierRuntime(tmp_path / "child" / "model.onnx").metadata["weights_sha256"]
    )


def test_the_text_export_runs_in_two_processes_torch_then_onnxruntime(text_job, tmp_path):
    """The first child holds torch and the backbone but no onnxruntime, and publishes nothing;
    the second (``--finish``) seals, checks, quantises and publishes without torch.  A stage
    that fails its checks in the second, or is incomplete, leaves the old model in place."""
    from export.text_groups_job import write_text_groups_job

    served, ids = text_job
    target = tmp_path / "model.onnx"
    target.write_bytes(b"the model in service")
    job_dir = tmp_path / "job"
    job_dir.mkdir()
    write_text_groups_job(job_dir, served, ids, target, True)
    child = [sys.executable, "-m", "export.child"]
    done = subprocess.run([*child, str(job_dir)], capture_output=True, text=True, timeout=scaled(300))
    first = json.loads((job_dir / "report.json").read_text())
    assert done.returncode == 0 and first["ok"] and first["next"] == "finish", done.stderr[-2000:]
    assert "torch" in first["imported"] and "onnxruntime" not in first["imported"]
    assert target.read_bytes() == b"the model in service"
    weights = job_dir / "stage" / "model.onnx.data"  # the staged graph's initializers, as external data
    good = weights.read_bytes()
    weights.write_bytes(bytes(len(good)))  # other weights than the torch reference's
    done = subprocess.run([*child, "--finish", str(job_dir)], capture_output=True, text=True, timeout=scaled(300))
    assert done.returncode == 1 and "parity check failed" in json.loads((job_dir / "report.json").read_text())["error"]
    assert target.read_bytes() == b"the model in service"
    weights.write_bytes(good[:-8])  # truncated
    done = subprocess.run([*child, "--finish", str(job_dir)], capture_output=True, text=True, timeout=scaled(300))
    assert done.returncode == 2 and "truncated" in json.loads((job_dir / "report.json").read_text())["error"]
    assert target.read_bytes() == b"the model in service"
    weights.write_bytes(good)
    done = subprocess.run([*child, "--finish", str(job_dir)], capture_output=True, text=True, timeout=scaled(300))
    second = json.loads((job_dir / "report.json").read_text())
    assert done.returncode == 0 and second["ok"] and "next" not in second, done.stderr[-2000:]
    assert "torch" not in second["imported"] and "onnxruntime" in second["imported"]
    assert second["report"]["parity_rows"] == len(ids) and second["report"]["int8_label_agreement"] >= 0.9
    assert target.read_bytes() != b"the model in service" and (tmp_path / "model.int8.onnx").is_file()
    assert not list(tmp_path.glob(".model*"))  # no temporaries left next to the model


@pytest.mark.parametrize(
    "command,timeout",
    [
        ([sys.executable, "-c", "import sys; sys.exit(3)"], 60.0),
        ([sys.executable, "-c", "import time; time.sleep(60)"], 1.0),
    ],
    ids=["fails", "times-out"],
)
def test_a_failing_or_hanging_text_export_leaves_the_old_model_and_the_worker(
    text_job, tmp_path, command, timeout, caplog
):
    """A text-groups child that fails or hangs: the old model stays, and the background worker
    the daemon trains beside goes on to export the next model."""
    served, ids = text_job
    (tmp_path / "model.onnx").write_bytes(b"the model in service")
    writer = ServedModelWriter(tmp_path, "bbc", int8=False, timeout_s=timeout, child_command=command)
    started = time.monotonic()
    writer.submit(ServeJob(served, ids))
    assert writer.wait(60) and time.monotonic() - started < 30
    assert (tmp_path / "model.onnx").read_bytes() == b"the model in service"
    assert "previous model stays in service" in caplog.text
    writer.child_command, writer.timeout_s = [sys.executable, "-m", "export.child"], 300.0
    writer.submit(ServeJob(served, ids))
    writer.close(300)
    assert (tmp_path / "model.onnx").read_bytes() != b"the model in service"
    assert not list(tmp_path.glob(".export-*"))


def test_a_text_job_without_its_backbone_is_refused(text_job, tmp_path):
    served, ids = text_job
    from export.snapshot import read_npz, write_npz
    from export.text_groups_job import write_text_groups_job

    write_text_groups_job(tmp_path, served, ids, tmp_path / "m.onnx", False)
    meta, arrays = read_npz(tmp_path / "served.npz")
    meta["backbone"] = {"dir": str(tmp_path / "nowhere"), "sha256": meta["backbone"]["sha256"]}
    write_npz(tmp_path / "served.npz", meta, arrays)
    done = subprocess.run([sys.executable, "-m", "export.child", str(tmp_path)], capture_output=True, text=True)
    assert done.returncode == 2, done.stderr[-2000:]
    assert "malformed job" in json.loads((tmp_path / "report.json").read_text())["error"]
    assert not (tmp_path / "m.onnx").exists()
