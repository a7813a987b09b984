"""Where a learner trains and in what precision (``ClientConfig.train``): the one place that
asks torch for CUDA.  A Raspberry Pi has none, a Jetson has one; a device whose config says
``cpu`` and ``off`` (the defaults) never reaches the code below, so its numbers are the ones
it had before these settings existed."""

from __future__ import annotations

import contextlib
import functools
import logging
from typing import Any, ContextManager

import torch

from fclcore.errors import ConfigError

log = logging.getLogger(__name__)

AMP_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


@functools.cache  # one resolution (and one log line) per process, however many daemons it runs
def resolve(spec: str) -> torch.device:
    """The torch.device ``train.device`` names; ConfigError (exit 2) for a CUDA device this
    machine lacks.  ``auto``: CUDA when torch has it, else CPU, and says which."""
    if spec == "cpu":
        return torch.device("cpu")
    has_cuda = torch.cuda.is_available()
    if spec == "auto":
        device = torch.device("cuda" if has_cuda else "cpu")
        log.info("train.device auto: training on %s", device)
        return device
    if not has_cuda:
        raise ConfigError(f"train.device: {spec} asked for, but torch {torch.__version__} sees no CUDA device")
    device = torch.device(spec)
    if (device.index or 0) >= torch.cuda.device_count():
        raise ConfigError(f"train.device: {spec} asked for, but torch sees {torch.cuda.device_count()} CUDA device(s)")
    return device


def place(learner: Any, spec: str, device: torch.device, amp: str) -> None:
    """``learner`` (a ``fclcore.learner.Learner``) onto ``device`` (resolved from ``spec``) with
    ``amp``; ValueError when its method cannot train there.  The CPU without amp is left as it
    always was.  ``auto``: a method that cannot leave the CPU stays there, and the log says so."""
    if device.type == "cpu" and amp == "off":
        return
    try:
        learner.place(device, amp)
    except ValueError as exc:
        if spec != "auto" or device.type == "cpu":
            raise
        log.warning("train.device auto: %s; it trains on the CPU", exc)
        if amp != "off":
            learner.place(torch.device("cpu"), amp)


def float32_only(method: str, amp: str) -> None:
    """ValueError (``place``'s refusal) when a method that trains in float32 only is asked for
    mixed precision."""
    if amp != "off":
        raise ValueError(f"method {method} trains in float32 only (asked: train.amp {amp})")


def autocast(device: torch.device, amp: str) -> ContextManager:
    """The forward pass's mixed precision: torch.autocast for bf16/fp16, nothing for off."""
    if amp == "off":
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=AMP_DTYPES[amp])


def grad_scaler(device: torch.device, amp: str) -> torch.amp.GradScaler | None:
    """fp16's loss scaling (its gradients underflow without it); None for off and bf16."""
    return torch.amp.GradScaler(device.type) if amp == "fp16" else None
