"""The run directory ``--out`` names: new or empty, or (with ``--force``) emptied of what an
earlier run wrote there, and writable, before any process starts."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Sequence

from fclcore.errors import ConfigError, StateError

# What one run writes into its directory: ``--force`` removes these (and only these) first.
RUN_ENTRIES = (
    "metrics.jsonl",
    "summary.json",
    "scenario.yaml",
    "logs",
    "configs",
    "clients",
    "state",
    "keys",
    "aux",
    "report",
)


def prepare_out(out_dir: Path, force: bool, entries: Sequence[str]) -> Path:
    """The run directory, empty: a non-empty one is refused (an earlier run's report would
    mix with this one's) unless ``force``, which removes ``entries`` (what an earlier run of
    the same kind wrote there)."""
    if out_dir.exists() and not out_dir.is_dir():
        raise ConfigError(f"--out {out_dir}: exists and is not a directory")
    if out_dir.is_dir() and any(out_dir.iterdir()):
        if not force:
            raise ConfigError(f"--out {out_dir}: not empty; choose a new directory or pass --force to replace the run")
        for name in entries:
            entry = out_dir / name
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry)
            else:
                entry.unlink(missing_ok=True)
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        probe = out_dir / ".fcl-write-test"
        probe.write_bytes(b"")
        probe.unlink()
    except (NotADirectoryError, FileExistsError) as exc:  # the path itself is wrong (through a file)
        raise ConfigError(f"--out {out_dir}: cannot create it: {exc.strerror or exc}") from None
    except OSError as exc:  # permissions, a read-only, full or virtual (/proc: ENOENT) file system
        raise StateError(f"--out {out_dir}: cannot write there: {exc.strerror or exc}") from None
    return out_dir
