"""This device's training data: its shard of the shared plan (``fcl simulate`` checked the same
split), as a ``ClientTasks`` of per-task train and test sets.  Kept apart from the daemon so the
data a device sees can be built and inspected without a broker or a learner."""

from __future__ import annotations

import dataclasses

import numpy as np

from fclcore.data import (
    ClientTasks,
    DataError,
    Dataset,
    client_task_split,
    dataset_class_names,
    domain_task_split,
    float_pixels,
    load_dataset,
    pool_task_split,
)
from fclcore.schema import ClientConfig


def load_client_data(cfg: ClientConfig, compact: bool = False) -> ClientTasks:
    """This device's shard, derived from the shared plan alone (the same split ``fcl simulate`` checked).

    ``compact``: binarised MNIST shards stay uint8 0/1 (pass them through :func:`float_tasks`
    for a learner without ``compact_pixels``); else every shard is float32."""
    spec = cfg.data
    seed = spec.data_seed
    gray = spec.domains is not None
    train, test = load_dataset(spec.dataset, spec.path, seed, spec.max_length, gray=gray, compact=not gray)
    if spec.domains is not None:  # domain-incremental: rotated / permuted grayscale images, every class per task
        return domain_task_split(
            train,
            test,
            spec.domains,
            spec.client_index,
            len(spec.client_tasks),
            seed,
            spec.per_class,
            spec.test_per_class,
        )
    if spec.pool_ids is not None:
        pooled = pool_task_split(train, test, spec.pool_tasks, spec.pool_ids, seed, spec.per_class, spec.test_per_class)
        return pooled if compact else float_tasks(pooled)
    own = client_task_split(
        train, test, spec.client_tasks, spec.client_index, seed, spec.test_tasks, spec.per_class, spec.test_per_class
    )
    fleet = None
    if spec.fleet:  # every device's shard of each task, as each device computes its own
        shards = [
            client_task_split(train, test, spec.client_tasks, i, seed, spec.test_tasks, spec.per_class, 1).train
            for i in range(len(spec.client_tasks))
        ]
        fleet = tuple(
            float_pixels(Dataset(np.concatenate([s[t].x for s in shards]), np.concatenate([s[t].y for s in shards])))
            for t in range(len(own.train))
        )
    arrivals = tuple(spec.arrivals) if spec.arrivals is not None else None
    tasks = ClientTasks(own.train, own.test, arrivals, fleet)
    return tasks if compact else float_tasks(tasks)


def float_tasks(tasks: ClientTasks) -> ClientTasks:
    """The shards as float32, cut from a compact set (the whole set is not kept); float shards unchanged."""
    return dataclasses.replace(
        tasks, train=tuple(map(float_pixels, tasks.train)), test=tuple(map(float_pixels, tasks.test))
    )


def served_class_names(cfg: ClientConfig) -> tuple[str, ...] | None:
    """The names the served model gives its classes (``fclcore.data.dataset_class_names``), or
    None: no data section, a dataset that numbers its classes, or a corpus folder not found
    (then the data loader says why)."""
    if cfg.data is None:
        return None
    try:
        return dataset_class_names(cfg.data.dataset, cfg.data.path)
    except DataError:
        return None
