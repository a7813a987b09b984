"""A round's work on the device, once the protocol has accepted its announcement: wait for the
task's data (a task folder) and for the device's own frames, evaluate the global model, train,
checkpoint, upload, hand the model to serving; at the end of the run, the final evaluation.

After every update the device checkpoints itself (``edge_client.state``) before publishing,
and keeps the update until a later round is announced, so that a restart re-sends it rather
than training again.
"""

from __future__ import annotations

import logging
import time

from edge_client.frames import ClientFrames
from edge_client.handoff import ServeHandoff
from edge_client.learning import DeviceLearner
from edge_client.modelsync import ModelSync
from edge_client.protocol import RejectedFrame, places
from edge_client.serving import ServedModelWriter, ServeJob
from edge_client.state import ClientState, ClientStateStore
from edge_client.status import RoundStats
from edge_client.uplink import Uplink, check_finite
from fclcore.checkpoint import CheckpointError
from fclcore.codec import Frame, Kind
from fclcore.config import ConfigError, from_dict, to_dict
from fclcore.procmem import release_free_memory
from fclcore.schema import ClientConfig, FederationSpec

log = logging.getLogger("edge_client.daemon")  # its parts log as the daemon did before the split


class RoundWork:
    def __init__(
        self,
        cfg: ClientConfig,
        device: DeviceLearner,
        frames: ClientFrames,
        sync: ModelSync,
        uplink: Uplink,
        stats: RoundStats,
        store: ClientStateStore,
        writer: ServedModelWriter,
        link,
        notifier,
    ) -> None:
        self.cfg, self.device, self.frames, self.sync, self.uplink = cfg, device, frames, sync, uplink
        self.stats, self.store, self.writer, self.link, self.notifier = stats, store, writer, link, notifier
        self.handoff = ServeHandoff(writer, cfg.serve.every)
        self.waiting: tuple[Frame, int] | None = None  # a round whose task's data has not arrived yet
        self.pending: tuple[Frame, int] | None = None  # a round waiting for the device's own frame
        self.final_eval: bytes | None = None  # the final evaluation sent, re-sent until the end is committed

    # -- checkpoints ---------------------------------------------------------------------
    def restore(self) -> None:
        """Continue from the last checkpoint, if there is one for this device."""
        try:
            state = self.store.load()
        except CheckpointError as exc:
            raise ConfigError(f"state_dir: {exc}; move it away to rejoin from scratch") from None
        if state is None:
            return
        if state.client_id != self.cfg.client_id or state.federation.get("name") != self.cfg.federation:
            raise ConfigError(
                f"state_dir {self.store.path.parent}: it belongs to {state.client_id!r} in "
                f"{state.federation.get('name')!r}; move it away to rejoin from scratch"
            )
        self.device.input_dim = self.device.input_dim or state.input_dim
        try:
            fed = from_dict(FederationSpec, state.federation, "checkpoint", "federation")
            self.device.resume(state, fed, self.uplink.limits)
        except ValueError as exc:  # ConfigError and CodecError are ValueErrors
            raise ConfigError(
                f"state_dir {self.store.path.parent}: cannot resume ({exc}); move it away to rejoin from scratch"
            ) from None
        self.frames.restore(state.frames)
        self.uplink.unacked = state.unacked
        self.uplink.sequence = max(self.uplink.sequence, state.sequence)
        log.info(
            "resuming after round %d (task %d)%s",
            self.device.done_round,
            self.device.task,
            "; the last update is not yet acknowledged" if self.uplink.unacked else "",
        )

    def checkpoint(self, unacked: bytes) -> None:
        device = self.device
        meta, arrays = device.learner.state()
        self.store.save(
            ClientState(
                self.cfg.client_id,
                to_dict(device.fed),
                device.task,
                device.done_round,
                self.uplink.sequence,
                self.frames.raw,
                unacked,
                meta,
                arrays,
                device.input_dim,
                device.run_id or "",
            )
        )

    # -- the round -------------------------------------------------------------------------
    def retry_waiting(self) -> bool:
        """While idle: join the waiting round as soon as its task's data has arrived."""
        if self.waiting is None or not self.device.have_data(self.waiting[0].header.task):
            return False
        frame, size = self.waiting
        self.waiting = None
        log.info("data for task %d arrived in %s", frame.header.task, self.device.task_dir.root)
        try:
            return self.handle_round(frame, size)
        except RejectedFrame as exc:
            self.stats.drop(exc)
            return False

    def take_pending(self) -> bool:
        """The round that waited for the device's own frame, now that it is here."""
        pending, self.pending = self.pending, None
        return self.handle_round(*pending) if pending is not None else False

    def take_own_frame(self, topic: str, frame: Frame, payload: bytes, size: int) -> bool:
        """A frame sent to this device alone (or the full one it fetched): kept; the round that
        waited for it goes on."""
        device = self.device
        if topic == self.frames.full_topic:
            return self.frames.take_full(frame, payload, size, device.learner) and self.take_pending()
        if not self.frames.take(topic, frame, payload, size, device.task, device.done_round):
            return False
        if self.pending is not None and not self.frames.wanted(self.pending[0], device.task, device.done_round):
            return self.take_pending()
        return False

    def answer_request(self, frame: Frame, arrival: float) -> None:
        """The aggregator asks for frames it misses: this device's update of that round (or its
        final evaluation) is sent again."""
        if self.cfg.client_id not in frame.meta.get("missing", ()):
            return
        if frame.meta.get("kind") == Kind.EVAL.name and self.final_eval is not None:
            self.uplink.send(self.final_eval, f"resend:eval:{frame.header.round}")
        else:
            self.uplink.resend(frame.header.round, self.device.done_round, arrival, "the aggregator asked for it")

    def handle_round(self, frame: Frame, size: int) -> bool:
        device = self.device
        if not device.have_data(frame.header.task):
            if self.waiting is None or self.waiting[0].header.task != frame.header.task:
                log.info(
                    "round %d is on task %d: waiting for its folder in %s",
                    frame.header.round,
                    frame.header.task,
                    device.task_dir.root,
                )
                if device.task >= 0:  # meanwhile, serve what the federation learned up to here
                    self.writer.submit(
                        self.served(
                            frame.header.round - 1, places(frame)[1], task_ended=frame.header.task != device.task
                        )
                    )
                    self.writer.wait()  # nothing to train until the data comes: serve it before saying so
                self.link.publish_status("online", waiting_for_task=frame.header.task)
            self.waiting = (frame, size)
            return False
        new_task = frame.header.task != device.task  # the task's own frame counts for its first round
        if new_task and self.frames.lacking(frame.header.task, device.learner):
            self.pending = (frame, size)
            return False  # the round waits for the full frame
        own = self.frames.round_bytes(frame.header.round, frame.header.task, new_task)
        self.stats.ledger.counted(frame.header.round, size, own)
        self.round(frame)
        return False

    def served(self, after_round: int, previous, task_ended: bool) -> ServeJob | None:
        """The model to hand to serving after ``after_round`` (``ServeHandoff.served``)."""
        device = self.device
        return self.handoff.served(device.learner, device.data.test, after_round, previous, task_ended)

    def round(self, frame: Frame) -> None:
        # the last round's export (its update is out already) finishes before this round's evaluation
        # and training, whose peaks it would add to (issue 40: FedSeIT's grew by 100 MB per task)
        self.writer.wait(self.cfg.serve.export_timeout_s)
        cpu_start, thread_start = time.process_time(), time.thread_time()
        device, learner = self.device, self.device.learner
        rnd, task = frame.header.round, frame.header.task
        place, previous = places(frame)
        task_ended = task != device.task and device.task >= 0
        if device.task < 0:  # a fresh device (one enrolling at task t too) evaluates with its tasks started
            device.start_tasks(task, self.frames)
        report = device.evaluate(rnd - 1, previous)
        eval_cpu = time.thread_time() - thread_start
        served = self.served(after_round=rnd - 1, previous=previous, task_ended=task_ended)
        if task != device.task:
            device.start_tasks(task, self.frames)
        elif (own := self.frames.pop_mid(rnd)) is not None:
            try:
                learner.receive_frame(own, rnd)
            except ValueError as exc:
                raise RejectedFrame(f"knowledge: {exc}") from None
        n_samples, train_nll = learner.train_round(device.arrived(rnd, task), rnd, place)
        tensors = learner.upload(rnd, place)
        train_cpu = time.thread_time() - thread_start - eval_cpu
        check_finite(rnd, train_nll, tensors, device.fed.wire.value_dtype)  # nothing non-finite leaves the device
        meta = {
            "n_samples": n_samples,
            "train_nll": None if train_nll is None else round(train_nll, 4),
            **({"eval": report} if report is not None else {}),
            "rejected": dict(self.stats.rejected),
            **({"sync": sync} if (sync := self.sync_report()) else {}),
            **learner.report(place),
            **({"allow_embedding_upload": True} if self.cfg.allow_embedding_upload else {}),
        }
        self.stats.ledger.reported(rnd, sync)
        payload = self.uplink.frame(Kind.UPDATE, rnd, task, meta, tensors, device.fed.value_coding, device.run_id)
        if learner.reads_upload:  # error feedback: what coding lost stays in the learner (checkpointed next)
            learner.uploaded(self.uplink.decoded_tensors(payload))
        device.done_round, self.uplink.unacked = rnd, payload
        self.checkpoint(payload)  # before publishing: a crash after this re-sends, never retrains
        self.uplink.send(payload, f"update:{rnd}")
        self.uplink.sent_at = time.monotonic()
        self.writer.submit(served)  # exported in the background, never before the update is out
        release_free_memory()  # the round's freed buffers go back to the OS, not into next round's peak
        self.stats.round_done(rnd, time.process_time() - cpu_start, eval_cpu, train_cpu)
        meter = self.link.meter.snapshot()
        self.link.publish_status(
            "online",
            task=task,
            round=rnd,
            bytes_up=meter["up"]["bytes"],
            bytes_down=meter["down"]["bytes"],
            waiting_for_task=None,
            health=self.stats.health(self.sync_report(), meter, self.cfg.memory_budget_mb),
        )
        self.notifier.status(f"round {rnd}, task {task}")
        trained = "" if meta.get("train_nll") is None else f", train NLL {meta['train_nll']:.4f}"  # classifiers: none
        log.info("round %d task %d: %d samples%s", rnd, task, n_samples, trained)

    def finish(self, frame: Frame) -> None:
        _, previous = places(frame)
        report = self.device.evaluate(frame.header.round - 1, previous, everything=True)
        served = self.served(after_round=frame.header.round - 1, previous=previous, task_ended=True)
        meta = {**({"eval": report} if report is not None else {}), "rejected": dict(self.stats.rejected)}
        rnd, task = frame.header.round, frame.header.task
        payload = self.uplink.frame(Kind.EVAL, rnd, task, meta, {}, self.device.fed.value_coding, self.device.run_id)
        self.final_eval = payload
        self.uplink.deliver(payload, f"eval:{rnd}")
        self.writer.submit(served)
        self.writer.wait()  # the final model is in service before the daemon exits
        log.info(
            "run finished; final %s per task %s",
            self.device.learner.metric,
            (report or {}).get(self.device.learner.metric),
        )

    def sync_report(self) -> dict[str, int]:
        """The cumulative resync counts every update reports: the model's and the device's own frames'."""
        return {**self.sync.report(), **self.frames.syncs}
