"""A speculative verify as a CUDA graph: the main model's forward over ``T = k + 1`` tokens (the newest token and
``k`` drafts, lumen_core.speculative) captured once per ``T`` on a ``GraphRunner``'s cache, stream and private pool,
and replayed for every verify of that size.

What changes from the one-token decode step (graph.py): the step's ``StepInputs`` hold ``T`` ids and ``T``
positions (``pos[t] = pos[0] + t``, written by the host before each replay). Embedding gathers the ``T`` ids, the
rope tables are built from the ``T`` positions, and attention over a full cache writes the ``T`` K/V rows and
attends each token up to its own position in one launch (``decode.attention_verify``); a sliding-window ring
runs the decode kernel once per token (token ``t`` writes its row at ``pos[t]`` and attends up to it:
``ops.attention``). The projections, norms and MoE run over
the ``T`` rows at once (GEMV up to 8 tokens: one read of each weight for the whole verify). The forward is captured
under ``lumen_core.speculative.recording()``: Gated-DeltaNet steps its conv and recurrent states token by token and
copies them after each token into buffers of the graph, so that after a replay the rewind copies back the state
after the last kept token (``trail``).

The graphs share the runner's private pool: a graph's temporaries may be another graph's scratch, which is safe
because each graph's outputs (logits, hidden rows, recorded states) are read before the next graph runs.
"""

from __future__ import annotations

import cupy as cp
import numpy as np

from lumen_core.speculative import recording

from .step import StepInputs, preparing


class VerifyGraph:
    """The verify of ``T`` tokens on ``runner``'s cache. ``hidden``: the forward also returns the final hidden rows
    (an MTP drafter reads them)."""

    def __init__(self, runner, T: int, hidden: bool):
        self.runner, self.T, self.hidden = runner, T, hidden
        with runner.dev:
            self.inputs = StepInputs(cp.zeros((T,), cp.int64), cp.zeros((T,), cp.int32))
            self._offsets = cp.arange(T, dtype=cp.int32)
            # the ids go over from page-locked memory, asynchronously (a pageable copy would wait for the stream)
            self._pinned = cp.cuda.alloc_pinned_memory(8 * T)
            self._copied = cp.cuda.Event(disable_timing=True)
        self._host_ids = np.frombuffer(self._pinned, dtype=np.int64, count=T)
        self.graph = self.logits = self.rows = self.trail = None

    def _forward(self):
        extra = {"hidden": True} if self.hidden else {}
        out = self.runner.model.forward([0] * self.T, self.runner.cache, all_logits=True, host=False, **extra)
        return out if self.hidden else (out, None)

    def prepare(self) -> str | None:
        """Warm up and capture (the cache is reset after: call between generations). None when the graph is ready,
        else why the verify cannot be captured."""
        r = self.runner
        cache, pos0 = r.cache, r.cache.pos
        try:
            with r.dev, r.stream, preparing(self.inputs), recording():
                self._forward()  # outside the pool: compiles, one-time constants
                cache.pos = pos0
            with r.dev, r.stream, cp.cuda.using_allocator(r.pool.malloc), preparing(self.inputs):
                with recording():
                    self._forward()
                cache.pos = pos0
                r.stream.synchronize()
                if self.inputs.host_calls or self.inputs.streams is not None:
                    return "the step crosses to the host (experts on the CPU or streamed from RAM)"
                r.stream.begin_capture()
                try:
                    with recording() as trail:
                        self.logits, self.rows = self._forward()
                finally:
                    graph = r.stream.end_capture()
                cache.pos = pos0
            self.graph, self.trail = graph, trail
        except Exception as exc:  # NotCapturable, or CUDA refusing an operation while capturing
            self.graph = self.logits = self.rows = self.trail = None
            r.stream.synchronize()
            return f"{type(exc).__name__}: {exc}"
        finally:
            r.reset()
        return None

    def run(self, ids: list[int]):
        """Replay for ``ids`` (T tokens) at the runner cache's position, which advances by T. -> (logits (T, vocab)
        f32, hidden rows or None, the recorded per-token states): device buffers, overwritten by the next replay."""
        r = self.runner
        if len(ids) != self.T:
            raise ValueError(f"this verify graph takes {self.T} tokens, not {len(ids)}")
        if r.cache.pos + self.T > r.cache.capacity:
            raise ValueError(f"the cache holds {r.cache.capacity} tokens; {self.T} more from {r.cache.pos} do not fit")
        with r.dev, r.stream:
            self._copied.synchronize()  # the previous replay's ids have left the pinned buffer
            self._host_ids[:] = [r.model.input_id(int(t)) for t in ids]
            cp.cuda.runtime.memcpyAsync(self.inputs.ids.data.ptr, self._host_ids.ctypes.data, 8 * self.T,
                                        cp.cuda.runtime.memcpyHostToDevice, r.stream.ptr)
            self._copied.record(r.stream)
            cp.add(self._offsets, np.int32(r.cache.pos), out=self.inputs.pos)  # pos[t] = pos + t, on the device
            self.graph.launch(r.stream)
        r.cache.pos += self.T
        return self.logits, self.rows, self.trail


def argmax_rows(logits) -> list[int]:
    """Each row's argmax, computed on the device; T integers come back (one synchronisation)."""
    return [int(t) for t in cp.argmax(logits, axis=-1).get()]
