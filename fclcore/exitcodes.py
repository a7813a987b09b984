"""Numbered exit codes of every ``fcl`` command, documented in one place (README links here).

The user-facing table is docs/exit-codes.md; tests/unit/test_units.py fails if a member is missing
there, and the systemd units refer to BAD_INPUT and INTERRUPTED by number.
"""

from enum import IntEnum


class ExitCode(IntEnum):
    OK = 0
    FAILURE = 1  # an unexpected error; the log has the traceback
    BAD_INPUT = 2  # bad command line, configuration or input file; one line says why
    BROKER_UNREACHABLE = 3  # could not connect to the MQTT broker in time
    NOT_ENOUGH_CLIENTS = 4  # too few clients came online, or a round missed its quorum every attempt
    CLIENT_FAILED = 5  # fcl simulate: a client or the aggregator process exited non-zero
    # the state directory (out_dir/state_dir, StateDirectory=) cannot be written: permissions, disk full
    STATE_ERROR = 6
    FEDERATION_FAILED = 7  # fcl client: the aggregator announced that the run failed (e.g. a round missed its quorum)
    OTHER_RUN = 8  # fcl client: a newer run of the federation started and on_new_run is "refuse"
    RUN_ENDED = 9  # fcl client: the run ended before this device took part, and no other run came (run_over_s)
    RUN_STALLED = 10  # fcl client: the aggregator runs another run than the device's, one it cannot join (run_over_s)
    INTERRUPTED = 130  # stopped by SIGINT/SIGTERM before the run finished
