"""An independent count of MQTT PUBLISH bytes: a TCP relay that parses the MQTT stream
(and, through ``rewrite``, a place to alter packets on their way).

It shares no code with fclcore.transport: it reads fixed headers and remaining lengths off
the raw byte stream (MQTT 3.1.1 section 2.2), learns each connection's client id from its
CONNECT packet, and sums PUBLISH packet sizes per client and direction.
"""

from __future__ import annotations

import socket
import threading
from collections import defaultdict

CONNECT, PUBLISH = 1, 3


class MqttCounter:
    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port = self.server.getsockname()[1]
        self.lock = threading.Lock()
        # (client id, "up" | "down") -> [publish packets, publish bytes, all bytes]
        self.counts: dict[tuple[str, str], list[int]] = defaultdict(lambda: [0, 0, 0])
        self._stop = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    def publish_bytes(self, client_id: str, direction: str) -> int:
        with self.lock:
            return self.counts[(client_id, direction)][1]

    def close(self) -> None:
        self._stop.set()
        self.server.close()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                downstream, _ = self.server.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self.upstream_port))
            conn = {"id": None}
            threading.Thread(target=self._pump, args=(downstream, upstream, "up", conn), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, downstream, "down", conn), daemon=True).start()

    def rewrite(self, packet: bytes, direction: str) -> bytes:
        """What the relay forwards for one complete packet: itself (a subclass may alter it)."""
        return packet

    def _pump(self, src: socket.socket, dst: socket.socket, direction: str, conn: dict) -> None:
        buffer = b""
        while True:
            try:
                chunk = src.recv(65536)
            except OSError:
                chunk = b""
            if not chunk:
                _close(dst)
                return
            packets, buffer = _split(buffer + chunk)
            for packet in packets:
                self._count(packet, direction, conn)
            try:
                dst.sendall(b"".join(self.rewrite(packet, direction) for packet in packets))
            except OSError:
                _close(src)
                return

    def _count(self, packet: bytes, direction: str, conn: dict) -> None:
        packet_type = packet[0] >> 4
        if packet_type == CONNECT:
            conn["id"] = _connect_client_id(packet[_header_length(packet) :])
        with self.lock:
            row = self.counts[(conn["id"] or "?", direction)]
            row[2] += len(packet)
            if packet_type == PUBLISH:
                row[0] += 1
                row[1] += len(packet)


def _header_length(buffer: bytes) -> int | None:
    """Bytes of the fixed header at the front of ``buffer`` (None: not all there yet)."""
    pos = 1
    while pos < len(buffer):
        pos += 1
        if not buffer[pos - 1] & 0x80:
            return pos
    return None


def _split(buffer: bytes) -> tuple[list[bytes], bytes]:
    """The complete packets at the front of ``buffer``, and the rest."""
    packets = []
    while (header := _header_length(buffer)) is not None:
        remaining, multiplier = 0, 1
        for byte in buffer[1:header]:
            remaining += (byte & 0x7F) * multiplier
            multiplier *= 128
        if len(buffer) < header + remaining:
            break
        packets.append(buffer[: header + remaining])
        buffer = buffer[header + remaining :]
    return packets, buffer


def _connect_client_id(body: bytes) -> str:
    name_len = int.from_bytes(body[0:2], "big")
    pos = 2 + name_len + 1 + 1 + 2  # protocol name, level, flags, keep-alive
    id_len = int.from_bytes(body[pos : pos + 2], "big")
    return body[pos + 2 : pos + 2 + id_len].decode("utf-8")


def _close(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    sock.close()
