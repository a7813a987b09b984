"""fclcore.optim: bit-for-bit torch.optim's steps and state, without importing torch._dynamo."""

from __future__ import annotations

import contextlib
import subprocess
import sys

import pytest
import torch
from support.timescale import scaled

from fclcore import optim

CASES = [
    ("Adam", {"lr": 1e-2}),
    ("Adam", {"lr": 1e-2, "fused": True}),
    ("Adam", {"lr": 1e-2, "weight_decay": 5e-4}),
    ("AdamW", {"lr": 2e-3, "weight_decay": 0.01}),
    ("SGD", {"lr": 0.05}),
    ("SGD", {"lr": 0.05, "momentum": 0.9}),
    ("SGD", {"lr": 0.05, "momentum": 0.9, "weight_decay": 1e-3, "nesterov": True}),
]


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(7, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))


def _train(model: torch.nn.Module, opt, steps: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(16, 7, generator=g)
        loss = model(x).pow(2).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()


@pytest.mark.parametrize("name,kwargs", CASES)
def test_steps_and_state_equal_torch_bit_for_bit(name, kwargs):
    ref, ours = _model(0), _model(0)
    ref_opt = getattr(torch.optim, name)(ref.parameters(), **kwargs)
    our_opt = getattr(optim, name)(ours.parameters(), **kwargs)
    _train(ref, ref_opt, 12, 1)
    _train(ours, our_opt, 12, 1)
    for a, b in zip(ref.parameters(), ours.parameters()):
        assert torch.equal(a, b)
    ref_state, our_state = ref_opt.state_dict()["state"], our_opt.state_dict()["state"]
    assert ref_state.keys() == our_state.keys()
    for i in ref_state:
        assert ref_state[i].keys() == our_state[i].keys()
        for k in ref_state[i]:
            assert torch.equal(torch.as_tensor(ref_state[i][k]), torch.as_tensor(our_state[i][k])), (i, k)


@pytest.mark.parametrize("name,kwargs", CASES)
def test_a_torch_checkpoint_continues_identically(name, kwargs):
    """State written by torch.optim, loaded into ours (and back), continues as torch would."""
    ref, ours = _model(2), _model(2)
    ref_opt = getattr(torch.optim, name)(ref.parameters(), **kwargs)
    _train(ref, ref_opt, 5, 3)
    ours.load_state_dict(ref.state_dict())
    our_opt = getattr(optim, name)(ours.parameters(), **kwargs)
    saved = ref_opt.state_dict()
    our_opt.load_state_dict(
        {
            "state": {i: {k: v.clone() for k, v in s.items()} for i, s in saved["state"].items()},
            "param_groups": saved["param_groups"],
        }
    )
    _train(ref, ref_opt, 4, 4)
    _train(ours, our_opt, 4, 4)
    for a, b in zip(ref.parameters(), ours.parameters()):
        assert torch.equal(a, b)
    back = getattr(torch.optim, name)(_model(9).parameters(), **kwargs)
    back.load_state_dict(our_opt.state_dict())  # and ours loads into torch's


def test_bad_state_is_refused():
    opt = optim.Adam(_model(0).parameters())
    with pytest.raises(ValueError, match="parameter groups"):
        opt.load_state_dict({"state": {}, "param_groups": []})
    with pytest.raises(ValueError, match="no group holds"):
        opt.load_state_dict({"state": {99: {}}, "param_groups": opt.state_dict()["param_groups"]})
    with pytest.raises(ValueError, match="empty parameter list"):
        optim.SGD([], lr=0.1)


def test_training_never_imports_torch_dynamo():
    code = (
        "import sys, torch\n"
        "from fclcore import optim\n"
        "m = torch.nn.Linear(4, 2)\n"
        "opts = (optim.Adam(m.parameters(), fused=True), optim.AdamW(m.parameters()),\n"
        "        optim.SGD(m.parameters(), momentum=0.9))\n"
        "for opt in opts:\n"
        "    m(torch.ones(3, 4)).sum().backward(); opt.step(); opt.zero_grad(); opt.load_state_dict(opt.state_dict())\n"
        "print('torch._dynamo' in sys.modules)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=scaled(120))
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False"


@pytest.mark.parametrize("name,kwargs", CASES)
def test_stepping_inside_the_backward_pass_equals_backward_then_step(name, kwargs):
    """Each parameter updated by its gradient hook, its gradient dropped: the same values and
    state as torch's backward() then step(), with no gradient left after the pass."""
    ref, ours = _model(3), _model(3)
    ref_opt = getattr(torch.optim, name)(ref.parameters(), **kwargs)
    our_opt = getattr(optim, name)(ours.parameters(), **kwargs)
    _train(ref, ref_opt, 9, 4)
    g = torch.Generator().manual_seed(4)
    for _ in range(9):
        x = torch.randn(16, 7, generator=g)
        our_opt.zero_grad(set_to_none=True)
        with our_opt.stepping_in_backward():
            ours(x).pow(2).mean().backward()
        assert all(p.grad is None for p in ours.parameters())
        our_opt.step()  # nothing left to do
    for a, b in zip(ref.parameters(), ours.parameters()):
        assert torch.equal(a, b)
    ref_state, our_state = ref_opt.state_dict()["state"], our_opt.state_dict()["state"]
    for i in ref_state:
        for k in ref_state[i]:
            assert torch.equal(torch.as_tensor(ref_state[i][k]), torch.as_tensor(our_state[i][k])), (i, k)
    ours(torch.ones(1, 7)).sum().backward()  # outside the block: no hook is left
    assert all(p.grad is not None for p in ours.parameters())


def test_a_parameter_updated_before_a_node_that_saved_it_raises():
    """A graph where a node reads a parameter after the parameter's gradient is complete:
    autograd refuses the stale value instead of computing with the updated one."""
    w = torch.nn.Parameter(torch.tensor([1.0, 2.0]))
    v = torch.nn.Parameter(torch.tensor([3.0, 4.0]))
    opt = optim.SGD([w, v], lr=0.1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        with opt.stepping_in_backward():
            (w.detach() * v * w).sum().backward()  # MulBackward saved w for v's gradient


@pytest.mark.parametrize("fused", [False, True])
def test_adam_state_made_before_the_first_step_changes_nothing(fused):
    ref, ours = _model(5), _model(5)
    ref_opt = optim.Adam(ref.parameters(), lr=1e-2, fused=fused)
    our_opt = optim.Adam(ours.parameters(), lr=1e-2, fused=fused)
    our_opt.init_state()
    assert all(float(s["step"]) == 0 and not s["exp_avg"].any() for s in our_opt.state.values())
    _train(ref, ref_opt, 6, 6)
    _train(ours, our_opt, 6, 6)
    for a, b in zip(ref.parameters(), ours.parameters()):
        assert torch.equal(a, b)


@pytest.mark.parametrize("in_backward", [False, True])
@pytest.mark.parametrize("fused", [False, True])
def test_adam_holds_the_entries_outside_a_mask_and_steps_the_rest_as_before(fused, in_backward):
    """``hold_outside``: where the mask is 0 a step changes neither the value nor the moments,
    which resume when the mask holds them again; inside, the values and moments of a plain
    step; a mask changed in place between steps is read anew."""
    ref, ours = _model(7), _model(7)
    ref_opt = optim.Adam(ref.parameters(), lr=1e-2, fused=fused)
    our_opt = optim.Adam(ours.parameters(), lr=1e-2, fused=fused)
    _train(ref, ref_opt, 3, 8)  # moments everywhere, so a step outside the mask would move them
    _train(ours, our_opt, 3, 8)
    weight = ours[0].weight
    mask = (torch.arange(weight.numel()).reshape(weight.shape) % 3 != 0).float()
    our_opt.hold_outside({weight: mask})
    g = torch.Generator().manual_seed(9)
    for step in range(3):
        if step == 2:
            mask.copy_(1 - mask)  # the other entries: held ones resume, stepped ones are held
        outside = mask == 0
        slots = our_opt.state[weight]
        before = [t.detach().clone() for t in (weight, slots["exp_avg"], slots["exp_avg_sq"])]
        x = torch.randn(16, 7, generator=g)
        for model, opt, backward_hooks in ((ref, ref_opt, False), (ours, our_opt, in_backward)):
            opt.zero_grad(set_to_none=True)
            with opt.stepping_in_backward() if backward_hooks else contextlib.nullcontext():
                model(x).pow(2).mean().backward()
            opt.step()
        state, ref_state = our_opt.state[weight], ref_opt.state[ref[0].weight]
        for i, (t, old, plain) in enumerate(
            zip(
                (weight, state["exp_avg"], state["exp_avg_sq"]),
                before,
                (ref[0].weight, ref_state["exp_avg"], ref_state["exp_avg_sq"]),
            )
        ):
            assert not torch.equal(plain[outside], old[outside])  # a plain step moves the entries outside
            assert torch.equal(t[outside], old[outside])  # held
            assert torch.equal(t[~outside], plain[~outside])  # a plain step
        for p, q in zip(ref.parameters(), ours.parameters()):
            if p is not ref[0].weight:  # the plain step of the parameters not held
                assert torch.equal(p, q)
        assert torch.equal(ref_state["step"], state["step"])  # one count per tensor
        with torch.no_grad():  # the reference steps on from the same values and moments
            ref[0].weight.copy_(weight)
            for k in ("exp_avg", "exp_avg_sq"):
                ref_state[k].copy_(state[k])


def test_adam_refuses_a_mask_it_cannot_apply():
    model = _model(0)
    opt = optim.Adam(model[0].parameters())
    with pytest.raises(ValueError, match="does not hold"):
        opt.hold_outside({model[2].weight: torch.ones_like(model[2].weight)})
    with pytest.raises(ValueError, match="shape"):
        opt.hold_outside({model[0].weight: torch.ones(3)})


@pytest.mark.parametrize("in_backward", [False, True])
@pytest.mark.parametrize("fused", [False, True])
def test_holding_outside_over_a_span_ends_where_a_hold_at_every_step_ends(fused, in_backward):
    """``holding_outside``: over a span whose mask stays the same, a masked forward and an
    elementwise penalty, the values and moments end bit for bit where ``hold_outside`` at every
    step leaves them (the weight's size a multiple of the fused kernel's vector width), and the
    moments are whole tensors of the parameter's shape again after the span; a second span
    with another mask resumes the held entries."""
    models = []
    for _ in range(2):
        torch.manual_seed(3)
        models.append(torch.nn.Linear(32, 64))
    opts = [optim.Adam(m.parameters(), lr=1e-2, fused=fused) for m in models]
    for model, opt in zip(models, opts):
        opt.init_state()
    g = torch.Generator().manual_seed(4)
    mask = torch.zeros(64 * 32)
    mask[torch.randperm(mask.numel(), generator=g)[: 32 * 31 + 37]] = 1.0  # inside: not a multiple of 8
    mask = mask.reshape(64, 32)
    opts[0].hold_outside({models[0].weight: mask})

    def steps(model, opt, seed):
        gen = torch.Generator().manual_seed(seed)
        for _ in range(12):
            x = torch.randn(8, 32, generator=gen)
            loss = (x @ (model.weight * mask).t() + model.bias).pow(2).mean() + 0.1 * model.weight.pow(2).sum()
            opt.zero_grad(set_to_none=True)
            with opt.stepping_in_backward() if in_backward else contextlib.nullcontext():
                loss.backward()
            opt.step()

    for span in range(2):
        if span == 1:
            mask.copy_(1 - mask)  # the other entries: held ones resume
        start = models[1].weight.detach().clone()
        steps(models[0], opts[0], 10 + span)
        with opts[1].holding_outside({models[1].weight: mask}):
            steps(models[1], opts[1], 10 + span)
        assert torch.equal(models[1].weight[mask == 0], start[mask == 0])  # held
        assert not torch.equal(models[1].weight[mask != 0], start[mask != 0])  # trained
        for p, q in zip(models[0].parameters(), models[1].parameters()):
            assert torch.equal(p, q)
            for key in ("exp_avg", "exp_avg_sq"):
                assert opts[1].state[q][key].shape == q.shape
                assert torch.equal(opts[0].state[p][key], opts[1].state[q][key])
            assert torch.equal(opts[0].state[p]["step"], opts[1].state[q]["step"])
    assert not opts[1].split and not opts[1].scratch  # nothing left of the span


def test_holding_outside_refuses_what_it_cannot_hold():
    model = _model(0)
    opt = optim.Adam(model[0].parameters())
    with pytest.raises(ValueError, match="does not hold"):
        with opt.holding_outside({model[2].weight: torch.ones_like(model[2].weight)}):
            pass
    with pytest.raises(ValueError, match="shape"):
        with opt.holding_outside({model[0].weight: torch.ones(3)}):
            pass
