"""Write docs/results.md from the result files under benchmarks/results/.

The README keeps what a first hour needs; every measured table lives here, copied from the
file its benchmark wrote, so the page cannot drift from the numbers (tests/unit/
test_results_page.py fails when docs/results.md differs from what this script writes).
After a benchmark updates its result file:

    python benchmarks/results_page.py            # rewrite docs/results.md
    python benchmarks/results_page.py --check    # exit 1 if docs/results.md is stale
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks/results"
PAGE = ROOT / "docs/results.md"

# (section, result file, what it measures); the order of the page.  Files not listed here are
# superseded or intermediate runs (SUPERSEDED says which), kept for their history.
SECTIONS: list[tuple[str, str, str]] = [
    ("Learning", "seqmnist.md", "ConFedMADE and its baselines on the full Sequential MNIST protocol."),
    ("Learning", "seqmnist_r10.md", "Every MADE method at 10 rounds per task, and ConFedMADE's communication steps."),
    ("Learning", "fedet_bbc_daemons_proto.md", "FedET with prototype-initialised heads, through the services."),
    ("Learning", "fedet_bbc_daemons.md", "FedET against its baselines, through the services."),
    ("Learning", "fedseit_bbc.md", "FedSeIT against FedWeIT-CNN, with SIT and DLS."),
    ("Learning", "filver.md", "FIL-VER in four enrollment scenarios."),
    ("Learning", "ngfl.md", "NGFL's settings in two regimes."),
    ("Bytes on the wire", "wire_all.md", "Every method, compression off and its defaults, side by side (issue 40)."),
    ("Bytes on the wire", "wire_dtypes.md", "float32, float16 and int8 values on one scenario."),
    ("Bytes on the wire", "fedseit_wire.md", "FedSeIT's compression stages on a small configuration (docs/wire.md)."),
    ("Bytes on the wire", "fedseit_bbc_defaults_int8.md", "FedSeIT's compression stages on bbc_fedseit, int8 values."),
    (
        "Bytes on the wire",
        "filver_wire_encoder.md",
        "FIL-VER's phase-0 encoder at its own density: bytes, accuracy and re-identification (docs/filver.md).",
    ),
    (
        "Bytes on the wire",
        "filver_wire.md",
        "FIL-VER compressed both ways, the encoder at the classifier's density (before encoder_density).",
    ),
    ("Bytes on the wire", "filver_wire_curve.md", "FIL-VER: density and dtype against accuracy and re-identification."),
    ("Devices", "device_budget.md", "Peak memory, CPU per round and bytes per day on the device, per scenario."),
    ("Devices", "device_memory_profile.md", "Device memory phase by phase."),
    ("Devices", "fedet_daemon.md", "FedET through the client daemon: CPU per round, memory, upload."),
    ("Serving", "inference.md", "The exported MADE: onnxruntime against torch."),
    ("Serving", "fedet_export.md", "FedET's export: torch, ONNX fp32 and int8."),
    ("Services", "aggregate.md", "Folding N sparse updates in one process."),
    ("Services", "fleet.md", "One round of many synthetic devices over Mosquitto."),
    ("Services", "chaos.md", "Seeded fault schedules over a persistent Mosquitto."),
    ("Services", "chaos-clock.md", "Wall-clock steps of +/-1 h on a device and -2 min / +1 h on the aggregator."),
    ("Services", "chaos_issue42.md", "The end of a run, forged run ids, late devices, retained garbage (issue 42)."),
    ("Services", "chaos_issue42_all.md", "One schedule of every fault kind, on a heavily loaded machine."),
    ("Services", "bad_inputs.md", "The bad-input table: seconds per row."),
    ("Services", "async.md", "Synchronous against buffered rounds, devices online 30% of the time (issue 37)."),
]
SUPERSEDED = {
    "aggregate_numpy.md": "aggregate.md with the NumPy fold only",
    "device_memory_profile_inference_mode.md": "device_memory_profile.md before inference mode",
    "fedet_bbc.md": "the in-process harness, before fedet_bbc_daemons.md",
    "fedet_bbc_seeds.md": "the in-process harness, per seed",
    "fedet_bbc_seeds23.md": "the in-process harness, seeds 2 and 3",
    "fedet_bbc_smoke.md": "a smoke run of the FedET benchmark",
    "fedet_cpu_seeds_after.md": "FedET's CPU switches on 4 seeds (README of methods/fedet)",
    "fedet_proto.md": "the in-process harness with proto_init",
    "method_packages.md": "a refactoring's same-numbers check",
    "fedseit_wire_offint8.md": "a row of fedseit_wire.md's table (docs/wire.md, FedSeIT)",
    "fedseit_bbc_defaults_int8_s2.md": "seed 2 of fedseit_bbc_defaults_int8.md (docs/wire.md, FedSeIT)",
    "fedseit_bbc_probe_downoff.md": "a one-setting probe in docs/wire.md's FedSeIT table",
    "fedseit_bbc_probe_kb0.3.md": "a one-setting probe in docs/wire.md's FedSeIT table",
    "fedseit_bbc_probe_kb1.md": "a one-setting probe in docs/wire.md's FedSeIT table",
    "fedseit_bbc_probe_keep1.md": "a one-setting probe in docs/wire.md's FedSeIT table",
    "fedseit_bbc_probe_offint8.md": "the int8-only row of docs/wire.md's FedSeIT table (now the default)",
    "fedseit_bbc_probe_offint8_s2.md": "seed 2 of the int8-only row (docs/wire.md, FedSeIT)",
}


def render() -> str:
    lines = [
        "# Results",
        "",
        "Every table below is copied from the result file its benchmark wrote under",
        "`benchmarks/results/` (each says its machine and command); `python benchmarks/results_page.py`",
        "writes this page and a test fails when it is stale. Do not edit it by hand.",
        "",
    ]
    section = None
    for title, name, what in SECTIONS:
        if title != section:
            lines += [f"## {title}", ""]
            section = title
        body = (RESULTS / name).read_text().strip()
        body = re.sub(r"^(#+) ", lambda m: "#" * min(len(m.group(1)) + 2, 6) + " ", body, flags=re.M)
        if not body.startswith("###"):
            body = f"### {name[:-3].replace('_', ' ')}\n\n{body}"
        lines += [body, "", f"*{what}* Source: `benchmarks/results/{name}`.", ""]
    return "\n".join(lines).rstrip() + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if docs/results.md is stale")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        stale = not PAGE.exists() or PAGE.read_text() != text
        if stale:
            print("docs/results.md is stale: run python benchmarks/results_page.py", file=sys.stderr)
        return int(stale)
    PAGE.write_text(text)
    print(f"wrote {PAGE.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
