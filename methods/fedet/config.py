"""Options of the FedET package (``federation.options`` when ``method: fedet``): Enhancer groups
on a frozen all-MiniLM-L6-v2.  The device's learning rate, batch size and epochs come from
``federation.train``."""

from __future__ import annotations

from dataclasses import dataclass

from fclcore.config import option


@dataclass
class FedETOptions:
    num_groups: int = option(2, "J, Enhancer groups per device")
    bottleneck: int = option(64, "Enhancer width m")
    max_length: int = option(64, "tokens per text (the model's input size)")
    gamma: float = option(0.1, "sample memory store ratio")
    weight_decay: float = option(0.01, "AdamW weight decay of the device's Enhancer training")
    distill_epochs: int = option(1, "device: double-distillation epochs per round")
    server_epochs: int = option(4, "aggregator: entropy-aware distillation epochs per round")
    aux_per_round: int = option(40, "aggregator: auxiliary texts per distillation")
    proto_init: float = option(0.0, "> 0: new head rows start as a nearest-prototype classifier (logit scale)")
    # device: keep the frozen prefix (embedding + block 0) of the task's training texts and of the
    # current task's test texts, 98 kB per 64-token text, instead of recomputing it in every pass
    prefix_cache: bool = option(True, "device: cache the frozen prefix (embedding + block 0) of the task's texts")
    # device: the encoder blocks above that prefix (1..5) run their matmuls in int8 in the Enhancer
    # passes (training, teachers, evaluation): about half the CPU of a training round; the selector's
    # features, the prefix and the aggregator stay float32 (``FrozenBackbone.with_int8_blocks``)
    int8_blocks: bool = option(False, "device: encoder blocks 1.. run their matmuls in int8 in the Enhancer passes")
    # device: the temporary group's distillation targets on its own texts (L_j) are its logits of
    # the round's training pass (each text's, before that step's update) instead of a second pass
    # after it; the memory's rows of U still get that pass
    teacher_from_training: bool = option(
        False, "device: the temporary group's own distillation targets from its training pass, not a second pass"
    )

    def __post_init__(self) -> None:
        if (
            min(self.num_groups, self.bottleneck, self.distill_epochs, self.aux_per_round) < 1
            or self.server_epochs < 0
            or self.max_length < 2
        ):
            raise ValueError(
                "fedet: expected num_groups, bottleneck, distill_epochs, aux_per_round >= 1, "
                "server_epochs >= 0, max_length >= 2"
            )
        if not 0 < self.gamma <= 1 or self.weight_decay < 0 or self.proto_init < 0:
            raise ValueError(
                f"fedet: expected gamma in (0, 1] and weight_decay >= 0, got {self.gamma}, {self.weight_decay}"
            )
