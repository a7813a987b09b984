"""The bytes no round row counts, in the run directory: what ``fcl simulate`` adds once every
participant has exited, from each device's own meter (``clients/<id>/wire.json``).

The aggregator's ``round_client`` rows count each round's update, announcement, the device's
own frames and the sync frames its update reports; a device also sends statuses, the final
EVAL and re-sent updates, and receives the aggregator's statuses, the FINISH, requests,
announcements seen again and sync frames no update reported.  The device attributes each of
those by kind (``edge_client.ledger``); this module writes them as one ``run_level`` line per
device in ``metrics.jsonl`` and as ``bytes.run_level`` in ``summary.json``, with what is left
over per device (``unattributed``: the meter minus the rows minus the run-level bytes, 0 when
every byte is accounted for; docs/metrics.md).
"""

from __future__ import annotations

import json
import os
from collections import Counter, defaultdict
from pathlib import Path

WAYS = ("up", "down")


def attribute(out_dir: Path) -> dict | None:
    """Add the run-level bytes to ``out_dir``'s run log and summary; the block written, or None
    when there is no summary or no device meter that attributes its bytes."""
    summary_path = out_dir / "summary.json"
    wires = {p.parent.name: json.loads(p.read_text()) for p in sorted((out_dir / "clients").glob("*/wire.json"))}
    wires = {cid: w for cid, w in wires.items() if "run_level" in w}  # a daemon from before the ledger: none
    if not summary_path.exists() or not wires:
        return None
    rows = _row_totals(out_dir / "metrics.jsonl")
    per_client = {cid: _device(wire, rows[cid]) for cid, wire in wires.items()}
    with open(out_dir / "metrics.jsonl", "a", encoding="utf-8") as log:
        for cid, entry in per_client.items():
            fields = {"client": cid, **{f"bytes_{d}": sum(entry[d].values()) for d in WAYS}, **entry}
            log.write(json.dumps({"event": "run_level", **fields}) + "\n")
    block = _totals(per_client, rows)
    summary = json.loads(summary_path.read_text())
    summary["bytes"]["run_level"] = block
    tmp = summary_path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(summary, indent=2), encoding="utf-8")
    os.replace(tmp, summary_path)
    return block


def _row_totals(path: Path) -> dict[str, dict[str, int]]:
    """Per device, the bytes up and down its ``round_client`` rows count."""
    rows: dict[str, dict[str, int]] = defaultdict(lambda: dict.fromkeys(WAYS, 0))
    for line in path.read_text(encoding="utf-8").splitlines():
        event = json.loads(line)
        if event.get("event") == "round_client":
            for d in WAYS:
                rows[event["client"]][d] += event[f"bytes_{d}"]
    return rows


def _device(wire: dict, rows: dict[str, int]) -> dict:
    """One device's run-level bytes by kind, its meter, and what neither accounts for."""
    run = wire["run_level"]
    return {
        "up": run["up"],
        "down": run["down"],
        "meter": {d: wire[d]["bytes"] for d in WAYS},
        "unattributed": {d: wire[d]["bytes"] - rows[d] - sum(run[d].values()) for d in WAYS},
    }


def _totals(per_client: dict[str, dict], rows: dict[str, dict[str, int]]) -> dict:
    """The block of ``summary.json``: by kind summed over devices, and the run-level share of all
    the bytes those devices metered (rows + run-level)."""
    kinds = {d: Counter() for d in WAYS}
    for entry in per_client.values():
        for d in WAYS:
            kinds[d].update(entry[d])
    run = sum(sum(k.values()) for k in kinds.values())
    counted = sum(rows[cid][d] for cid in per_client for d in WAYS)
    return {
        "source": "each device's meter (clients/<id>/wire.json), less its round rows",
        **{f"{d}_by_kind": dict(sorted(kinds[d].items())) for d in WAYS},
        **{f"{d}_total": sum(kinds[d].values()) for d in WAYS},
        "share": round(run / (run + counted), 4) if run + counted else None,
        "unattributed": {d: sum(e["unattributed"][d] for e in per_client.values()) for d in WAYS},
        "per_client": per_client,
    }
