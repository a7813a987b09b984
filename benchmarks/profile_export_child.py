"""Peak RSS of each process of FedET's export child (issue 20): the torch half and the
onnxruntime half (``python -m export.child JOB_DIR`` then ``--finish JOB_DIR``), on the real
all-MiniLM-L6-v2 with two Enhancer groups of seeded random weights, int8 on, as the daemon's
``edge_client.serving`` runs them.

    python benchmarks/profile_export_child.py
    python benchmarks/profile_export_child.py --rows 48 --classes 5

Prints one JSON document: each half's ``peak_rss_mb`` (its own ``ru_maxrss``), the frameworks
it imported and its wall seconds, the sha256 of the published fp32 and int8 files (the
inputs are seeded: the same code must publish the same bytes), and the load average before
and after.  Nothing is written
under ``benchmarks/results``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def file_sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def write_job(job_dir: Path, target: Path, rows: int, classes: int, max_length: int) -> None:
    """A text-groups job for ``target``: MiniLM from its package, groups of seeded weights."""
    import torch

    from export.text_groups_job import write_text_groups_job
    from fclbases.minilm.backbone import FrozenBackbone, default_minilm_dir, load_minilm
    from fclbases.minilm.enhancer import EnhancerConfig, EnhancerGroup
    from fclcore.served import TextGroupsServed

    source = default_minilm_dir()
    backbone = FrozenBackbone(load_minilm(source))
    cfg = EnhancerConfig(hidden=backbone.cfg.hidden, bottleneck=64, blocks=backbone.cfg.layers)
    split = classes // 2
    groups = [EnhancerGroup(cfg, range(split), seed=1), EnhancerGroup(cfg, range(split, classes), seed=2)]
    with torch.no_grad():
        for g in groups:  # not the identity: every Enhancer changes the pass
            for e in g.enhancers:
                e.up.weight.normal_(0.0, 0.02, generator=torch.Generator().manual_seed(3))
    rng = np.random.default_rng(0)
    prototypes = {c: rng.standard_normal(cfg.hidden).astype(np.float32) for c in range(classes)}
    group_of = {c: int(c >= split) for c in range(classes)}
    ids = np.zeros((rows, max_length), np.int64)
    for r in range(rows):
        n = int(rng.integers(8, max_length + 1))
        ids[r, :n] = np.concatenate([[101], rng.integers(1000, 29000, n - 2), [102]])
    served = TextGroupsServed(
        backbone,
        groups,
        prototypes,
        group_of,
        task=1,
        max_length=max_length,
        method="fedet",
        backbone_source=str(source),
    )
    write_text_groups_job(job_dir, served, ids, target, True)


def run_half(job_dir: Path, *flags: str) -> dict:
    env = dict(
        os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    )
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "export.child", *flags, str(job_dir)], capture_output=True, text=True, env=env
    )
    doc = json.loads((job_dir / "report.json").read_text())
    if done.returncode != 0 or not doc.get("ok"):
        raise SystemExit(f"export.child {' '.join(flags)} failed ({done.returncode}): {doc} {done.stderr[-2000:]}")
    (job_dir / "report.json").unlink()
    return {
        "peak_rss_mb": doc["peak_rss_mb"],
        "imported": doc.get("imported"),
        "wall_s": round(time.monotonic() - started, 1),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=32, help="parity rows")
    parser.add_argument("--classes", type=int, default=5)
    parser.add_argument("--max-length", type=int, default=64)
    args = parser.parse_args(argv)
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="fcl-export-child-") as tmp:
        job_dir, target = Path(tmp) / "job", Path(tmp) / "model.onnx"
        job_dir.mkdir()
        write_job(job_dir, target, args.rows, args.classes, args.max_length)
        first = run_half(job_dir)
        second = run_half(job_dir, "--finish")
        published = target.is_file() and target.with_name("model.int8.onnx").is_file()
        sha256 = {f.name: file_sha256(f) for f in (target, target.with_name("model.int8.onnx")) if f.is_file()}
    print(
        json.dumps(
            {
                "command": "python benchmarks/profile_export_child.py " + " ".join(argv or sys.argv[1:]),
                "torch_half": first,
                "onnxruntime_half": second,
                "published": published,
                "sha256": sha256,
                "load_before": round(load_before, 2),
                "load_after": round(os.getloadavg()[0], 2),
            },
            indent=2,
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
