"""Server-side training (SST, Alg. 1 l. 11-12): S SGD steps of the classifier on the
aggregator's rehearsal buffer, after FedAvg.  The only torch import on the aggregator's side
of FIL-VER; ``strategy`` imports this module on first use.

Each step draws ``sst_batch`` items uniformly from the whole buffer (every task, every device,
including devices that have left); Stats items get a fresh z = mu + sigma * eps per step.
SGD with momentum starts afresh every round; draws are seeded by (federation seed, round), and
torch runs one thread here, so the result does not depend on the machine's core count.
"""

from __future__ import annotations

import numpy as np
import torch
from torch.nn import functional as F

from methods.filver.config import FILVEROptions
from methods.filver.model import Classifier, get_params, load_params, sample
from methods.filver.wire import CLS


def server_side_training(params: dict[str, np.ndarray], buffer, o: FILVEROptions, seed: tuple[int, int]) -> dict:
    """``params`` (the classifier after FedAvg) -> the classifier after ``o.sst_steps`` steps."""
    torch.set_num_threads(1)  # float sums in one order: the same numbers on any core count (and as in-process)
    torch.manual_seed(int(np.random.SeedSequence(list(seed)).generate_state(1)[0]))
    gen = torch.Generator().manual_seed(int(np.random.SeedSequence([*seed, 5]).generate_state(1)[0]))
    model = Classifier(o)
    load_params(model, CLS, params)
    opt = torch.optim.SGD(model.parameters(), lr=o.sst_lr, momentum=o.momentum)
    z, y = torch.from_numpy(np.asarray(buffer.z, np.float32)), torch.from_numpy(np.asarray(buffer.y, np.int64))
    log_sigma = None if buffer.log_sigma is None else torch.from_numpy(np.asarray(buffer.log_sigma, np.float32))
    for _ in range(o.sst_steps):
        rows = torch.randint(len(y), (min(o.sst_batch, len(y)),), generator=gen)
        batch = sample(z[rows], None if log_sigma is None else log_sigma[rows], gen)
        loss = F.cross_entropy(model(batch), y[rows])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    return get_params(model, CLS)
