"""Tests use the product's Mosquitto runner; kept as a module so fixtures import one name."""

from fcl_edge.broker import MosquittoProcess as Mosquitto
from fcl_edge.broker import free_port

__all__ = ["Mosquitto", "free_port"]
