"""Signatures, replays and the update-norm bound in the aggregator's inbox (issue 5, points 5-6)."""

from __future__ import annotations

import os
import stat

import numpy as np
import pytest
from test_inbox import OPEN, check, dense_tensors, make_inbox, payload

from aggregator.inbox import Rejection, update_distance
from fclcore.codec import SparseTensor
from fclcore.signing import SignatureError, load_keys, read_key, sign, verify, write_key
from fclcore.strategy import Update

KEY_A, KEY_B = bytes(range(32)), bytes(range(1, 33))


def test_sign_verify_round_trip_and_forgeries() -> None:
    frame = payload()
    signed = sign(frame, KEY_A)
    assert verify(signed, KEY_A) == frame
    with pytest.raises(SignatureError, match="key"):
        verify(signed, KEY_B)  # another device's key
    tampered = bytearray(signed)
    tampered[-10] ^= 1
    with pytest.raises(SignatureError, match="key"):
        verify(bytes(tampered), KEY_A)
    with pytest.raises(SignatureError, match="unsigned"):
        verify(frame, KEY_A)
    with pytest.raises(SignatureError, match="shorter"):
        verify(b"FCLS" + b"\0" * 5, KEY_A)


# docs/protocol.md P-6.2, P-6.3
def test_inbox_requires_the_topic_clients_signature() -> None:
    inbox = make_inbox(keys={"a": KEY_A, "b": KEY_B})
    assert isinstance(check(sign(payload(), KEY_A), inbox=inbox), Update)
    unsigned = check(payload(seq=2), inbox=inbox)
    assert isinstance(unsigned, Rejection) and unsigned.reason == "signature"
    # b's key on a's topic: a device cannot speak for another one
    forged = check(sign(payload(seq=3), KEY_B), inbox=inbox)
    assert isinstance(forged, Rejection) and forged.reason == "signature"


# docs/protocol.md P-SEQ-3
def test_replayed_and_repeated_sequences_are_rejected() -> None:
    inbox = make_inbox()
    first = payload(seq=10)
    assert isinstance(check(first, inbox=inbox), Update)
    again = check(first, inbox=inbox)  # the same bytes again, e.g. a re-send or a replay
    assert isinstance(again, Rejection) and again.reason == "duplicate"
    older = check(payload(seq=9), inbox=inbox)
    assert isinstance(older, Rejection) and older.reason == "replay"
    assert inbox.last_seq == {"a": 10}
    # a newer frame from the same device passes the sequence check (the round loop then
    # rejects a second update for one round with its own "duplicate" check)
    assert isinstance(check(payload(seq=11), inbox=inbox), Update)
    assert inbox.last_seq == {"a": 11}


def test_rejected_frames_do_not_advance_the_sequence_mark() -> None:
    inbox = make_inbox()
    bad = check(payload(seq=50, meta={"n_samples": 0}), inbox=inbox)
    assert isinstance(bad, Rejection)
    assert inbox.last_seq == {}
    assert isinstance(check(payload(seq=5), inbox=inbox), Update)


def test_update_norm_bound() -> None:
    current = {k: np.zeros(v.shape, np.float32) for k, v in dense_tensors().items()}
    expected = float(np.sqrt(sum((v.astype(np.float64) ** 2).sum() for v in dense_tensors().values())))
    assert update_distance(dense_tensors(), current) == pytest.approx(expected)
    inbox = make_inbox(max_update_norm=expected * 0.99)
    data = payload()
    result = inbox.check("a", data, len(data), OPEN, set(), current=current)
    assert isinstance(result, Rejection) and result.reason == "norm"
    inbox = make_inbox(max_update_norm=expected * 1.01)
    assert isinstance(inbox.check("a", data, len(data), OPEN, set(), current=current), Update)


def test_update_distance_counts_only_the_entries_a_sparse_update_carries() -> None:
    current = {"w": np.ones((2, 3), np.float32)}
    sparse = {
        "w": SparseTensor((2, 3), np.array([1, 5]), np.array([4.0, 1.0], np.float32)),
        "kb:w": np.full((2, 3), 100.0, np.float32),
    }  # not part of the global model: skipped
    assert update_distance(sparse, current) == pytest.approx(3.0)


# docs/protocol.md P-6.2
def test_key_files(tmp_path) -> None:
    key = write_key(tmp_path / "a.key")
    assert stat.S_IMODE(os.stat(tmp_path / "a.key").st_mode) == 0o600
    assert read_key(tmp_path / "a.key") == key and len(key) == 32
    with pytest.raises(FileExistsError):
        write_key(tmp_path / "a.key")  # provisioning never overwrites a device's key
    (tmp_path / "bad.key").write_text("abcd\n")
    with pytest.raises(ValueError, match="64 hex digits"):
        read_key(tmp_path / "bad.key")
    with pytest.raises(ValueError, match="no key provisioned for 'b'"):
        load_keys(tmp_path, ["a", "b"])


def test_fcl_keygen(tmp_path) -> None:
    from conftest import run_fcl

    result = run_fcl("keygen", str(tmp_path / "keys"), "c0", "c1")
    assert result.returncode == 0, result.stderr
    keys = {c: read_key(tmp_path / "keys" / f"{c}.key") for c in ("c0", "c1")}
    assert keys["c0"] != keys["c1"]
    again = run_fcl("keygen", str(tmp_path / "keys"), "c0")
    assert again.returncode == 0 and "kept" in again.stderr
    assert read_key(tmp_path / "keys" / "c0.key") == keys["c0"]
    assert run_fcl("keygen", str(tmp_path / "keys"), "a/b").returncode == 2
