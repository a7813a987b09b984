"""What a device serves, described by format, for ``export`` (which knows formats, not methods).

* ``ServedModel`` (format ``made``): plain MADE weights composed by the learning method;
* ``TextGroupsServed`` (format ``text-groups``): a frozen transformer backbone, Enhancer
  groups and the prototype selector that routes a text to its group;
* ``TextTasksServed`` (format ``text-tasks``): a task-incremental text classifier, one head
  per task, the caller's task id picks the head;
* ``ImageClassifierServed`` (format ``image-classifier``): a small conv / max-pool / linear
  classifier over square one-channel images, given as plain NumPy layer weights.

A learner's ``served_model`` returns one of these; ``export.formats.export_served`` writes
it as a verified ONNX file.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Mapping, Sequence

import numpy as np

from fclcore.made_spec import MadeConfig, param_shapes


@dataclass(frozen=True, eq=False)
class ServedModel:
    """The plain MADE weights a device serves, plus where they came from.

    ``params`` are already composed by the learning method (e.g. ``B*sigmoid(m) + A + sum
    alpha*A_kb``) and keyed like ``param_shapes(made)``; they are validated and stored as
    read-only float32 copies.
    """

    made: MadeConfig
    params: dict[str, np.ndarray]
    order_index: int
    method: str
    task: int
    binarize: str = ""
    format = "made"

    def __post_init__(self) -> None:
        if not isinstance(self.made, MadeConfig):
            raise ValueError(f"made must be a MadeConfig, got {type(self.made).__name__}")
        for name, minimum in (("order_index", 0), ("task", 0)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < minimum:
                raise ValueError(f"{name} must be an int >= {minimum}, got {v!r}")
            object.__setattr__(self, name, int(v))
        if not isinstance(self.method, str) or not self.method.strip():
            raise ValueError(f"method must be a non-empty string, got {self.method!r}")
        if not isinstance(self.binarize, str):
            raise ValueError(f"binarize must be a string, got {self.binarize!r}")
        if not isinstance(self.params, dict):
            raise ValueError(f"params must be a dict of arrays, got {type(self.params).__name__}")
        expected = param_shapes(self.made)
        missing = [n for n in expected if n not in self.params]
        unexpected = [n for n in self.params if n not in expected]
        if missing or unexpected:
            raise ValueError(f"parameter names mismatch: missing {missing}, unexpected {unexpected}")
        params = {}
        for name, shape in expected.items():
            a = np.asarray(self.params[name])
            if a.dtype == object or not np.issubdtype(a.dtype, np.floating):
                raise ValueError(f"parameter {name!r} must be a float array, got dtype {a.dtype}")
            if a.shape != shape:
                raise ValueError(f"parameter {name!r}: expected shape {shape}, got {a.shape}")
            a = np.array(a, dtype=np.float32, order="C", copy=True)
            if not np.isfinite(a).all():
                raise ValueError(f"parameter {name!r} contains NaN or infinite values")
            a.flags.writeable = False
            params[name] = a
        object.__setattr__(self, "params", params)

    @property
    def order_k(self) -> int:
        """The order index reduced modulo ``num_orders`` (the masks that get baked in)."""
        return self.order_index % self.made.num_orders


@dataclass(frozen=True, eq=False)
class TextGroupsServed:
    """A text classifier: backbone + Enhancer groups + nearest-prototype group selection.

    ``prototypes`` maps a class id to its global prototype (unit embedding mean) and
    ``group_of`` a class id to the group that classifies it.  ``backbone`` and ``groups`` are
    the torch modules of ``fclbases.minilm``.  ``backbone_source``: the model directory
    (``config.json`` + ``model.safetensors``) the backbone was loaded from unchanged, so that an
    export child can load the same weights itself (``export.text_groups_job``); empty: only this
    process has them, and the model is exported in process.  ``class_names``: recorded in the
    exported file (``fcl infer`` prints them), indexed by class id.
    """

    backbone: Any
    groups: Sequence[Any]
    prototypes: Mapping[int, np.ndarray]
    group_of: Mapping[int, int]
    task: int
    max_length: int
    method: str = ""
    extra: dict = field(default_factory=dict)
    backbone_source: str = ""
    class_names: Sequence[str] = ()  # class id -> name; empty: a class is named by its number
    format = "text-groups"


@dataclass(frozen=True, eq=False)
class FrozenTable:
    """A frozen weight of a served module that a shipped file already holds: tensor ``tensor`` of
    ``model_dir/model.safetensors`` with rows ``zero_rows`` zeroed, times ``scale`` in float32.
    ``array`` is the module's own copy (float32, equal to that).  A snapshot names it by its
    source instead of copying it (``export.snapshot_formats``)."""

    array: np.ndarray
    model_dir: str
    tensor: str
    scale: float
    zero_rows: tuple[int, ...] = ()


@dataclass(frozen=True, eq=False)
class TextTasksServed:
    """A task-incremental text classifier: token ids -> one head per task (the task id picks it).

    ``module`` is a torch ``nn.Module`` (never imported here):
    ``forward(input_ids int64 [B, L], attention_mask int64 [B, L]) -> logits float32 [B, T, W]``
    with T = ``len(labels)`` tasks and W = the most labels of a task; task t's head fills its
    first ``len(labels[t])`` columns and the columns past them are ``-inf``.  ``labels`` and
    ``class_names`` are validated and stored as tuples.
    """

    module: Any
    labels: Sequence[Sequence[int]]  # per task: global class ids in head-column order
    class_names: Sequence[str]  # global class id -> name
    task: int  # the last task trained (== len(labels) - 1)
    max_length: int  # tokens per text incl. [CLS]/[SEP] (padding with id 0)
    method: str = ""
    extra: dict = field(default_factory=dict)
    frozen: Sequence[FrozenTable] = ()  # weights of ``module`` a shipped file holds (its snapshot names them)
    format = "text-tasks"

    def __post_init__(self) -> None:
        if isinstance(self.class_names, str) or not isinstance(self.class_names, Sequence):
            raise ValueError(f"class_names must be a sequence of strings, got {type(self.class_names).__name__}")
        names = tuple(self.class_names)
        if any(not isinstance(n, str) for n in names):
            raise ValueError(f"class_names must all be strings, got {names!r}")
        object.__setattr__(self, "class_names", names)
        object.__setattr__(self, "labels", _task_labels(self.labels, len(names)))
        for name, minimum in (("task", 0), ("max_length", 2)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < minimum:
                raise ValueError(f"{name} must be an int >= {minimum}, got {v!r}")
            object.__setattr__(self, name, int(v))
        if self.task != len(self.labels) - 1:
            raise ValueError(f"task must be len(labels) - 1 = {len(self.labels) - 1} (the last task), got {self.task}")
        if not isinstance(self.method, str):
            raise ValueError(f"method must be a string, got {self.method!r}")
        if not isinstance(self.extra, dict):
            raise ValueError(f"extra must be a dict, got {type(self.extra).__name__}")


def check_task_labels(labels: Any, n_classes: int) -> tuple[tuple[int, ...], ...]:
    """``labels`` (per task, class ids) validated as :class:`TextTasksServed` does; ValueError."""
    return _task_labels(labels, n_classes)


def with_class_names(served: Any, names: Sequence[str] | None) -> Any:
    """``served`` with its classes named by ``names`` (class id -> name, e.g. the dataset's
    folder names) where it names them only by their numbers; anything else unchanged."""
    if not names or not hasattr(served, "class_names"):
        return served
    have = tuple(served.class_names)
    if served.format == "text-groups":
        ids = [int(c) for c in served.prototypes]
        return replace(served, class_names=tuple(names)) if not have and max(ids, default=0) < len(names) else served
    numbered = have == tuple(str(i) for i in range(len(have)))
    return replace(served, class_names=tuple(names[: len(have)])) if numbered and len(have) <= len(names) else served


def _task_labels(labels: Any, n_classes: int) -> tuple[tuple[int, ...], ...]:
    """``labels`` as a tuple of per-task tuples of distinct class ids in ``[0, n_classes)``."""
    if isinstance(labels, (str, bytes)) or not isinstance(labels, (Sequence, np.ndarray)) or len(labels) == 0:
        raise ValueError(f"labels must be a non-empty sequence of per-task label lists, got {labels!r}")
    out = []
    for t, row in enumerate(labels):
        if isinstance(row, (str, bytes)) or not isinstance(row, (Sequence, np.ndarray)) or len(row) == 0:
            raise ValueError(f"labels[{t}] must be a non-empty sequence of class ids, got {row!r}")
        if any(isinstance(c, bool) or not isinstance(c, (int, np.integer)) for c in row):
            raise ValueError(f"labels[{t}] must contain ints, got {list(row)!r}")
        ids = tuple(int(c) for c in row)
        if len(set(ids)) != len(ids) or min(ids) < 0 or max(ids) >= n_classes:
            raise ValueError(f"labels[{t}] must be distinct class ids in [0, {n_classes}) (class_names), got {ids}")
        out.append(ids)
    return tuple(out)


IMAGE_LAYER_KINDS = ("conv2d", "relu", "maxpool2", "flatten", "linear")
_IMAGE_LAYER_PARAMS = {
    "conv2d": ("weight", "bias", "padding"),
    "relu": (),
    "maxpool2": (),
    "flatten": (),
    "linear": ("weight", "bias"),
}
_REFERENCE_CHUNK = 256  # rows per im2col pass of ImageClassifierServed.logits (bounds its memory)


@dataclass(frozen=True, eq=False)
class ImageClassifierServed:
    """A small image classifier over square one-channel images: conv / ReLU / 2x2 max-pool
    layers, a flatten, then linear / ReLU layers ending in one logit per class.

    The model's input is ``(N, image_side**2)`` float32 rows, pixel values as the device's data
    has them (e.g. grayscale in [0, 1]), row-major; the graph reshapes them to
    ``(N, 1, image_side, image_side)``.  ``layers`` is a sequence of ``(kind, params)`` pairs:

    * ``("conv2d", {"weight": (out, in, k, k), "bias": (out,), "padding": int >= 0})``: stride 1,
      the same zero padding on every side (``torch.nn.Conv2d(in, out, k, padding=p)``);
    * ``("relu", {})``, ``("maxpool2", {})`` (2x2, stride 2, odd rows/columns dropped as
      ``torch.nn.functional.max_pool2d(h, 2)`` does), ``("flatten", {})`` (``(C, H, W)`` ->
      ``C*H*W`` in C order, as ``torch.flatten(h, 1)``); ``None`` is accepted for the empty params;
    * ``("linear", {"weight": (out, in), "bias": (out,)})``: ``h @ weight.T + bias`` (``nn.Linear``).

    Shapes must chain (checked by propagating ``(1, side, side)`` through the layers), a linear
    layer needs a flattened input, and the last layer must be linear with ``len(class_names)``
    outputs.  Arrays are stored as read-only float32 copies and ``layers`` as a tuple of
    ``(kind, dict)`` pairs.  :meth:`logits` is the NumPy reference forward.
    """

    image_side: int
    layers: Sequence[tuple[str, Mapping[str, Any] | None]]
    class_names: Sequence[str]  # class id (logit column) -> name
    method: str
    task: int
    format = "image-classifier"

    def __post_init__(self) -> None:
        for name, minimum in (("image_side", 1), ("task", 0)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < minimum:
                raise ValueError(f"{name} must be an int >= {minimum}, got {v!r}")
            object.__setattr__(self, name, int(v))
        if not isinstance(self.method, str) or not self.method.strip():
            raise ValueError(f"method must be a non-empty string, got {self.method!r}")
        if isinstance(self.class_names, str) or not isinstance(self.class_names, Sequence):
            raise ValueError(f"class_names must be a sequence of strings, got {type(self.class_names).__name__}")
        names = tuple(self.class_names)
        if not names or any(not isinstance(n, str) for n in names):
            raise ValueError(f"class_names must be a non-empty sequence of strings, got {names!r}")
        object.__setattr__(self, "class_names", names)
        if isinstance(self.layers, (str, bytes)) or not isinstance(self.layers, Sequence) or not self.layers:
            raise ValueError(f"layers must be a non-empty sequence of (kind, params) pairs, got {self.layers!r}")
        layers = []
        shape: tuple[int, ...] = (1, self.image_side, self.image_side)  # (C, H, W), or (F,) once flattened
        for i, layer in enumerate(self.layers):
            kind, params = _image_layer(i, layer)
            shape = _image_layer_shape(i, kind, params, shape)
            layers.append((kind, params))
        if layers[-1][0] != "linear":
            raise ValueError(f"the last layer must be linear (one logit per class), got {layers[-1][0]!r}")
        if shape != (len(names),):
            raise ValueError(f"the last linear layer has {shape[0]} outputs but there are {len(names)} class_names")
        object.__setattr__(self, "layers", tuple(layers))

    @property
    def input_dim(self) -> int:
        """Pixels per input row: ``image_side ** 2``."""
        return self.image_side * self.image_side

    @property
    def num_classes(self) -> int:
        return len(self.class_names)

    def layer_summary(self) -> list[str]:
        """One line per layer, e.g. ``conv2d 1->4 k5 p0``, ``maxpool2``, ``linear 128->10``."""
        out = []
        for kind, p in self.layers:
            if kind == "conv2d":
                o, c, k, _ = p["weight"].shape
                out.append(f"conv2d {c}->{o} k{k} p{p['padding']}")
            elif kind == "linear":
                o, c = p["weight"].shape
                out.append(f"linear {c}->{o}")
            else:
                out.append(kind)
        return out

    def logits(self, x: Any) -> np.ndarray:
        """Reference logits ``(N, classes)`` float64 for float rows ``(N, image_side**2)``, computed
        in float64 with NumPy only (convolutions by im2col, ``_REFERENCE_CHUNK`` rows at a time)."""
        a = np.asarray(x)
        if a.dtype == object or not (np.issubdtype(a.dtype, np.number) or a.dtype == np.bool_):
            raise ValueError(f"x must be a numeric array, got dtype {a.dtype}")
        if a.ndim != 2 or a.shape[1] != self.input_dim:
            raise ValueError(f"x must have shape (N, {self.input_dim}), got {a.shape}")
        a = a.astype(np.float64)
        out = np.empty((len(a), self.num_classes), np.float64)
        for s in range(0, len(a), _REFERENCE_CHUNK):
            out[s : s + _REFERENCE_CHUNK] = self._forward(a[s : s + _REFERENCE_CHUNK])
        return out

    def _forward(self, x: np.ndarray) -> np.ndarray:
        n = len(x)
        h = x.reshape(n, 1, self.image_side, self.image_side)
        for kind, p in self.layers:
            if kind == "conv2d":
                h = _conv2d(h, p["weight"].astype(np.float64), p["bias"].astype(np.float64), p["padding"])
            elif kind == "relu":
                h = np.maximum(h, 0.0)
            elif kind == "maxpool2":
                c, hh, ww = h.shape[1:]
                h = h[:, :, : hh // 2 * 2, : ww // 2 * 2].reshape(n, c, hh // 2, 2, ww // 2, 2).max(axis=(3, 5))
            elif kind == "flatten":
                h = h.reshape(n, -1)
            else:  # linear
                h = h @ p["weight"].astype(np.float64).T + p["bias"].astype(np.float64)
        return h


def _conv2d(x: np.ndarray, w: np.ndarray, b: np.ndarray, padding: int) -> np.ndarray:
    """Stride-1 cross-correlation (as ``torch.nn.Conv2d``) by im2col: (N, C, H, W) -> (N, O, H', W')."""
    n, o, k = len(x), w.shape[0], w.shape[2]
    if padding:
        x = np.pad(x, ((0, 0), (0, 0), (padding, padding), (padding, padding)))
    win = np.lib.stride_tricks.sliding_window_view(x, (k, k), axis=(2, 3))  # (N, C, H', W', k, k)
    ho, wo = win.shape[2:4]
    cols = win.transpose(0, 2, 3, 1, 4, 5).reshape(n * ho * wo, -1)  # (N*H'*W', C*k*k)
    y = cols @ w.reshape(o, -1).T + b  # (N*H'*W', O)
    return y.reshape(n, ho, wo, o).transpose(0, 3, 1, 2)


def _image_array(i: int, kind: str, name: str, value: Any, ndim: int) -> np.ndarray:
    a = np.asarray(value)
    if a.dtype == object or not np.issubdtype(a.dtype, np.floating):
        raise ValueError(f"layers[{i}] ({kind}): {name} must be a float array, got dtype {a.dtype}")
    if a.ndim != ndim or 0 in a.shape:
        raise ValueError(f"layers[{i}] ({kind}): {name} must be a non-empty {ndim}-d array, got shape {a.shape}")
    a = np.array(a, dtype=np.float32, order="C", copy=True)
    if not np.isfinite(a).all():
        raise ValueError(f"layers[{i}] ({kind}): {name} contains NaN or infinite values")
    a.flags.writeable = False
    return a


def _image_layer(i: int, layer: Any) -> tuple[str, dict[str, Any]]:
    """``layer`` as a validated ``(kind, params)`` pair (arrays: read-only float32 copies)."""
    if isinstance(layer, (str, bytes)) or not isinstance(layer, Sequence) or len(layer) != 2:
        raise ValueError(f"layers[{i}] must be a (kind, params) pair, got {layer!r}")
    kind, params = layer
    if kind not in _IMAGE_LAYER_PARAMS:
        raise ValueError(f"layers[{i}]: unknown kind {kind!r}; known kinds: {', '.join(IMAGE_LAYER_KINDS)}")
    if params is None:
        params = {}
    if not isinstance(params, Mapping):
        raise ValueError(f"layers[{i}] ({kind}): params must be a mapping, got {type(params).__name__}")
    want = _IMAGE_LAYER_PARAMS[kind]
    if set(params) != set(want):
        raise ValueError(
            f"layers[{i}] ({kind}): params must be {{{', '.join(want)}}}, got {{{', '.join(map(str, params))}}}"
        )
    out: dict[str, Any] = {}
    if kind == "conv2d":
        pad = params["padding"]
        if isinstance(pad, bool) or not isinstance(pad, (int, np.integer)) or pad < 0:
            raise ValueError(f"layers[{i}] (conv2d): padding must be an int >= 0, got {pad!r}")
        out["weight"] = _image_array(i, kind, "weight", params["weight"], 4)
        out["bias"] = _image_array(i, kind, "bias", params["bias"], 1)
        out["padding"] = int(pad)
    elif kind == "linear":
        out["weight"] = _image_array(i, kind, "weight", params["weight"], 2)
        out["bias"] = _image_array(i, kind, "bias", params["bias"], 1)
    return kind, out


def _image_layer_shape(i: int, kind: str, p: dict[str, Any], shape: tuple[int, ...]) -> tuple[int, ...]:
    """The output shape (without the batch) of layer ``i`` on an input of ``shape``; ValueError if
    the shapes do not chain."""
    where = f"layers[{i}] ({kind})"
    image = len(shape) == 3
    if kind == "relu":
        return shape
    if kind == "linear":
        if image:
            raise ValueError(f"{where}: needs a flattened input, got (C, H, W) = {shape}: add a flatten layer")
        out_f, in_f = p["weight"].shape
        if in_f != shape[0]:
            raise ValueError(
                f"{where}: weight {p['weight'].shape} takes {in_f} inputs, the previous layer gives {shape[0]}"
            )
        if p["bias"].shape != (out_f,):
            raise ValueError(f"{where}: bias must have shape ({out_f},), got {p['bias'].shape}")
        return (out_f,)
    if not image:
        raise ValueError(f"{where}: needs a (C, H, W) input, got the flattened {shape[0]} features")
    c, h, w = shape
    if kind == "flatten":
        return (c * h * w,)
    if kind == "maxpool2":
        if h < 2 or w < 2:
            raise ValueError(f"{where}: a 2x2 pool needs an input of at least 2x2, got {h}x{w}")
        return (c, h // 2, w // 2)
    out_c, in_c, kh, kw = p["weight"].shape  # conv2d
    if kh != kw:
        raise ValueError(f"{where}: the kernel must be square, got weight {p['weight'].shape}")
    if in_c != c:
        raise ValueError(f"{where}: weight {p['weight'].shape} takes {in_c} channels, the previous layer gives {c}")
    if p["bias"].shape != (out_c,):
        raise ValueError(f"{where}: bias must have shape ({out_c},), got {p['bias'].shape}")
    side = h + 2 * p["padding"] - kh + 1
    if side < 1:
        raise ValueError(f"{where}: a {kh}x{kh} kernel with padding {p['padding']} does not fit a {h}x{w} input")
    return (out_c, side, side)
