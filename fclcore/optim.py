"""The optimisers a device trains with: torch's own update arithmetic, without torch.optim's
class machinery.

``torch.optim.Optimizer`` wraps ``add_param_group``, ``zero_grad``, ``state_dict`` and friends in
``torch._disable_dynamo``, whose first call imports ``torch._dynamo`` and with it sympy: about
75 MB of resident memory on every device that never compiles anything (measured in
``firmware_notes/memory.md``).  These classes keep the same parameter groups, state and
``state_dict`` layout and call torch's functional updates (``torch.optim.adam.adam``,
``torch.optim.sgd.sgd``) with the arguments ``torch.optim.Adam`` / ``AdamW`` / ``SGD`` pass,
so a step is bit-for-bit torch's (``tests/unit/test_optim.py`` checks it) and a checkpoint written
by either loads into the other.

Only what the learners use is here: no closures, no amsgrad, no sparse gradients, no
capturable or differentiable steps.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Iterable, Iterator, Mapping

import torch
from torch import Tensor
from torch.optim.adam import adam as _adam
from torch.optim.sgd import sgd as _sgd

from fclcore.procmem import release_free_memory

__all__ = ["Optimizer", "Adam", "AdamW", "SGD"]

VECTOR_PAD = 64  # entries: a multiple of every CPU vector width torch's kernels use


class Optimizer:
    """Parameter groups, per-parameter state and torch's ``state_dict`` layout."""

    def __init__(self, params: Iterable[Tensor] | Iterable[dict[str, Any]], defaults: dict[str, Any]) -> None:
        params = list(params)
        if not params:
            raise ValueError("optimizer got an empty parameter list")
        groups = [dict(g) for g in params] if isinstance(params[0], dict) else [{"params": params}]
        self.defaults = defaults
        self.param_groups: list[dict[str, Any]] = []
        seen: set[int] = set()
        for group in groups:
            group["params"] = list(group["params"])
            for p in group["params"]:
                if not isinstance(p, Tensor) or not p.is_leaf:
                    raise TypeError(f"optimizer can only optimize leaf tensors, got {type(p).__name__}")
                if id(p) in seen:
                    raise ValueError("some parameters appear in more than one parameter group")
                seen.add(id(p))
            for key, value in defaults.items():
                group.setdefault(key, value)
            self.param_groups.append(group)
        self.state: dict[Tensor, dict[str, Any]] = {}

    @torch.no_grad()
    def step(self) -> None:
        """One update of every parameter that has a gradient."""
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if params:
                self._step_group(group, params)

    def _step_group(self, group: dict[str, Any], params: list[Tensor]) -> None:
        raise NotImplementedError

    @contextlib.contextmanager
    def stepping_in_backward(self) -> Iterator[None]:
        """Inside, a backward pass updates each parameter as soon as it has accumulated the
        parameter's gradient, and drops that gradient: the gradients of a model are never all
        held at once.  Every parameter's update reads only its own gradient and state, so the
        values are bit-for-bit those of ``backward()`` then ``step()`` (``tests/unit/test_optim.py``).
        A node that saved a parameter for its own backward and runs after the update would
        make autograd raise (the saved tensor's version changed), never compute with new
        values.  The hooks go when the block ends."""
        handles = []
        for group in self.param_groups:
            for p in group["params"]:
                if p.requires_grad:
                    handles.append(p.register_post_accumulate_grad_hook(functools.partial(self._step_now, group)))
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()

    def _step_now(self, group: dict[str, Any], p: Tensor) -> None:
        with torch.no_grad():
            self._step_group(group, [p])
        p.grad = None

    def zero_grad(self, set_to_none: bool = True) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if set_to_none:
                    p.grad = None
                else:
                    p.grad.detach_()
                    p.grad.requires_grad_(False)
                    p.grad.zero_()

    def state_dict(self) -> dict[str, Any]:
        """``{"state": {index: {...}}, "param_groups": [{..., "params": [index, ...]}]}``, indices
        counting parameters over the groups in order, as ``torch.optim.Optimizer.state_dict``."""
        index: dict[int, int] = {}
        groups = []
        for group in self.param_groups:
            for p in group["params"]:
                index.setdefault(id(p), len(index))
            groups.append(
                {**{k: v for k, v in group.items() if k != "params"}, "params": [index[id(p)] for p in group["params"]]}
            )
        return {"state": {index[id(p)]: dict(s) for p, s in self.state.items()}, "param_groups": groups}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state written by ``state_dict`` (ours or torch's): hyperparameters per group,
        state tensors cast to their parameter's dtype and device (``step`` as the update wants it)."""
        groups = state_dict.get("param_groups")
        if not isinstance(groups, list) or len(groups) != len(self.param_groups):
            raise ValueError("loaded state dict has a different number of parameter groups")
        by_index: dict[int, Tensor] = {}
        for mine, saved in zip(self.param_groups, groups):
            if len(saved.get("params", ())) != len(mine["params"]):
                raise ValueError(
                    "loaded state dict contains a parameter group that doesn't match the size of optimizer's group"
                )
            by_index.update(zip(saved["params"], mine["params"]))
        state: dict[Tensor, dict[str, Any]] = {}
        for key, slots in state_dict.get("state", {}).items():
            if key not in by_index:
                raise ValueError(f"loaded state dict has state for parameter {key}, which no group holds")
            p = by_index[key]
            group = next(g for g in self.param_groups if any(q is p for q in g["params"]))
            state[p] = {name: self._cast(p, name, value, group) for name, value in slots.items()}
        for mine, saved in zip(self.param_groups, groups):
            mine.update({k: v for k, v in saved.items() if k != "params"})
        self.state = state

    @staticmethod
    def _cast(p: Tensor, name: str, value: Any, group: dict[str, Any]) -> Any:
        if not isinstance(value, Tensor):
            return value
        if name == "step":
            return value.to(dtype=torch.float32, device=p.device) if group.get("fused") else value
        return value.to(dtype=p.dtype, device=p.device) if p.is_floating_point() else value.to(device=p.device)


def _gather(flat: Tensor, index: Tensor) -> Tensor:
    """``flat[index]`` followed by zeros up to a multiple of ``VECTOR_PAD`` entries: torch's fused
    CPU kernels compute a tensor's last ``numel % vector width`` entries on a scalar path whose
    rounding differs, so a padded compact tensor takes the same path, and the same bits, as
    the whole one it came from (whose size is such a multiple for every weight of the MADEs here);
    the zero entries stay zero under Adam (no gradient, no moments)."""
    out = torch.zeros(-(-len(index) // VECTOR_PAD) * VECTOR_PAD, dtype=flat.dtype, device=flat.device)
    torch.index_select(flat, 0, index, out=out[: len(index)])
    return out


def _scalar_dtype() -> torch.dtype:
    return torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32


class Adam(Optimizer):
    """``torch.optim.Adam`` (L2 weight decay; ``decoupled_weight_decay=True`` is AdamW)."""

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        *,
        foreach: bool | None = None,
        fused: bool | None = None,
        decoupled_weight_decay: bool = False,
    ) -> None:
        if lr < 0 or eps < 0 or weight_decay < 0 or not (0 <= betas[0] < 1 and 0 <= betas[1] < 1):
            raise ValueError(f"invalid Adam settings: lr={lr}, betas={betas}, eps={eps}, weight_decay={weight_decay}")
        if fused and foreach:
            raise RuntimeError("`fused` and `foreach` cannot be `True` together.")
        defaults = dict(
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            amsgrad=False,
            maximize=False,
            foreach=foreach,
            capturable=False,
            differentiable=False,
            fused=fused,
            decoupled_weight_decay=decoupled_weight_decay,
        )
        super().__init__(params, defaults)
        self.held: dict[Tensor, Tensor] = {}  # parameter -> its entry mask (``hold_outside``)
        # parameter -> (flat indices inside its mask, outside mask, [(inside, outside) per moment])
        self.split: dict[Tensor, tuple[Tensor, Tensor, list[tuple[Tensor, Tensor]]]] = {}  # holding_outside
        self.scratch: tuple[Tensor, ...] = ()  # holding_outside: a step's gathered value and gradient

    def hold_outside(self, masks: Mapping[Tensor, Tensor]) -> None:
        """From now on a step leaves each entry of ``masks``' parameters where the mask is 0 as
        it was: its value and both its moments (the parameter's ``step`` still counts every
        step, as ``torch.optim.SparseAdam`` and lazy Adam do: one bias correction per tensor).
        The entries inside the mask get exactly the update of a plain step.  A mask (of the
        parameter's shape, 0/1 of any dtype) is read at each step, so a buffer changed in place
        between steps holds different entries each time.  An empty mapping holds nothing."""
        for p, mask in masks.items():
            self._check_hold(p, mask)
        self.held = dict(masks)

    @contextlib.contextmanager
    def holding_outside(self, masks: Mapping[Tensor, Tensor]) -> Iterator[None]:
        """For a span of steps over which ``masks`` do not change: ``hold_outside`` over each
        step of the span, with the moments split for the span instead of copied per step.  On
        entry each held parameter's moments are split into the entries inside its mask and
        those outside (compacted: together the memory they had); a step gathers the inside
        entries of the parameter and its gradient, takes torch's Adam step on them alone and
        writes them back; on exit the moments are whole again.  The entries outside are never
        touched, so the values and moments there are as on entry, and those inside take a plain
        step's update: bit for bit when the parameter's size is a multiple of the CPU's vector
        width (``_gather``; every weight of the Sequential MNIST MADE), else to the rounding of
        the few entries the fused kernel's scalar tail steps.  The masks (0/1, the parameter's
        shape) are read on entry.  A caller uses it only where a step inside a mask reads no
        entry outside it (a masked forward, elementwise penalties, no gradient clipping).  It
        costs two splits per span (``benchmarks/profile_confedmade_rounds.py``: a ConFedMADE
        round 1.2x the CPU of a plain one, against 1.9x for ``hold_outside``)."""
        groups = [self._check_hold(p, mask) for p, mask in masks.items()]
        if not all(p.is_contiguous() for p in masks):
            raise ValueError("holding_outside: a parameter that is not contiguous")
        spans: dict[int, tuple[Tensor, Tensor]] = {}  # id(mask) -> (outside, flat indices inside)
        with torch.no_grad():
            for (p, mask), group in zip(masks.items(), groups):
                if id(mask) not in spans:
                    inside = mask.reshape(-1) != 0
                    spans[id(mask)] = (~inside, inside.nonzero().reshape(-1))
                outside, index = spans[id(mask)]
                state = self._state(group, p)  # made now if no step made it yet: zeros are held too
                split = []
                for key in ("exp_avg", "exp_avg_sq"):
                    whole = state.pop(key).reshape(-1)  # the last reference: freed once split
                    split.append((_gather(whole, index), whole.masked_select(outside)))
                    del whole
                self.split[p] = (index, outside, split)
                release_free_memory()  # the whole moments' memory back now: the next split reuses it
            size = max((len(m) for _, _, ((m, _), _) in self.split.values()), default=0)
            device = next(iter(masks)).device if masks else None  # the parameters' (one device per learner)
            self.scratch = (torch.zeros(size, device=device), torch.zeros(size, device=device))  # a step's value, grad
        try:
            yield
        finally:
            with torch.no_grad():
                for p in list(self.split):
                    index, outside, split = self.split.pop(p)
                    for key, (inner, outer) in zip(("exp_avg", "exp_avg_sq"), split):
                        whole = torch.empty(p.numel(), dtype=inner.dtype, device=inner.device)
                        whole.index_copy_(0, index, inner[: len(index)])
                        whole.masked_scatter_(outside, outer)
                        self.state[p][key] = whole.reshape(p.shape)
                    del split, inner, outer
                    release_free_memory()  # as on entry: the parts' memory back before the next merge
                self.scratch = ()

    def _check_hold(self, p: Tensor, mask: Tensor) -> dict[str, Any]:
        """The parameter group holding ``p``, once ``mask`` fits it."""
        group = next((g for g in self.param_groups if any(p is q for q in g["params"])), None)
        if group is None:
            raise ValueError("hold_outside: a parameter this optimizer does not hold")
        if tuple(mask.shape) != tuple(p.shape):
            raise ValueError(f"hold_outside: mask of shape {tuple(mask.shape)} for a parameter {tuple(p.shape)}")
        return group

    def _state(self, group: dict[str, Any], p: Tensor) -> dict[str, Any]:
        """``p``'s state, created as torch's first step creates it (step 0, zero moments)."""
        state = self.state.setdefault(p, {})
        if not state:
            state["step"] = (
                torch.zeros((), dtype=torch.float32, device=p.device)
                if group["fused"]
                else torch.tensor(0.0, dtype=_scalar_dtype())
            )
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        return state

    def init_state(self) -> None:
        """Create every parameter's state now, as its first step would (the same values): the
        moments are then allocated when the caller chooses, not in the middle of a step among
        its temporaries.  A parameter that never gets a gradient keeps a state at step 0."""
        for group in self.param_groups:
            for p in group["params"]:
                self._state(group, p)

    def _step_group(self, group: dict[str, Any], group_params: list[Tensor]) -> None:
        """``group_params``: the group's parameters with a gradient, in the group's order."""
        params, grads, exp_avgs, exp_avg_sqs, steps = [], [], [], [], []
        for p in group_params:
            if p.grad.is_sparse:
                raise RuntimeError("Adam does not support sparse gradients")
            state = self._state(group, p)
            if p in self.split:  # holding_outside: stepped alone, below
                continue
            params.append(p)
            grads.append(p.grad)
            exp_avgs.append(state["exp_avg"])
            exp_avg_sqs.append(state["exp_avg_sq"])
            steps.append(state["step"])
        held = self._save_held(params) if self.held else []
        if params:
            self._adam(group, params, grads, exp_avgs, exp_avg_sqs, steps)
        for tensors, mask, before in held:  # the held entries back as they were before the step
            inside = mask != 0
            for t, b in zip(tensors, before):
                torch.where(inside, t, b, out=t)
        for p in group_params:
            if p in self.split:
                self._step_inside(group, p)

    def _step_inside(self, group: dict[str, Any], p: Tensor) -> None:
        """``holding_outside``: Adam's step on the entries of ``p`` inside its mask alone,
        gathered into the span's scratch (zero-padded: ``VECTOR_PAD``) and written back."""
        index, _, ((m, _), (v, _)) = self.split[p]
        n = len(index)
        value, grad = (t[: len(m)] for t in self.scratch)
        grad[n:].zero_()  # the padding: no gradient, so its zero moments stay zero
        torch.index_select(p.reshape(-1), 0, index, out=value[:n])
        torch.index_select(p.grad.reshape(-1), 0, index, out=grad[:n])
        self._adam(group, [value], [grad], [m], [v], [self.state[p]["step"]])
        p.reshape(-1).index_copy_(0, index, value[:n])

    @staticmethod
    def _adam(group: dict[str, Any], params, grads, exp_avgs, exp_avg_sqs, steps) -> None:
        """torch's functional Adam with the arguments ``torch.optim.Adam`` passes."""
        beta1, beta2 = group["betas"]
        _adam(
            params,
            grads,
            exp_avgs,
            exp_avg_sqs,
            [],
            steps,
            amsgrad=False,
            has_complex=any(torch.is_complex(p) for p in params),
            beta1=beta1,
            beta2=beta2,
            lr=group["lr"],
            weight_decay=group["weight_decay"],
            eps=group["eps"],
            maximize=False,
            foreach=group["foreach"],
            capturable=False,
            differentiable=False,
            fused=group["fused"],
            grad_scale=None,
            found_inf=None,
            decoupled_weight_decay=group["decoupled_weight_decay"],
        )

    def _save_held(self, params: list[Tensor]) -> list[tuple[tuple[Tensor, ...], Tensor, list[Tensor]]]:
        """For each of ``params`` held by ``hold_outside``: (parameter and moments, its mask, copies
        of them), taken before a step so the step's changes outside the mask can be undone.  Whole
        copies and one ``where`` pass each: compacting the held entries (``masked_select``, then
        ``masked_scatter_``) made a training round 3.1x as long in CPU, these copies 1.9x
        (``benchmarks/profile_confedmade_rounds.py``)."""
        out = []
        for p in params:
            mask = self.held.get(p)
            if mask is not None:
                state = self.state[p]
                tensors = (p, state["exp_avg"], state["exp_avg_sq"])
                out.append((tensors, mask, [t.clone() for t in tensors]))
        return out


class AdamW(Adam):
    """``torch.optim.AdamW``: Adam with decoupled weight decay (default 0.01)."""

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        *,
        foreach: bool | None = None,
        fused: bool | None = None,
    ) -> None:
        super().__init__(
            params, lr, betas, eps, weight_decay, foreach=foreach, fused=fused, decoupled_weight_decay=True
        )


class SGD(Optimizer):
    """``torch.optim.SGD`` (momentum, dampening, L2 weight decay, Nesterov)."""

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        momentum: float = 0.0,
        dampening: float = 0.0,
        weight_decay: float = 0.0,
        nesterov: bool = False,
        *,
        foreach: bool | None = None,
        fused: bool | None = None,
    ) -> None:
        if lr < 0 or momentum < 0 or weight_decay < 0:
            raise ValueError(f"invalid SGD settings: lr={lr}, momentum={momentum}, weight_decay={weight_decay}")
        if nesterov and (momentum <= 0 or dampening != 0):
            raise ValueError("Nesterov momentum requires a momentum and zero dampening")
        defaults = dict(
            lr=lr,
            momentum=momentum,
            dampening=dampening,
            weight_decay=weight_decay,
            nesterov=nesterov,
            maximize=False,
            foreach=foreach,
            differentiable=False,
            fused=fused,
        )
        super().__init__(params, defaults)

    def _step_group(self, group: dict[str, Any], group_params: list[Tensor]) -> None:
        """``group_params``: the group's parameters with a gradient, in the group's order."""
        params, grads, buffers = [], [], []
        has_sparse = False
        for p in group_params:
            params.append(p)
            grads.append(p.grad)
            has_sparse |= p.grad.is_sparse
            if group["momentum"] != 0:
                buffers.append(self.state.get(p, {}).get("momentum_buffer"))
        _sgd(
            params,
            grads,
            buffers,
            weight_decay=group["weight_decay"],
            momentum=group["momentum"],
            lr=group["lr"],
            dampening=group["dampening"],
            nesterov=group["nesterov"],
            maximize=False,
            has_sparse_grad=has_sparse,
            foreach=group["foreach"],
            fused=group["fused"],
            grad_scale=None,
            found_inf=None,
        )
        if group["momentum"] != 0:
            for p, buffer in zip(params, buffers):
                self.state.setdefault(p, {})["momentum_buffer"] = buffer
