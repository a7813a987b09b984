"""The learning methods: one package per method, each registering itself in
``fclcore.method.REGISTRY`` when imported.  Runtimes import this package (never a method
package directly) and look methods up by the scenario's name.

Adding a method: a package here (its options, server ``strategy`` and device ``learner``, or
subclasses of the shared bases in ``fclbases``, and a ``register(MethodSpec(...))`` in its
``__init__``), one import line below, and its tests (docs/adding-a-method.md).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import methods.confedmade
import methods.fedavgm
import methods.fedet
import methods.fedseit
import methods.filver
import methods.ngfl  # noqa: F401  (each package registers its methods)
from fclcore.config import options_help, to_dict
from fclcore.errors import ConfigError
from fclcore.method import REGISTRY, MethodSpec, lookup
from fclcore.schema import FederationSpec

__all__ = [
    "REGISTRY",
    "MethodSpec",
    "describe",
    "learner_for",
    "lookup",
    "names",
    "positions_for",
    "resolve",
    "strategy_for",
]


def names() -> list[str]:
    return sorted(REGISTRY)


def describe(name: str) -> str:
    """What ``fcl simulate --help-method NAME`` prints: the method's summary, what it serves and
    where an example runs, and each option with its type, default and help text."""
    spec = lookup(name, "--help-method")
    lines = [
        f"{spec.name}: {spec.summary}",
        f"package methods/{spec.package}; metric {spec.metric}; serves {spec.served_format}; "
        f"wire values {spec.value_dtype} unless federation.wire.value_dtype says",
        f"example: fcl simulate {spec.example_scenario} --out runs/{spec.name} --set federation.method={spec.name}",
        "",
        "federation.options:",
    ]
    for option, default, text in options_help(spec.options):
        lines += [f"  {option}: {default}", *([f"      {text}"] if text else [])]
    return "\n".join(lines) + "\n"


def resolve(fed: FederationSpec, source: str = "federation") -> tuple[MethodSpec, Any, FederationSpec]:
    """(spec, parsed options, the federation with its options' defaults and the method's value
    dtype filled in); ConfigError naming ``source`` and the key for an unknown method or option.
    Every runtime reads the federation through here, so the aggregator, its devices and the
    byte counts all see one concrete ``wire.value_dtype`` (a scenario's own value wins)."""
    spec = lookup(fed.method, source)
    options = spec.parse_options(fed.options, source)
    try:
        fed.check_schedule()
    except ValueError as exc:
        raise ConfigError(f"{source}: federation.{exc}") from None
    if fed.rounds.mode == "buffered" and not spec.buffered:
        raise ConfigError(f"{source}: federation.rounds.mode: {fed.method} does not support buffered rounds")
    if fed.rounds.mode == "buffered" and fed.wire.sparsify == "topk":
        raise ConfigError(f"{source}: federation.rounds.mode: buffered rounds need dense uploads (wire.sparsify)")

    wire = dataclasses.replace(fed.wire, value_dtype=fed.wire.value_dtype or spec.value_dtype)
    return spec, options, dataclasses.replace(fed, options=to_dict(options), wire=wire)  # filled: sent and hashed


def strategy_for(fed: FederationSpec, input_dim: int, aux_dir: str | None = None, source: str = "federation"):
    """The server half of ``fed.method`` (imports only the method's strategy module)."""
    spec, options, fed = resolve(fed, source)
    return spec.strategy_class()(fed, options, input_dim, aux_dir=aux_dir)


def learner_for(fed: FederationSpec, input_dim: int, client_index: int, source: str = "federation"):
    """The device half of ``fed.method`` (imports only the method's learner module)."""
    spec, options, fed = resolve(fed, source)
    return spec.learner_class()(fed, options, input_dim, client_index)


def positions_for(fed: FederationSpec, input_dim: int, source: str = "federation"):
    """``rnd`` -> the positions round ``rnd``'s aggregation can change, as both halves derive
    them (``MethodSpec.downlink_positions``), or None."""
    spec, options, fed = resolve(fed, source)
    return spec.positions(fed, options, input_dim)
