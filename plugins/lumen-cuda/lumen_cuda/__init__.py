"""Lumen's CUDA backend on CuPy. Importing this package must not import CuPy or initialise CUDA: the backend
class is registered by name and every op is a thin wrapper that imports the implementation on first call.

Module order: each module of the package imports (at its top or inside a function) only modules listed before it
in ``MODULE_ORDER``, so there is no import cycle (tests/test_cuda_engines.py checks it from the source). In words:
kernels (compiled code), state, step, pinned, the CuPy references and the kernels' launchers, then moe and the
streamed experts on top of them, then ops (the contract, which routes to all of them), then verify (a speculative
verify's graph) and graph (the decode runner), then the backend, then this package (the registration).
"""

import functools

from lumen_core import hookimpl
from lumen_core.ops import CONTRACT

# Weight formats ``linear`` accepts on cuda; GGUF block formats are dequantized to bf16 when uploaded
# (``CUDABackend.stored_format``), others are refused there.
LINEAR_FORMATS = ("f32", "bf16", "f16", "fp8", "nvfp4")
# Hand-written kernels (lumen_cuda.gemv, kernels/*.cu) registered above the CuPy ops; each falls back to the CuPy
# op where it does not apply (GEMV: more than 8 tokens, or K not a multiple of 8 / 16). fp8 / nvfp4: the GEMV for
# T <= 8, else from 5 tokens the tensor-core gemm_split, else dequantize + cuBLAS; f32: a GEMV for T <= 8 (cuBLAS
# cannot be captured in a CUDA graph), else cuBLAS.
KERNEL_PRIORITY = 10
KERNEL_OPS = (("linear", "linear_f32", "f32"),
              ("linear", "linear_bf16", "bf16"), ("linear", "linear_f16", "f16"), ("linear", "linear_fp8", "fp8"),
              ("linear", "linear_nvfp4", "nvfp4"), ("embedding", "embedding_fp8", "fp8"),
              ("embedding", "embedding_nvfp4", "nvfp4"), ("rms_norm", "rms_norm", None))


MODULE_ORDER = (
    "kernels", "state", "step", "pinned", "delta", "sampler", "cupy_ops", "flash_mma_model", "fp8_attention_model",
    "flash", "hostcall", "sm120_layout", "fp8_mma_model", "fp8_mma", "attention", "vision_ops", "gdn_prefill",
    "decode", "sm120", "fuse_plan", "gemv", "moe", "hostweights", "stream", "ops", "batch_decode", "verify",
    "graph", "backend",
    "__init__",
)


@hookimpl
def register_backends(register):
    register("cuda", "lumen_cuda.backend:CUDABackend")


# Ops that take a Weight, which may be kept in host RAM (store 'ram': lumen_cuda.hostweights)
WEIGHT_OPS = ("linear", "embedding", "linear_group")
# Ops that take the backend instance (``backend=``): routed experts in host RAM stream through its expert cache.
# Each CUDABackend's op set binds them to itself (backend._BackendOpSet, through the ``bind`` attribute).
# The KV cache ops take it too: a cache records the backend's attention.compute-quantization (fp8 attention).
BACKEND_OPS = ("moe_experts", "moe_experts_packed", "moe_shared", "kv_cache", "sliding_kv_cache")


@hookimpl
def register_ops(register):
    for name in CONTRACT:
        if name != "linear":
            register(name, "cuda", _host_aware(name, _lazy(name)))
    for fmt in (*LINEAR_FORMATS, None):
        register("linear", "cuda", _host_aware("linear", _lazy("linear")), variant=fmt)
    for op, fn, variant in KERNEL_OPS:
        register(op, "cuda", _host_aware(op, _lazy_kernel(fn)), variant=variant, priority=KERNEL_PRIORITY)
    # optional ops (lumen_core.ops.OPTIONAL): fused projections, and the Gated-DeltaNet gates in one kernel
    register("linear_group", "cuda", _host_aware("linear_group", _lazy_kernel("linear_group")))
    register("gdn_gates", "cuda", _lazy("gdn_gates"))
    register("gated_delta_rule_gates", "cuda", _lazy("gated_delta_rule_gates"))  # a decode step's gates in its kernel
    register("add_rms_norm", "cuda", _lazy_kernel("add_rms_norm"))  # a residual add and the next norm in one kernel
    register("gated_delta_net", "cuda", _lazy("gated_delta_net"))  # a decode step's token mixer in one kernel
    # a MoE block's shared expert as one more slot of the routed experts' kernels (lumen_cuda.ops.moe_shared)
    register("moe_shared", "cuda", _lazy("moe_shared"))
    # a speculative verify's Gated-DeltaNet: T tokens in one launch each, the states after every token kept
    register("causal_conv1d_kept", "cuda", _lazy("causal_conv1d_kept"))
    register("gated_delta_rule_kept", "cuda", _lazy("gated_delta_rule_kept"))
    # a batched step's token mixers: the decoding sequences' rows in one launch per op (lumen_cuda.batch_decode)
    for op in ("attention_segments", "causal_conv1d_segments", "gated_delta_rule_segments"):
        register(op, "cuda", _lazy_batch(op))


def _host_aware(op: str, call):
    """``call``, with a Weight kept in page-locked host RAM (``Weight.store == "ram"``) replaced first by what the op
    reads (a zero-copy view, or a VRAM copy for a prefill: lumen_cuda.hostweights). Other ops are returned as they
    are."""
    if op not in WEIGHT_OPS:
        return call

    def wrapped(*args, **kwargs):
        ws = (args[1] if op == "linear_group" else args[1:2]) if len(args) == 2 and not kwargs else ()
        if any(getattr(w, "store", None) == "ram" for w in ws):
            from . import hostweights

            return hostweights.dispatch(op, call, *args, **kwargs)
        return call(*args, **kwargs)

    wrapped.__name__ = wrapped.__qualname__ = call.__name__
    return wrapped


def _lazy(op: str):
    """``lumen_cuda.ops.<op>``, imported (with CuPy) when a plan first calls it."""
    impl = None

    def call(*args, **kwargs):
        nonlocal impl
        if impl is None:
            from . import ops

            impl = getattr(ops, op)
        return impl(*args, **kwargs)

    call.__name__ = call.__qualname__ = f"cuda_{op}"
    if op in BACKEND_OPS:
        call.bind = lambda backend: functools.partial(call, backend=backend)
    return call


def _lazy_kernel(fn: str):
    """``lumen_cuda.gemv.<fn>`` (a hand-written kernel's launcher), imported (with CuPy) on its first call."""
    impl = None

    def call(*args, **kwargs):
        nonlocal impl
        if impl is None:
            from . import gemv

            impl = getattr(gemv, fn)
        return impl(*args, **kwargs)

    call.__name__ = call.__qualname__ = f"cuda_kernel_{fn}"
    return call


def _lazy_batch(op: str):
    """``lumen_cuda.batch_decode.<op>``, imported (with CuPy) on its first call."""
    impl = None

    def call(*args, **kwargs):
        nonlocal impl
        if impl is None:
            from . import batch_decode

            impl = getattr(batch_decode, op)
        return impl(*args, **kwargs)

    call.__name__ = call.__qualname__ = f"cuda_batch_{op}"
    return call
