"""FIL-VER on the aggregator: phase-0 FedAvg, the frozen encoder sent once per device, the
rehearsal buffer and server-side training (SST).

* Rounds ``< phase0_rounds``: sample-weighted FedAvg of encoder and classifier.  The last one
  freezes the encoder; from then on the global model is the classifier alone.
* Every device in a round's roster that has not had the encoder gets it in a frame of its own
  (retained on its topic) before the round; the round's ``client_frames`` names them.
* After phase 0: FedAvg of the classifier; the round's rehearsal items join the buffer; with
  ``sst_steps`` the classifier takes that many SGD steps on the buffer (``server_train``,
  the only torch on this side, imported on first use); the result goes down.
* The buffer is committed with each round (a replayed journal re-checks updates, it never
  adds items: items enter only when a round is aggregated), holds at most ``buffer_size``
  items, and is never pruned by device state.  Eviction when full: drop the oldest item of
  the largest (task, class) group, so no task or class crowds out the others.
* Compressed (``wire.COMPRESSION``, the default): updates carry ``<name>@delta``; the
  aggregator keeps the true model (``TrueModel``: phase 0's encoder and classifier, then the
  classifier), adds the deltas' sample-weighted mean, runs SST on it, and announces the
  model devices hold moved by the top-k towards it.  The frozen encoder is the true one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

import numpy as np

from fclbases.update_checks import refuse_unexpected, task_report
from fclcore.aggregation import RunningSum, weighted_average
from fclcore.codec import Frame, SparseTensor, Tensor
from fclcore.schema import FederationSpec
from fclcore.sparsify import DELTA, Compression, TrueModel, checked_delta, mean_change
from fclcore.strategy import Checked, Downlinks, Rejected, Strategy, Update, tensor_nbytes
from methods.filver.config import FILVEROptions
from methods.filver.wire import (
    COMPRESSION,
    EMB_LOG_SIGMA,
    EMB_MU,
    EMB_Y,
    EMB_Z,
    ENC,
    FORM_TENSORS,
    classifier_shapes,
    density,
    encoder_shapes,
    initial_params,
    parse_report,
)

EMB_NAMES = (EMB_Y, EMB_Z, EMB_MU, EMB_LOG_SIGMA)
TRUE = "true/"  # checkpoint prefix of the model the deltas add up to (the downlink's residual)


@dataclass(frozen=True)
class Embeddings:
    """One update's rehearsal items: z (or mu) rows, log sigma rows (Stats), labels."""

    z: np.ndarray
    log_sigma: np.ndarray | None
    y: np.ndarray


class Buffer:
    """The aggregator's rehearsal buffer: arrays in arrival order (``seq`` increases); ``client``
    indexes ``clients``, who sent each item (kept for audits; SST ignores it)."""

    def __init__(self, latent: int, stats: bool, cap: int) -> None:
        self.cap = cap
        self.z = np.zeros((0, latent), np.float32)
        self.log_sigma = np.zeros((0, latent), np.float32) if stats else None
        self.y = np.zeros(0, np.int64)
        self.task = np.zeros(0, np.int64)
        self.seq = np.zeros(0, np.int64)
        self.client = np.zeros(0, np.int64)
        self.clients: list[str] = []
        self.next_seq = 0
        self.evicted = 0

    def __len__(self) -> int:
        return len(self.y)

    def add(self, items: Embeddings, task: int, client: str) -> None:
        n = len(items.y)
        if client not in self.clients:
            self.clients.append(client)
        self.client = np.concatenate([self.client, np.full(n, self.clients.index(client), np.int64)])
        self.z = np.concatenate([self.z, items.z])
        if self.log_sigma is not None:
            self.log_sigma = np.concatenate([self.log_sigma, items.log_sigma])
        self.y = np.concatenate([self.y, items.y])
        self.task = np.concatenate([self.task, np.full(n, task, np.int64)])
        self.seq = np.concatenate([self.seq, np.arange(self.next_seq, self.next_seq + n)])
        self.next_seq += n
        self._evict()

    def _evict(self) -> None:
        drop = []
        keep = np.ones(len(self), bool)
        while keep.sum() > self.cap:
            groups: dict[tuple[int, int], list[int]] = {}
            for i in np.flatnonzero(keep):
                groups.setdefault((int(self.task[i]), int(self.y[i])), []).append(int(i))
            largest = max(groups.values(), key=lambda rows: (len(rows), -min(self.seq[rows])))
            oldest = min(largest, key=lambda i: self.seq[i])
            keep[oldest] = False
            drop.append(oldest)
        if drop:
            self._keep(keep)
            self.evicted += len(drop)

    def _keep(self, keep: np.ndarray) -> None:
        self.z, self.y, self.task, self.seq = self.z[keep], self.y[keep], self.task[keep], self.seq[keep]
        self.client = self.client[keep]
        if self.log_sigma is not None:
            self.log_sigma = self.log_sigma[keep]

    def arrays(self) -> dict[str, np.ndarray]:
        out = {"buffer/z": self.z, "buffer/y": self.y, "buffer/task": self.task, "buffer/seq": self.seq}
        out["buffer/client"] = self.client
        if self.log_sigma is not None:
            out["buffer/log_sigma"] = self.log_sigma
        return out

    def restore(self, arrays: Mapping[str, np.ndarray], next_seq: int, evicted: int, clients: list[str]) -> None:
        try:
            z, y, task, seq, client = (arrays[f"buffer/{k}"] for k in ("z", "y", "task", "seq", "client"))
            log_sigma = arrays["buffer/log_sigma"] if self.log_sigma is not None else None
        except KeyError as exc:
            raise ValueError(f"filver checkpoint: missing {exc}") from None
        n = len(y)
        if z.shape != (n, self.z.shape[1]) or len(task) != n or len(seq) != n or len(client) != n:
            raise ValueError("filver checkpoint: the buffer's arrays do not fit")
        if n and not 0 <= client.min() <= client.max() < len(clients):
            raise ValueError("filver checkpoint: the buffer names unknown clients")
        self.z, self.log_sigma, self.y, self.task, self.seq = z, log_sigma, y, task, seq
        self.client, self.clients = client, list(clients)
        self.next_seq, self.evicted = next_seq, evicted


class FILVERStrategy(Strategy):
    def __init__(self, fed: FederationSpec, options: FILVEROptions, input_dim: int, aux_dir: str | None = None):
        super().__init__(fed, options, input_dim, aux_dir)
        self.o = options
        if self.schedule.last_round(0) < options.phase0_rounds:
            raise ValueError(
                f"filver: phase0_rounds {options.phase0_rounds} leaves no round of task 1 for the classifier; "
                f"give task 1 more rounds (federation.task_rounds[0] > phase0_rounds)"
            )
        self.enc_shapes = encoder_shapes(options, input_dim)
        self.cls_shapes = classifier_shapes(options)
        self.encoder: dict[str, np.ndarray] | None = None  # frozen after phase 0
        self.has_encoder: set[str] = set()  # devices the frozen encoder was sent to
        self.frames: dict[int, list[str]] = {}  # round -> devices that get a frame before it
        self.buffer = Buffer(options.latent, options.upload == "stats", options.buffer_size)
        self.compression = Compression.of(fed.wire, COMPRESSION)
        on = self.compression.up_density is not None or self.compression.down_density is not None
        self.true = TrueModel(self.compression.down_density, fed.wire.error_feedback) if on else None

    def initial_model(self) -> dict[str, np.ndarray]:
        return initial_params({**self.enc_shapes, **self.cls_shapes}, self.fed.seed)

    def fits(self, params: dict[str, np.ndarray]) -> bool:
        """A committed model is the phase-0 one (encoder + classifier) or the classifier alone."""
        shapes = {k: v.shape for k, v in params.items()}
        return shapes in ({**self.enc_shapes, **self.cls_shapes}, self.cls_shapes)

    @property
    def dense_fp32_bytes(self) -> int:
        """The reference of a round after phase 0: the classifier, dense float32."""
        return 4 * sum(int(np.prod(s)) for s in self.cls_shapes.values())

    def phase0(self, rnd: int) -> bool:
        return rnd < self.o.phase0_rounds

    def _trained(self, rnd: int) -> dict[str, tuple[int, ...]]:
        """The tensors a round's updates carry: encoder and classifier in phase 0, then the classifier."""
        return {**self.enc_shapes, **self.cls_shapes} if self.phase0(rnd) else self.cls_shapes

    # -- downlinks -------------------------------------------------------------------------
    def client_downlinks(self, rnd: int, clients: Sequence[str]) -> Downlinks:
        if self.phase0(rnd) or self.encoder is None:
            return {}
        task = self.schedule.task_of(rnd)
        new = [c for c in clients if c not in self.has_encoder]
        if new:  # rounds without a new device keep no entry (the state stays small)
            self.frames[rnd] = new
        self.has_encoder.update(new)
        return {c: ({"for_task": task, "encoder": True}, dict(self.encoder)) for c in new}

    def announce_meta(self, rnd: int) -> dict:
        return {"client_frames": self.frames.get(rnd, [])}

    def downlink_log(self, meta: dict) -> dict:
        return {"encoder": bool(meta.get("encoder"))}

    # -- updates ---------------------------------------------------------------------------
    def normalize(self, frame: Frame) -> Checked:
        rnd = frame.header.round
        place = self.schedule.place(rnd)
        shapes = self._trained(rnd)
        out: dict[str, Tensor] = {}
        for name, shape in shapes.items():
            share = density(name, self.compression.up_density, self.o)
            if share:
                t = frame.tensors.get(name + DELTA)
                if t is None:
                    raise ValueError(f"{name + DELTA}: expected the compressed change of {name}")
                out[name + DELTA] = checked_delta(name, t, shape, share)
                continue
            t = frame.tensors.get(name)
            if t is None or isinstance(t, SparseTensor) or tuple(t.shape) != shape:
                raise ValueError(f"{name}: expected a dense {shape} tensor")
            if not np.isfinite(t).all():
                raise Rejected("nonfinite", f"{name}: NaN or infinite values")
            out[name] = t
        refuse_unexpected(frame.tensors, {*out, *EMB_NAMES})
        report = task_report(parse_report, frame.meta, place.task, "filver")
        return Checked(out, self._embeddings(frame, report["form"]))

    def _embeddings(self, frame: Frame, form: str) -> Embeddings | None:
        """The update's rehearsal items, validated; None if it carries none."""
        sent = [n for n in EMB_NAMES if n in frame.tensors]
        if not sent:
            if form != "none":
                raise Rejected("embeddings", f"meta.filver.form {form!r} but no embedding tensors")
            return None
        if frame.meta.get("allow_embedding_upload") is not True:
            raise Rejected("consent", "embeddings from a device whose config does not allow embedding uploads")
        if self.phase0(frame.header.round) or self.o.upload == "none":
            raise Rejected("embeddings", "this federation takes no embeddings in this round")
        expected = {EMB_Y, *FORM_TENSORS[self.o.upload]}
        if form != self.o.upload or set(sent) != expected:
            raise Rejected("embeddings", f"expected form {self.o.upload!r} ({sorted(expected)}), got {form!r} {sent}")
        y = frame.tensors[EMB_Y]
        if isinstance(y, SparseTensor) or y.ndim != 1:
            raise Rejected("embeddings", f"{EMB_Y}: expected a dense vector of labels")
        n = len(y)
        if n > self.o.max_embed_per_round:
            raise Rejected("budget", f"{n} rehearsal items, the budget is {self.o.max_embed_per_round} per round")
        if not np.isfinite(y).all() or (y != np.round(y)).any() or (y < 0).any() or (y >= self.o.classes).any():
            raise Rejected("labels", f"{EMB_Y}: expected integer labels in [0, {self.o.classes})")
        rows = []
        for name in FORM_TENSORS[self.o.upload]:
            t = frame.tensors[name]
            if isinstance(t, SparseTensor) or tuple(t.shape) != (n, self.o.latent):
                raise Rejected("embeddings", f"{name}: expected a dense ({n}, {self.o.latent}) matrix")
            if not np.isfinite(t).all():
                raise Rejected("nonfinite", f"{name}: NaN or infinite values")
            rows.append(np.array(t, dtype=np.float32))
        if self.o.upload == "stats" and (
            (rows[1] < self.o.log_sigma_min).any() or (rows[1] > self.o.log_sigma_max).any()
        ):
            raise Rejected("embeddings", f"{EMB_LOG_SIGMA}: outside [{self.o.log_sigma_min}, {self.o.log_sigma_max}]")
        return Embeddings(rows[0], rows[1] if len(rows) > 1 else None, y.astype(np.int64))

    def bytes_by_kind(self, tensors: Mapping[str, Tensor], meta=None) -> dict[str, int]:
        out = {"model": 0, "embeddings": 0}
        for name, t in tensors.items():
            out["embeddings" if name.startswith("emb:") else "model"] += tensor_nbytes(t)
        return out

    # -- rounds ----------------------------------------------------------------------------
    def aggregate(self, updates: Sequence[Update], current: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        rnd = updates[0].frame.header.round
        merged = self._merged(updates, current, rnd)
        if self.phase0(rnd):
            if rnd + 1 < self.o.phase0_rounds:
                return self._announced(merged, current)
            self.encoder = {k: v for k, v in merged.items() if k.startswith(ENC)}  # frozen from here on
            if self.true is not None:  # the encoder's residual goes with phase 0: devices get it whole
                self.true.values = {k: v for k, v in self.true.values.items() if not k.startswith(ENC)}
            return self._announced({k: v for k, v in merged.items() if not k.startswith(ENC)}, current)
        task = self.schedule.task_of(rnd)
        for u in updates:  # sorted by client by the service: the buffer's order is reproducible
            if u.parsed is not None:
                self.buffer.add(u.parsed, task, u.client)
        if self.o.sst_steps and len(self.buffer):
            from methods.filver.server_train import server_side_training

            merged = server_side_training(merged, self.buffer, self.o, seed=(self.fed.seed, rnd))
        return self._announced(merged, current)

    def _merged(self, updates: Sequence[Update], current: dict[str, np.ndarray], rnd: int) -> dict[str, np.ndarray]:
        """FedAvg (sample-weighted) of the round's updates: of the announced model (``current``)
        uncompressed; under compression, of the true model, which the deltas' mean moves."""
        if self.true is None:
            return weighted_average([(dict(u.tensors), float(u.n_samples)) for u in updates], current)
        shapes = self._trained(rnd)
        true = {name: self.true.values.get(name, current[name]) for name in shapes}
        if not self.compression.up_density:  # dense uploads from the announced model: their mean's move
            plain = weighted_average([(dict(u.tensors), float(u.n_samples)) for u in updates], current)
            return {n: (true[n] + (plain[n].astype(np.float64) - current[n])).astype(np.float32) for n in shapes}
        running = RunningSum(shapes)
        for u in updates:
            running.add({name: u.tensors[name + DELTA] for name in shapes}, float(u.n_samples))
        return {
            n: (true[n] + mean_change(running.sums[n], running.total_weight, s)).astype(np.float32)
            for n, s in shapes.items()
        }

    def _announced(self, target: dict[str, np.ndarray], current: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The model to announce: ``target`` itself uncompressed; else the true model becomes
        ``target`` and what devices hold moves towards it by the top-k (``TrueModel.step``)."""
        if self.true is None:
            return target
        out = {}
        for name, value in target.items():
            true = self.true.values.get(name, current[name])
            share = density(name, self.compression.down_density, self.o)
            out[name] = self.true.step(name, current[name], value.astype(np.float64) - true, share)
        return out

    # -- checkpoint ------------------------------------------------------------------------
    def state(self) -> tuple[dict, dict[str, np.ndarray]]:
        arrays = dict(self.buffer.arrays())
        if self.true is not None:
            arrays.update(self.true.state(TRUE))
        if self.encoder is not None:
            arrays.update({f"encoder/{k}": v for k, v in self.encoder.items()})
        meta = {
            "frozen": self.encoder is not None,
            "has_encoder": sorted(self.has_encoder),
            "frames": {str(r): c for r, c in self.frames.items()},
            "buffer_next_seq": self.buffer.next_seq,
            "buffer_evicted": self.buffer.evicted,
            "buffer_clients": self.buffer.clients,
        }
        return meta, arrays

    def restore(self, meta: dict, arrays: dict[str, np.ndarray]) -> None:
        if not meta:
            return
        try:
            encoder = None
            if meta["frozen"]:
                encoder = {k: arrays[f"encoder/{k}"] for k in self.enc_shapes}
                if any(encoder[k].shape != s for k, s in self.enc_shapes.items()):
                    raise ValueError("filver checkpoint: the frozen encoder does not fit")
            clients = [str(c) for c in meta["buffer_clients"]]
            self.buffer.restore(arrays, int(meta["buffer_next_seq"]), int(meta["buffer_evicted"]), clients)
            self.has_encoder = {str(c) for c in meta["has_encoder"]}
            self.frames = {int(r): [str(c) for c in cs] for r, cs in meta["frames"].items()}
        except (KeyError, TypeError) as exc:
            raise ValueError(f"filver checkpoint: missing or malformed {exc}") from None
        if self.true is not None:
            self.true.restore(arrays, TRUE, {**self.enc_shapes, **self.cls_shapes})
        self.encoder = encoder
