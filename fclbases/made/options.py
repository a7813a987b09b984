"""What every MADE method's options share, and what they decide: the MADE order a step trains
with and the order whose mask restricts a round's upload.

Both orders are pure functions of the synchronised federation settings, so every client and
the aggregator agree without exchanging masks.  A MADE method's options dataclass extends
``MadeOptions``; the learner and strategy bases here read only these fields.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from fclcore.config import option
from fclcore.made_spec import MadeConfig, order_schedule


@dataclass
class MadeOptions:
    order_per: Literal["batch", "round"] = option(
        "batch", "how often the MADE order changes: per mini-batch or per round"
    )


def step_order(made: MadeConfig, options: MadeOptions, rnd: int, step: int) -> int:
    """Order of local mini-batch ``step`` in round ``rnd`` (per batch, or fixed per round)."""
    return order_schedule(made, rnd, 0 if options.order_per == "round" else step)


def upload_order(made: MadeConfig, options: MadeOptions, rnd: int) -> int:
    """The order whose MADE mask restricts the base uploaded in round ``rnd``."""
    return order_schedule(made, rnd, 0)
