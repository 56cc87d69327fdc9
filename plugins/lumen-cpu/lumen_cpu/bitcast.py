"""``as_f32``: a uint32's bits as an f32, in registers (an LLVM bitcast), for numba kernels that build floats from
packed codes (fp8, NVFP4, bf16). Going through an array view instead costs a store and a reload per value and a
second loop; with the bitcast each decode is one loop that LLVM vectorises (the fp8 dot: 1.1-1.45x on an AMD EPYC
core, no measurable change on the H200 machine's Xeon; docs/cuda.md, Step 7)."""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.extending import intrinsic


@intrinsic
def as_f32(typingctx, u):
    """The low 32 bits of an integer (numba widens uint32 arithmetic to 64 bits) as an f32."""
    if not isinstance(u, types.Integer):
        return None

    def codegen(context, builder, sig, args):
        v = args[0]
        if u.bitwidth > 32:
            v = builder.trunc(v, ir.IntType(32))
        elif u.bitwidth < 32:
            v = builder.zext(v, ir.IntType(32))
        return builder.bitcast(v, ir.FloatType())

    return types.float32(u), codegen
