"""Options of the NGFL package (``federation.options``) and its presets.

Defaults follow the reading notes (``NOTES-001-002-004.md`` 3.4 G2-G3, G7, G9, G11): an MLP
extractor 784-256-128, self-attention loss with partial fusion (SA-PF), post-alignment, idle
devices skip the round, a task active for 2 trained rounds (5 for the base task, the device's
first), SGD with momentum 0.9 (weight decay 5e-4 on the base task at lr 0.01, 2e-4 after).  The
incremental rounds' learning rate, batch and epochs come from ``federation.train`` (the notes:
lr 0.005, batch 128, one epoch).

Each preset is a subclass whose defaults differ; a scenario may still override any field.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from fclcore.config import option


@dataclass
class NGFLOptions:
    """SA-PF (``ngfl``): self-attention over the current task's rows, partial fusion."""

    hidden: list[int] = option([256, 128], "the extractor's layers (ReLU after each)")
    loss: Literal["self", "total"] = option("self", "SA: softmax over the current task's rows; TA: over every row")
    fusion: Literal["partial", "total"] = option(
        "partial", "a row is averaged over its trainers this round, or its viewers"
    )
    literal_eq10: bool = option(False, "the paper's Eq. 10 as printed: divide by every sender (docs/ngfl.md)")
    alignment: Literal["post", "pre"] = option("post", "pre: announce new classes, start once the aggregator has them")
    idle: Literal["skip", "train"] = option("skip", "no active task: send a skip notice, or train the last task again")
    rounds_per_task: int = option(2, "trained rounds a task stays active (R)")
    base_rounds: int = option(5, "the same for the device's first task (the base task)")
    base_lr: float = option(0.01, "the base task's SGD learning rate (later tasks: federation.train.lr)")
    base_weight_decay: float = option(5e-4, "SGD weight decay on the base task")
    weight_decay: float = option(2e-4, "SGD weight decay on later tasks")
    momentum: float = option(0.9, "SGD, fresh every round")
    replay: Literal["none", "self", "global"] = option("none", "the upper references: own past data, everyone's")

    def __post_init__(self) -> None:
        if not self.hidden or min(self.hidden) < 1:
            raise ValueError(f"hidden: expected positive layer sizes, got {self.hidden}")
        if self.rounds_per_task < 1 or self.base_rounds < 1:
            raise ValueError("expected rounds_per_task >= 1 and base_rounds >= 1")
        if not self.base_lr > 0 or self.weight_decay < 0 or self.base_weight_decay < 0 or not 0 <= self.momentum < 1:
            raise ValueError("expected base_lr > 0, weight decays >= 0 and momentum in [0, 1)")
        if self.replay != "none" and self.loss != "total":
            raise ValueError("replay: the upper references train with loss: total (replayed classes need every row)")

    @property
    def partial(self) -> bool:
        return self.fusion == "partial"


@dataclass
class TATFOptions(NGFLOptions):
    """TA-TF (``ngfl-ta-tf``): plain federated learning on a growing head."""

    loss: Literal["self", "total"] = "total"
    fusion: Literal["partial", "total"] = "total"


@dataclass
class TAPFOptions(NGFLOptions):
    """TA-PF (``ngfl-ta-pf``)."""

    loss: Literal["self", "total"] = "total"


@dataclass
class SATFOptions(NGFLOptions):
    """SA-TF (``ngfl-sa-tf``)."""

    fusion: Literal["partial", "total"] = "total"


@dataclass
class SelfOptions(TATFOptions):
    """Self (``ngfl-self``): the upper reference where each device replays all its own past data."""

    replay: Literal["none", "self", "global"] = "self"


@dataclass
class GlobalOptions(TATFOptions):
    """Global (``ngfl-global``): each device replays a Self-sized sample of every device's earlier data."""

    replay: Literal["none", "self", "global"] = "global"
