"""FedET on the device: Enhancer groups on a frozen transformer (Liu et al., IJCAI 2023).

* ``selector``  -- the Enhancer Select Module (nearest global class prototype -> group);
* ``memory``    -- the bounded sample memory (store ratio gamma);
* ``losses``    -- double distillation (eq. 3-5) as pure functions;
* ``learner``   -- Local_ICL (Algorithm 1): temporary group, distillation, the upload;
* ``baselines`` -- finetune / replay / multi-task FedAvg on one Enhancer group.

Not yet wired into ``edge_client.daemon``; ``benchmarks/bench_fedet_bbc.py`` runs the whole
message flow in-process (class sums -> assignment + prototypes -> group uploads -> the
changed group back), every frame through the wire codec.
"""
from edge_client.fedet.learner import FedETClient, FedETConfig, GroupUpload

__all__ = ["FedETClient", "FedETConfig", "GroupUpload"]
