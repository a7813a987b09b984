"""Which onnxruntime execution provider runs a served model (``serve.providers``): the first of
the configured list that the installed onnxruntime has.  A Jetson's onnxruntime-gpu has
TensorRT and CUDA, PyPI's wheel on a Raspberry Pi has the CPU only, so one ordered list serves
both.  onnxruntime itself falls back along the list when a provider fails to initialise; the
runtime reports the one its session really runs on."""

from __future__ import annotations

import functools
import logging

import onnxruntime as ort

log = logging.getLogger(__name__)

CPU = "CPUExecutionProvider"


@functools.cache  # one line in the log per list (none for the default), however often a model is (re)loaded
def usable(wanted: tuple[str, ...]) -> tuple[str, ...]:
    """The wanted providers (names checked by ``fclcore.schema.check_providers``) this
    onnxruntime has, in order; the CPU when it has none of them."""
    have = set(ort.get_available_providers())
    chosen = tuple(name for name in wanted if name in have) or (CPU,)
    lacking = [name for name in wanted if name not in have]
    if wanted != (CPU,):  # the default, as before these settings existed, goes unsaid
        note = f" (this onnxruntime {ort.__version__} lacks {', '.join(lacking)})" if lacking else ""
        log.info("serving with %s%s", chosen[0], note)
    return chosen
