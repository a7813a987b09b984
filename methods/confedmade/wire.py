"""The ConFedMADE package's wire contract, used by both halves.

* An update carries, per MADE weight, the packed base ``B*sigmoid(m)`` (``fclcore.masked_upload``:
  values, plus ``<name>#units`` when not every unit is kept) and every bias dense; on a catch-up
  round (``catchup_every``) also ``<name>#extra``, a sparse tensor of entries outside that
  selection whose value moved furthest from the global model's; the last
  update of a task but the last also carries ``kb:<weight>``, the client's thresholded A_t
  (full shape; the last task's would reach nobody: ``shares_knowledge``).
* A knowledge frame (the per-client downlink at a task start) names the chosen entries,
  ``meta = {"for_task": t, "entries": [{"id", "client", "task"}, ...]}``, in the order the
  device stacks them, and carries one tensor per entry and weight, named ``<entry id>|<weight
  name>``, for the entries the device does not hold: those its last task-end update did not
  declare (``kb_held``, the ids of every entry it holds).  An entry id is ``<client>/t<task>``.
  The *full* frame (every named entry carried) is published beside it on the device's
  ``kb/<client>/full`` topic whenever the frame leaves some out: a device that finds an entry
  neither held nor carried fetches that one (``methods.confedmade.kbstore``).
* The model delta of a round's announcement (``fclcore.model_sync``) sends ConFedMADE's weights
  as their values inside the aggregated round's MADE mask (``delta_positions``): uploads carry
  nothing outside it, so nothing else can change, and both halves derive the mask from the seed.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from fclbases.made.options import upload_order
from fclcore.made_spec import made_masks, mask_for_param, param_shapes

KB_PREFIX = "kb:"  # prefix of the task-adaptive tensors a task's last update carries
EXTRA = "#extra"  # suffix of a weight's catch-up entries (outside the round's selection), a sparse tensor
MAX_ENTRIES = 4096
HELD = "kb_held"  # update metadata: the knowledge-base entries the device holds (at a task's end)


def entry_id(client: str, task: int) -> str:
    return f"{client}/t{task}"


def shares_knowledge(task: int, num_tasks: int) -> bool:
    """Whether task ``task``'s last update carries its A_t: not the last task's, which no later
    task start would hand to anyone."""
    return task < num_tasks - 1


def knowledge_key(entry: str, weight: str) -> str:
    """The tensor name of ``weight`` of knowledge entry ``entry`` in a knowledge frame."""
    return f"{entry}|{weight}"


def knowledge_meta(task: int, entries: list[tuple[str, str, int]]) -> dict:
    """The knowledge frame's metadata for ``task``: entries as (id, client, task)."""
    return {"for_task": task, "entries": [{"id": i, "client": c, "task": t} for i, c, t in entries]}


def parse_knowledge_meta(meta: object) -> list[str]:
    """The entry ids of a knowledge frame's metadata; ValueError if it is malformed."""
    entries = meta.get("entries") if isinstance(meta, dict) else None
    if (
        not isinstance(entries, list)
        or len(entries) > MAX_ENTRIES
        or not all(isinstance(e, dict) and isinstance(e.get("id"), str) and "|" not in e["id"] for e in entries)
    ):
        raise ValueError("knowledge: expected meta.entries, a list of entries with string ids (no '|')")
    ids = [e["id"] for e in entries]
    if len(set(ids)) != len(ids):
        raise ValueError("knowledge: an entry is named twice")
    return ids


def parse_held(meta: object) -> list[str] | None:
    """The entry ids an update declares its device holds (``kb_held``), None when it declares
    none; ValueError if the declaration is malformed."""
    held = meta.get(HELD) if isinstance(meta, dict) else None
    if held is None:
        return None
    if not isinstance(held, list) or len(held) > MAX_ENTRIES or not all(isinstance(e, str) for e in held):
        raise ValueError(f"meta.{HELD}: expected a list of at most {MAX_ENTRIES} entry ids")
    return held


def delta_positions(fed: Any, options: Any, input_dim: int, rnd: int) -> dict[str, np.ndarray] | None:
    """The weight entries round ``rnd``'s masked FedAvg can change: the round's MADE mask."""
    if not options.upload_made_mask:
        return None
    made = fed.model.made_config(input_dim)
    masks = made_masks(made, upload_order(made, options, rnd))
    return {name: mask_for_param(masks, name) > 0 for name in param_shapes(made) if name.endswith(".weight")}
