"""Torch-free specification of a MADE model (Germain et al., 2015).

Everything that defines *which* MADE is trained lives here, in plain numpy:
the configuration, the input orders, the hidden-unit degrees, the masks, the
names/shapes of the trainable tensors and their initial values. The aggregator
imports this module without torch to build the initial global model and to
reason about parameters, and the clients' torch model (``fclcore.models.made``)
derives its masks from the very same functions. Because masks are a pure
function of ``(MadeConfig, order_index)``, only the config (including
``mask_seed``) travels over MQTT; masks are never sent. This module must never
import torch.

Degree conventions (1-based, as in the paper):

* input dimension ``order[p]`` has degree ``p + 1``;
* hidden unit ``k`` of layer ``l`` has degree ``m_l(k)`` in
  ``[min(m_{l-1}), D - 1]`` (``min(m_0) = 1``);
* masks have nn.Linear weight layout ``(out, in)``:
  hidden ``M[k, j] = m_l(k) >= m_{l-1}(j)``, output ``M[d, k] = deg(d) > m_L(k)``,
  direct ``M[d, j] = deg(d) > deg(j)``;

so output ``d`` depends only on inputs strictly earlier in the order.
"""

from __future__ import annotations

import functools
import numbers
from dataclasses import dataclass

import numpy as np

from fclcore.splitmix import SplitMix64

__all__ = [
    "MadeConfig",
    "MadeMasks",
    "input_order",
    "input_degrees",
    "hidden_degrees",
    "made_masks",
    "order_schedule",
    "param_shapes",
    "init_params",
    "mask_for_param",
]


MASK_RNGS = ("pcg64", "splitmix64")


def _check_int(name: str, value: object, minimum: int) -> int:
    """Return ``value`` as a plain int, or raise ValueError saying what was expected.

    bool is rejected explicitly because it is an Integral subclass and a
    ``True`` slipping into e.g. ``num_orders`` would be silently accepted.
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r} ({type(value).__name__})")
    if int(value) < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {int(value)}")
    return int(value)


@dataclass(frozen=True)
class MadeConfig:
    """Everything needed to rebuild the same MADE (architecture + masks) anywhere.

    Frozen and hashable so it can be shared between aggregator and clients and
    used as a cache key; ``hidden_sizes`` given as a list (e.g. from YAML/JSON)
    is normalised to a tuple.
    """

    input_dim: int
    hidden_sizes: tuple[int, ...] = (500,)
    direct: bool = True
    natural_order: bool = True
    num_orders: int = 1
    mask_seed: int = 0
    connectivity_agnostic: bool = False  # each order index also draws its own hidden degrees
    # the generator orders and degrees are drawn from: NumPy's PCG64, or SplitMix64, which any
    # language reproduces in a few lines (docs/protocol.md, rules P-7.8 and P-7.9)
    mask_rng: str = "pcg64"

    def __post_init__(self) -> None:
        object.__setattr__(self, "input_dim", _check_int("input_dim", self.input_dim, 1))
        hs = self.hidden_sizes
        if isinstance(hs, (str, bytes)) or not hasattr(hs, "__iter__"):
            raise ValueError(f"hidden_sizes must be a non-empty sequence of ints >= 1, got {hs!r}")
        hs = tuple(_check_int(f"hidden_sizes[{i}]", h, 1) for i, h in enumerate(hs))
        if not hs:
            raise ValueError("hidden_sizes must be a non-empty sequence of ints >= 1, got ()")
        object.__setattr__(self, "hidden_sizes", hs)
        for flag in ("direct", "natural_order", "connectivity_agnostic"):
            if not isinstance(getattr(self, flag), (bool, np.bool_)):
                raise ValueError(f"{flag} must be a bool, got {getattr(self, flag)!r}")
            object.__setattr__(self, flag, bool(getattr(self, flag)))
        object.__setattr__(self, "num_orders", _check_int("num_orders", self.num_orders, 1))
        # numpy SeedSequence only accepts non-negative entropy.
        object.__setattr__(self, "mask_seed", _check_int("mask_seed", self.mask_seed, 0))
        if self.mask_rng not in MASK_RNGS:
            raise ValueError(f"mask_rng must be one of {MASK_RNGS}, got {self.mask_rng!r}")


@dataclass(frozen=True)
class MadeMasks:
    """All 0/1 float32 masks of a MADE for one input order, in (out, in) layout."""

    hidden: tuple[np.ndarray, ...]
    output: np.ndarray
    direct: np.ndarray | None


def input_order(cfg: MadeConfig, order_index: int) -> np.ndarray:
    """Permutation ``order`` of ``range(D)``: ``order[p]`` is the dimension at position ``p``.

    ``order_index`` (>= 0) is taken modulo ``num_orders`` so any step counter
    can be passed. Orders are drawn from a dedicated seed stream ``(mask_seed, 1, k)``
    so they are deterministic per ``(mask_seed, k)`` and independent of the
    hidden-degree stream.
    """
    k = _check_int("order_index", order_index, 0) % cfg.num_orders
    if k == 0 and cfg.natural_order:
        return np.arange(cfg.input_dim, dtype=np.int64)
    if cfg.mask_rng == "splitmix64":
        return np.asarray(SplitMix64(cfg.mask_seed, 1, k).permutation(cfg.input_dim), dtype=np.int64)
    rng = np.random.default_rng((cfg.mask_seed, 1, k))
    return rng.permutation(cfg.input_dim).astype(np.int64)


def input_degrees(order: np.ndarray) -> np.ndarray:
    """Degrees of the inputs for ``order``: ``deg[order[p]] = p + 1``."""
    order = np.asarray(order)
    d = order.shape[0]
    if order.ndim != 1 or not np.array_equal(np.sort(order), np.arange(d)):
        raise ValueError(f"order must be a permutation of range({d}), got {order!r}")
    deg = np.empty(d, dtype=np.int64)
    deg[order] = np.arange(1, d + 1, dtype=np.int64)
    return deg


@functools.lru_cache(maxsize=256)
def _hidden_degrees_cached(cfg: MadeConfig, k: int = 0) -> tuple[np.ndarray, ...]:
    """Cached, read-only hidden degrees (they are recomputed on every order switch otherwise).

    Index 0 (and every index without connectivity-agnostic training) uses the stream
    ``(mask_seed, 0)``; index k > 0 of a connectivity-agnostic model uses ``(mask_seed, 0, k)``."""
    key = (cfg.mask_seed, 0, k) if k and cfg.connectivity_agnostic else (cfg.mask_seed, 0)
    rng = SplitMix64(*key) if cfg.mask_rng == "splitmix64" else np.random.default_rng(key)
    d = cfg.input_dim
    low = 1
    out = []
    for h in cfg.hidden_sizes:
        # Upper bound D-1: a unit of degree D could only feed outputs of degree > D (none).
        # For D == 1 the range is empty; clamp so the model still builds (its output is constant).
        high = max(low, d - 1)
        if isinstance(rng, SplitMix64):
            m = np.asarray(rng.integers(low, high, h), dtype=np.int64)
        else:
            m = rng.integers(low, high + 1, size=h, dtype=np.int64)
        m.flags.writeable = False
        out.append(m)
        # Lower bound min(previous): units below it would have no incoming connections.
        low = int(m.min())
    return tuple(out)


def hidden_degrees(cfg: MadeConfig, order_index: int = 0) -> list[np.ndarray]:
    """Degrees ``m_l`` of every hidden layer for order index ``order_index``.

    By default they do not depend on the order: degrees refer to *positions* in the order, so
    switching orders only relabels inputs and the network's connectivity pattern stays
    fixed (order-agnostic training as in the paper).  With ``connectivity_agnostic`` every
    order index also draws its own degrees (Germain et al., section 4.1), from a seed stream
    every device derives alike; index 0 keeps the default degrees, so a model served at
    order 0 is the same either way.
    """
    k = _check_int("order_index", order_index, 0) % cfg.num_orders
    return [m.copy() for m in _hidden_degrees_cached(cfg, k if cfg.connectivity_agnostic else 0)]


def made_masks(cfg: MadeConfig, order_index: int) -> MadeMasks:
    """Compute every mask (hidden, output, direct) for order ``order_index``.

    All masks are recomputed because the first hidden, output and direct masks
    depend on the input degrees, which change with the order.
    """
    deg_in = input_degrees(input_order(cfg, order_index))
    prev = deg_in
    hidden = []
    k = order_index % cfg.num_orders if cfg.connectivity_agnostic else 0
    for m in _hidden_degrees_cached(cfg, k):
        hidden.append((m[:, None] >= prev[None, :]).astype(np.float32))
        prev = m
    output = (deg_in[:, None] > prev[None, :]).astype(np.float32)
    direct = (deg_in[:, None] > deg_in[None, :]).astype(np.float32) if cfg.direct else None
    return MadeMasks(hidden=tuple(hidden), output=output, direct=direct)


def order_schedule(cfg: MadeConfig, round_index: int, step: int) -> int:
    """Order index for local mini-batch ``step`` of round ``round_index``.

    A pure function of its arguments so every client uses the same order for
    the same step without any coordination message. The prime multiplier makes
    consecutive rounds start at different points of the cycle.
    """
    round_index = _check_int("round_index", round_index, 0)
    step = _check_int("step", step, 0)
    if cfg.num_orders == 1:
        return 0
    return (round_index * 7919 + step) % cfg.num_orders


def param_shapes(cfg: MadeConfig) -> dict[str, tuple[int, ...]]:
    """Names and shapes of the trainable tensors, in ``named_parameters()`` order.

    The names are the contract between the aggregator (numpy) and the torch
    model, so they mirror its module names exactly.
    """
    shapes: dict[str, tuple[int, ...]] = {}
    fan_in = cfg.input_dim
    for i, h in enumerate(cfg.hidden_sizes):
        shapes[f"hidden.{i}.weight"] = (h, fan_in)
        shapes[f"hidden.{i}.bias"] = (h,)
        fan_in = h
    shapes["output.weight"] = (cfg.input_dim, fan_in)
    shapes["output.bias"] = (cfg.input_dim,)
    if cfg.direct:
        shapes["direct.weight"] = (cfg.input_dim, cfg.input_dim)
    return shapes


def init_params(cfg: MadeConfig, seed: int) -> dict[str, np.ndarray]:
    """Initial float32 parameters, uniform(-1/sqrt(fan_in), 1/sqrt(fan_in)) like nn.Linear.

    Lets the aggregator create the initial global model without torch. Weights
    are left unmasked: masked entries are ignored in the forward pass and
    become live under other orders.
    """
    rng = np.random.default_rng(_check_int("seed", seed, 0))
    shapes = param_shapes(cfg)
    params: dict[str, np.ndarray] = {}
    for name, shape in shapes.items():
        # fan_in of a bias is that of its layer's weight (nn.Linear convention).
        fan_in = shapes[name.rsplit(".", 1)[0] + ".weight"][1]
        bound = 1.0 / np.sqrt(fan_in)
        params[name] = rng.uniform(-bound, bound, size=shape).astype(np.float32)
    return params


def mask_for_param(masks: MadeMasks, name: str) -> np.ndarray | None:
    """The 0/1 mask multiplying parameter ``name``; None for biases (never masked)."""
    parts = name.split(".")
    if len(parts) == 3 and parts[0] == "hidden" and parts[1].isdigit() and int(parts[1]) < len(masks.hidden):
        layer, kind = masks.hidden[int(parts[1])], parts[2]
    elif len(parts) == 2 and parts[0] == "output":
        layer, kind = masks.output, parts[1]
    elif name == "direct.weight":
        if masks.direct is None:
            raise ValueError("direct.weight requested but these masks have no direct connection")
        layer, kind = masks.direct, "weight"
    else:
        raise ValueError(f"unknown MADE parameter name {name!r}")
    if kind == "bias":
        return None
    if kind == "weight":
        return layer
    raise ValueError(f"unknown MADE parameter name {name!r}")
