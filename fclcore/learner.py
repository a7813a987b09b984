"""The device half of a learning method, as the client daemon sees it.

The daemon owns the round protocol (what arrives, when to evaluate, when to send); a
``Learner`` owns the model: it merges the global model, starts tasks, trains a round, says
what to upload, evaluates, and describes what the device serves (``served_model``, a
``fclcore.served`` description that ``export`` turns into ONNX).  No torch import here:
each method's learner brings its own framework.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from fclcore.codec import Frame, Tensor
from fclcore.data import Dataset
from fclcore.schedule import RoundPlace
from fclcore.schema import FederationSpec


def round_seed(*parts: int) -> int:
    """A 63-bit seed from integers (for per-client, per-round shuffling)."""
    return int(np.random.SeedSequence(list(parts)).generate_state(2, dtype=np.uint32).view(np.uint64)[0] >> 1)


class Learner:
    """One client's model and optimiser state across rounds and tasks.

    ``allow_embedding_upload``: the device's privacy opt-in (``ClientConfig.allow_embedding_upload``,
    set by the daemon right after building the learner); only then may a method upload embeddings
    of the device's data."""

    metric = "nll"  # what ``evaluate`` returns per task: "nll" (lower is better) or "accuracy"
    sees_all_tasks = False  # True: ``train_round`` gets every task's data from the start (offline)
    allow_embedding_upload = False  # True: this device opted in to uploading embeddings of its data
    fleet_data: tuple[Dataset, ...] | None = None  # every device's shard per task (MethodSpec.fleet_data only)
    # True: ``train_round`` and ``evaluate`` also take binarised images as uint8 0/1 (a compact
    # set, ``fclcore.data.float_pixels``) and convert per batch; the daemon then keeps its shard
    # in a quarter of float32's memory.  False: the daemon hands the learner float32 pixels.
    compact_pixels = False
    # a directory of the device's state directory for what the learner keeps on disk across tasks
    # (set by the daemon right after building the learner; None: keep it in memory)
    store_dir: str | None = None
    # True: the learner keeps what coding took from its upload (error feedback, fclcore.sparsify),
    # so the daemon hands it the update as the aggregator decodes it (``uploaded``) before the checkpoint
    reads_upload = False

    def __init__(self, fed: FederationSpec, options: Any, input_dim: int, client_index: int) -> None:
        self.fed = fed
        self.options = options
        self.input_dim = input_dim
        self.client_index = client_index
        self.task = -1

    def place(self, device: Any, amp: str) -> None:
        """Train on ``device`` (a ``torch.device``) with mixed precision ``amp`` (``fclcore.device``):
        the model, optimiser state and batches go there, uploads come back to host memory.  The
        daemon calls it right after building the learner, and only when the device's config asks
        for something other than the CPU without amp.  A method not yet moved off the CPU says so."""
        raise ValueError(f"method {self.fed.method} trains on the CPU without amp only (asked: {device}, amp {amp})")

    def load_global(self, tensors: dict[str, Tensor], rnd: int, meta: dict | None = None) -> None:
        """Merge the aggregator's model (``meta``: the round message's metadata); ValueError if
        names or shapes do not fit."""
        raise NotImplementedError

    def start_task(self, task: int, downlink: Frame | None) -> None:
        """Called once before the first round of each task (with this device's own downlink
        frame for that round, if the strategy sent one)."""
        self.task = task

    def lacks(self, downlink: Frame) -> list[str]:
        """What a task's own downlink frame refers to that neither it carries nor this device
        holds (e.g. knowledge-base entries sent before and lost since): the daemon then fetches
        the frame that carries everything instead.  ValueError if the frame is malformed."""
        return []

    def receive_frame(self, frame: Frame, rnd: int) -> None:
        """A frame the strategy sent this device alone for round ``rnd`` of the task in hand
        (not its first round); called before ``train_round``.  ValueError if it does not fit."""
        raise ValueError(f"{type(self).__name__} takes no frame of its own in the middle of a task")

    def train_round(self, train: Sequence[Dataset], rnd: int, place: RoundPlace) -> tuple[int, float | None]:
        """Local training for round ``rnd``; ``train[i]`` is task i's data for i <= current task
        (for every task if ``sees_all_tasks``; for an ``own_clock`` method, every task of the device
        with None where it has not arrived yet).  Returns (samples used, mean train NLL, or None
        when the method has no single training NLL to report)."""
        raise NotImplementedError

    def upload(self, rnd: int, place: RoundPlace) -> dict[str, Tensor]:
        """The tensors to send for this round."""
        raise NotImplementedError

    def uploaded(self, tensors: dict[str, Tensor]) -> None:
        """This round's upload as the aggregator decodes it (only for ``reads_upload``)."""

    def report(self, place: RoundPlace) -> dict:
        """Extra JSON metadata for this round's upload."""
        return {}

    def evaluate(self, tests: Sequence[Dataset | None]) -> list[float | None]:
        """Per task, the ``metric`` on its test data; None where no data is given."""
        raise NotImplementedError

    def served_model(self, task: int, binarize: str = "") -> Any:
        """What the device serves now (a ``fclcore.served`` description), or None if nothing yet."""
        return None

    # A restarted daemon rebuilds the learner's structure by calling ``start_task`` for every
    # task it had started (with the same downlink frames), then ``load_state``.
    def state(self) -> tuple[dict, dict[str, np.ndarray]]:
        """(JSON meta, arrays) of everything ``load_state`` needs.  The arrays may be views of
        the live state (no second copy of the learner in memory): the caller writes them before
        the learner trains again, as the daemon's checkpoint does."""
        raise NotImplementedError

    def load_state(self, meta: dict, arrays: dict[str, np.ndarray]) -> None:
        """Inverse of ``state`` on a learner rebuilt to the same structure; ValueError if it
        does not fit."""
        raise NotImplementedError
