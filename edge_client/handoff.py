"""When the device hands a model to serving (``edge_client.serving`` exports it): after a task,
or after every round if so configured (``serve.every``), never twice for the same round, and
only once the device has held-out rows to check the export against."""

from __future__ import annotations

import logging
from typing import Sequence

from edge_client.serving import ServedModelWriter, ServeJob
from fclcore.data import Dataset, float_pixels
from fclcore.learner import Learner
from fclcore.schedule import RoundPlace

log = logging.getLogger("edge_client.daemon")  # its parts log as the daemon did before the split


class ServeHandoff:
    def __init__(self, writer: ServedModelWriter, every: str) -> None:
        self.writer, self.every = writer, every
        self.served_round = -1  # the round after which the served model was last exported

    def served(
        self,
        learner: Learner,
        tests: Sequence[Dataset],
        after_round: int,
        previous: RoundPlace | None,
        task_ended: bool,
    ) -> ServeJob | None:
        """The model to serve after ``after_round`` (a snapshot the background export may
        read while training goes on), or None: after a task, or every round if so configured."""
        every = self.every
        if (
            after_round < 0
            or previous is None
            or every == "never"
            or (every == "task" and not task_ended)
            or after_round == self.served_round
        ):
            return None
        task = previous.task
        # The export's parity rows: the task's held-out rows.  A device on its own task clock may
        # have fewer task folders than the federation has tasks (or none yet): its newest ones.
        ordered = ([tests[task]] if task < len(tests) else []) + list(reversed(tests))
        parity = next((float_pixels(d).x for d in ordered if len(d)), None)  # float32 for the export
        if parity is None:
            log.info("not serving the model after round %d: no data on this device yet", after_round)
            return None
        self.served_round = after_round
        return self.writer.snapshot(learner, task, parity)
