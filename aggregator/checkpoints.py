"""What a round's commit holds and a restart takes back.

A commit gathers the state of every part that outlives a round (the strategy's, the live client
set, each device's sequence mark, the run log's offset and rejection counts) with the global
model, the run id and the sequence, into one ``Committed`` that ``StateStore`` writes atomically.
``resume`` checks that a committed state belongs to this federation and gives each part its
share back; what is left to the service (the model, the sequence, the run id) it returns.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np

from aggregator.clients import ClientSet
from aggregator.inbox import Inbox
from aggregator.runlog import RunLog
from aggregator.state import Committed, StateStore
from fclcore.checkpoint import CheckpointError
from fclcore.errors import ConfigError
from fclcore.strategy import Strategy

log = logging.getLogger(__name__)


@dataclass
class Checkpoints:
    store: StateStore
    fingerprint: str  # of the federation and input size (``aggregator.state.fingerprint``)
    federation: str
    strategy: Strategy
    clients: ClientSet
    inbox: Inbox
    runlog: RunLog

    def resume(self) -> Committed | None:
        """The last committed round, its parts' state restored; None if nothing was committed.
        ConfigError when the state is unusable or another federation's."""
        try:
            committed = self.store.load()
        except CheckpointError as exc:
            raise ConfigError(f"state_dir: {exc}; move it away to start the federation afresh") from None
        if committed is None:
            return None
        if committed.fingerprint != self.fingerprint:
            raise ConfigError(
                f"state_dir {self.store.dir}: it belongs to a different federation or input_dim; "
                f"move it away to start afresh, or restore the old config"
            )
        if not self.strategy.fits(committed.global_params):
            raise ConfigError(f"state_dir {self.store.dir}: the committed model does not fit this federation")
        try:
            self.strategy.restore(committed.strategy, committed.strategy_arrays)
            self.clients.restore(committed.clients)
            self.runlog.resume(committed.metrics_offset, committed.rejections)
        except (KeyError, ValueError, OSError) as exc:  # OSError: metrics.jsonl gone
            raise ConfigError(f"state_dir {self.store.dir}: cannot resume ({exc})") from None
        self.inbox.last_seq.update(committed.last_seq)
        log.info("resuming %s after committed round %d", self.federation, committed.round)
        return committed

    def commit(self, rnd: int, model: dict[str, np.ndarray], sequence: int, run_id: str) -> None:
        """Round ``rnd`` is done: ``model`` is the global model after it (its journal goes)."""
        meta, arrays = self.strategy.state()
        self.store.commit(
            Committed(
                self.fingerprint,
                rnd,
                sequence,
                dict(self.inbox.last_seq),
                dict(self.runlog.rejections),
                self.runlog.offset(),
                meta,
                model,
                arrays,
                self.clients.state(),
                run_id,
            )
        )
