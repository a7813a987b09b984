"""The run directory contract: ``metrics.jsonl`` (one JSON object per event) and ``summary.json``.

Event kinds written to metrics.jsonl (field ``event``):

* ``round_client`` — one per (round, client): bytes_up/bytes_down (MQTT PUBLISH packet
  bytes), payload_up/payload_down, up_kinds/down_kinds (the packet bytes by kind: ``model``,
  ``knowledge``: the per-client frames' tensors, ``control``), dense_fp32_up/dense_fp32_down
  (what dense float32 FedAvg would have sent: the reference), full_finetune_fp32_up/_down
  (methods that train adapters on a frozen backbone: the whole model each way), sync (the
  sync frames the device fetched: model "full", "catchup", ...; "knowledge", the full
  per-client frames), status (accepted | missing), n_samples, train_nll;
* ``round`` — one per closed round: accepted clients, duration, attempt, and the wall-clock
  times (Unix seconds) of its first and last accepted update (``first_update_t``,
  ``last_update_t``; what the fleet benchmark times folding and closing by);
* ``eval`` — a client's held-out NLL per task for the global model after ``round``;
* ``round_summary`` — mean over clients of the current task's NLL after ``round``;
* ``rejected`` — a message the aggregator dropped, with its reason (counted in summary.json
  ``rejected``); what each device dropped is its ``rejected_by_client`` in ``round_client``
  (cumulative), and its latest count is summary.json ``rejected_by_client``;
* ``resumed`` — the aggregator restarted from its committed state (lines after the last
  committed round were dropped and that round runs again);
* ``membership`` — with a membership table: a client ``retired`` when a task started, or
  ``enrolled`` (a late client's first round in a roster).

``fcl simulate`` appends one ``run_level`` line per device once every participant has exited:
the bytes of its meter no ``round_client`` row counts, by kind (``fcl_edge.attribution``).

``summary.json`` has ``status`` (``complete``: the run's end is committed; ``interrupted``:
stopped, a restart goes on; ``failed``: the aggregator gave up), ``missing_final_evaluations``
(the devices of the last task whose final evaluation is not in ``final``), ``final`` (the mean
of per-client continual metrics, over clients with a report at every task end) and ``fleet``:
the continual metrics of one matrix whose row t is, per test task, the mean over every client
that reported after task t (so devices that enrolled late or retired count in the rows they
reported; a row nobody reported is null).
"""

from __future__ import annotations

import json
import os
import threading
import warnings
from collections import Counter, defaultdict
from pathlib import Path

import numpy as np

from aggregator.inbox import eval_metric
from fclcore.continual import accuracy_metrics, continual_metrics, loss_matrix, mean_metrics

MAX_REJECTION_EVENTS = 10_000  # beyond this, rejections are only counted (a flood must not fill the disk)


# what ``up_vs_dense`` / ``down_vs_dense`` divide by: every round's exchange with each trained
# tensor sent whole, in float32, both ways (the FedAvg reference of the run's own method)
DENSE_REFERENCE = "dense fp32 FedAvg of the tensors the method trains"
# the second reference of a method that trains adapters on a frozen backbone (FedET's paper's)
FULL_FINETUNE_REFERENCE = "dense fp32 full fine-tuning: the whole model, frozen backbone included"


def share(sent: int, dense: int) -> float | None:
    """``sent`` as a share of the dense reference, to 4 decimals (None without a reference)."""
    return round(sent / dense, 4) if dense else None


class RunLog:
    def __init__(self, out_dir: str | os.PathLike) -> None:
        self.dir = Path(out_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self._file = open(self.dir / "metrics.jsonl", "a", encoding="utf-8")
        self._lock = threading.Lock()
        self.rejections: Counter[str] = Counter()  # reason -> messages the aggregator dropped
        self.client_rejections: dict[str, dict[str, int]] = {}  # client -> its latest reason -> count
        self.bytes: dict[str, Counter] = defaultdict(Counter)  # client -> up/down/payload totals
        self.dense_fp32_up = 0
        self.dense_fp32_down = 0
        self.full_finetune: Counter[str] = Counter()  # up/down: the full fine-tuning reference's bytes
        self.kinds: dict[str, Counter] = {"up": Counter(), "down": Counter()}  # direction -> kind -> bytes
        self.syncs: Counter[str] = Counter()  # sync frames fetched by devices, by reason
        self.evals: dict[str, dict[int, dict]] = defaultdict(dict)  # client -> round -> report

    def write(self, event: str, flush: bool = True, **fields: object) -> None:
        """Append one event; ``flush=False`` leaves it in the buffer for the next flushed write
        (a round's thousand ``round_client`` rows are one write to the file, not a thousand)."""
        line = json.dumps({"event": event, **fields}, sort_keys=False)
        with self._lock:
            self._file.write(line + "\n")
            if flush:
                self._file.flush()

    def round_client(
        self,
        rnd: int,
        task: int,
        client: str,
        *,
        up: int,
        payload_up: int,
        down: int,
        payload_down: int,
        dense_fp32_up: int,
        dense_fp32_down: int = 0,
        **extra: object,
    ) -> None:
        totals = self.bytes[client]
        totals.update(up=up, payload_up=payload_up, down=down, payload_down=payload_down)
        self._note_client_rejections(client, extra.get("rejected_by_client"))
        self._note_kinds(extra)
        self.dense_fp32_up += dense_fp32_up
        self.dense_fp32_down += dense_fp32_down
        self.write(
            "round_client",
            False,  # the round's own event, after its clients' rows, flushes them all
            round=rnd,
            task=task,
            client=client,
            bytes_up=up,
            bytes_down=down,
            payload_up=payload_up,
            payload_down=payload_down,
            dense_fp32_up=dense_fp32_up,
            dense_fp32_down=dense_fp32_down,
            **extra,
        )

    def offset(self) -> int:
        """Bytes of metrics.jsonl written so far (a checkpoint records it)."""
        with self._lock:
            self._file.flush()
            return self._file.tell()

    def resume(self, offset: int, rejections: dict[str, int]) -> None:
        """After a restart: drop lines past the last committed round and rebuild the counters
        from the lines before it, so no round is counted twice."""
        path = self.dir / "metrics.jsonl"
        with self._lock:
            self._file.close()
            with open(path, "r+b") as handle:
                if handle.seek(0, os.SEEK_END) < offset:
                    raise ValueError(
                        f"{path} is shorter ({handle.tell()} bytes) than the checkpoint's "
                        f"offset {offset}: it was truncated or replaced"
                    )
                handle.truncate(offset)
            self._file = open(path, "a", encoding="utf-8")
        with open(path, encoding="utf-8") as handle:
            for line in handle:
                event = json.loads(line)
                if event["event"] == "round_client":
                    self.bytes[event["client"]].update(
                        up=event["bytes_up"],
                        payload_up=event["payload_up"],
                        down=event["bytes_down"],
                        payload_down=event["payload_down"],
                    )
                    self.dense_fp32_up += event.get("dense_fp32_up", 0)
                    self.dense_fp32_down += event.get("dense_fp32_down", 0)
                    self._note_kinds(event)
                    self._note_client_rejections(event["client"], event.get("rejected_by_client"))
                elif event["event"] == "eval":
                    report = {k: v for k, v in event.items() if k not in ("event", "client")}
                    self.evals[event["client"]][report["round"]] = report
        self.rejections = Counter(rejections)
        self.write("resumed", offset=offset)

    def _note_kinds(self, record: dict) -> None:
        for direction in ("up", "down"):
            self.kinds[direction].update(record.get(f"{direction}_kinds") or {})
            if f"full_finetune_fp32_{direction}" in record:  # rows of a method with that reference
                self.full_finetune[direction] += record[f"full_finetune_fp32_{direction}"]
        self.syncs.update(record.get("sync") or {})

    def _note_client_rejections(self, client: str, counts: object) -> None:
        """A device reports its drops so far with each update: the latest report is its total."""
        if isinstance(counts, dict):
            self.client_rejections[client] = dict(counts)

    def rejected(self, reason: str, detail: str, **fields: object) -> None:
        self.rejections[reason] += 1
        if sum(self.rejections.values()) <= MAX_REJECTION_EVENTS:
            self.write("rejected", reason=reason, detail=detail, **fields)

    def evaluation(self, client: str, report: dict) -> None:
        self.evals[client][report["round"]] = report
        self.write("eval", client=client, **report)

    def round_summary(self, rnd: int, task: int) -> float | None:
        """Mean over clients of the current task's NLL after ``rnd``, once all reports are in."""
        reports = [e[rnd] for e in self.evals.values() if rnd in e and e[rnd]["task"] == task]
        if not reports:
            return None
        metric = eval_metric(reports[0])
        mean = round(float(np.mean([r[metric][task] for r in reports])), 4)
        self.write("round_summary", round=rnd, task=task, **{f"mean_{metric}": mean}, clients=len(reports))
        return mean

    def round_means(self, rnd: int) -> tuple[str, dict[int, float]] | None:
        """(metric, task -> mean over clients) of the evaluations of the model after ``rnd``:
        every task some client scored (mid-task rounds score the current task only)."""
        reports = [e[rnd] for e in self.evals.values() if rnd in e]
        if not reports:
            return None
        metric, sums = eval_metric(reports[0]), defaultdict(list)
        for report in reports:
            for task, value in enumerate(report.get(metric, ())):
                if value is not None:
                    sums[task].append(value)
        return metric, {task: round(float(np.mean(v)), 4) for task, v in sorted(sums.items())}

    def summary(
        self,
        *,
        method: str,
        federation: str,
        clients: list[str],
        tasks: int,
        rounds: int,
        rounds_per_task: int,
        task_ends: list[int],
        status: str = "complete",
        missing_final_evaluations: list[str] | None = None,
        **extra: object,
    ) -> dict:
        """``task_ends``: the last round of each task (the schedule's), whose evaluations are
        the rows of the continual metrics."""
        per_client = {}
        for client in clients:
            found = self._task_matrix(client, task_ends)
            if found is not None:
                metric, matrix = found
                scores = continual_metrics(matrix) if metric == "nll" else accuracy_metrics(matrix)
                per_client[client] = {**scores, f"{metric}_matrix": _jsonable(matrix)}
        up = sum(c["up"] for c in self.bytes.values())
        down = sum(c["down"] for c in self.bytes.values())
        out = {
            "status": status,
            "missing_final_evaluations": missing_final_evaluations or [],
            "method": method,
            "federation": federation,
            "clients": len(clients),
            "client_ids": clients,
            "tasks": tasks,
            "rounds": rounds,
            "rounds_per_task": rounds_per_task,
            "bytes": {
                "up_total": up,
                "down_total": down,
                "payload_up_total": sum(c["payload_up"] for c in self.bytes.values()),
                "payload_down_total": sum(c["payload_down"] for c in self.bytes.values()),
                "dense_fp32_up_total": self.dense_fp32_up,
                "dense_fp32_down_total": self.dense_fp32_down,
                "reference": DENSE_REFERENCE,
                "up_vs_dense": share(up, self.dense_fp32_up),
                "down_vs_dense": share(down, self.dense_fp32_down),
                **self._full_finetune(up, down),
                "up_by_kind": dict(self.kinds["up"]),
                "down_by_kind": dict(self.kinds["down"]),
                "syncs": dict(self.syncs),
                "per_client": {c: dict(v) for c, v in sorted(self.bytes.items())},
            },
            "rejected": dict(self.rejections),
            "rejected_by_client": {c: n for c, n in sorted(self.client_rejections.items()) if n},
            "final": {**mean_metrics(per_client), "per_client": per_client},
            "fleet": self.fleet_scores(clients, task_ends),
            **extra,
        }
        tmp = self.dir / "summary.json.tmp"
        tmp.write_text(json.dumps(out, indent=2), encoding="utf-8")
        os.replace(tmp, self.dir / "summary.json")
        return out

    def _full_finetune(self, up: int, down: int) -> dict:
        """The full fine-tuning reference and the run's shares of it, where the method has one."""
        if not self.full_finetune:
            return {}
        full_up, full_down = self.full_finetune["up"], self.full_finetune["down"]
        return {
            "full_finetune_fp32_up_total": full_up,
            "full_finetune_fp32_down_total": full_down,
            "reference_full_finetune": FULL_FINETUNE_REFERENCE,
            "up_vs_full_finetune": share(up, full_up),
            "down_vs_full_finetune": share(down, full_down),
        }

    def _task_matrix(self, client: str, task_ends: list[int]) -> tuple[str, np.ndarray] | None:
        """(metric, n[t][i]) from the evaluation after the last round of each task, if all are present."""
        rows, metric = [], "nll"
        for last in task_ends:
            report = self.evals.get(client, {}).get(last)
            if report is None:
                return None
            metric = eval_metric(report)
            rows.append([np.nan if v is None else v for v in report[metric]])
        return metric, loss_matrix(rows)

    def fleet_scores(self, clients: list[str], task_ends: list[int]) -> dict | None:
        """The continual metrics of the fleet's matrix: row t, per test task, the mean over the
        clients that reported an evaluation after ``task_ends[t]`` (None if nobody ever did)."""
        rows, counts, metric = [], [], None
        for t, last in enumerate(task_ends):
            reports = [self.evals[c][last] for c in clients if last in self.evals.get(c, {})]
            metric = metric or (eval_metric(reports[0]) if reports else None)
            row = []
            for i in range(t + 1):
                seen = [r[metric][i] for r in reports if i < len(r[metric]) and r[metric][i] is not None]
                row.append(float(np.mean(seen)) if seen else np.nan)
            rows.append(row)
            counts.append(len(reports))
        if metric is None:
            return None
        matrix = loss_matrix(rows)
        with warnings.catch_warnings():  # a row or column nobody reported: nan means of empty slices
            warnings.simplefilter("ignore", RuntimeWarning)
            scores = continual_metrics(matrix) if metric == "nll" else accuracy_metrics(matrix)
        return {**scores, f"{metric}_matrix": _jsonable(matrix), "clients_per_task": counts}

    def close(self) -> None:
        with self._lock:
            self._file.close()


def _jsonable(matrix: np.ndarray) -> list[list[float | None]]:
    return [[None if np.isnan(v) else round(float(v), 4) for v in row] for row in matrix]
