"""Options of the FIL-VER package (``federation.options``) and its presets.

Defaults follow the reading notes (``NOTES-001-002-004.md`` section 1.4): a 16/32-channel
conv encoder with two 1000-unit layers and 256-d heads, a 256-1000-1000-10 classifier, beta
1e-3, phase 0 = 5 FedAvg rounds of Adam 1e-3 on task 1, 10% of each task shard rehearsed and
uploaded once, SST 30 steps x 64 at SGD 0.01.  The client rounds' optimiser, learning rate,
batch and epochs come from ``federation.train`` (the notes: SGD 0.01, batch 64, one epoch;
``momentum`` below).

Each preset is a subclass whose defaults differ; a scenario may still override any field.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from fclcore.config import option


@dataclass
class FILVEROptions:
    """VER-Sampled+SST (``filver``): sampled z rehearsed on the device and uploaded for SST."""

    channels: list[int] = option([16, 32], "the two 5x5 convs")
    padding: int = option(0, "0: the CPU preset (flatten 512 on 28x28); 2: the paper-size preset")
    hidden: int = option(1000, "the encoder's two linear layers and the classifier's two hidden layers")
    latent: int = option(256, "d of z (and of mu, log sigma)")
    classes: int = option(10, "one shared head (domain-incremental)")
    encoder: Literal["variational", "deterministic"] = option("variational", "deterministic: EBR (z = mu, no KL)")
    beta: float = option(1e-3, "weight of KL(N(mu, sigma) || N(0, I)); the privacy knob")
    phase0_rounds: int = option(5, "FedAvg rounds of encoder + classifier at the start of task 1")
    phase0_lr: float = option(1e-3, "Adam, fresh every round")
    encoder_density: float = option(
        1.0, "phase 0, compressed: share of the encoder's entries sent each way (top-k; 1.0 its whole change)"
    )
    momentum: float = option(0.9, "of the SGD client rounds (federation.train.optimizer: sgd), reset per round")
    rehearsal: bool = option(True, "mix z re-sampled from the kept (mu, sigma) of past tasks into training")
    upload: Literal["z", "stats", "none"] = option(
        "z", "what goes up of each rehearsal item: z, (mu, log sigma) or nothing"
    )
    share: float = option(0.1, "of each task shard kept (class-balanced) for rehearsal and uploaded once")
    max_embed_per_round: int = option(64, "the aggregator rejects an update carrying more items")
    sst_steps: int = option(30, "server-side training steps after each FedAvg (0: no SST)")
    sst_batch: int = option(64, "server-side training batch size")
    sst_lr: float = option(0.01, "SGD with momentum ``momentum``, fresh every round")
    buffer_size: int = option(4000, "rehearsal items the aggregator keeps (eviction: docs/filver.md)")
    log_sigma_min: float = option(-10.0, "the head's log sigma (a std) is clamped to this range")
    log_sigma_max: float = option(5.0, "upper clamp of the head's log sigma")

    def __post_init__(self) -> None:
        if len(self.channels) != 2 or min(self.channels) < 1 or self.padding not in (0, 1, 2):
            raise ValueError(
                f"expected two positive conv channel counts and padding 0-2, got {self.channels}, {self.padding}"
            )
        if min(self.hidden, self.latent) < 1 or self.classes < 2:
            raise ValueError("expected hidden >= 1, latent >= 1 and classes >= 2")
        if self.beta < 0 or self.phase0_rounds < 1 or not self.phase0_lr > 0 or not 0 <= self.momentum < 1:
            raise ValueError("expected beta >= 0, phase0_rounds >= 1, phase0_lr > 0, momentum in [0, 1)")
        if not 0 < self.encoder_density <= 1:
            raise ValueError(f"expected encoder_density in (0, 1], got {self.encoder_density}")
        if not 0 < self.share <= 1 or self.max_embed_per_round < 1:
            raise ValueError(f"expected share in (0, 1] and max_embed_per_round >= 1, got {self.share}")
        if self.sst_steps < 0 or self.sst_batch < 1 or not self.sst_lr > 0 or self.buffer_size < 1:
            raise ValueError("expected sst_steps >= 0, sst_batch >= 1, sst_lr > 0, buffer_size >= 1")
        if not self.log_sigma_min < self.log_sigma_max:
            raise ValueError("expected log_sigma_min < log_sigma_max")
        if self.encoder == "deterministic" and self.upload == "stats":
            raise ValueError("upload: stats needs the variational encoder (a deterministic one has no sigma)")

    @property
    def variational(self) -> bool:
        return self.encoder == "variational"


@dataclass
class StatsOptions(FILVEROptions):
    """VER-Stats+SST (``filver-stats``): (mu, log sigma) go up; the server samples z (not private)."""

    upload: Literal["z", "stats", "none"] = "stats"


@dataclass
class EBROptions(FILVEROptions):
    """EBR+SST (``filver-ebr``): a deterministic encoder with its own phase 0; embeddings go up."""

    encoder: Literal["variational", "deterministic"] = "deterministic"


@dataclass
class NoSSTOptions(FILVEROptions):
    """VER without SST (``filver-nosst``): device rehearsal only; nothing but the classifier goes up."""

    upload: Literal["z", "stats", "none"] = "none"
    sst_steps: int = 0


@dataclass
class VanillaOptions(NoSSTOptions):
    """Vanilla FL (``filver-vanilla``): the same frozen encoder, current-task z only."""

    rehearsal: bool = False


@dataclass
class OfflineOptions(VanillaOptions):
    """Offline (``filver-offline``): the classifier trains on every task's data from the start."""
