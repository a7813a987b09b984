"""How ``fcl simulate`` waits for the participants once the aggregator has ended: a device still
exporting its final served model is waited for as long as its export may take (not a fixed
30 s, which a loaded machine or a slow board overran), all of them against one bound."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

from fcl_edge.simulate import FINAL_GRACE_S, _outcome
from fclcore.exitcodes import ExitCode
from fclcore.schema import ServeSpec


class Proc:
    """A participant that exits with ``code`` once it is given ``needs`` seconds to (or never)."""

    def __init__(self, code: int = 0, needs: float = 0.0) -> None:
        self.code, self.needs, self.asked = code, needs, []

    def wait(self, timeout: float) -> int:
        self.asked.append(timeout)
        if timeout < self.needs:
            raise subprocess.TimeoutExpired("fcl client", timeout)
        return self.code


def test_a_device_exporting_after_the_run_is_waited_for(tmp_path: Path, capsys) -> None:
    exporting = Proc(needs=120.0)  # a final export of two minutes
    procs = {"aggregator": Proc(), "client-0": Proc(), "client-1": exporting}
    assert _outcome(tmp_path, procs, deadline=time.monotonic() + 3600) == ExitCode.OK
    assert FINAL_GRACE_S > ServeSpec().export_timeout_s
    assert exporting.asked[0] > ServeSpec().export_timeout_s
    assert capsys.readouterr().err == ""


def test_a_device_that_never_exits_is_stopped_at_the_deadline(tmp_path: Path, capsys) -> None:
    hung = Proc(needs=float("inf"))
    procs = {"aggregator": Proc(), "client-0": hung}
    assert _outcome(tmp_path, procs, deadline=time.monotonic() + 2) == ExitCode.CLIENT_FAILED
    assert hung.asked[0] <= 2.0
    assert "client-0 did not finish within --timeout" in capsys.readouterr().err


def test_the_waits_share_one_bound(tmp_path: Path) -> None:
    """Each participant's wait is what is left of the one grace period, not a fresh one."""
    first, second = Proc(needs=float("inf")), Proc(needs=float("inf"))

    def slow_wait(timeout: float) -> int:  # the first one uses up the grace period
        first.asked.append(timeout)
        time.sleep(1.5)
        raise subprocess.TimeoutExpired("fcl client", timeout)

    first.wait = slow_wait
    _outcome(tmp_path, {"aggregator": Proc(), "a": first, "b": second}, deadline=time.monotonic() + 1.2)
    assert second.asked == [1.0]  # only the minimum is left
