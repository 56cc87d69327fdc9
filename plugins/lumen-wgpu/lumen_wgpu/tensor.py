"""``WTensor``: an f32 (or i32) array in a wgpu buffer, with numpy-style views.

It implements the small tensor protocol architectures use (lumen_core.backend): ``.shape``, ``.reshape``, basic
slicing (ints, step-1 slices, ``...``) and ``+ - * /`` with tensors (broadcasting) or Python scalars. Views share
the buffer and carry an element offset and strides; kernels that want a dense input call ``dense()``, which copies
a strided view once. Arithmetic records one strided elementwise dispatch (``elementwise``).
"""

from __future__ import annotations

import math
import threading

import numpy as np

from . import wgsl
from .device import Buffer, Context, pack

DTYPES = {"f32": np.float32, "i32": np.int32}
WG = 256
_CURRENT = threading.local()


def current_context() -> Context:
    """The context ops without a tensor argument allocate on (``rope_tables``, caches and states): the one whose
    backend's ``use`` or ``take`` ran last in this thread."""
    ctx = getattr(_CURRENT, "ctx", None)
    if ctx is None or ctx.closed:
        raise RuntimeError("no wgpu device is current: call the backend's use() first")
    return ctx


def set_current(ctx: Context) -> None:
    _CURRENT.ctx = ctx


class WTensor:
    __slots__ = ("ctx", "buf", "offset", "shape", "strides", "dtype")

    def __init__(self, ctx: Context, buf: Buffer, shape, dtype: str = "f32", offset: int = 0, strides=None):
        self.ctx, self.buf, self.dtype, self.offset = ctx, buf, dtype, offset
        self.shape = tuple(int(d) for d in shape)
        self.strides = tuple(strides) if strides is not None else dense_strides(self.shape)

    # -- facts ------------------------------------------------------------------------------------------------
    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return 4 * self.size

    @property
    def is_dense(self) -> bool:
        return all(st == ds for st, ds, d in zip(self.strides, dense_strides(self.shape), self.shape, strict=True)
                   if d != 1)

    def __len__(self) -> int:
        return self.shape[0]

    def __repr__(self) -> str:
        return f"WTensor(shape={self.shape}, dtype={self.dtype}, wgpu:{self.ctx.index})"

    # -- host -------------------------------------------------------------------------------------------------
    def _lumen_to_host(self) -> np.ndarray:
        x = self.dense()
        raw = self.ctx.read(x.buf.gpu, 4 * x.offset, 4 * x.size)
        return np.frombuffer(raw, dtype=DTYPES[self.dtype]).reshape(self.shape).copy()

    get = _lumen_to_host

    def __array__(self, dtype=None, copy=None):
        a = self._lumen_to_host()
        return a if dtype is None else a.astype(dtype)

    # -- views ------------------------------------------------------------------------------------------------
    def dense(self) -> WTensor:
        """This tensor, or a dense copy of it when it is a strided view."""
        return self if self.is_dense else elementwise("a", [self], dtype=self.dtype)

    def reshape(self, *shape) -> WTensor:
        if len(shape) == 1 and isinstance(shape[0], (tuple, list)):
            shape = tuple(shape[0])
        shape = list(shape)
        if -1 in shape:
            i = shape.index(-1)
            rest = math.prod(d for j, d in enumerate(shape) if j != i)
            shape[i] = self.size // rest if rest else 0
        if math.prod(shape) != self.size:
            raise ValueError(f"cannot reshape a tensor of shape {self.shape} into {tuple(shape)}")
        x = self.dense()
        return WTensor(x.ctx, x.buf, shape, x.dtype, x.offset)

    def __getitem__(self, key) -> WTensor:
        if not isinstance(key, tuple):
            key = (key,)
        if any(k is Ellipsis for k in key):
            i = next(j for j, k in enumerate(key) if k is Ellipsis)
            fill = (slice(None),) * (self.ndim - len(key) + 1)
            key = key[:i] + fill + key[i + 1:]
        if len(key) > self.ndim:
            raise IndexError(f"too many indices for a tensor of shape {self.shape}")
        offset, shape, strides = self.offset, [], []
        for axis, (d, st) in enumerate(zip(self.shape, self.strides, strict=True)):
            k = key[axis] if axis < len(key) else slice(None)
            if isinstance(k, (int, np.integer)):
                k = int(k) + d if k < 0 else int(k)
                if not 0 <= k < d:
                    raise IndexError(f"index {key[axis]} is out of bounds for axis {axis} of size {d}")
                offset += k * st
            elif isinstance(k, slice):
                start, stop, step = k.indices(d)
                if step < 1:
                    raise IndexError("wgpu tensors take slices with a positive step")
                n = max(0, -(-(stop - start) // step))
                offset += start * st if n else 0
                shape.append(n)
                strides.append(st * step)
            else:
                raise IndexError(f"wgpu tensors take ints, slices and ... as indices, not {type(k).__name__}")
        return WTensor(self.ctx, self.buf, shape, self.dtype, offset, strides)

    def broadcast_to(self, shape) -> WTensor:
        shape = tuple(shape)
        lead = len(shape) - self.ndim
        if lead < 0:
            raise ValueError(f"cannot broadcast {self.shape} to {shape}")
        strides = []
        for axis, d in enumerate(shape):
            if axis < lead:
                strides.append(0)
                continue
            own = self.shape[axis - lead]
            if own == d:
                strides.append(self.strides[axis - lead])
            elif own == 1:
                strides.append(0)
            else:
                raise ValueError(f"cannot broadcast {self.shape} to {shape}")
        return WTensor(self.ctx, self.buf, shape, self.dtype, self.offset, strides)

    def repeat(self, n: int, axis: int) -> WTensor:
        """numpy's ``repeat`` along an axis of size 1 (the only one architectures use): a broadcast copy."""
        axis = axis % self.ndim
        if self.shape[axis] != 1:
            raise NotImplementedError("wgpu tensors repeat only along an axis of size 1")
        shape = list(self.shape)
        shape[axis] = n
        return self.broadcast_to(shape).dense() if n != 1 else self

    # -- arithmetic -------------------------------------------------------------------------------------------
    def _binary(self, other, expr: str, rexpr: str | None = None):
        if isinstance(other, WTensor):
            return elementwise(expr, [self, other])
        if isinstance(other, (int, float, np.integer, np.floating)):
            return elementwise(expr.replace("b", "s"), [self], scalar=float(other))
        if isinstance(other, np.ndarray) and other.size == 1:
            return elementwise(expr.replace("b", "s"), [self], scalar=float(other.reshape(())))
        return NotImplemented

    def __add__(self, o):
        return self._binary(o, "a + b")

    __radd__ = __add__

    def __sub__(self, o):
        return self._binary(o, "a - b")

    def __rsub__(self, o):
        return self._binary(o, "b - a")

    def __mul__(self, o):
        return self._binary(o, "a * b")

    __rmul__ = __mul__

    def __truediv__(self, o):
        return self._binary(o, "a / b")

    def __rtruediv__(self, o):
        return self._binary(o, "b / a")

    def __neg__(self):
        return elementwise("-a", [self])


def dense_strides(shape) -> tuple[int, ...]:
    out, acc = [], 1
    for d in reversed(shape):
        out.append(acc)
        acc *= d
    return tuple(reversed(out))


def empty(ctx: Context, shape, dtype: str = "f32") -> WTensor:
    return WTensor(ctx, ctx.alloc(4 * max(1, math.prod(shape))), shape, dtype)


def from_numpy(ctx: Context, array, dtype: str | None = None, dynamic=None) -> WTensor:
    """``array`` on the device (integers as i32, the rest f32). ``dynamic``: how the bytes change from one
    captured decode step to the next (device.Capture)."""
    a = np.asarray(array)
    if dtype is None:
        dtype = "i32" if np.issubdtype(a.dtype, np.integer) else "f32"
    a = np.ascontiguousarray(a, dtype=DTYPES[dtype])
    return WTensor(ctx, ctx.upload(a, dynamic), a.shape, dtype)


# -- elementwise ------------------------------------------------------------------------------------------------
MAX_DIMS = 4
_ARGS = "abc"


def _elementwise_code(expr: str, arity: int, dtype: str, prelude: str = "") -> str:
    ty = "f32" if dtype == "f32" else "u32"  # i32 tensors are only ever copied: move their bits
    binds = [(_ARGS[i] + "_in", "r", ty) for i in range(arity)] + [("out", "w", ty)]
    loads = "\n".join(f"  let {_ARGS[i]} = {_ARGS[i]}_in[at(i, {7 + 5 * i}u)];" for i in range(arity))
    return wgsl.header(binds) + prelude + f"""
// words: 0 n, 1 s (f32 scalar), 2..5 shape, 6 offset of out, then per input 4 strides and its offset
fn at(i: u32, base: u32) -> u32 {{
  var r = i;
  let i3 = r % w(5u); r = r / w(5u);
  let i2 = r % w(4u); r = r / w(4u);
  let i1 = r % w(3u); let i0 = r / w(3u);
  return w(base + 4u) + i0 * w(base) + i1 * w(base + 1u) + i2 * w(base + 2u) + i3 * w(base + 3u);
}}
@compute @workgroup_size({WG})
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nw: vec3<u32>,
        @builtin(local_invocation_index) lid: u32) {{
  let i = group_id(wid, nw) * {WG}u + lid;
  if (i >= w(0u)) {{ return; }}
  let s = wf(1u);
{loads}
  out[w(6u) + i] = {expr};
}}
"""


def elementwise(expr: str, inputs: list[WTensor], scalar: float = 0.0, dtype: str = "f32", shape=None,
                out: WTensor | None = None, prelude: str = "") -> WTensor:
    """``expr`` (WGSL over ``a``, ``b``, ``c`` — the inputs, broadcast to one shape — and ``s``, a scalar) into a
    new dense tensor, or into ``out`` (a dense tensor of that shape; what ``concat`` and cache writes use)."""
    ctx = inputs[0].ctx
    if shape is None:
        shape = np.broadcast_shapes(*(x.shape for x in inputs))
    shape = tuple(shape)
    if len(shape) > MAX_DIMS:
        lead = math.prod(shape[:len(shape) - MAX_DIMS + 1])
        if all(x.is_dense and x.shape == shape for x in inputs):
            flat = [x.reshape((lead,) + shape[len(shape) - MAX_DIMS + 1:]) for x in inputs]
            return elementwise(expr, flat, scalar, dtype, out=None if out is None else out.reshape(flat[0].shape),
                               prelude=prelude).reshape(shape)
        raise NotImplementedError(f"wgpu elementwise ops take at most {MAX_DIMS} dims ({shape})")
    views = [x.broadcast_to(shape) for x in inputs]
    pad = MAX_DIMS - len(shape)
    if out is None:
        out = empty(ctx, shape, dtype)
    elif not out.is_dense or out.shape != shape:
        raise ValueError(f"elementwise: out must be dense of shape {shape}, not {out.shape}")
    words: list = [math.prod(shape), float(scalar)] + [1] * pad + list(shape) + [out.offset]
    for v in views:
        words += [0] * pad + list(v.strides) + [v.offset]
    n = math.prod(shape)
    kernel = ctx.kernel(f"elementwise[{expr}]", _elementwise_code(expr, len(inputs), dtype, prelude),
                        "r" * len(inputs) + "w")
    ctx.dispatch(kernel, [v.buf.gpu for v in views] + [out.buf.gpu], pack(*words), wgsl.grid(-(-n // WG)))
    return out
