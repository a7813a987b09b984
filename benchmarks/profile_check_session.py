"""What onnxruntime's session options do to the memory of a text-tasks export's check (issue 40).

Loads an exported text-tasks ``model.onnx`` with the check's options (``export.runtime
.session_options``: CPU arena and memory patterns off, one intra-op thread) and with each
variant, one fresh process per variant, runs 64 seeded random token rows in chunks of 32 and
prints RSS over the process before the load (after, and the peak) and how far each variant's
logits are from the default options'.  Linux only.

    python benchmarks/profile_check_session.py RUN/clients/client-0/model.onnx
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

VARIANTS = ["default", "no-optimisation", "basic-optimisation", "no-prepacking"]


def _mb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) // 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def one(path: str, variant: str, out: str) -> None:
    import numpy as np
    import onnxruntime as ort

    from export.runtime import session_options

    so = session_options(1)
    if variant == "no-optimisation":
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    elif variant == "basic-optimisation":
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    elif variant == "no-prepacking":
        so.add_session_config_entry("session.disable_prepacking", "1")
    ids = np.random.default_rng(0).integers(1000, 20000, (64, 128)).astype(np.int64)
    mask = np.ones_like(ids)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = _mb("VmRSS")
    session = ort.InferenceSession(path, sess_options=so, providers=["CPUExecutionProvider"])
    loaded = _mb("VmRSS") - before
    feeds = [{"input_ids": ids[s : s + 32], "attention_mask": mask[s : s + 32]} for s in (0, 32)]
    logits = np.concatenate([session.run(["logits"], f)[0] for f in feeds])
    after, peak = _mb("VmRSS") - before, _mb("VmHWM") - before
    print(f"{variant:20s} loaded +{loaded} MB, after the run +{after} MB, peak +{peak} MB")
    np.save(out, logits)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", help="a text-tasks model.onnx")
    parser.add_argument("--one", nargs=2, metavar=("VARIANT", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        return one(args.model, *args.one)
    import numpy as np

    with tempfile.TemporaryDirectory() as tmp:
        for v in VARIANTS:
            subprocess.run([sys.executable, __file__, args.model, "--one", v, f"{tmp}/{v}.npy"], check=True)
        ref = np.load(f"{tmp}/default.npy")
        finite = np.isfinite(ref)
        for v in VARIANTS[1:]:
            got = np.load(f"{tmp}/{v}.npy")
            print(f"{v:20s} max |logit - default's| {float(np.abs(got[finite] - ref[finite]).max()):.3g}")


if __name__ == "__main__":
    main()
