"""Crash-safe state files (fclcore.checkpoint) and the aggregator's state store."""

from __future__ import annotations

import io
import zipfile

import numpy as np
import pytest
from support.timescale import scaled

from aggregator.state import Committed, StateStore
from fclcore import checkpoint
from fclcore.checkpoint import CheckpointError


def test_round_trip(tmp_path) -> None:
    arrays = {"w": np.arange(6, dtype=np.float32).reshape(2, 3), "i": np.array([1, 2], np.int64)}
    checkpoint.save(tmp_path / "c.npz", {"round": 3, "who": ["a"]}, arrays)
    meta, loaded = checkpoint.load(tmp_path / "c.npz")
    assert meta == {"round": 3, "who": ["a"]}
    assert set(loaded) == {"w", "i"} and all(np.array_equal(loaded[k], v) for k, v in arrays.items())
    assert [p.name for p in tmp_path.iterdir()] == ["c.npz"]  # no temporary file left


def test_truncated_and_garbage_files_are_refused(tmp_path) -> None:
    path = tmp_path / "c.npz"
    checkpoint.save(path, {"a": 1}, {"w": np.ones(100, np.float32)})
    path.write_bytes(path.read_bytes()[:-50])
    with pytest.raises(CheckpointError):
        checkpoint.load(path)
    path.write_bytes(b"not a zip")
    with pytest.raises(CheckpointError):
        checkpoint.load(path)


def test_object_arrays_are_never_unpickled(tmp_path) -> None:
    with pytest.raises(ValueError, match="numeric"):
        checkpoint.save(tmp_path / "c.npz", {}, {"o": np.array([{"x": 1}], dtype=object)})
    buffer = io.BytesIO()  # a hand-made file holding a pickled object array
    np.savez(buffer, __meta__=np.frombuffer(b"{}", np.uint8), evil=np.array([object()], dtype=object))
    (tmp_path / "evil.npz").write_bytes(buffer.getvalue())
    with pytest.raises(CheckpointError):
        checkpoint.load(tmp_path / "evil.npz")


def test_missing_metadata_is_refused(tmp_path) -> None:
    buffer = io.BytesIO()
    np.savez(buffer, w=np.ones(3))
    (tmp_path / "c.npz").write_bytes(buffer.getvalue())
    with pytest.raises(CheckpointError, match="metadata"):
        checkpoint.load(tmp_path / "c.npz")
    assert zipfile.is_zipfile(tmp_path / "c.npz")


def test_state_store_commit_and_journal(tmp_path) -> None:
    store = StateStore(tmp_path / "state")
    assert store.load() is None
    store.journal(4, "client-0", b"payload-0", 120)
    store.journal(4, "c.1__x", b"payload-1", 99)  # ids may hold dots and underscores
    store.journal(3, "client-0", b"stale", 1)
    assert store.journaled(4) == [("c.1__x", b"payload-1", 99), ("client-0", b"payload-0", 120)]
    assert store.journaled(3) == []  # the round-4 files were not round 3's, and went
    store.journal(5, "client-0", b"p", 1)
    state = Committed(
        "fp",
        round=5,
        sequence=9,
        last_seq={"client-0": 7},  # docs/protocol.md P-SEQ-3: the marks are committed with each round
        rejections={"codec": 2},
        metrics_offset=1234,
        strategy={"knowledge": []},
        global_params={"l0.weight": np.ones((2, 2), np.float32)},
        strategy_arrays={"kb/0/x/indices": np.array([1])},
    )
    store.commit(state)
    assert store.journaled(5) == []  # a commit clears the journal
    loaded = store.load()
    assert (loaded.round, loaded.sequence, loaded.last_seq, loaded.rejections, loaded.metrics_offset) == (
        5,
        9,
        {"client-0": 7},
        {"codec": 2},
        1234,
    )
    assert np.array_equal(loaded.global_params["l0.weight"], np.ones((2, 2)))
    assert set(loaded.strategy_arrays) == {"kb/0/x/indices"}


def test_a_cleared_journal_is_renamed_away_and_deleted_in_the_background(tmp_path) -> None:
    store = StateStore(tmp_path / "state")
    for client in ("a", "b", "c"):
        store.journal(2, client, b"x" * 10, 50)
    store.clear_journal()  # one rename: nothing of round 2 is journaled any more, at once
    assert store.journaled(2) == [] and not store.open_dir.exists()
    assert store.wait_swept(timeout=scaled(30)) and sorted(p.name for p in store.dir.iterdir()) == []
    store.journal(3, "a", b"y", 1)  # the next round journals into a fresh open/
    assert store.journaled(3) == [("a", b"y", 1)]
    # a crash between the rename and the deletion leaves a cleared journal: never read, deleted at start
    left = store.dir / "cleared.1.0"
    left.mkdir()
    (left / "3__1__b.frame").write_bytes(b"z")
    restarted = StateStore(tmp_path / "state")
    assert restarted.journaled(3) == [("a", b"y", 1)]
    assert restarted.wait_swept(timeout=scaled(30)) and not left.exists()


def _service_cfg(tmp_path, **federation):
    from fclcore.config import from_dict
    from fclcore.schema import AggregatorConfig

    return from_dict(
        AggregatorConfig,
        {
            "federation": {
                "name": "f",
                "num_tasks": 1,
                "rounds_per_task": 3,
                "model": {"hidden_sizes": [4]},
                **federation,
            },
            "expected_clients": ["c0"],
            "out_dir": str(tmp_path / "agg"),
            "input_dim": 5,
        },
        "test",
    )


def test_aggregator_refuses_state_of_another_federation_and_damaged_state(tmp_path) -> None:
    from aggregator.service import AggregatorService
    from fclcore.errors import ConfigError

    service = AggregatorService(_service_cfg(tmp_path))
    service._commit(0)  # as after round 0
    service.runlog.close()
    resumed = AggregatorService(_service_cfg(tmp_path))
    assert resumed.next_round == 1
    resumed.runlog.close()
    with pytest.raises(ConfigError, match="different federation"):
        AggregatorService(_service_cfg(tmp_path, seed=7))
    (tmp_path / "agg/state/committed.npz").write_bytes(b"garbage")
    with pytest.raises(ConfigError, match="move it away"):
        AggregatorService(_service_cfg(tmp_path))


def test_a_torn_journal_tail_is_cut_off_and_new_records_follow_whole_ones(tmp_path) -> None:
    """A power cut can leave the last record half written (or its bytes wrong): reading the
    journal keeps every whole record before it, cuts the rest off, and what the restarted
    service appends next is read back too."""
    store = StateStore(tmp_path / "state")
    for client in ("a", "b", "c"):
        store.journal(7, client, client.encode() * 100, 300)
    store.close()
    path = store.open_dir / "7.journal"
    whole = path.read_bytes()
    for cut in (1, 50, 200):  # torn inside c's payload, inside b's, inside a's header
        path.write_bytes(whole[:-cut])
        restarted = StateStore(tmp_path / "state")
        kept = [c for c, _, _ in restarted.journaled(7)]
        assert kept == ["a", "b", "c"][: len(kept)] and len(kept) < 3
        assert path.stat().st_size < len(whole) - cut + 1  # the torn record is gone from the file
        restarted.journal(7, "d", b"d", 1)
        restarted.close()
        assert [c for c, _, _ in StateStore(tmp_path / "state").journaled(7)] == [*kept, "d"]
    corrupt = bytearray(whole)
    corrupt[len(whole) // 2] ^= 0xFF  # a flipped bit inside b's record: its CRC fails, b and c are not read
    path.write_bytes(bytes(corrupt))
    assert [c for c, _, _ in StateStore(tmp_path / "state").journaled(7)] == ["a"]


def test_the_journal_syncs_once_per_group(tmp_path, monkeypatch) -> None:
    """Appends reach the file at once (a killed process loses none) but fdatasync runs once per
    ``sync`` (and every ``SYNC_EVERY`` records), not once per record."""
    import aggregator.state as state_mod

    syncs = []
    monkeypatch.setattr(state_mod.os, "fdatasync", lambda fd: syncs.append(fd))
    monkeypatch.setattr(state_mod, "SYNC_EVERY", 4)
    store = StateStore(tmp_path / "state")
    for i in range(3):
        store.journal(1, f"c{i}", b"x", 1)
    assert syncs == [] and StateStore(tmp_path / "state").journaled_clients(1) == ["c0", "c1", "c2"]
    store.sync()
    store.sync()  # nothing new: no second fdatasync
    assert len(syncs) == 1
    for i in range(3, 10):
        store.journal(1, f"c{i}", b"x", 1)
    assert len(syncs) == 2  # after the 4th record since the last sync; 3 wait
    store.close()
    assert len(syncs) == 3 and StateStore(tmp_path / "state").journaled_clients(1) == sorted(f"c{i}" for i in range(10))
