"""Options of the ConFedMADE package (``federation.options``): ConFedMADE, FedWeIT-MADE(*) and
the FedAvg-family baselines of the paper's comparison.  Each method reads the ones it uses.

Defaults for the decomposed methods follow the ConFedMADE paper (appendix B.1).  The MADE
architecture itself is ``federation.model`` (``fclcore.schema.ModelSpec``); the MADE order
schedule is the shared base's option (``fclbases.made.options.MadeOptions``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional

from fclbases.made.options import MadeOptions
from fclcore.config import option


@dataclass
class ConFedMADEOptions(MadeOptions):
    lambda1: float = option(1e-4, "L1 sparsity of the task-adaptive parameters A")
    lambda2: float = option(100.0, "drift penalty on B*sigmoid(m_i) + A_i of earlier tasks")
    lambda3: float = option(10.0, "A_t starts as B / lambda3")
    mask_init: float = option(2.0, "initial unit-mask logit m (sigmoid(2) = 0.88)")
    keep_units: float = option(1.0, "share of output units (ranked by sigmoid(m)) whose base goes up each round")
    upload_made_mask: bool = option(True, "confedmade: restrict uploads to the round's MADE mask (ablation switch)")
    kb_threshold: float = option(1e-3, "|A_t| below this is not sent to the knowledge base")
    kb_policy: Literal["all", "recent", "random"] = option("all", "which entries a client gets (Algorithm 2 line 6)")
    kb_k: int = option(4, "entries per client for the recent/random policies")
    # the policy's entries, most recent task first, while they fit
    kb_budget_mb: Optional[float] = option(
        None, "bound on a client's knowledge frame (MB on the wire); null: none (it grows with clients x tasks)"
    )
    prox_mu: float = option(0.01, "fedprox proximal weight")
    ewc_lambda: float = option(100.0, "fedcurv/EWC penalty weight")
    # every ``catchup_every`` rounds an upload also carries the ``catchup_share`` of each weight's
    # entries outside the round's selection that moved furthest from the global model
    catchup_every: int = option(0, "confedmade catch-up sync: every this many rounds (0: never)")
    catchup_share: float = option(0.05, "catch-up share of each weight with the largest change")
    # Adam leaves the entries of B and the A_i outside the step's MADE mask (with order_per: round,
    # the round's upload mask) as they are, value and moments, so they resume their momentum when a
    # later mask holds them again; off: a plain Adam step moves them with their stale moments (the NLL
    # gives them no gradient) and decays the moments, and since load_global overwrites only the
    # entries a device sent, those moves stay in its model.  Its effect on NLL and device CPU:
    # README.md, "Adam held outside the round's MADE mask" (benchmarks/results/seqmnist_r10.json).
    masked_moments: Optional[bool] = option(
        None, "decomposed methods: Adam holds entries outside the MADE mask; null: on for confedmade only"
    )

    def __post_init__(self) -> None:
        for name in ("lambda1", "lambda2", "kb_threshold", "prox_mu", "ewc_lambda"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}: expected >= 0, got {getattr(self, name)}")
        if self.lambda3 <= 0 or not 0 < self.keep_units <= 1 or self.kb_k < 1:
            raise ValueError("expected lambda3 > 0, keep_units in (0, 1], kb_k >= 1")
        if self.catchup_every < 0 or not 0 < self.catchup_share <= 1:
            raise ValueError("expected catchup_every >= 0 and catchup_share in (0, 1]")
        if self.kb_budget_mb is not None and not self.kb_budget_mb > 0:
            raise ValueError(f"kb_budget_mb: expected a positive size in MB or null, got {self.kb_budget_mb}")
