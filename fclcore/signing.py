"""Per-device update signatures: HMAC-SHA256 with a key provisioned on each device.

A signed message is an envelope around an ordinary codec frame::

    4   magic b"FCLS"
    32  HMAC-SHA256(device key, frame)
    ... the frame (fclcore.codec v1), unchanged

The aggregator holds one key per expected device (``<keys_dir>/<client_id>.key``, 64 hex
digits) and verifies with the key of the client the *topic* names; the frame header must
name the same client (checked by the inbox).  Replays are stopped one level up: an update
whose header sequence is not above the last one accepted from that device is rejected, and
that high-water mark is persisted with the aggregator's state.

HMAC rather than Ed25519: no extra dependency on small devices, and the aggregator must be
trusted with the model anyway; a per-device key limits a stolen key to its own device.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from pathlib import Path
from typing import Iterable

from fclcore.errors import BadInput

MAGIC = b"FCLS"
TAG_BYTES = 32
KEY_BYTES = 32


class SignatureError(BadInput):
    """A signed envelope that is malformed, unsigned where a signature is required, or forged."""


def sign(frame: bytes, key: bytes) -> bytes:
    return MAGIC + hmac.new(key, frame, hashlib.sha256).digest() + frame


def is_signed(payload: bytes) -> bool:
    return payload[:4] == MAGIC


def verify(payload: bytes, key: bytes) -> bytes:
    """The frame inside a signed envelope, or SignatureError."""
    if not is_signed(payload):
        raise SignatureError("unsigned message where a signature is required")
    if len(payload) < len(MAGIC) + TAG_BYTES:
        raise SignatureError(f"signed envelope of {len(payload)} bytes is shorter than its header")
    tag, frame = payload[4 : 4 + TAG_BYTES], payload[4 + TAG_BYTES :]
    if not hmac.compare_digest(tag, hmac.new(key, frame, hashlib.sha256).digest()):
        raise SignatureError("signature does not match the device's key")
    return frame


def read_key(path: str | os.PathLike) -> bytes:
    """A key file: 64 hex digits (surrounding whitespace allowed)."""
    text = Path(path).read_text(encoding="ascii", errors="replace").strip()
    try:
        key = bytes.fromhex(text)
    except ValueError:
        key = b""
    if len(key) != KEY_BYTES:
        raise ValueError(f"{path}: expected {2 * KEY_BYTES} hex digits (a {KEY_BYTES}-byte key)")
    return key


def load_keys(keys_dir: str | os.PathLike, clients: Iterable[str]) -> dict[str, bytes]:
    """Each client's key from ``keys_dir/<client>.key``; ValueError naming the first missing one."""
    keys = {}
    for client in clients:
        path = Path(keys_dir) / f"{client}.key"
        if not path.exists():
            raise ValueError(f"{path}: no key provisioned for {client!r}")
        keys[client] = read_key(path)
    return keys


def write_key(path: str | os.PathLike) -> bytes:
    """Create a new random key file readable by its owner only; refuses to overwrite."""
    key = secrets.token_bytes(KEY_BYTES)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w", encoding="ascii") as handle:
        handle.write(key.hex() + "\n")
    return key
