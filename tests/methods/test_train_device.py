"""Where a learner trains (``train.device``, ``train.amp``; fclcore.device): the CPU path keeps
its numbers bit for bit, a learner placed elsewhere holds every trainable tensor there and
uploads host arrays, and a device this machine lacks is a one-line config error."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from support.builders import binary_rows, made_federation
from support.timescale import scaled

from fclcore import device as fcl_device
from fclcore.codec import Frame, Header, Kind, SparseTensor
from fclcore.config import ConfigError, from_dict
from fclcore.data import Dataset
from fclcore.learner import Learner
from fclcore.made_spec import init_params
from fclcore.schedule import TaskSchedule
from fclcore.schema import ClientConfig, FederationSpec
from methods import learner_for
from methods.confedmade.wire import entry_id, knowledge_key, knowledge_meta

D = 10
ROOT = Path(__file__).resolve().parents[2]
PLACEABLE = ["fedavg", "fedprox", "fedcurv", "confedmade", "fedweit-made", "fedweit-made-star"]


@pytest.fixture(autouse=True)
def _fresh_resolution():
    fcl_device.resolve.cache_clear()
    yield
    fcl_device.resolve.cache_clear()


def _fed(method: str) -> FederationSpec:
    return made_federation(method, num_tasks=2)


def _data(seed: int, n: int = 32) -> Dataset:
    return binary_rows(seed, D, n)


def _run(method: str, placement: tuple[torch.device, str] | None) -> tuple[list[dict], list]:
    """Four rounds over two tasks: every upload, then the evaluation."""
    learner = learner_for(_fed(method), D, 1)
    if placement is not None:
        learner.place(*placement)
    schedule = TaskSchedule.uniform(2, 2)
    params = init_params(learner.made, 0)
    uploads, data = [], [_data(1), _data(2)]
    for rnd in range(4):
        place = schedule.place(rnd)
        if place.task_start:
            learner.start_task(place.task, None)
        learner.load_global(params, rnd)
        learner.train_round(data[: place.task + 1], rnd, place)
        uploads.append(learner.upload(rnd, place))
    return uploads, learner.evaluate(data)


def _arrays(tensor) -> list:
    """A dense upload, or a sparse one's indices and values."""
    return [tensor.indices, tensor.values] if isinstance(tensor, SparseTensor) else [tensor]


@pytest.mark.parametrize("method", PLACEABLE)
def test_placed_on_the_cpu_is_bit_identical_to_unplaced(method):
    plain, placed = _run(method, None), _run(method, (torch.device("cpu"), "off"))
    assert plain[1] == placed[1]
    for a, b in zip(plain[0], placed[0]):
        assert a.keys() == b.keys()
        for name in a:
            for x, y in zip(_arrays(a[name]), _arrays(b[name]), strict=True):
                assert isinstance(y, np.ndarray)  # uploads leave as host arrays
                np.testing.assert_array_equal(x, y)


def test_bf16_autocast_changes_the_training_and_stays_finite():
    plain, bf16 = _run("fedavg", None), _run("fedavg", (torch.device("cpu"), "bf16"))
    assert all(np.isfinite(v) for v in bf16[1])
    assert any(not np.array_equal(plain[0][-1][n], bf16[0][-1][n]) for n in plain[0][-1])


def test_fp16_trains_with_a_grad_scaler():
    uploads, nll = _run("fedavg", (torch.device("cpu"), "fp16"))
    assert all(np.isfinite(v) for v in nll)
    assert all(np.isfinite(a).all() for a in uploads[-1].values())


def test_placed_on_another_device_every_trainable_tensor_goes_there():
    learner = learner_for(_fed("fedavg"), D, 1)
    learner.load_global(init_params(learner.made, 0), 0)
    learner.train_round([_data(1)], 0, TaskSchedule.uniform(2, 2).place(0))  # Adam's moments, to move
    learner.place(torch.device("meta"), "off")
    assert {p.device.type for p in learner.model.parameters()} == {"meta"}
    assert {b.device.type for b in learner.model.buffers()} == {"meta"}
    moments = [v for s in learner.optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    assert moments and {v.device.type for v in moments} == {"meta"}


def _knowledge(learner, task: int) -> Frame | None:
    """Two other devices' entries for each earlier task (random A-like values); None for task 0."""
    if task == 0:
        return None
    rng = np.random.default_rng(task)
    entries, tensors = [], {}
    for t in range(task):
        for other in ("other-0", "other-1"):
            eid = entry_id(other, t)
            entries.append((eid, other, t))
            for prefix, layer in learner.model.layers.items():
                a = (rng.standard_normal(tuple(layer.weight.shape)) * 0.1).astype(np.float32)
                tensors[knowledge_key(eid, f"{prefix}.weight")] = SparseTensor.from_dense(a)
    return Frame(Header(Kind.KNOWLEDGE, "t", 0, task, "c1", 1), knowledge_meta(task, entries), tensors)


def _decomposed_tensors(learner) -> dict[str, list[torch.Tensor]]:
    """Every tensor a decomposed learner trains with, by what it is."""
    layers = learner.model.layers.values()
    out = {
        "parameters": list(learner.model.parameters()),
        "buffers": list(learner.model.buffers()),
        "knowledge": [k for layer in layers for k in layer.knowledge],
        "settled": [t for layer in layers for t in layer.settled.values()],
        "anchors": [t for base, adaptive, bias, offsets in learner.anchor.values() for t in (base, *adaptive, *offsets)]
        + [a[2] for a in learner.anchor.values() if a[2] is not None],
        "moments": [v for s in learner.optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)],
        "workspace": [learner.work._flat],
    }
    assert all(out.values()), {k: len(v) for k, v in out.items()}
    return out


@pytest.mark.parametrize("method", ["confedmade", "fedweit-made"])
def test_a_decomposed_learner_placed_mid_task_moves_everything_it_trains_with(method):
    learner = learner_for(made_federation(method, num_tasks=3), D, 1)
    learner.load_global(init_params(learner.made, 0), 0)
    schedule = TaskSchedule.uniform(3, 2)
    for task in range(3):  # task 1 settled, task 2's stack built
        learner.start_task(task, _knowledge(learner, task))
        learner.train_round([_data(t) for t in range(task + 1)], 2 * task, schedule.place(2 * task))
    learner.place(torch.device("meta"), "off")
    for kind, tensors in _decomposed_tensors(learner).items():
        assert {t.device.type for t in tensors} == {"meta"}, kind
    held = {id(p) for group in learner.optimizer.param_groups for p in group["params"]}
    assert {id(p) for p in learner.optimizer.state} <= held  # the moments belong to the moved parameters


def test_confedmade_placed_before_its_first_task_builds_every_task_there():
    """The daemon's order: place right after building, then the tasks start on the device."""
    fed = made_federation("confedmade", num_tasks=3)
    fed = dataclasses.replace(fed, options={**fed.options, "order_per": "batch"})  # the hold over every step
    learner = learner_for(fed, D, 1)
    learner.place(torch.device("meta"), "off")
    for task in range(3):
        learner.start_task(task, _knowledge(learner, task))
        learner.load_global(init_params(learner.made, 0), 2 * task)  # host arrays merged on the device
    learner.optimizer.init_state()
    for kind, tensors in _decomposed_tensors(learner).items():
        assert {t.device.type for t in tensors} == {"meta"}, kind
    masks = {id(layer.mask) for layer in learner.model.layers.values()}
    assert learner.optimizer.held and {id(m) for m in learner.optimizer.held.values()} <= masks


def test_confedmade_refuses_fp16_whose_scaling_cannot_reach_its_backward_updates():
    learner = learner_for(_fed("confedmade"), D, 1)
    learner.place(torch.device("cpu"), "bf16")
    with pytest.raises(ValueError, match="fp16"):
        learner.place(torch.device("cpu"), "fp16")  # its updates happen inside the backward pass


class _CpuOnly(Learner):
    """A learner that cannot leave the CPU (as FedET's, FedSeIT's, FIL-VER's and NGFL's today)."""

    def __init__(self) -> None:  # only ``place`` is asked
        self.fed = type("Fed", (), {"method": "cpu-only"})()
        self.placed: tuple | None = None

    def place(self, device: torch.device, amp: str) -> None:
        if device.type != "cpu":
            raise ValueError(f"method cpu-only trains on the CPU only (asked: {device})")
        self.placed = (device, amp)


@pytest.mark.parametrize("has_cuda, expected", [(False, "cpu"), (True, "cuda")])
def test_auto_takes_cuda_when_torch_has_it(monkeypatch, has_cuda, expected):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: has_cuda)
    assert fcl_device.resolve("auto") == torch.device(expected)


def test_cuda_without_cuda_is_a_config_error(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match="cuda:1 asked for"):
        fcl_device.resolve("cuda:1")


def test_cuda_index_beyond_the_devices_is_a_config_error(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert fcl_device.resolve("cuda:0") == torch.device("cuda:0")
    with pytest.raises(ConfigError, match="sees 1 CUDA device"):
        fcl_device.resolve("cuda:1")


@pytest.mark.parametrize("bad", ["gpu", "cuda:x", "CUDA", "cuda:"])
def test_a_device_name_torch_does_not_take_is_a_config_error(bad):
    raw = {"client_id": "c0", "federation": "f", "data_dir": "/tmp", "train": {"device": bad}}
    with pytest.raises(ConfigError, match="device: expected auto, cpu, cuda or cuda:N"):
        from_dict(ClientConfig, raw, "client.yaml")


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_simulate_asked_for_cuda_without_it_exits_2_with_one_line(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "fcl_edge.cli", "simulate", "configs/scenarios/quickstart.yaml"]
        + ["--set", "device=cuda", "--out", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=scaled(300),
    )
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "train.device: cuda asked for" in lines[0], proc.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
@pytest.mark.parametrize(
    "setting, says",
    [
        ("train:\n  device: cuda\n", "train.device: cuda asked for"),
        ("serve:\n  providers: [FpgaExecutionProvider]\n", "unknown: ['FpgaExecutionProvider']"),
    ],
)
def test_fcl_client_refuses_what_this_machine_lacks_with_one_line(tmp_path, setting, says):
    (tmp_path / "data").mkdir()
    config = tmp_path / "client.yaml"
    config.write_text(
        f"client_id: c0\nfederation: f\ndata_dir: {tmp_path / 'data'}\nout_dir: {tmp_path / 'out'}\n"
        f"broker:\n  url: mqtt://127.0.0.1:1\n{setting}"
    )
    proc = subprocess.run(
        [sys.executable, "-m", "fcl_edge.cli", "client", "--config", str(config)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=scaled(300),
    )
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and says in lines[0], proc.stderr


def test_auto_leaves_a_method_that_cannot_move_on_the_cpu_and_says_so(monkeypatch, caplog):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    cuda = fcl_device.resolve("auto")
    learner = _CpuOnly()
    with caplog.at_level("WARNING", logger="fclcore.device"):
        fcl_device.place(learner, "auto", cuda, "bf16")
    assert [r.getMessage() for r in caplog.records if r.levelname == "WARNING"] == [
        "train.device auto: method cpu-only trains on the CPU only (asked: cuda); it trains on the CPU"
    ]
    assert learner.placed == (torch.device("cpu"), "bf16")
    with pytest.raises(ValueError, match="cpu-only trains on the CPU"):
        fcl_device.place(learner, "cuda", cuda, "off")  # asked for by name: refused


def test_auto_resolves_and_logs_once_per_process(monkeypatch, caplog):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with caplog.at_level("INFO", logger="fclcore.device"):
        assert fcl_device.resolve("auto") == fcl_device.resolve("auto") == torch.device("cpu")
    assert [r.getMessage() for r in caplog.records] == ["train.device auto: training on cpu"]
