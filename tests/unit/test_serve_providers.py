"""``serve.providers``: the served MADE model runs on the first listed onnxruntime provider the
installed onnxruntime has, says which, and an unknown name is a config error."""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
from support.timescale import scaled

from export import providers
from export.onnx_made import ServedModel, export_served_model
from export.runtime import MadeRuntime
from fclcore.config import ConfigError, from_dict, load_config
from fclcore.made_spec import MadeConfig, init_params
from fclcore.schema import ClientConfig

ROOT = Path(__file__).resolve().parents[2]
JETSON = ["TensorrtExecutionProvider", "CUDAExecutionProvider", "CPUExecutionProvider"]
CFG = MadeConfig(12, (24,), direct=True, natural_order=False, num_orders=2, mask_seed=11)


@pytest.fixture(autouse=True)
def _fresh_choice():
    providers.usable.cache_clear()
    yield
    providers.usable.cache_clear()


@pytest.fixture
def model_file(tmp_path: Path) -> Path:
    path = tmp_path / "model.onnx"
    export_served_model(ServedModel(CFG, init_params(CFG, 0), 1, "fedavg", 0, "value>7"), path)
    return path


def _lacking(names: list[str]) -> list[str]:
    return [n for n in names if n not in ort.get_available_providers()]


@pytest.mark.skipif(not _lacking(JETSON[:2]), reason="this onnxruntime has TensorRT and CUDA")
def test_unavailable_providers_fall_back_to_the_next_and_say_so(model_file, caplog):
    with caplog.at_level(logging.INFO, logger="export.providers"):
        rt = MadeRuntime.load(model_file, providers=JETSON)
    first = next(n for n in JETSON if n in ort.get_available_providers())
    assert rt.provider == first
    said = [r.getMessage() for r in caplog.records if r.name == "export.providers"]
    assert said == [f"serving with {first} (this onnxruntime {ort.__version__} lacks {', '.join(_lacking(JETSON))})"]
    x = (np.random.default_rng(0).random((5, 12)) < 0.5).astype(np.float32)
    np.testing.assert_array_equal(rt.log_likelihood(x), MadeRuntime.load(model_file).log_likelihood(x))


def test_the_default_is_the_cpu(model_file):
    assert MadeRuntime.load(model_file).provider == "CPUExecutionProvider"


@pytest.mark.parametrize("names", [["FpgaExecutionProvider"], ["CPUExecutionProvider"] * 2, []])
def test_an_unknown_or_repeated_provider_is_a_config_error(names):
    raw = {"client_id": "c0", "federation": "f", "data_dir": "/tmp", "serve": {"providers": names}}
    with pytest.raises(ConfigError, match="providers: expected distinct onnxruntime provider names"):
        from_dict(ClientConfig, raw, "client.yaml")


def test_the_jetson_config_lists_tensorrt_cuda_cpu(monkeypatch):
    monkeypatch.setenv("FCL_MQTT_PASSWORD", "s3cret")
    cfg = load_config(ClientConfig, ROOT / "configs/services/client-jetson.yaml")
    assert cfg.serve.providers == JETSON
    assert (cfg.train.device, cfg.train.amp) == ("auto", "off")


def test_fcl_infer_takes_providers_and_refuses_an_unknown_one(model_file):
    def infer(names: str) -> subprocess.CompletedProcess:
        cmd = [sys.executable, "-m", "export.cli", "infer", str(model_file), "--op", "sample", "--n", "2"]
        return subprocess.run(
            [*cmd, "--providers", names], cwd=ROOT, capture_output=True, text=True, timeout=scaled(120)
        )

    ok = infer(",".join(JETSON))
    assert ok.returncode == 0, ok.stderr
    bad = infer("FpgaExecutionProvider,CPUExecutionProvider")
    assert bad.returncode == 2
    assert len(bad.stderr.strip().splitlines()) == 1 and "FpgaExecutionProvider" in bad.stderr
