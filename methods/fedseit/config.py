"""Options of the FedSeIT package (``federation.options``): FedSeIT, its SIT and DLS variants,
and the FedWeIT-on-CNN baseline.  Defaults follow the FedSeIT paper (Tab. 4) as adapted in
the reading notes (section 2, G2-G13): lambda1 on A only, A_t = B / 5, mask logits from 0.
"""

from __future__ import annotations

from dataclasses import dataclass

from fclcore.config import option

# the base of these units goes up each round, and these entries of A_t at a task's end: every
# one by default.  0.2 and 0.05 (with down_sparsify: topk, down_density: 0.05) cut the bytes to
# 6.6% of dense fp32 but cost 1.9-3.4 accuracy points and FedSeIT's lead over FedWeIT-CNN
# (docs/wire.md, "FedSeIT"), so they are options, not the default; int8 values are the default
KEEP_UNITS, KB_DENSITY = 1.0, 1.0


@dataclass
class FedSeITOptions:
    max_length: int = option(64, "wordpieces per text, [CLS] and [SEP] included")
    kernel_sizes: list[int] = option([3, 4, 5], "the convolution kernel widths (wordpieces), one conv each")
    filters: int = option(128, "output channels of each conv (N^F)")
    dropout: float = option(0.3, "dropout before the classifier head")
    embed_rms: float = option(0.4, "the frozen MiniLM table is rescaled once to this RMS (notes G7)")
    lambda1: float = option(1e-3, "L1 on every task-adaptive A (not on the mask: notes G6)")
    lambda2: float = option(1.0, "retroactive drift ||dB * sigmoid(m_i) + dA_i||^2 of earlier tasks")
    adaptive_div: float = option(5.0, "A_t starts as B / adaptive_div")
    mask_init: float = option(0.0, "initial logit of the per-task unit mask m")
    keep_units: float = option(KEEP_UNITS, "share of output units (ranked by sigmoid(m)) whose base goes up")
    kb_threshold: float = option(1e-3, "|A_t| below this is not sent to the knowledge base")
    kb_density: float = option(KB_DENSITY, "share of A_t's entries sent to the knowledge base (its largest by |A|)")
    slots: int = option(3, "foreign slots without SIT: the previous-task A of up to this many clients")
    sit: bool = option(False, "Selective Inter-client Transfer: top-K entries by the centres' similarity")
    sit_k: int = option(3, "K, the slots with SIT")
    sit_q: int = option(200, "Q, the most centres a device sends per task")
    sit_tau: float = option(0.0, "pairwise cosines <= tau count 0 in the score (0: the paper's plain mean)")
    dls: bool = option(False, "+DLS: also federate W_f and W_c (decomposed like the convs); heads stay local")

    def __post_init__(self) -> None:
        if not 2 <= self.max_length <= 512 or self.filters < 1 or not self.kernel_sizes:
            raise ValueError("expected max_length in [2, 512], filters >= 1 and at least one kernel size")
        if any(k < 1 or k > self.max_length for k in self.kernel_sizes) or len(set(self.kernel_sizes)) != len(
            self.kernel_sizes
        ):
            raise ValueError(f"kernel_sizes: expected distinct sizes in [1, max_length], got {self.kernel_sizes}")
        for name in ("lambda1", "lambda2", "kb_threshold"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}: expected >= 0, got {getattr(self, name)}")
        if not 0 <= self.dropout < 1 or self.adaptive_div <= 0 or self.embed_rms <= 0:
            raise ValueError("expected dropout in [0, 1), adaptive_div > 0, embed_rms > 0")
        for name in ("keep_units", "kb_density"):
            if not 0 < getattr(self, name) <= 1:
                raise ValueError(f"{name}: expected a share in (0, 1], got {getattr(self, name)}")
        if self.slots < 1 or self.sit_k < 1 or self.sit_q < 1 or not -1 <= self.sit_tau < 1:
            raise ValueError("expected slots >= 1, sit_k >= 1, sit_q >= 1 and sit_tau in [-1, 1)")

    @property
    def num_slots(self) -> int:
        """Foreign slots per task: K with SIT, else ``slots``."""
        return self.sit_k if self.sit else self.slots
