"""Buffered asynchronous rounds (FedBuff): which updates the open model version takes, and
with what weight (``federation.rounds.mode: buffered``, docs/buffered.md).

A round is a model version: version ``v`` is announced as round ``v``, and a device names in
its update's header the round, hence the version, it trained on.  The open version takes any
update trained on it or on one of the ``max_staleness`` versions before it, folded as it
arrives with weight ``n_samples / sqrt(1 + staleness)`` (staleness: versions published since
the one it trained on), and the next version is published once ``buffer_k`` updates are in:
the strategy's own close of those weighted sums.  An update older than that is refused as
"stale".  Everything else, the checks, the journal and its replay, the one update per device
per version, is the synchronous round's, so exactly-once folding holds as it does there: a
replayed update has the same header, hence the same weight.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from fclcore.aggregation import RunningSum
from fclcore.strategy import Strategy, Update

STALE = "stale"  # the rejection reason of an update trained on too old a version


def staleness_weight(staleness: int) -> float:
    """How much an update counts per sample, ``staleness`` versions after the one it trained on."""
    if staleness < 0:
        raise ValueError(f"staleness: expected >= 0, got {staleness}")
    return 1.0 / math.sqrt(1.0 + staleness)


@dataclass(frozen=True)
class Buffer:
    buffer_k: int  # accepted updates per published version
    max_staleness: int  # versions an update may lag the open one

    def stale_problem(self, trained_on: int, open_version: int) -> str | None:
        """Why an update trained on ``trained_on`` may not go into ``open_version`` (None: it may);
        only asked about versions before the open one."""
        staleness = open_version - trained_on
        if staleness <= self.max_staleness:
            return None
        return (
            f"trained on version {trained_on}, {staleness} versions before the open one "
            f"({open_version}); max_staleness {self.max_staleness}"
        )

    def fold(self, strategy: Strategy, running: RunningSum, update: Update, open_version: int) -> Update:
        """Fold ``update`` into the open version's sums with weight n_samples x staleness weight;
        what the round keeps is the strategy's, with the device's own sample count."""
        weight = update.n_samples * staleness_weight(open_version - update.frame.header.round)
        kept = strategy.fold(running, replace(update, n_samples=weight))
        return replace(kept, n_samples=update.n_samples)
