"""The wgpu decode runner: a decode step captured once and replayed, its token picked on the device.

WebGPU cannot resubmit a command buffer, so there is no CUDA graph to replay; instead the first decode step of a
generation runs through the model's Python and is captured (device.Capture: every dispatch with its pipeline,
bind group and params, every upload), and later steps re-encode that list (``Context.replay``) without running the
model's Python or the ops' again. What changes from step to step — the token, the positions of the rope tables,
attention's key count and cache slot — is given by the ops as ``dynamic`` functions of the step's inputs.

The capture is checked before it is trusted: the second step is captured too, and the first capture's prediction
for it (every static params block, every dynamic function's output) must equal what the second step recorded; if
anything differs (an op whose params change with the position but declared no function for it), the runner says so
once and steps run through the model's Python for this generation.

A replayed step is submitted in chunks of ``CHUNK`` dispatches (the device runs the first while the host encodes the
next: faster than one command buffer a step on the H200); ``LUMEN_WGPU_CHUNK=0`` submits each step once.

Greedy sampling (temperature 0, no repetition penalty) runs an argmax kernel and reads back 4 bytes; other sampling
reads the logits row back and samples on the host (lumen_core.sampling). ``LUMEN_WGPU_REPLAY=0`` turns replay off.
"""

from __future__ import annotations

import os
import sys

import numpy as np

from lumen_core.backend import DecodeRunner
from lumen_core.sampling import make_sampler

from . import wgsl
from .device import pack
from .tensor import WTensor, empty

WG = 256
_ARGMAX = wgsl.header([("X", "r", "f32"), ("out", "w", "u32")]) + f"""
// words: 0 n, 1 offset of the row. One workgroup; the lowest index wins a tie (numpy's argmax); NaN never wins.
var<workgroup> best_v: array<f32, {WG}>;
var<workgroup> best_i: array<u32, {WG}>;
@compute @workgroup_size({WG})
fn main(@builtin(local_invocation_index) lid: u32) {{
  let n = w(0u);
  var bv = -3.4028234663852886e38; var bi = 0xffffffffu;
  for (var i = lid; i < n; i += {WG}u) {{
    let v = X[w(1u) + i];
    if (v > bv || (bi == 0xffffffffu && v == v)) {{ bv = v; bi = i; }}
  }}
  best_v[lid] = bv; best_i[lid] = bi;
  workgroupBarrier();
  for (var s = {WG // 2}u; s > 0u; s >>= 1u) {{
    if (lid < s) {{
      let ov = best_v[lid + s]; let oi = best_i[lid + s];
      if (oi != 0xffffffffu && (ov > best_v[lid] || (ov == best_v[lid] && oi < best_i[lid]) ||
                                best_i[lid] == 0xffffffffu)) {{
        best_v[lid] = ov; best_i[lid] = oi;
      }}
    }}
    workgroupBarrier();
  }}
  if (lid == 0u) {{ out[0] = select(best_i[0], 0u, best_i[0] == 0xffffffffu); }}
}}
"""


def argmax(row: WTensor) -> int:
    """The index of the largest value of a 1-D row, computed on the device; 4 bytes come back."""
    row = row.reshape(-1) if row.ndim != 1 else row
    row = row.dense()
    ctx = row.ctx
    out = empty(ctx, (1,), "i32")
    ctx.dispatch(ctx.kernel("argmax", _ARGMAX, "rw"), [row.buf.gpu, out.buf.gpu], pack(row.size, row.offset), (1, 1, 1))
    return int(np.frombuffer(ctx.read(out.buf.gpu, 0, 4), dtype=np.uint32)[0])


# a replayed step is submitted every this many dispatches, so the device starts while the host still encodes (the
# H200, the 9B shape: 32 beat 64 to 256 and one submit a step; benchmarks/wgpu_step_profile.py). LUMEN_WGPU_CHUNK=0:
# one command buffer a step.
CHUNK = int(os.environ.get("LUMEN_WGPU_CHUNK", "32"))


class Runner(DecodeRunner):
    def __init__(self, model, backend, context_size: int):
        self.model, self.backend, self.context_size = model, backend, context_size
        self.replay_on = os.environ.get("LUMEN_WGPU_REPLAY", "1") != "0"
        self.cache = model.new_cache(context_size)
        self._cap = None  # the first step's capture, (capture, position, logits)
        self.trusted = False  # the capture predicted the second step exactly
        self.failed: str | None = None  # why replay was given up for this generation
        self.replayed = 0  # steps replayed (tests read it)
        self.chunk = CHUNK

    def reset(self) -> None:
        self._drop()
        self.failed = None
        self.backend.use()
        self.cache = self.model.new_cache(self.context_size)

    def _drop(self) -> None:
        if self._cap is not None:
            self.backend.ctx.release(self._cap[0])
        self._cap, self.trusted = None, False

    def _inputs(self, token: int, pos: int) -> dict:
        to_input = getattr(self.model, "input_id", None)  # Gemma maps a few token ids before its embedding
        return {"delta": pos - self._cap[1], "token": int(to_input(token) if to_input else token)}

    def step(self, token: int):
        token, cache, ctx = int(token), self.cache, self.backend.ctx
        if self.trusted:
            ctx.replay(self._cap[0], self._inputs(token, cache.pos), self.chunk)
            cache.pos += 1
            self.replayed += 1
            return self._cap[2]
        if not self.replay_on or self.failed:
            return self.model.forward([token], cache, host=False)
        pos = cache.pos
        ctx.begin_capture()
        try:
            logits = self.model.forward([token], cache, host=False)
        finally:
            cap = ctx.end_capture()
        if self._cap is None:
            self._cap = (cap, pos, logits)
            return logits
        why = mismatch(self._cap[0], cap, self._inputs(token, pos))
        ctx.release(cap)
        if why is None:
            self.trusted = True
        else:
            self.failed = why
            self._drop()
            print(f"lumen: note: {self.backend.device}: decode steps run through the model's Python: a captured step "
                  f"did not predict the next one ({why})", file=sys.stderr)
        return logits

    def close(self) -> None:
        self._drop()

    def sampler(self, params):
        if params.temperature == 0 and params.repetition_penalty == 1.0:
            return lambda logits, previous_ids=(): argmax(logits)
        host = make_sampler(params)
        return lambda logits, previous_ids=(): host(np.asarray(self.backend.to_host(logits), np.float32),
                                                    previous_ids)


def mismatch(first, second, inputs: dict) -> str | None:
    """None where ``first`` (a capture) replayed with ``inputs`` records exactly what ``second`` recorded (the
    same kernels, params, workgroup counts and uploaded bytes, in order), else what differs."""
    if len(first.records) != len(second.records):
        return f"{len(first.records)} records, then {len(second.records)}"
    for i, (a, b) in enumerate(zip(first.records, second.records, strict=True)):
        if a[0] != b[0]:
            return f"record {i}: {a[0]}, then {b[0]}"
        if a[0] == "upload":
            want = a[2] if a[3] is None else a[3](inputs)
            if want != b[2]:
                return f"record {i}: upload of {len(b[2])} bytes changed" + (" (no dynamic function)" if a[3] is None
                                                                             else "")
            continue
        if a[1] is not b[1]:
            return f"record {i}: kernel {a[1].name}, then {b[1].name}"
        params, groups = (a[3], a[4]) if a[5] is None else a[5](inputs)
        if params != b[3] or tuple(groups) != tuple(b[4]):
            return f"record {i}: kernel {a[1].name}'s params or workgroups changed" + (
                " (no dynamic function)" if a[5] is None else "")
    return None
