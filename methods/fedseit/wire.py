"""The FedSeIT package's wire contract, used by both halves.

Global model (every round, down): the shared base of each conv, ``conv<k>.weight`` as a
(filters, embed_dim * k) matrix (the (out, in, k) filter tensor with its input axes
flattened, so ``fclcore.masked_upload`` codes it per output unit); with DLS also the bases
``wf<k>.weight`` (filters, slots * filters) and ``wc.weight`` (n * filters, 2n * filters).

An update carries:

* every round, each base as ``B * sigmoid(m_t)`` on the kept units (``masked_upload``; at most
  ``keep_units`` of them, else rejected as ``compression``);
* at a task's last round, ``kb:conv<k>.weight``: A_t's largest entries (``kb_density`` of them,
  none below ``kb_threshold``; more is rejected as ``compression``), sparse, full shape;
* with SIT, in a task's first round, ``sit:centres`` (q, embed_dim): k-means centres of the
  task's documents' mean word embeddings (``methods.fedseit.sit``), the key of the entry;
* metadata ``{"fedseit": {"task": t, "foreign": [ids of the entries in its slots]}}``.

The announced model (``COMPRESSION``; ``fclcore.sparsify``): the aggregator keeps the true
masked mean ``W`` of the bases (every round the mean of the uploads over the senders of each
entry, ``W`` where nobody sent) and announces the model devices hold, ``A``, moved to ``W`` at
the top-k entries of ``|W - A|``: a sparse delta whose hash devices verify.  A device merges
only the entries the announcement changed (the others are stale; its own value is newer).
``federation.wire.down_sparsify: none`` announces ``W`` itself.  ``federation.wire.sparsify``
does not apply: the masked base on the kept units is this method's uplink compression.

Nothing else leaves the device: no documents, no document vectors, no heads, no W_f / W_c
unless DLS.

A knowledge frame (the per-client downlink) carries the entries chosen for the device's
slots: ``meta = {"for_task": t, "entries": [{"id", "client", "task", "score", "own"}]}``
and, per entry that is not the device's own, one tensor per conv ``<id>|conv<k>.weight``.
The device fills its own entries from the A it uploaded (0 bytes).  Without SIT it comes
with the task's first round; with SIT with the task's second (the centres go up in the
first).  An entry id is ``<client>/t<task>``.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from fclcore.sparsify import Compression
from fclcore.text import default_tokenizer_json

KB_PREFIX = "kb:"
CENTRES = "sit:centres"
META_KEY = "fedseit"
MAX_ENTRIES = 64
# dense announcements by default; ``down_sparsify: topk`` with ``down_density: 0.05`` is the
# measured option (docs/wire.md, "FedSeIT": with keep_units 0.2 and kb_density 0.05, 6.6% of dense)
COMPRESSION = Compression()
_ENTRY_ID = re.compile(r"^(?P<client>[A-Za-z0-9_.-]{1,64})/t(?P<task>\d{1,4})$")


def embedding_dim() -> int:
    """Width of the frozen word-embedding table (all-MiniLM-L6-v2's ``hidden_size``), read
    from the model's ``config.json`` without loading any weights."""
    config = default_tokenizer_json().parent / "config.json"
    return int(json.loads(config.read_text())["hidden_size"])


def conv_name(k: int) -> str:
    return f"conv{k}.weight"


def wf_name(k: int) -> str:
    return f"wf{k}.weight"


WC_NAME = "wc.weight"


def base_shapes(kernel_sizes: list[int], filters: int, embed_dim: int, slots: int, dls: bool) -> dict:
    """Name -> shape of every federated base."""
    shapes = {conv_name(k): (filters, embed_dim * k) for k in kernel_sizes}
    if dls:
        n = len(kernel_sizes)
        shapes.update({wf_name(k): (filters, slots * filters) for k in kernel_sizes})
        shapes[WC_NAME] = (n * filters, 2 * n * filters)
    return shapes


def kept_units(share: float, units: int) -> int:
    """Units of a base whose values go up each round, as ``masked_upload.top_units`` counts them."""
    return max(1, int(round(share * units)))


def entry_id(client: str, task: int) -> str:
    return f"{client}/t{task}"


def knowledge_key(entry: str, weight: str) -> str:
    return f"{entry}|{weight}"


@dataclass(frozen=True)
class Entry:
    id: str
    client: str
    task: int
    score: float
    own: bool

    def to_meta(self) -> dict:
        return {"id": self.id, "client": self.client, "task": self.task, "score": round(self.score, 6), "own": self.own}


def parse_entries(meta: object, task: int) -> list[Entry]:
    """The entries of a knowledge frame for ``task``; ValueError if anything is malformed."""
    entries = meta.get("entries") if isinstance(meta, dict) else None
    if not isinstance(entries, list) or len(entries) > MAX_ENTRIES or meta.get("for_task") != task:
        raise ValueError(f"knowledge: expected meta.for_task == {task} and a list of at most {MAX_ENTRIES} entries")
    out = []
    for e in entries:
        ok = isinstance(e, dict) and isinstance(e.get("id"), str) and _ENTRY_ID.match(e["id"])
        if not ok or not isinstance(e.get("own"), bool) or not isinstance(e.get("score"), (int, float)):
            raise ValueError(f"knowledge: malformed entry {str(e)[:80]}")
        m = _ENTRY_ID.match(e["id"])
        if int(m["task"]) >= task or e.get("client") != m["client"] or e.get("task") != int(m["task"]):
            raise ValueError(f"knowledge: entry {e['id']} is not an earlier task's")
        out.append(Entry(e["id"], m["client"], int(m["task"]), float(e["score"]), e["own"]))
    if len({e.id for e in out}) != len(out):
        raise ValueError("knowledge: duplicate entry ids")
    return out


def parse_report(meta: object) -> dict:
    """An update's ``fedseit`` metadata: {"task": int, "foreign": [entry ids]}; ValueError otherwise."""
    rep = meta.get(META_KEY) if isinstance(meta, dict) else None
    foreign = rep.get("foreign") if isinstance(rep, dict) else None
    if (
        not isinstance(rep, dict)
        or not isinstance(rep.get("task"), int)
        or not isinstance(foreign, list)
        or len(foreign) > MAX_ENTRIES
        or not all(isinstance(i, str) and _ENTRY_ID.match(i) for i in foreign)
    ):
        raise ValueError(f"meta.{META_KEY}: expected {{task: int, foreign: [entry ids]}}")
    return {"task": rep["task"], "foreign": list(foreign)}
