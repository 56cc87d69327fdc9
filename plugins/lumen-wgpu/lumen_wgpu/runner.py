"""The wgpu decode runner: a decode step recorded into one command buffer, its token picked on the device.

WebGPU has no replayable command buffers for compute (no CUDA-graph analogue: a command buffer is submitted once),
so each step records its dispatches again; the recorder (device.Context) keeps them in one command buffer, submitted
when the sampled token is read back. Greedy sampling (temperature 0, no repetition penalty) runs an argmax kernel
and reads back 4 bytes; other sampling reads the logits row back and samples on the host (lumen_core.sampling).
"""

from __future__ import annotations

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


class Runner(DecodeRunner):
    def __init__(self, model, backend, context_size: int):
        self.model, self.backend, self.context_size = model, backend, context_size
        self.cache = model.new_cache(context_size)

    def reset(self) -> None:
        self.backend.use()
        self.cache = self.model.new_cache(self.context_size)

    def step(self, token: int):
        return self.model.forward([int(token)], self.cache, host=False)

    def sampler(self, params):
        if params.temperature == 0 and params.repetition_penalty == 1.0:
            return lambda logits, previous_ids=(): argmax(logits)
        host = make_sampler(params)
        return lambda logits, previous_ids=(): host(np.asarray(self.backend.to_host(logits), np.float32),
                                                    previous_ids)
