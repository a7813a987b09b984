"""Which MADE order a step trains with, and which order's mask restricts a round's upload.

Both are pure functions of the synchronised federation settings, so every client and the
aggregator agree without exchanging masks.
"""

from __future__ import annotations

from typing import Any

from fclcore.made_spec import MadeConfig, order_schedule


def step_order(made: MadeConfig, options: Any, rnd: int, step: int) -> int:
    """Order of local mini-batch ``step`` in round ``rnd`` (per batch, or fixed per round)."""
    return order_schedule(made, rnd, 0 if options.order_per == "round" else step)


def upload_order(made: MadeConfig, options: Any, rnd: int) -> int:
    """The order whose MADE mask restricts the base uploaded in round ``rnd``."""
    return order_schedule(made, rnd, 0)
