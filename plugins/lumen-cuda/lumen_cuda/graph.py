"""CUDA-graph decode: one model's one-token step captured once, replayed per token.

How a Python forward pass becomes position-independent: while a step is prepared, ``STEP`` holds two device
buffers, the token id and its position. The ops that would otherwise bake host values into the launch read
them instead: ``embedding`` gathers the row ``STEP.ids`` names, ``rope_tables`` builds cos/sin from
``STEP.pos``, ``attention`` writes and reads the KV cache at ``STEP.pos`` (lumen_cuda.decode). Every other op of
the step (GEMV kernels, norms, the Gated-DeltaNet step, MoE routing and experts) already runs without the host.
An op that cannot (a ring KV cache, cuBLAS on f32 weights, a host sync) raises ``NotCapturable``, or CUDA
refuses the capture; either way ``prepare`` returns None with the reason and the engine decodes eagerly.

Memory: the step's temporaries come from a private CuPy pool used for nothing else, so the addresses the graph
was recorded with stay the graph's. The step runs eagerly twice first: once outside that pool (NVRTC compiles,
one-time device data such as fused projection weights and rotary constants is made in the ordinary pool), once
inside it (the pool caches its blocks); then it is captured, and the cache is zeroed.

Streams: the graph runs on a blocking stream, which the legacy default stream (eager prefill, the sampler)
orders itself against, so prefill → replay → sampling need no explicit events.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import cupy as cp
import numpy as np

from lumen_core.backend import DecodeRunner


class NotCapturable(RuntimeError):
    """An op met inside a step being prepared for a CUDA graph cannot run without the host."""


@dataclass
class StepInputs:
    ids: cp.ndarray  # (1,) int64: the token of this step (already through model.input_id)
    pos: cp.ndarray  # (1,) int32: its position (tokens before it)


STEP: StepInputs | None = None  # set while a decode step is prepared (warm-up and capture)


def device_ids(ids):
    """ids (a host list) as a device int64 array, or STEP.ids while a decode step is prepared."""
    if STEP is not None:
        if len(ids) != 1:
            raise NotCapturable(f"a captured decode step embeds 1 token, not {len(ids)}")
        return STEP.ids
    return cp.asarray(np.asarray(ids, dtype=np.int64))


def device_pos(start: int):
    """This token's position as a (1,) int32 device array: STEP.pos while a step is prepared, else a fresh one
    (a fill kernel, no copy from the host)."""
    if STEP is not None:
        return STEP.pos
    return cp.full((1,), start, dtype=cp.int32)


def require_host(what: str) -> None:
    """Raise NotCapturable when a step is being prepared: ``what`` needs host values or a host sync."""
    if STEP is not None:
        raise NotCapturable(f"{what} cannot run inside a captured decode step")


class GraphRunner(DecodeRunner):
    """A model's decode step as a CUDA graph on one device (see the module docstring)."""

    def __init__(self, model, backend, context_size: int):
        self.model, self.backend = model, backend
        self.dev = backend.dev
        with self.dev:
            self.stream = cp.cuda.Stream(non_blocking=False)
            self.pool = cp.cuda.MemoryPool()
            self.inputs = StepInputs(cp.zeros((1,), cp.int64), cp.zeros((1,), cp.int32))
            self.cache = model.new_cache(context_size)
        self.graph = None
        self.logits = None  # the graph's output buffer (1, vocab) f32, in the private pool

    def prepare(self) -> str | None:
        """Warm up and capture; None when the graph is ready, else why the step cannot be captured."""
        global STEP
        pos0 = self.cache.pos
        try:
            with self.dev, self.stream:  # warm-up 1: one-time work (fused weights, tables, constants) made
                STEP = self.inputs       # outside the graph's pool
                try:
                    self.model.forward([0], self.cache, host=False)
                    self.cache.pos = pos0
                finally:
                    STEP = None
            with self.dev, self.stream, cp.cuda.using_allocator(self.pool.malloc):
                STEP = self.inputs
                try:
                    self.model.forward([0], self.cache, host=False)  # warm-up 2: the pool caches its blocks
                    self.cache.pos = pos0
                    self.stream.synchronize()
                    self.stream.begin_capture()
                    try:
                        self.logits = self.model.forward([0], self.cache, host=False)
                    finally:
                        graph = self.stream.end_capture()
                    self.cache.pos = pos0
                finally:
                    STEP = None
            self.graph = graph
            self.graph.upload(self.stream) if hasattr(self.graph, "upload") else None
        except Exception as exc:  # NotCapturable, or CUDA refusing an operation while capturing
            self.graph, self.logits = None, None
            self.stream.synchronize()
            return f"{type(exc).__name__}: {exc}"
        self.reset()
        return None

    def reset(self) -> None:
        with self.dev:
            _zero(self.cache.layers)
        self.cache.pos = 0

    def step(self, token: int):
        """Replay the step for ``token`` at ``cache.pos``; the (1, vocab) logits buffer (overwritten next step)."""
        if self.cache.pos >= self.cache.capacity:
            raise ValueError(f"the cache holds {self.cache.capacity} tokens; position {self.cache.pos} is past it")
        with self.dev, self.stream:
            self.inputs.ids.fill(self.model.input_id(int(token)))
            self.inputs.pos.fill(self.cache.pos)
            self.graph.launch(self.stream)
        self.cache.pos += 1
        return self.logits

    def sampler(self, params):
        from .sampler import DeviceSampler

        return DeviceSampler(params)


def _zero(obj) -> None:
    """Zero every device array reachable from a cache's layer states; drop ring caches' ``recent`` records."""
    if isinstance(obj, cp.ndarray):
        obj.fill(0)
    elif isinstance(obj, list | tuple):
        for o in obj:
            _zero(o)
    elif dataclasses.is_dataclass(obj):
        for f in dataclasses.fields(obj):
            if f.name == "recent":
                setattr(obj, f.name, None)
            else:
                _zero(getattr(obj, f.name))


def decode_runner(model, backend, context_size: int):
    """(runner, None) when the step was captured, else (None, the reason)."""
    runner = GraphRunner(model, backend, context_size)
    why = runner.prepare()
    return (None, why) if why else (runner, None)
