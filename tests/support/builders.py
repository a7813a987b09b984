"""Small federations and accepted updates for method tests: the defaults every hand-built one
repeated, written once, so a test states only what it is about."""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from fclcore.codec import Frame, Header, Kind, decode, encode
from fclcore.data import Dataset
from fclcore.schema import FederationSpec, ModelSpec, TrainSpec
from fclcore.strategy import Update


def federation_spec(**overrides: Any) -> FederationSpec:
    """A ConFedMADE federation small enough for a unit test (3 tasks of 2 rounds, one hidden
    layer of 24 units, 3 orders); keywords replace fields, ``options`` are laid over the defaults'."""
    options = {"order_per": "round", "keep_units": 0.5, **overrides.pop("options", {})}
    fields: dict[str, Any] = {
        "name": "t",
        "method": "confedmade",
        "num_tasks": 3,
        "rounds_per_task": 2,
        "model": ModelSpec(hidden_sizes=[24], num_orders=3, mask_seed=3),
        "train": TrainSpec(batch_size=8, lr=0.01),
        "options": options,
    }
    return FederationSpec(**{**fields, **overrides})


def update(
    client: str,
    tensors: Mapping[str, Any],
    *,
    rnd: int = 0,
    n_samples: int = 40,
    meta: Mapping[str, Any] | None = None,
    strategy: Any = None,
    wire_dtype: str | None = None,
    federation: str = "t",
) -> Update:
    """An UPDATE of ``client`` for round ``rnd`` as the aggregator accepts it: with ``wire_dtype``
    encoded and decoded first (as on the wire); its tensors ``strategy.normalize``'s view of the
    frame when a strategy is given, else ``tensors`` as they are."""
    frame = Frame(Header(Kind.UPDATE, federation, rnd, 0, client, 1), {"n_samples": n_samples, **(meta or {})}, tensors)
    if wire_dtype is not None:
        frame = decode(encode(frame, wire_dtype))
    return Update(client, frame, n_samples, 0, 0, strategy.normalize(frame) if strategy is not None else dict(tensors))


def made_federation(method: str, num_tasks: int) -> FederationSpec:
    """A small MADE federation any MADE method's learner runs (the options every one of them reads)."""
    return FederationSpec(
        name="t",
        method=method,
        num_tasks=num_tasks,
        rounds_per_task=2,
        model=ModelSpec(hidden_sizes=[16], num_orders=2, mask_seed=3),
        train=TrainSpec(batch_size=8, lr=0.01),
        options={"order_per": "round", "keep_units": 0.5, "ewc_lambda": 1.0},
    )


def binary_rows(seed: int, dim: int, n: int = 32) -> Dataset:
    """``n`` seeded rows of ``dim`` 0/1 values, all labelled 0."""
    rng = np.random.default_rng(seed)
    return Dataset((rng.random((n, dim)) > 0.5).astype(np.float32), np.zeros(n, np.int64))
