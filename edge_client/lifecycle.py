"""Which run the device is in and how it leaves it: meeting a round or FINISH of another run
(adopt, join, refuse, drop or hold it), the task membership of each frame (retired, not enrolled
yet), and a run that ends early because the aggregator gave up.

The daemon's round protocol asks these questions of every accepted frame; the answers set the
exit code and the retained status the daemon leaves with.  ``RunGate`` says which run a frame
may be acted on; this part acts on it.
"""

from __future__ import annotations

import logging

from edge_client.frames import ClientFrames
from edge_client.learning import DeviceLearner
from edge_client.protocol import RejectedFrame, membership_state, places
from edge_client.rounds import RoundWork
from edge_client.rungate import Message, RunGate
from edge_client.serving import ServedModelWriter
from edge_client.uplink import Uplink
from fclcore.codec import Frame, Kind
from fclcore.exitcodes import ExitCode
from fclcore.membership import NOT_ENROLLED, RETIRED
from fclcore.runid import is_newer
from fclcore.schema import ClientConfig, FederationSpec

log = logging.getLogger("edge_client.daemon")  # its parts log as the daemon did before the split


class RunLifecycle:
    def __init__(
        self,
        cfg: ClientConfig,
        device: DeviceLearner,
        gate: RunGate,
        frames: ClientFrames,
        work: RoundWork,
        uplink: Uplink,
        serving: ServedModelWriter,
        link,
    ) -> None:
        self.cfg, self.device, self.gate, self.frames = cfg, device, gate, frames
        self.work, self.uplink, self.serving, self.link = work, uplink, serving, link
        self.exit_code: ExitCode | None = None  # set when the run ends other than by finishing (failed, other run)
        self.final_state = "stopped"  # the retained status the daemon leaves: "retired" once the membership retires it
        self.told_not_enrolled = False

    def meet(self, frame: Frame, run: str, message: Message) -> bool | None:
        """A round or FINISH of a run this device is not in: adopt it (a fresh device, at a
        round), join it (a newer run, ``on_new_run: join``: start over), refuse it (exit
        ``OTHER_RUN``), drop it (an earlier run's retained message, the end of a run this device
        took no part in, a run id from the future), or hold it until the aggregator's status names
        its run (``RunGate``).  True when the daemon must stop; None when held."""
        kind, current = frame.header.kind, self.device.run_id
        if current is None and kind is Kind.FINISH and frame.meta.get("failed") is None:
            self.gate.saw_end_of_other_run()
            raise RejectedFrame(f"run: the end of run {run}, which this device took no part in")
        if current is not None and not is_newer(run, current):
            raise RejectedFrame(f"run: a {kind.name} of run {run}, an earlier run than this device's {current}")
        if current is not None and kind is Kind.FINISH:
            raise RejectedFrame(f"run: the end of run {run}, a newer run this device has not joined")
        self.gate.check_bound(run)
        if not self.gate.confirmed(run):
            self.gate.hold(run, message)
            return None
        if current is None:
            self.adopt(run)
            return False
        if self.cfg.on_new_run == "refuse":
            log.error(
                "a newer run %s of %s started; this device belongs to run %s and on_new_run is refuse: exiting",
                run,
                self.cfg.federation,
                current,
            )
            self.exit_code = ExitCode.OTHER_RUN
            return True
        log.warning(
            "a newer run %s of %s started: joining it from scratch (was in run %s)", run, self.cfg.federation, current
        )
        self.device.forget()
        self.work.pending = self.work.waiting = self.uplink.unacked = None
        self.work.handoff.served_round, self.told_not_enrolled = -1, False
        self.frames.reset()
        self.adopt(run)
        return False

    def adopt(self, run: str) -> None:
        """Belong to ``run``: the device's own frames of other runs go; those of this run kept aside come in."""
        self.device.run_id = run
        self.gate.own_frame()
        self.frames.adopt(run)
        self.link.status_fields.update(run=run)

    def finish_early(self, frame: Frame, fed: FederationSpec) -> bool:
        """A FINISH that is not the end of this run's last round: the aggregator gave up (the
        device exits ``FEDERATION_FAILED`` with its checkpoint as it is, also one that has not
        trained yet: no round of this run will come), or a stale one (dropped)."""
        failed = frame.meta.get("failed")
        if failed is None:
            raise RejectedFrame(
                f"finish: for round {frame.header.round}, but the federation has {fed.total_rounds} rounds"
            )
        log.error("the aggregator ended run %s as failed: %s", self.device.run_id, str(failed)[:200])
        self.uplink.unacked = None
        self.serving.wait()
        self.exit_code = ExitCode.FEDERATION_FAILED
        return True

    def outside(self, frame: Frame, fed: FederationSpec) -> bool | None:
        """None while this device is a member of the frame's task; True once the membership
        retires it (it leaves the run), False while it is not enrolled yet (it waits)."""
        state = membership_state(fed, self.cfg.client_id, frame.header.task)
        if state == RETIRED:
            self.retire(frame, fed)
            return True
        if state == NOT_ENROLLED:
            if not self.told_not_enrolled:
                log.info("not enrolled yet in task %d (federation.membership): waiting", frame.header.task)
                self.told_not_enrolled = True
            return False
        return None

    def retire(self, frame: Frame, fed: FederationSpec) -> None:
        """A round (or the end) of a task in which this device is retired: it serves the model of
        its last round, if it has one, and leaves the run with the status "retired"."""
        log.info("retired from task %d (federation.membership): leaving the federation", frame.header.task)
        if self.device.learner is not None and frame.header.round - 1 == self.device.done_round:
            try:  # the announcement carries the aggregate of this device's last round: serve it
                self.device.load(frame, fed)
                self.serving.submit(self.work.served(frame.header.round - 1, places(frame)[1], task_ended=True))
            except RejectedFrame as exc:
                log.warning("not serving the last model: %s", exc)
        self.uplink.unacked = None
        self.serving.wait()
        self.final_state = "retired"
