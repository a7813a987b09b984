"""A paho subscriber that decodes every update and per-client frame crossing the broker, for
end-to-end tests that check what actually went over the wire."""

from __future__ import annotations

import threading

import paho.mqtt.client as mqtt

from fclcore.codec import Frame, decode


class Listener:
    """Every update and per-client frame of a federation, decoded, as it crossed the broker."""

    def __init__(self, port: int, extra_topics: tuple[str, ...] = ()) -> None:
        self.frames: list[tuple[str, Frame]] = []
        self.payloads: list[tuple[str, bytes]] = []  # the same messages, as received
        self.lock = threading.Lock()
        self.client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="listener")
        self.client.on_message = self._on_message
        topics = ["fcl/+/update/+", "fcl/+/kb/+", *extra_topics]
        self.client.on_connect = lambda c, *a: c.subscribe([(t, 1) for t in topics])
        self.client.connect("127.0.0.1", port)
        self.client.loop_start()

    def _on_message(self, client, userdata, msg) -> None:
        if msg.payload:
            with self.lock:
                self.payloads.append((msg.topic, bytes(msg.payload)))
                self.frames.append((msg.topic, decode(msg.payload)))

    def stop(self) -> list[tuple[str, Frame]]:
        self.client.loop_stop()
        self.client.disconnect()
        return self.frames
