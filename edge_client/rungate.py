"""Which run the device may act on, and when it stops waiting for one.

A run id is a start time (``fclcore.runid``), and a newer run replaces the one a device is in, so
one forged ROUND with a far-future run id used to move every device into a run that never comes
(issue 42).  Three rules close that:

* a run id that starts more than ``max_clock_skew_s`` ahead of this device's clock is dropped
  (``run`` in the device's rejection counts), as the aggregator drops far-future sequences;
* a frame of a run the device is not in is acted on only once the aggregator's retained status
  names that run (the status is the aggregator's own, with its last-will): until then it is held
  (the latest one), and the device's checkpoint keeps the run it is in;
* a device with nothing to do in any run gives up after ``run_over_s``: when the run it saw end
  never had it (``RUN_ENDED``), or when the aggregator's status keeps naming another run than the
  device's, an earlier one it cannot join, while none of its own run comes (``RUN_STALLED``);
  and a device that sent its final evaluation waits that long at most for the aggregator to say
  the end is committed.
"""

from __future__ import annotations

import logging
import time
from typing import Callable

from edge_client.protocol import RejectedFrame
from edge_client.status import AggregatorWatch
from fclcore.exitcodes import ExitCode
from fclcore.runid import is_newer, started_us

log = logging.getLogger("edge_client.daemon")
Message = tuple[str, bytes, int]  # topic, payload, packet bytes


class RunGate:
    def __init__(
        self,
        watch: AggregatorWatch,
        max_skew_s: float,
        run_over_s: float,
        clock: Callable[[], float] = time.monotonic,
        wall_us: Callable[[], int] = lambda: time.time_ns() // 1000,
    ) -> None:
        self.watch, self.max_skew_us, self.run_over_s = watch, int(max_skew_s * 1e6), run_over_s
        self.clock, self.wall_us = clock, wall_us
        self.held: tuple[str, Message] | None = None  # (run, message) of a run not named by the status yet
        self.ended_since: float | None = None  # when the end of a run this device took no part in was seen
        self.own_seen = clock()  # when the last frame of the device's own run came
        self.final_sent: float | None = None  # when the final evaluation was sent
        self.other_since: float | None = None  # since when the aggregator's status names another run

    def check_bound(self, run: str) -> None:
        ahead = started_us(run) - self.wall_us() - self.max_skew_us
        if ahead > 0:
            raise RejectedFrame(
                f"run: run {run} starts {ahead / 1e6:.0f} s past this device's clock + max_clock_skew_s "
                "(a forged run id, or a clock that is wrong)"
            )

    def confirmed(self, run: str) -> bool:
        return self.watch.run == run

    def hold(self, run: str, message: Message) -> None:
        if self.held is None or self.held[0] != run:
            log.info("a frame of run %s, which the aggregator's status does not name (yet): held", run)
        self.held = (run, message)

    def release(self) -> Message | None:
        """The held frame, once the aggregator's status names its run."""
        if self.held is not None and self.confirmed(self.held[0]):
            message, self.held = self.held[1], None
            return message
        return None

    def own_frame(self) -> None:
        self.own_seen, self.ended_since = self.clock(), None

    def saw_end_of_other_run(self) -> None:
        if self.ended_since is None:
            self.ended_since = self.clock()

    def verdict(self, device_run: str | None) -> ExitCode | None:
        """What the daemon exits with now, if it is done waiting (``OK``: its final evaluation's
        end is committed, or no longer waited for)."""
        now = self.clock()
        if self.final_sent is not None:
            if device_run is not None and self.watch.ended == device_run:
                return ExitCode.OK
            if now - self.final_sent > self.run_over_s:
                log.warning("the end of run %s was not acknowledged in %.0f s: exiting", device_run, self.run_over_s)
                return ExitCode.OK
            return None
        if self.ended_since is not None and now - self.ended_since > self.run_over_s:
            log.error("the run ended before this device took part, and no other run came in %.0f s", self.run_over_s)
            return ExitCode.RUN_ENDED
        earlier = self.watch.run is not None and device_run is not None and is_newer(device_run, self.watch.run)
        other = earlier and self.watch.state == "online"  # a newer run is joined at its first round instead
        self.other_since = (self.other_since or now) if other else None
        if other and now - max(self.own_seen, self.other_since) > self.run_over_s:
            log.error(
                "the aggregator runs %s, not this device's run %s, and nothing of %s came in %.0f s",
                self.watch.run,
                device_run,
                device_run,
                self.run_over_s,
            )
            return ExitCode.RUN_STALLED
        return None
