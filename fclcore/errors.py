"""The toolkit's own errors: one base, each kind mapped to its documented exit code here.

``fcl`` (``fcl_edge.cli.main``) turns any ``FclError`` that reaches it into one line on
stderr and ``exc.exit_code`` (docs/exit-codes.md); anything else is a bug with a traceback
and exit 1.  Importable without any third-party package.
"""

from fclcore.exitcodes import ExitCode


class FclError(Exception):
    """Base of every error the toolkit raises on purpose; the message is one line."""

    exit_code = ExitCode.FAILURE


class BadInput(FclError, ValueError):
    """Bad configuration, file or message content (exit 2)."""

    exit_code = ExitCode.BAD_INPUT


class ConfigError(BadInput):
    """A configuration file or override is invalid; the message names the file and key."""


class BrokerUnreachable(FclError, RuntimeError):
    """The MQTT broker could not be reached or refused us (exit 3)."""

    exit_code = ExitCode.BROKER_UNREACHABLE


class NotEnoughClients(FclError, RuntimeError):
    """Too few clients came online, or a round missed its quorum every attempt (exit 4)."""

    exit_code = ExitCode.NOT_ENOUGH_CLIENTS


class StateError(FclError, RuntimeError):
    """A state directory cannot be read back or written (exit 6)."""

    exit_code = ExitCode.STATE_ERROR


class TrainingDiverged(BadInput):
    """A device's loss or update stopped being finite: the training settings need changing (exit 2).

    Retrying cannot help (the same round diverges again from the same checkpoint), so this is
    bad input, the code systemd does not restart."""
