"""The method contract's last step, shared by the contract test and the methods' runs through
Mosquitto: a finished run's device checkpoints rebuild their learners through the registry,
exactly, to the model each device served, which exports with ONNX parity."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

import numpy as np


def assert_restores_and_serves(out: Path, served_format: str, export_to: Path, exported: Sequence[str]) -> None:
    """Every device of the run in ``out`` restores exactly and serves ``served_format``; the
    ``exported`` devices' served models are exported into ``export_to`` (raises unless ONNX
    matches torch)."""
    from edge_client.state import learner_from_state, served_from_state
    from export.formats import export_served

    clients = sorted(p.name for p in (out / "clients").iterdir() if (p / "state").is_dir())
    assert clients and set(exported) <= set(clients), (clients, exported)
    for client in clients:
        state_dir = out / "clients" / client / "state"
        learner, state = learner_from_state(state_dir)  # rebuilt through the registry, as on a restart
        meta, arrays = learner.state()
        assert json.loads(json.dumps(meta)) == state.learner_meta
        assert set(arrays) == set(state.learner_arrays)
        for key, value in arrays.items():  # restored exactly: continuing from here is continuing the run
            np.testing.assert_array_equal(value, state.learner_arrays[key], err_msg=key)
        served = served_from_state(state_dir)
        assert served.format == served_format
        if client in exported:
            report = export_served(served, export_to / f"{client}.onnx")
            assert report["bytes"] > 0
        assert (out / "clients" / client / "model.onnx").exists()  # served by the daemon in the background
