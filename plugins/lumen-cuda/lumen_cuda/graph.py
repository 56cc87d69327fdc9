"""CUDA-graph decode: one model's one-token step captured once, replayed per token.

How a Python forward pass becomes position-independent: while a step is prepared, the runner's ``StepInputs``
is the current step (lumen_cuda.step: a context passed down to the ops, not a module global), holding two device
buffers, the token id and its position. The ops that would otherwise bake host values into the launch read
them instead: ``embedding`` gathers the row the step's ``ids`` name, ``rope_tables`` builds cos/sin from its
``pos``, ``attention`` writes and reads the KV cache at ``pos`` (lumen_cuda.decode). Every other op of
the step (GEMV kernels, norms, the Gated-DeltaNet step, MoE routing and experts) already runs without the host.
An op that cannot (a ring KV cache, cuBLAS on f32 weights, a host sync) raises ``NotCapturable``, or CUDA
refuses the capture; either way ``prepare`` returns None with the reason and the engine decodes eagerly.

Memory: the step's temporaries come from a private CuPy pool used for nothing else, so the addresses the graph
was recorded with stay the graph's. The step runs eagerly twice first: once outside that pool (NVRTC compiles,
one-time device data such as fused projection weights and rotary constants is made in the ordinary pool), once
inside it (the pool caches its blocks); then it is captured, and the cache is zeroed.

Streams: the graph runs on a blocking stream, which the legacy default stream (eager prefill, the sampler)
orders itself against, so prefill → replay → sampling need no explicit events.

Host calls: routed experts on the CPU (``CUDABackend.call`` while a step is prepared) become nodes of the graph
(hostcall.py): by default two kernels around a mailbox the CPU backend's native server answers (one token's fp8 /
NVFP4 experts), else (LUMEN_HOSTCALL=python, or work that is not one native job) a Python host node each.
``StepInputs.host_calls`` keeps them as long as the graph,
``_launch`` arms the servers with the step's number of jobs, ``_check`` raises what the crossings met (reported by
the next ``step`` / token), and the host waits on blocking events (``_event``).

Ownership: everything a runner made (graph, private pool, cache, step inputs, host calls, greedy buffers) is its
own, and goes with it, or with ``close`` (``CUDABackend.close`` closes the runners it made). Two runners (two
engines on one GPU, a main model and its draft) share nothing but compiled kernels.
"""

from __future__ import annotations

import dataclasses

import cupy as cp
import numpy as np

from lumen_core.backend import DecodeRunner

from . import hostcall, kernels
from .sampler import DeviceSampler
from .step import StepInputs, preparing

GREEDY_BLOCKS, GREEDY_THREADS = 128, 256  # kernels/greedy.cu


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
        self._greedy = None  # greedy_tokens' kernel, scratch, remap table, pinned slots and events
        self._chain = None  # greedy_chain's raw tokens (device), pinned copy and event
        self._between = None  # called before each replay: the streamed-expert cache's upkeep (ExpertStreams.maintain)
        self._done = None  # step's blocking event (steps with host calls)
        self._verify: dict = {}  # (T, hidden) -> VerifyGraph, or the reason it could not be captured (verify.py)

    def prepare(self) -> str | None:
        """Warm up and capture; None when the graph is ready, else why the step cannot be captured."""
        pos0 = self.cache.pos
        try:
            # warm-up 1: one-time work (fused weights, tables, constants) made outside the graph's pool
            with self.dev, self.stream, preparing(self.inputs):
                self.model.forward([0], self.cache, host=False)
                self.cache.pos = pos0
            with self.dev, self.stream, cp.cuda.using_allocator(self.pool.malloc), preparing(self.inputs):
                self.model.forward([0], self.cache, host=False)  # warm-up 2: the pool caches its blocks
                self.cache.pos = pos0
                self.stream.synchronize()  # the warm-ups' host calls have run; only the capture's are kept
                del self.inputs.host_calls[:]
                self.stream.begin_capture()
                try:
                    self.logits = self.model.forward([0], self.cache, host=False)
                finally:
                    graph = self.stream.end_capture()
                self.cache.pos = pos0
            self.graph = graph
            if self.inputs.streams is not None:
                self._between = self.inputs.streams.maintain
            self.graph.upload(self.stream) if hasattr(self.graph, "upload") else None
        except Exception as exc:  # NotCapturable, or CUDA refusing an operation while capturing
            self.graph, self.logits = None, None
            self.stream.synchronize()
            return f"{type(exc).__name__}: {exc}"
        self.reset()
        return None

    def __del__(self) -> None:
        """Steps still queued (greedy_tokens runs two ahead) finish before the graph, its pool and its host calls'
        buffers are freed: a replay outliving them would run host nodes whose calls are gone and write memory
        the next engine may own."""
        try:
            self.stream.synchronize()
        except Exception:  # interpreter shutdown, or a failed __init__: nothing is left to wait for
            pass

    def close(self) -> None:
        """Free the graph, its private pool, the cache and the step's buffers now (queued steps finish first);
        the runner cannot step afterwards."""
        self.stream.synchronize()
        self.graph = self.logits = self._greedy = self._chain = self._between = self._done = None
        self._verify = {}
        self.inputs = StepInputs(self.inputs.ids, self.inputs.pos)  # drops host calls, constants, the streams
        self.cache = None
        self.pool.free_all_blocks()

    def verify_graph(self, T: int, hidden: bool = False):
        """The captured speculative verify of ``T`` tokens on this runner's cache (lumen_cuda.verify), made on first
        use — which resets the cache, so ask between generations — or None when the verify cannot be captured
        (``verify_note(T, hidden)`` says why)."""
        from .verify import VerifyGraph

        key = (T, bool(hidden))
        if key not in self._verify:
            graph = VerifyGraph(self, T, hidden)
            why = graph.prepare()
            self._verify[key] = why if why else graph
        found = self._verify[key]
        return None if isinstance(found, str) else found

    def verify_note(self, T: int, hidden: bool = False) -> str | None:
        found = self._verify.get((T, bool(hidden)))
        return found if isinstance(found, str) else None

    def argmax_rows(self, logits) -> list[int]:
        from .verify import argmax_rows

        with self.dev:
            return argmax_rows(logits)

    def reset(self) -> None:
        self.stream.synchronize()  # steps still queued (greedy_tokens runs ahead) finish, host calls included
        self._check()
        with self.dev:
            _zero(self.cache.layers)
        self.cache.pos = 0

    def step(self, token: int):
        """Replay the step for ``token`` at ``cache.pos``; the (1, vocab) logits buffer (overwritten next step)."""
        if self.cache.pos >= self.cache.capacity:
            raise ValueError(f"the cache holds {self.cache.capacity} tokens; position {self.cache.pos} is past it")
        self._check()
        with self.dev, self.stream:
            self.inputs.ids.fill(self.model.input_id(int(token)))
            self.inputs.pos.fill(self.cache.pos)
            if self._between is not None:
                self._between()
            self._launch()
            if self.inputs.host_calls:  # the sampler's read would spin on a core the host nodes need: sleep here
                if self._done is None:
                    self._done = self._event()
                self._done.record(self.stream)
                self._done.synchronize()
        self.cache.pos += 1
        return self.logits

    def _launch(self) -> None:
        """Replay the graph on this runner's stream. With host calls, their backends first release this thread's
        idle worker threads (``Backend.release_threads``): the host nodes compute on CUDA's driver thread, whose
        own pool would otherwise share the cores with this one (docs/cuda.md)."""
        released = []
        hostcall.arm(self.inputs.host_calls)
        for hc in self.inputs.host_calls:
            if hc.target is not None and not any(hc.target is b for b in released):
                released.append(hc.target)
                hc.target.release_threads()
        self.graph.launch(self.stream)

    def _event(self):
        """An event the host waits on. With host calls in the step, a blocking one: the waiting thread sleeps
        instead of spinning on a core, which the CPU experts' threads need (a spinning waiter slowed every host
        node's parallel kernels); without, CUDA's default (spinning: the lowest latency)."""
        return cp.cuda.Event(block=bool(self.inputs.host_calls), disable_timing=True)

    def _check(self) -> None:
        """Raise what a host node of an earlier replay met (hostcall.py), if the step has any."""
        if self.inputs.host_calls:
            hostcall.check(self.inputs)

    def sampler(self, params):
        return DeviceSampler(params)

    def _greedy_parts(self):
        """greedy_next's kernel, scratch, remap table, two raw-token slots, pinned memory and events (made once)."""
        if self._greedy is None:
            with self.dev:
                vocab = getattr(self.model, "vocab_size", self.logits.size)
                pairs = [(t, i) for t in range(vocab) if (i := self.model.input_id(t)) != t]
                remap = np.array(pairs or [(0, 0)], dtype=np.int64).reshape(-1)
                self._greedy = (
                    kernels.function("greedy", "greedy_next"),
                    cp.empty(GREEDY_BLOCKS, cp.float32), cp.empty(GREEDY_BLOCKS, cp.int32),
                    cp.zeros(1, cp.uint32), cp.asarray(remap), np.int32(len(pairs)),
                    [cp.empty(1, cp.int64) for _ in range(2)],  # raw tokens per slot (device)
                    cp.cuda.alloc_pinned_memory(16), [self._event(), self._event()])
        return self._greedy

    def greedy_chain(self, k: int, token: int | None = None, logits=None, after=None) -> list[int]:
        """``k`` greedy tokens with one synchronisation (a draft model's proposal): each step's argmax becomes the
        next step's input on the device (``greedy_next``), and the host reads the ``k`` tokens once at the end.
        The chain starts from ``token`` (replayed first, at ``cache.pos``) or, with ``token`` None, from ``logits``
        (a device row (vocab,) of the position just before ``cache.pos``: e.g. a verify graph's last row). Then
        k - 1 more replays, each fed the token before it: ``cache.pos`` advances by k (token given) or k - 1.
        ``after()`` runs after each replay, on this runner's stream (enqueued work: recording the states)."""
        fn, part_v, part_i, counter, remap, nremap, _, _, _ = self._greedy_parts()
        if self._chain is None or self._chain[0].size < k:
            with self.dev:
                self._chain = (cp.empty(max(k, 8), cp.int64), cp.cuda.alloc_pinned_memory(8 * max(k, 8)),
                               self._event())
        raw, pinned, done = self._chain
        n = self.logits.size
        if self.cache.pos + k - (token is None) > self.cache.capacity:
            raise ValueError(f"the cache holds {self.cache.capacity} tokens; {k} more from {self.cache.pos} do not fit")
        self._check()
        with self.dev, self.stream:
            if token is not None:
                self.inputs.ids.fill(self.model.input_id(int(token)))
            self.inputs.pos.fill(self.cache.pos - (token is None))  # greedy_next adds one
            row = self.logits.reshape(-1) if token is not None else logits.reshape(-1)
            for i in range(k):
                if i or token is not None:
                    if self._between is not None:
                        self._between()
                    self._launch()
                    self.cache.pos += 1
                    if after is not None:
                        after()
                    row = self.logits.reshape(-1)
                fn((GREEDY_BLOCKS,), (GREEDY_THREADS,), (row, np.int32(n), part_v, part_i, counter, self.inputs.ids,
                                                         self.inputs.pos, raw[i:i + 1], remap, nremap))
            cp.cuda.runtime.memcpyAsync(pinned.ptr, raw.data.ptr, 8 * k, cp.cuda.runtime.memcpyDeviceToHost,
                                        self.stream.ptr)
            done.record(self.stream)
        done.synchronize()
        self._check()
        return [int(t) for t in np.frombuffer(pinned, dtype=np.int64, count=k)]

    def greedy_tokens(self, token: int):
        """The greedy continuation of ``token``, pipelined: after each replay ``greedy_next`` (kernels/greedy.cu)
        writes the argmax to the next step's input id (through the model's input_id remapping) and advances the
        position on the device, so the next replay is queued before the host has read this token; the host reads
        each token from pinned memory one step behind the GPU. Up to two steps run ahead of the consumer (their
        cache writes lie past the last token yielded: harmless, since ``reset`` precedes every generation)."""
        n = self.logits.size
        fn, part_v, part_i, counter, remap, nremap, raw, pinned, events = self._greedy_parts()
        host = np.frombuffer(pinned, dtype=np.int64, count=2)
        logits = self.logits.reshape(-1)
        pending, launches = [], [0]

        def launch() -> None:  # at most two in flight: a new launch reuses the slot just read
            if self.cache.pos >= self.cache.capacity:
                return
            slot = launches[0] % 2
            launches[0] += 1
            with self.dev, self.stream:
                if self._between is not None:
                    self._between()
                self._launch()
                self.cache.pos += 1
                fn((GREEDY_BLOCKS,), (GREEDY_THREADS,), (logits, np.int32(n), part_v, part_i, counter,
                                                         self.inputs.ids, self.inputs.pos, raw[slot], remap, nremap))
                cp.cuda.runtime.memcpyAsync(host.ctypes.data + 8 * slot, raw[slot].data.ptr, 8,
                                            cp.cuda.runtime.memcpyDeviceToHost, self.stream.ptr)
                events[slot].record(self.stream)
            pending.append(slot)

        # The device and stream are made current only around each launch, never across a ``yield``: a generator
        # suspended inside ``with self.stream`` would leave this runner's stream current for its caller, so another
        # engine's work (its prefill, its own greedy kernel) would be queued here, out of order with its own steps.
        if self.cache.pos >= self.cache.capacity:
            raise ValueError(f"the cache holds {self.cache.capacity} tokens; position {self.cache.pos} is past it")
        with self.dev, self.stream:
            self.inputs.ids.fill(self.model.input_id(int(token)))
            self.inputs.pos.fill(self.cache.pos)
        launch()
        launch()
        while pending:
            slot = pending.pop(0)
            events[slot].synchronize()
            self._check()
            tok = int(host[slot])
            launch()  # queued before the consumer looks at tok
            yield tok


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
