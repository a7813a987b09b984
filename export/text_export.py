"""What the text exporters (``onnx_text_groups``, ``onnx_text_tasks``) share: the tokenizer
they record or embed, and the token rows they check parity on.

numpy only at import (``tokenizers`` lazily); no torch, no onnx.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np

from export._proto import sha256
from export.publish import OPSET, ExportError

__all__ = ["PARITY_RANDOM_ROWS", "tokenizer_metadata", "random_token_rows", "parity_token_rows"]

PARITY_RANDOM_ROWS = 32


def tokenizer_metadata(
    tokenizer_json: str | os.PathLike, vocab_size: int | None = None, embed: bool = True
) -> tuple[dict[str, Any], int]:
    """(``tokenizer_sha256`` [+ ``tokenizer_json`` with ``embed``], number of tokens) of a
    tokenizer.json; with ``vocab_size``, its tokens must fit the model's embeddings."""
    try:
        raw = Path(tokenizer_json).read_bytes()
        from tokenizers import Tokenizer

        n = Tokenizer.from_str(raw.decode("utf-8")).get_vocab_size(with_added_tokens=True)
    except ImportError as exc:
        raise ExportError("tokenizer_json needs the 'tokenizers' package") from exc
    except Exception as exc:  # noqa: BLE001 - tokenizers raises a plain Exception for malformed JSON
        raise ExportError(f"{tokenizer_json}: not a usable tokenizer.json ({str(exc).splitlines()[0][:160]})") from None
    if vocab_size is not None and n > vocab_size:
        raise ExportError(f"{tokenizer_json}: {n} tokens, but the backbone has only {vocab_size} embeddings")
    out: dict[str, Any] = {"tokenizer_sha256": sha256(raw).hexdigest()}
    if embed:
        out["tokenizer_json"] = raw.decode("utf-8")
    return out, n


def random_token_rows(vocab: int, max_length: int, rows: int) -> tuple[np.ndarray, np.ndarray]:
    """Seeded random token rows of random length (right-padded with id 0) for the parity check."""
    rng = np.random.default_rng(0)
    length = min(max_length, 32)
    ids = rng.integers(0, vocab, (rows, length), dtype=np.int64)
    mask = np.zeros_like(ids)
    for i, n in enumerate(rng.integers(2, length + 1, rows)):
        mask[i, :n] = 1
    ids[mask == 0] = 0
    return ids, mask


def parity_token_rows(vocab: int, max_length: int, ids: Any, mask: Any) -> tuple[np.ndarray, np.ndarray, str]:
    """(ids, mask, description) to check parity on: the given rows, validated, or (``ids`` None)
    :data:`PARITY_RANDOM_ROWS` seeded random ones."""
    if ids is None:
        if mask is not None:
            raise ExportError("parity_mask given without parity_ids")
        a, m = random_token_rows(vocab, max_length, PARITY_RANDOM_ROWS)
        return a, m, f"random_tokens:{PARITY_RANDOM_ROWS}"
    a = np.asarray(ids)
    m = np.ones_like(a) if mask is None else np.asarray(mask)
    if a.ndim != 2 or a.shape != m.shape or a.shape[0] == 0 or not np.issubdtype(a.dtype, np.integer):
        raise ExportError(
            f"parity_ids and parity_mask must be integer arrays of the same shape (N >= 1, L), "
            f"got {a.shape} and {m.shape}"
        )
    if a.shape[1] > max_length or a.min() < 0 or a.max() >= vocab or not np.isin(m, (0, 1)).all():
        raise ExportError(f"parity rows must have L <= max_length {max_length}, ids in [0, {vocab}) and a 0/1 mask")
    return np.ascontiguousarray(a, np.int64), np.ascontiguousarray(m, np.int64), f"parity_ids:{a.shape[0]}"


def trace_token_model(module: Any, max_length: int, outputs: list[str]) -> Any:
    """Trace ``module(input_ids, attention_mask)`` (int64 [batch, seq]) to an ONNX proto with
    dynamic batch and seq axes and a dynamic batch on every output; ExportError if tracing fails.
    torch and onnx are imported here, so the torch-free runtimes can import this module."""
    import io
    import warnings

    import onnx
    import torch

    length = min(8, max_length)
    ids = torch.zeros((2, length), dtype=torch.int64)
    mask = torch.ones((2, length), dtype=torch.int64)
    mask[1, length // 2 :] = 0
    buf = io.BytesIO()
    axes = {"input_ids": {0: "batch", 1: "seq"}, "attention_mask": {0: "batch", 1: "seq"}}
    try:
        with warnings.catch_warnings(), torch.no_grad():
            warnings.simplefilter("ignore")  # the legacy exporter's deprecation and tracer warnings
            torch.onnx.export(
                module,
                (ids, mask),
                buf,
                dynamo=False,
                opset_version=OPSET,
                input_names=["input_ids", "attention_mask"],
                output_names=outputs,
                dynamic_axes={**axes, **{name: {0: "batch"} for name in outputs}},
                do_constant_folding=True,
            )
    except Exception as exc:  # the tracer raises many types
        raise ExportError(f"torch.onnx.export failed: {exc}") from exc
    return onnx.load_from_string(buf.getvalue())
