"""Options of FedAvgM (``federation.options``): the server step's rate and momentum on top of the
MADE base's (``MadeOptions``)."""

from __future__ import annotations

from dataclasses import dataclass

from fclbases.made.options import MadeOptions
from fclcore.config import option


@dataclass
class FedAvgMOptions(MadeOptions):
    server_lr: float = option(1.0, "server learning rate: w <- w - server_lr * v")
    server_momentum: float = option(0.9, "server momentum beta: v <- beta * v + (w - FedAvg(w_k)); 0: FedAvg")

    def __post_init__(self) -> None:
        if not self.server_lr > 0 or not 0 <= self.server_momentum < 1:
            raise ValueError(
                f"expected server_lr > 0 and server_momentum in [0, 1), got {self.server_lr}, {self.server_momentum}"
            )
