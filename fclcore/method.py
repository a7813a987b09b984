"""What a learning method is to the runtimes: a ``MethodSpec`` in one registry.

A method package (``methods/<package>/``) registers one spec per scenario name it answers
to; baselines are presets of the same package (another name, another learner or strategy
class, the same options dataclass).  The runtimes never name a method: they look the name
up here and get the options schema, the server strategy (imported only by the aggregator),
the device learner (imported only by the device), the metric and the served-model format.

Strategy and learner classes are named as ``"module:Class"`` strings and imported on first
use, so the aggregator never imports a device learner (nor torch, unless the method declares
``server_torch``) and the device never imports the server half.
"""

from __future__ import annotations

import dataclasses
import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Literal

from fclcore.codec import VALUE_DTYPES
from fclcore.config import from_dict
from fclcore.errors import ConfigError

if TYPE_CHECKING:  # pragma: no cover
    from fclcore.learner import Learner
    from fclcore.strategy import Strategy


@dataclass(frozen=True)
class MethodSpec:
    name: str  # what ``federation.method`` says
    package: str  # the method package that defines it, e.g. "confedmade"
    options: type  # dataclass of the package's options (``federation.options``)
    strategy: str  # "module:Class" of the server half
    learner: str  # "module:Class" of the device half
    metric: Literal["nll", "accuracy"] = "nll"
    # the ``summary.json`` ``final`` key of the one number its results table and README report
    # (``HEADLINES`` names it): what ``fcl simulate`` prints and ``compare:`` tables rank by;
    # "" is avg_nll for NLL methods and avg_incremental_accuracy for accuracy ones
    headline: str = ""
    served_format: str = "made"  # what the device serves: an ``export`` format name
    server_torch: bool = False  # the strategy trains on the server (imports torch)
    needs_aux_data: bool = False  # the strategy reads ``aux_dir`` (server-side unlabelled data)
    own_clock: bool = False  # devices keep their own task clock: tasks arrive per device (``tasks.arrivals``,
    # a new task folder), are never waited for, and the learner gets every task that has arrived
    fleet_data: bool = False  # the learner replays every device's data (a simulation-only upper reference)
    summary: str = ""  # the first line of ``fcl simulate --help-method NAME``
    example_scenario: str = ""  # a shipped scenario file that runs this method
    smoke_overrides: tuple[str, ...] = ()  # ``--set`` items that shrink it to seconds (contract tests)
    # "module:function" (fed, options, input_dim, rnd) -> {tensor: bool mask} or None: the entries
    # round ``rnd``'s aggregation can change, derived from the seed on both sides, so the model
    # delta sends their values without positions (``fclcore.model_sync``); "" for none
    downlink_positions: str = ""
    # ``federation.wire.value_dtype`` when a scenario leaves it unset (``methods.resolve``): what
    # the method's tensors lose little by; baselines keep float32, the dense FedAvg reference
    value_dtype: str = "float32"
    # the strategy may run ``federation.rounds.mode: buffered`` (FedBuff, docs/buffered.md): its
    # fold takes each update's weight as given and needs nothing of the version it was trained on
    buffered: bool = False

    @property
    def headline_key(self) -> str:
        return self.headline or ("avg_nll" if self.metric == "nll" else "avg_incremental_accuracy")

    def parse_options(self, raw: Any, source: str = "federation") -> Any:
        """The options dataclass from ``federation.options``; ConfigError naming the key."""
        return from_dict(self.options, raw if raw is not None else {}, source, "federation.options")

    def strategy_class(self) -> type["Strategy"]:
        return _load(self.strategy)

    def learner_class(self) -> type["Learner"]:
        return _load(self.learner)

    def positions(self, fed: Any, options: Any, input_dim: int) -> Callable[[int], Any]:
        """``rnd`` -> the derived delta positions of round ``rnd`` (None without a positions function)."""
        if not self.downlink_positions:
            return lambda rnd: None
        function = _load(self.downlink_positions)
        return lambda rnd: function(fed, options, input_dim, rnd)

    def data_length(self, options: Any) -> int | None:
        """Tokens per text for text methods (their options' ``max_length``), else None."""
        return getattr(options, "max_length", None)


REGISTRY: dict[str, MethodSpec] = {}
# what each ``headline`` key is called wherever a run's number is printed (docs/metrics.md)
HEADLINES = {
    "avg_nll": "avg NLL",
    "avg_incremental_accuracy": "avg incremental accuracy",
    "avg_accuracy": "accuracy after the last task",
}


def register(*specs: MethodSpec) -> None:
    """Called by each method package's ``__init__``; a name may be registered once."""
    for spec in specs:
        if not dataclasses.is_dataclass(spec.options):
            raise TypeError(f"{spec.name}: options must be a dataclass")
        if spec.value_dtype not in VALUE_DTYPES:
            raise ValueError(f"{spec.name}: value_dtype {spec.value_dtype!r} is not one of {VALUE_DTYPES}")
        other = REGISTRY.get(spec.name)
        if other is not None and other != spec:
            raise ValueError(f"method {spec.name!r} registered twice ({other.package}, {spec.package})")
        REGISTRY[spec.name] = spec


def lookup(name: object, source: str = "federation") -> MethodSpec:
    """The spec registered under ``name``; ConfigError (one line, file and key) otherwise."""
    if not isinstance(name, str) or name not in REGISTRY:
        raise ConfigError(
            f"{source}: federation.method: unknown method {name!r} (expected one of: {', '.join(sorted(REGISTRY))})"
        )
    return REGISTRY[name]


def _load(target: str) -> Any:
    module, _, name = target.partition(":")
    return getattr(importlib.import_module(module), name)
