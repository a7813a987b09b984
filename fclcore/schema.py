"""Configuration schemas for the three YAML files a user writes.

* ``AggregatorConfig`` — the aggregator service (broker, state/out dir, the federation it runs);
* ``ClientConfig`` — the client daemon on one device (broker, identity, where its data is);
* ``Scenario`` — an experiment that ``fcl simulate`` turns into one aggregator config and
  N client configs.

``FederationSpec`` is the federation-wide part: the aggregator sends it to clients inside
every round announcement, so devices never need to be reconfigured to change a run.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field, replace
from typing import Any, Literal, Optional
from urllib.parse import urlparse

from fclcore.capabilities import Decodes
from fclcore.chunks import DEFAULT_CHUNK_BYTES, MIN_CHUNK_BYTES
from fclcore.codec import ValueCoding
from fclcore.made_spec import MadeConfig
from fclcore.topics import validate_id


@dataclass
class BrokerSpec:
    """How a service reaches the broker.

    ``mqtts://`` turns on TLS: the broker's certificate is checked against ``ca_file`` (or
    the system CAs when it is None) and its host name against the url.  ``cert_file`` and
    ``key_file`` are the device's own certificate for brokers that ``require_certificate``.
    File paths are checked here, so a typo fails at load time instead of as a TLS timeout.

    ``url`` may also be a list: the nodes of a broker cluster.  The link connects to the
    first that answers and, when its broker goes away, moves on to the next (round-robin).
    All urls of a list use one scheme, so TLS is on or off for the whole cluster.
    """

    url: str | list[str] = "mqtt://127.0.0.1:1883"
    username: Optional[str] = None
    password: Optional[str] = None  # use "${env:NAME}" to keep it out of the file
    keepalive_s: int = 30
    reconnect_min_s: float = 0.5
    reconnect_max_s: float = 30.0
    ca_file: Optional[str] = None  # PEM CA bundle for mqtts://; None: the system CAs
    cert_file: Optional[str] = None  # PEM client certificate (with key_file)
    key_file: Optional[str] = None  # PEM private key of cert_file, unencrypted; keep it mode 0600
    tls_insecure: bool = False  # skip the host name check (the chain is still checked): testing only
    connect_timeout_s: float = 10.0  # a service that cannot connect at start exits 3 after this long

    def __post_init__(self) -> None:
        parse_broker_urls(self.url)
        if not self.connect_timeout_s > 0:
            raise ValueError(f"connect_timeout_s: expected seconds > 0, got {self.connect_timeout_s}")
        if self.keepalive_s < 5:
            raise ValueError(f"keepalive_s: expected >= 5, got {self.keepalive_s}")
        if not 0 < self.reconnect_min_s <= self.reconnect_max_s:
            raise ValueError("reconnect delays: expected 0 < reconnect_min_s <= reconnect_max_s")
        self._check_tls()

    @property
    def urls(self) -> tuple[str, ...]:
        """The broker url(s) in the order they are tried."""
        return (self.url,) if isinstance(self.url, str) else tuple(self.url)

    @property
    def tls(self) -> bool:
        return urlparse(self.urls[0]).scheme == "mqtts"

    def _check_tls(self) -> None:
        files = {k: getattr(self, k) for k in ("ca_file", "cert_file", "key_file")}
        if not self.tls:
            given = [k for k, v in files.items() if v is not None] + (["tls_insecure"] if self.tls_insecure else [])
            if given:
                raise ValueError(f"{given[0]}: TLS settings need an mqtts:// url, got {self.url!r}")
            return
        if (self.cert_file is None) != (self.key_file is None):
            have, missing = ("cert_file", "key_file") if self.key_file is None else ("key_file", "cert_file")
            raise ValueError(
                f"{missing}: a client certificate needs both cert_file and key_file, "
                f"got only {have}={getattr(self, have)!r}"
            )
        for key, path in files.items():
            if path is not None and not os.path.isfile(path):
                raise ValueError(f"{key}: expected an existing PEM file, got {path!r}")

    def redacted(self) -> dict:
        """For logs: file paths are shown (never their contents), the password never."""
        out = {"url": self.url, "username": self.username, "password": "***" if self.password else None}
        if self.tls:
            out.update(
                ca_file=self.ca_file or "<system CAs>",
                cert_file=self.cert_file,
                key_file=self.key_file,
                tls_insecure=self.tls_insecure,
            )
        return out


BROKER_SCHEMES = {"mqtt": 1883, "mqtts": 8883}  # scheme -> default port


def parse_broker_url(url: str) -> tuple[str, int]:
    """``mqtt://host[:port]`` or ``mqtts://host[:port]`` -> (host, port); ValueError with the URL otherwise."""
    parsed = urlparse(url)
    if "@" in parsed.netloc:  # checked first: the messages below echo the url, this one holds a secret
        raise ValueError("broker url: credentials go in broker.username / broker.password, not in the url")
    if parsed.scheme not in BROKER_SCHEMES or not parsed.hostname:
        raise ValueError(f"broker url: expected mqtt://host[:port] or mqtts://host[:port], got {url!r}")
    try:
        port = parsed.port or BROKER_SCHEMES[parsed.scheme]
    except ValueError:
        raise ValueError(f"broker url: bad port in {url!r}") from None
    return parsed.hostname, port


def parse_broker_urls(url: str | list[str]) -> list[tuple[str, int]]:
    """One url or a non-empty list of distinct urls of one scheme -> [(host, port), ...]."""
    if isinstance(url, str):
        return [parse_broker_url(url)]
    if not url:
        raise ValueError("broker url: expected a url or a non-empty list of urls, got []")
    addresses = [parse_broker_url(u) for u in url]
    schemes = sorted({urlparse(u).scheme for u in url})
    if len(schemes) > 1:
        raise ValueError(f"broker url: the urls of a list must share one scheme, got {' and '.join(schemes)}")
    seen: set[tuple[str, int]] = set()
    for address, text in zip(addresses, url):
        if address in seen:
            raise ValueError(f"broker url: {text!r} is listed twice")
        seen.add(address)
    return addresses


@dataclass
class ModelSpec:
    """MADE architecture; masks are derived on every device from ``mask_seed``."""

    hidden_sizes: list[int] = field(default_factory=lambda: [500])
    direct: bool = True
    natural_order: bool = True
    num_orders: int = 1  # > 1: order-agnostic training over a cycle of seeded orders
    mask_seed: int = 0
    connectivity_agnostic: bool = False  # with num_orders > 1: each order also redraws hidden degrees
    # orders and degrees from NumPy's PCG64 or from SplitMix64 (protocol 2: docs/protocol.md P-7.9),
    # which a device in any language derives; left out of ``to_dict`` at its default, so a
    # federation that does not set it announces what protocol 1 devices read
    mask_rng: Literal["pcg64", "splitmix64"] = "pcg64"

    omit_when_default = ("mask_rng",)

    def __post_init__(self) -> None:
        if not self.hidden_sizes or any(h < 1 for h in self.hidden_sizes):
            raise ValueError(f"hidden_sizes: expected positive sizes, got {self.hidden_sizes}")
        if self.num_orders < 1:
            raise ValueError(f"num_orders: expected >= 1, got {self.num_orders}")

    def made_config(self, input_dim: int) -> MadeConfig:
        return MadeConfig(
            input_dim=input_dim,
            hidden_sizes=tuple(self.hidden_sizes),
            direct=self.direct,
            natural_order=self.natural_order,
            num_orders=self.num_orders,
            mask_seed=self.mask_seed,
            connectivity_agnostic=self.connectivity_agnostic,
            mask_rng=self.mask_rng,
        )


@dataclass
class TrainSpec:
    local_epochs: int = 1
    batch_size: int = 32
    lr: float = 1e-3
    optimizer: Literal["adam", "sgd"] = "adam"

    def __post_init__(self) -> None:
        if self.local_epochs < 1 or self.batch_size < 1 or not self.lr > 0:
            raise ValueError("train: expected local_epochs >= 1, batch_size >= 1, lr > 0")


@dataclass
class RoundSpec:
    deadline_s: float = 120.0  # a round closes when every expected client replied or this passes
    quorum: float = 1.0  # fraction of expected clients needed to aggregate at the deadline
    start_timeout_s: float = 120.0  # how long to wait for clients to come online
    max_attempts: int = 3  # re-announcements of a round that missed its quorum
    resend_after_s: float = 20.0  # ask clients whose update has not arrived to send it again, this often
    max_update_norm: Optional[float] = None  # reject an update whose L2 distance to the global model is larger
    # "buffered" (FedBuff, docs/buffered.md): a model version is published every ``buffer_k``
    # accepted updates, each trained on any of the last ``max_staleness`` versions or the current one
    mode: Literal["sync", "buffered"] = "sync"
    buffer_k: int = 2
    max_staleness: int = 4

    # left out of ``to_dict`` at their defaults: a synchronous federation hashes as before they existed
    omit_when_default = ("mode", "buffer_k", "max_staleness")

    def __post_init__(self) -> None:
        if self.buffer_k < 1 or self.max_staleness < 0:
            raise ValueError(
                f"rounds: expected buffer_k >= 1 and max_staleness >= 0, got {self.buffer_k}, {self.max_staleness}"
            )
        if not 0 < self.quorum <= 1:
            raise ValueError(f"quorum: expected a fraction in (0, 1], got {self.quorum}")
        if self.deadline_s <= 0 or self.start_timeout_s <= 0 or self.max_attempts < 1:
            raise ValueError("rounds: expected positive deadline_s, start_timeout_s, max_attempts")
        if self.resend_after_s <= 0:
            raise ValueError(f"resend_after_s: expected > 0, got {self.resend_after_s}")
        if self.max_update_norm is not None and not self.max_update_norm > 0:
            raise ValueError(f"max_update_norm: expected a positive bound or null, got {self.max_update_norm}")


@dataclass
class WireSpec:
    """How tensor values travel, in every direction (updates, round downlinks, knowledge).
    int8 is block-scaled 8-bit (codec v2; error bound in ``fclcore.codec``)."""

    # None: the method's choice (``MethodSpec.value_dtype``), filled in by ``methods.resolve``
    # before anything is sent or hashed: announcements and fingerprints always carry a concrete
    # dtype (so a float32 method's JSON is what it was when float32 was the federation default)
    value_dtype: Optional[Literal["float32", "float16", "int8"]] = None
    max_frame_mb: float = 64.0  # frames above this are rejected on both sides
    int8_block: int = 64  # int8: consecutive values that share one float32 scale
    int8_rounding: Literal["nearest", "stochastic"] = "nearest"  # int8: stochastic is unbiased, seeded
    # a device behind by up to this many model versions catches up from one retained frame of
    # the entries changed meanwhile; further behind (or just joined) it fetches the full model
    catchup_versions: int = 4
    # retained frames longer than this many bytes go as chunks a device resumes after a drop
    # (docs/protocol.md section 16); null: every frame whole (devices of protocol 1 and 2 read
    # no chunks).  Smaller frames are sent whole.
    chunk_bytes: Optional[int] = DEFAULT_CHUNK_BYTES
    # Compression of dense updates (fclcore.sparsify; docs/wire.md "Compression"): None leaves
    # each setting to the method (off for every method but NGFL's family); a scenario's value wins.
    sparsify: Optional[Literal["none", "topk"]] = None  # uplink: top-k of the change + residual; "none": dense
    density: Optional[float] = None  # uplink top-k: share of each tensor's entries kept, in (0, 1]
    error_feedback: bool = True  # keep what was not sent (device and aggregator) and add it next time
    down_sparsify: Optional[Literal["none", "topk"]] = None  # downlink: the announced model moves by top-k
    down_density: Optional[float] = None  # downlink top-k: share of each tensor's entries changed, in (0, 1]

    # left out of ``to_dict`` at their defaults: a federation that does not set them announces
    # the same JSON, and resumes a state dir with the same fingerprint, as before they existed
    omit_when_default = ("sparsify", "density", "error_feedback", "down_sparsify", "down_density", "chunk_bytes")

    def __post_init__(self) -> None:
        for key in ("density", "down_density"):
            value = getattr(self, key)
            if value is not None and not 0 < value <= 1:
                raise ValueError(f"{key}: expected a share in (0, 1] or null, got {value}")
        if not 0 < self.max_frame_mb <= 255:  # MQTT caps a packet just under 256 MiB
            raise ValueError(f"max_frame_mb: expected a size in (0, 255] MB, got {self.max_frame_mb}")
        if self.chunk_bytes is not None and not MIN_CHUNK_BYTES <= self.chunk_bytes <= 2**31:
            raise ValueError(f"chunk_bytes: expected {MIN_CHUNK_BYTES} to 2^31 bytes or null, got {self.chunk_bytes}")
        if not 0 <= self.catchup_versions <= 64:
            raise ValueError(f"catchup_versions: expected 0-64, got {self.catchup_versions}")
        if not 1 <= self.int8_block <= 65535:
            raise ValueError(f"int8_block: expected 1 <= values per scale <= 65535, got {self.int8_block}")


@dataclass
class FederationSpec:
    """``method`` names a registered learning method (``methods/``); ``options`` are that
    method's options, validated by its package (the runtimes pass them through)."""

    name: str
    method: str = "fedavg"
    seed: int = 0
    num_tasks: int = 1
    rounds_per_task: int = 10
    model: ModelSpec = field(default_factory=ModelSpec)  # the MADE architecture (MADE methods)
    train: TrainSpec = field(default_factory=TrainSpec)
    options: dict[str, Any] = field(default_factory=dict)
    rounds: RoundSpec = field(default_factory=RoundSpec)
    wire: WireSpec = field(default_factory=WireSpec)
    task_rounds: Optional[list[int]] = None  # rounds of each task, when they differ (default: rounds_per_task)
    # client id -> one state per task ("x * * o"; fclcore/membership.py): devices that enroll late
    # and retire.  None: every device takes part in every task.  Checked where the clients are known.
    membership: Optional[dict[str, str]] = None

    moved_keys = {"fedet": "federation.options (the options of method fedet)"}  # old key -> where it went

    def __post_init__(self) -> None:
        validate_id(self.name, "federation name")
        if self.num_tasks < 1 or self.rounds_per_task < 1:
            raise ValueError("expected num_tasks >= 1 and rounds_per_task >= 1")
        if self.task_rounds is not None and (not self.task_rounds or min(self.task_rounds) < 1):
            raise ValueError(f"task_rounds: expected positive round counts (one per task), got {self.task_rounds}")

    @property
    def value_coding(self) -> ValueCoding:
        """What the runtimes pass to ``codec.encode``; stochastic int8 rounding is seeded from ``seed``."""
        if self.wire.value_dtype is None:
            raise ValueError("federation.wire.value_dtype: unset; methods.resolve fills in the method's choice")
        return ValueCoding(self.wire.value_dtype, self.wire.int8_block, self.wire.int8_rounding, self.seed)

    @property
    def total_rounds(self) -> int:
        return sum(self.task_rounds) if self.task_rounds is not None else self.num_tasks * self.rounds_per_task

    def check_schedule(self) -> None:
        """ValueError unless ``task_rounds`` (if given) has one entry per task."""
        if self.task_rounds is not None and len(self.task_rounds) != self.num_tasks:
            raise ValueError(
                f"task_rounds: expected {self.num_tasks} round counts (one per task), got {self.task_rounds}"
            )


@dataclass
class AggregatorConfig:
    federation: FederationSpec
    expected_clients: list[str]
    out_dir: str = "runs/aggregator"
    broker: BrokerSpec = field(default_factory=BrokerSpec)
    input_dim: int = 64  # the data dimension the federation's model is built for
    state_dir: Optional[str] = None  # committed round state for crash recovery (default: out_dir/state)
    keys_dir: Optional[str] = None  # <client>.key per device: when set, every update must be signed
    metrics_port: Optional[int] = None  # Prometheus endpoint (needs the "service" extra); None: off
    metrics_addr: str = "127.0.0.1"
    metrics_linger_s: float = 0.0  # the endpoint stays up this long after the run ends (not on SIGTERM)
    aux_dir: Optional[str] = None  # server-side unlabelled data for methods that read it (FedET: .txt files)
    enrollment: Literal["closed", "open"] = "closed"  # open: a device that comes online enrolls (next round)
    max_clients: int = 10_000  # enrolled devices at most
    drop_after_missed: Optional[int] = None  # a device that missed this many rounds in a row leaves the roster
    # how far before the run's start a protocol-1 device (sequences on the aggregator's clock) may number
    max_clock_skew_s: float = 30.0
    sites: list[str] = field(default_factory=list)  # ids in expected_clients that are site aggregators

    def __post_init__(self) -> None:
        if not self.expected_clients:
            raise ValueError("expected_clients: expected at least one client id")
        if not set(self.sites) <= set(self.expected_clients):
            raise ValueError(f"sites: expected ids from expected_clients, got {sorted(set(self.sites))[:5]}")
        if self.max_clients < len(self.expected_clients) or (self.drop_after_missed or 1) < 1:
            raise ValueError("expected max_clients >= len(expected_clients) and drop_after_missed >= 1 or null")
        for cid in self.expected_clients:
            validate_id(cid, "client id")
        if len(set(self.expected_clients)) != len(self.expected_clients):
            raise ValueError("expected_clients: duplicate client ids")
        if not self.max_clock_skew_s > 0:
            raise ValueError(f"max_clock_skew_s: expected a positive number of seconds, got {self.max_clock_skew_s}")
        if not 0 <= self.metrics_linger_s <= 3600:
            raise ValueError(f"metrics_linger_s: expected 0 to 3600 seconds, got {self.metrics_linger_s}")
        if self.metrics_port is not None and not 0 <= self.metrics_port <= 65535:
            raise ValueError(f"metrics_port: expected a TCP port in [0, 65535], got {self.metrics_port}")


@dataclass
class SiteConfig:
    """A site aggregator (aggregator.site): it runs the rounds the root announces with its own
    devices, on its own broker bridged to the root's, and forwards one partial sum per round."""

    federation: FederationSpec  # the same federation section as the root's (checked against its rounds)
    site_id: str  # this site's id: one of the root's expected_clients and sites
    expected_clients: list[str]  # this site's devices
    broker: BrokerSpec = field(default_factory=BrokerSpec)  # the site's own broker
    out_dir: str = "runs/site"
    state_dir: Optional[str] = None  # journal and last forwarded round (default: out_dir/state)
    input_dim: int = 64
    keys_dir: Optional[str] = None  # <client>.key per device: when set, every device update must be signed
    site_key: Optional[str] = None  # this site's key file: when set, its partial sums are signed with it
    collect_s: Optional[float] = None  # how long a round collects from devices (default: deadline_s / 2)
    max_clock_skew_s: float = 30.0

    def __post_init__(self) -> None:
        validate_id(self.site_id, "site_id")
        if not self.expected_clients:
            raise ValueError("expected_clients: expected at least one device id")
        for cid in self.expected_clients:
            validate_id(cid, "client id")
        if len(set(self.expected_clients)) != len(self.expected_clients) or self.site_id in self.expected_clients:
            raise ValueError("expected_clients: duplicate ids, or the site's own id")
        if self.collect_s is not None and not self.collect_s > 0:
            raise ValueError(f"collect_s: expected a positive number of seconds or null, got {self.collect_s}")
        if not self.max_clock_skew_s > 0:
            raise ValueError(f"max_clock_skew_s: expected a positive number of seconds, got {self.max_clock_skew_s}")


@dataclass
class DataSpec:
    dataset: Literal["digits", "mnist", "bbc"] = "digits"
    path: Optional[str] = None  # MNIST IDX or BBC News directory; default: the packaged copy
    class_fraction: float = 1.0  # share of the classes each device holds (0.6: FedET's non-iid setting)
    per_class: Optional[int] = None  # at most this many training rows per (device, class)
    test_per_class: Optional[int] = None  # at most this many test rows per class
    split_seed: Optional[int] = None  # seed of the train/test split and of the document parts (None: federation.seed)

    def __post_init__(self) -> None:
        if not 0 < self.class_fraction <= 1:
            raise ValueError(f"class_fraction: expected a share in (0, 1], got {self.class_fraction}")
        if any(v is not None and v < 1 for v in (self.per_class, self.test_per_class)):
            raise ValueError("per_class, test_per_class: expected >= 1 or null")
        if self.split_seed is not None and self.split_seed < 0:
            raise ValueError(f"split_seed: expected a non-negative int or null, got {self.split_seed}")


@dataclass
class RandomTasks:
    classes_per_task: int = 1
    classes: list[int] = field(default_factory=lambda: list(range(10)))


@dataclass
class PoolTasks:
    """FedSeIT's protocol: a pool of label sets (a set may repeat, its documents do not: each
    label's training rows are split among the pool tasks that hold it), from which every client
    takes ``per_client`` distinct tasks by the federation seed."""

    tasks: list[list[int]]
    per_client: int

    def __post_init__(self) -> None:
        if not self.tasks:
            raise ValueError("pool.tasks: expected at least one task (a list of labels)")
        for i, task in enumerate(self.tasks):
            if not task or len(set(task)) != len(task):
                raise ValueError(f"pool.tasks[{i}]: expected distinct labels, got {task}")
        if self.per_client < 1:
            raise ValueError(f"pool.per_client: expected >= 1, got {self.per_client}")


@dataclass
class DomainTasks:
    """Domain-incremental tasks (FIL-VER's rotated / permuted MNIST): every task holds the same
    ``classes`` (one shared head); task t's images are rotated by ``t * step_deg`` degrees
    (``rotate``) or have their pixels permuted by a seeded permutation (``permute``, task 0 is
    the identity).  Each task gets a disjoint share of the training images (fclcore.data.domain_task_split)."""

    tasks: int
    transform: Literal["rotate", "permute"] = "rotate"
    step_deg: float = 20.0
    classes: list[int] = field(default_factory=lambda: list(range(10)))

    def __post_init__(self) -> None:
        if isinstance(self.tasks, bool) or not isinstance(self.tasks, int) or self.tasks < 1:
            raise ValueError(f"domains.tasks: expected an int >= 1, got {self.tasks!r}")
        if self.transform not in ("rotate", "permute"):
            raise ValueError(f"domains.transform: expected 'rotate' or 'permute', got {self.transform!r}")
        if isinstance(self.step_deg, bool) or not isinstance(self.step_deg, (int, float)):
            raise ValueError(f"domains.step_deg: expected a number of degrees, got {self.step_deg!r}")
        if not -float("inf") < self.step_deg < float("inf"):
            raise ValueError(f"domains.step_deg: expected a finite angle, got {self.step_deg}")
        if not self.classes or len(set(self.classes)) != len(self.classes):
            raise ValueError(f"domains.classes: expected distinct classes, got {self.classes}")
        if any(isinstance(c, bool) or not isinstance(c, int) or c < 0 for c in self.classes):
            raise ValueError(f"domains.classes: expected non-negative int labels, got {self.classes}")


@dataclass
class IncrementalTasks:
    """NGFL's class-incremental protocol (reading notes 3.4 G4-G5): task 0 is the ``base``
    classes on every device; task s (s >= 1) is pool s - 1, held only by the devices that took
    it.  Each device takes round(``share`` x pools) pools, drawn with the federation seed and
    redrawn until every pool has a device; a pool's training rows are split without overlap
    among its devices, the base's among all.  Every task's test set holds its classes' test rows."""

    base: list[int]
    pools: list[list[int]]
    share: float = 0.6

    def __post_init__(self) -> None:
        classes = [*self.base, *(c for pool in self.pools for c in pool)]
        if not self.base or not self.pools or any(not pool for pool in self.pools):
            raise ValueError("incremental: expected a non-empty base and non-empty pools")
        if len(set(classes)) != len(classes) or any(isinstance(c, bool) or not isinstance(c, int) for c in classes):
            raise ValueError(f"incremental: expected distinct int classes over base and pools, got {classes}")
        if not 0 < self.share <= 1:
            raise ValueError(f"incremental.share: expected a share in (0, 1], got {self.share}")


@dataclass
class TasksSpec:
    """Exactly one of: the same task sequence for every client, an explicit sequence per
    client, sequences drawn per client with the scenario seed, a class-incremental split,
    a pool of tasks that clients draw from (``pool``), or domain-incremental tasks over the
    same classes (``domains``: rotated / permuted images)."""

    shared: Optional[list[list[int]]] = None
    per_client: Optional[list[list[list[int]]]] = None
    random: Optional[RandomTasks] = None
    sizes: Optional[list[int]] = None  # class-incremental: a seeded class order cut into tasks of these sizes
    pool: Optional[PoolTasks] = None  # FedSeIT: each client takes pool.per_client tasks of a shared pool
    domains: Optional[DomainTasks] = None  # FIL-VER: domains.tasks rotated / permuted copies of the classes
    incremental: Optional[IncrementalTasks] = None  # NGFL: a base task, then pools each device may take
    # Methods whose devices keep their own task clock (``MethodSpec.own_clock``): per client, per
    # task, the round before which the task arrives on that device (null: its task's first round).
    arrivals: Optional[list[list[Optional[int]]]] = None

    def __post_init__(self) -> None:
        kinds = ("shared", "per_client", "random", "sizes", "pool", "domains", "incremental")
        given = [k for k in kinds if getattr(self, k) is not None]
        if len(given) != 1:
            raise ValueError(f"tasks: expected exactly one of {', '.join(kinds)}; got {given or 'none'}")
        for row in self.arrivals or []:
            if any(r is not None and (isinstance(r, bool) or not isinstance(r, int) or r < 0) for r in row):
                raise ValueError(f"tasks.arrivals: expected rounds >= 0 or null, got {row}")


@dataclass
class ClientDataSpec:
    """Where a simulated device's data comes from: its shard of a scenario's dataset."""

    dataset: Literal["digits", "mnist", "bbc"] = "digits"
    path: Optional[str] = None
    client_tasks: list[list[list[int]]] = field(default_factory=list)  # a device's task may be empty
    client_index: int = 0
    seed: int = 0
    test_tasks: Optional[list[list[int]]] = None  # classes of each task's test set (default: the device's own)
    per_class: Optional[int] = None
    test_per_class: Optional[int] = None
    max_length: int = 64  # text: tokens per text
    split_seed: Optional[int] = None  # seed of the dataset split and the document parts (None: seed)
    pool_tasks: Optional[list[list[int]]] = None  # tasks.pool: the federation's whole pool ...
    pool_ids: Optional[list[int]] = None  # ... and this device's pool task ids, in task order
    domains: Optional[DomainTasks] = None  # tasks.domains: the plan's domain tasks (grayscale, domain_task_split)
    arrivals: Optional[list[Optional[int]]] = None  # per task, its arrival round (own clock; null: its start)
    fleet: bool = False  # also load every device's shard of each task (a simulation-only upper reference)

    def __post_init__(self) -> None:
        if (self.pool_tasks is None) != (self.pool_ids is None):
            raise ValueError("pool_tasks, pool_ids: expected both (a device of a pool plan) or neither")
        if self.domains is not None and self.pool_ids is not None:
            raise ValueError("domains, pool_ids: expected at most one (a domain plan or a pool plan)")

    @property
    def data_seed(self) -> int:
        """The seed of the dataset split and of this device's document parts."""
        return self.seed if self.split_seed is None else self.split_seed


# every execution provider onnxruntime 1.32 names (ort.get_all_providers()); a build has a few
ORT_PROVIDERS = (
    "TensorrtExecutionProvider", "CUDAExecutionProvider", "MIGraphXExecutionProvider",
    "OpenVINOExecutionProvider", "DnnlExecutionProvider", "VitisAIExecutionProvider", "QNNExecutionProvider",
    "NnapiExecutionProvider", "VSINPUExecutionProvider", "JsExecutionProvider", "CoreMLExecutionProvider",
    "DmlExecutionProvider", "RknpuExecutionProvider", "WebNNExecutionProvider", "WebGpuExecutionProvider",
    "XnnpackExecutionProvider", "CANNExecutionProvider", "AzureExecutionProvider", "CPUExecutionProvider",
)  # fmt: skip


def check_providers(names: list[str]) -> None:
    """ValueError unless ``names`` are distinct onnxruntime provider names (checked without
    importing onnxruntime, which the daemon loads only when it first serves)."""
    unknown = [n for n in names if n not in ORT_PROVIDERS]
    if unknown or not names or len(set(names)) != len(names):
        raise ValueError(f"providers: expected distinct onnxruntime provider names, got {names} (unknown: {unknown})")


@dataclass
class ServeSpec:
    """When the device re-exports the model it serves (out_dir/model.onnx)."""

    every: Literal["task", "round", "never"] = "task"
    int8: bool = False  # also write model.int8.onnx (dynamic int8 weights)
    export_timeout_s: float = 600.0  # an export child (MADE, FedET text) still running after this is killed
    # onnxruntime execution providers of the served MADE model (the control socket), in order of
    # preference: the first the installed onnxruntime has runs it (export/providers.py)
    providers: list[str] = field(default_factory=lambda: ["CPUExecutionProvider"])

    def __post_init__(self) -> None:
        if not self.export_timeout_s > 0:
            raise ValueError(f"serve.export_timeout_s must be > 0, got {self.export_timeout_s}")
        check_providers(self.providers)


DEVICE_PATTERN = re.compile(r"auto|cpu|cuda(:[0-9]+)?")


@dataclass
class TrainPlacement:
    """Where and in what precision this device trains (``fclcore.device``): its own hardware,
    so it lives in the device's config, not in the federation's ``train``.  ``cpu``/``off``
    leave every number as it was before these settings existed."""

    device: str = "cpu"  # auto (CUDA when torch has it, else CPU), cpu, cuda, cuda:N
    # mixed precision of the training step; on the quickstart (CPU) bf16 moved avg NLL by under
    # 0.005 nats (confedmade 20.9486 -> 20.9478, fedavg 22.7763 -> 22.7807): docs/accelerators.md
    amp: Literal["off", "bf16", "fp16"] = "off"

    def __post_init__(self) -> None:
        if not isinstance(self.device, str) or not DEVICE_PATTERN.fullmatch(self.device):
            raise ValueError(f"device: expected auto, cpu, cuda or cuda:N, got {self.device!r}")


@dataclass
class ClientConfig:
    client_id: str
    federation: str
    data: Optional[ClientDataSpec] = None  # a shard of a scenario's dataset (simulations) ...
    data_dir: Optional[str] = None  # ... or task folders that arrive on the device (edge_client/taskdir.py)
    out_dir: str = "runs/client"
    broker: BrokerSpec = field(default_factory=BrokerSpec)
    threads: int = 1  # torch intra-op threads; keep small on shared-core devices
    serve: ServeSpec = field(default_factory=ServeSpec)
    state_dir: Optional[str] = None  # learner state and unacknowledged upload (default: out_dir/state)
    key_file: Optional[str] = None  # this device's signing key (64 hex digits); see fcl keygen
    allow_embedding_upload: bool = False  # privacy opt-in: this device may upload embeddings of its data
    on_new_run: Literal["join", "refuse"] = "join"  # a newer run of the federation: start over in it, or exit 8
    aggregator_timeout_s: float = 300.0  # no aggregator this long: say so in the status and the log (never exit)
    memory_budget_mb: Optional[float] = None  # told in the status: dashboards and alerts compare peak RSS with it
    # a run id may start at most this far ahead of this device's clock (a later one is a forgery or a wrong clock)
    max_clock_skew_s: float = 30.0
    # with nothing to do in any run this long (its run ended before it came; its aggregator runs another
    # run), the device exits 9 / 10; its final evaluation is held this long for the end to be acknowledged
    run_over_s: float = 300.0
    train: TrainPlacement = field(default_factory=TrainPlacement)
    # declare less than this daemon decodes (docs/protocol.md section 17): fields of its status's
    # ``decodes`` (frames, dtypes, layouts, derived_positions, chunks), each left out meaning all of it;
    # the aggregator then sends it frames made for it, on fcl/<fed>/down/<client_id>
    decodes: Optional[dict[str, Any]] = None

    def __post_init__(self) -> None:
        validate_id(self.client_id, "client_id")
        problem = Decodes.of(self.decodes).unservable()  # ValueError naming a bad field
        if problem is not None:
            raise ValueError(f"decodes: {problem}")
        for name in ("aggregator_timeout_s", "max_clock_skew_s", "run_over_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}: expected a positive number, got {getattr(self, name)}")
        if self.memory_budget_mb is not None and not 0 < self.memory_budget_mb < 2**30:
            raise ValueError(f"memory_budget_mb: expected a positive number of MiB, got {self.memory_budget_mb}")
        validate_id(self.federation, "federation")
        if (self.data is None) == (self.data_dir is None):
            raise ValueError("data, data_dir: expected exactly one (a dataset shard, or a task directory)")


@dataclass
class Scenario:
    federation: FederationSpec
    clients: int
    tasks: TasksSpec
    data: DataSpec = field(default_factory=DataSpec)
    sign_updates: bool = False  # fcl simulate provisions a key per device and the aggregator requires signatures
    membership: Optional[str] = None  # a preset (fully, decreasing, increasing, scattered) -> federation.membership
    allow_embedding_upload: bool = False  # copied into every client config
    device: str = "cpu"  # train.device of every client config (TrainPlacement)
    amp: Literal["off", "bf16", "fp16"] = "off"  # train.amp of every client config
    # ``fcl simulate`` runs the scenario once per method listed, each into OUT/<method>, and
    # prints one comparison table; empty or absent: one run of federation.method
    compare: Optional[list[str]] = None
    # method name -> that method's own federation.options in this scenario, so that one scenario
    # can compare (or run alone) methods whose options differ; see ``run_federation``
    method_options: dict[str, dict[str, Any]] = field(default_factory=dict)
    # client id (or "default") -> the link it sits behind: a profile of fcl_edge/links.py, e.g.
    # "lte-m" or "lte-m@60/120" (online 60 s, offline 120 s); docs/links.md.  None: loopback
    links: Optional[dict[str, str]] = None

    def __post_init__(self) -> None:
        if self.clients < 1:
            raise ValueError(f"clients: expected >= 1, got {self.clients}")
        TrainPlacement(self.device, self.amp)  # ValueError naming the bad one
        for name in self.method_options:
            validate_id(name, "method_options: method name")
        for name in self.compare or ():
            validate_id(name, "compare: method name")
        if self.compare and len(set(self.compare)) != len(self.compare):
            raise ValueError(f"compare: expected distinct method names, got {self.compare}")
        if self.tasks.per_client is not None and len(self.tasks.per_client) != self.clients:
            raise ValueError(
                f"tasks.per_client: expected {self.clients} client sequences, got {len(self.tasks.per_client)}"
            )

    def run_federation(self) -> FederationSpec:
        """The federation one run of ``federation.method`` gets: that method's ``method_options``
        with ``federation.options`` (shared by every method, and what ``--set federation.options.K=V``
        sets) laid over them; with ``task_rounds``, one task per entry (until the tasks say otherwise)."""
        fed = self.federation
        if fed.task_rounds is not None:
            fed = replace(fed, num_tasks=len(fed.task_rounds))
        own = self.method_options.get(fed.method)
        return replace(fed, options={**own, **fed.options}) if own else fed
