"""The decode step being prepared for a CUDA graph, as the ops see it: one ``StepInputs`` per ``GraphRunner``.

While a runner prepares its step (two eager warm-ups, then the capture: graph.py), ``preparing(inputs)`` makes the
runner's ``StepInputs`` the current step, and the ops that would otherwise bake host values into the launch read
it: ``device_ids`` (the token id the step embeds), ``device_pos`` (its position), ``rope`` constants; ops that
need the host (a sync, cuBLAS on f32) call ``require_host``, which raises ``NotCapturable`` then.

The current step is a ``ContextVar``, set only for the duration of ``preparing`` and restored after it: it is
the runner's object passed down the call stack (``model.forward`` -> layers -> ops cannot take it as an argument:
the architectures call backend-neutral ops), per thread, so two engines (a main model and its draft, two served
models) preparing or decoding never see each other's step, and nothing of a step outlives its runner.
"""

from __future__ import annotations

import dataclasses
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import cupy as cp
import numpy as np


class NotCapturable(RuntimeError):
    """An op met inside a step being prepared for a CUDA graph cannot run without the host."""


@dataclass
class StepInputs:
    ids: cp.ndarray  # (T,) int64: the tokens of this step (already through model.input_id); T = 1 for decoding
    # (T,) int32: their positions, pos[t] = pos[0] + t (a speculative verify's T = k + 1 tokens: lumen_cuda.verify)
    pos: cp.ndarray
    # the expert cache of the backend whose streamed experts the step reads (stream.ExpertStreams; the runner
    # calls its maintain() before each replay), or None
    streams: Any = None
    host_calls: list = dataclasses.field(default_factory=list)  # the step's CPU crossings (hostcall.py)
    host_errors: list = dataclasses.field(default_factory=list)  # what their host nodes raised, not yet reported
    # device constants the step's ops upload in the first warm-up (outside the graph's pool) and read in the
    # capture: rotary inverse frequencies (ops.rope_tables), keyed by their values
    constants: dict = dataclasses.field(default_factory=dict)


_CURRENT: ContextVar[StepInputs | None] = ContextVar("lumen_cuda_step", default=None)


def current() -> StepInputs | None:
    """The step being prepared on this thread, or None (ops run eagerly)."""
    return _CURRENT.get()


@contextmanager
def preparing(inputs: StepInputs):
    """Make ``inputs`` the current step for the block (graph.GraphRunner.prepare)."""
    token = _CURRENT.set(inputs)
    try:
        yield inputs
    finally:
        _CURRENT.reset(token)


def device_ids(ids):
    """ids (a host list) as a device int64 array, or the step's ids while a decode step is prepared."""
    step = _CURRENT.get()
    if step is not None:
        if len(ids) != step.ids.size:
            raise NotCapturable(f"this captured step embeds {step.ids.size} token(s), not {len(ids)}")
        return step.ids
    return cp.asarray(np.asarray(ids, dtype=np.int64))


def device_pos(start: int):
    """This token's position as a (1,) int32 device array: the step's while one is prepared, else a fresh one
    (a fill kernel, no copy from the host)."""
    step = _CURRENT.get()
    if step is not None:
        return step.pos
    return cp.full((1,), start, dtype=cp.int32)


def require_host(what: str) -> None:
    """Raise NotCapturable when a step is being prepared: ``what`` needs host values or a host sync."""
    if _CURRENT.get() is not None:
        raise NotCapturable(f"{what} cannot run inside a captured decode step")
