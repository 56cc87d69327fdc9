"""Lumen's CUDA backend on CuPy. Importing this package must not import CuPy or initialise CUDA: the backend
class is registered by name and every op is a thin wrapper that imports the implementation on first call."""

from lumen_core import hookimpl
from lumen_core.ops import CONTRACT

# Weight formats ``linear`` accepts on cuda; others (fp8, GGUF blocks) are refused when the weight is uploaded.
LINEAR_FORMATS = ("f32", "bf16", "f16")


@hookimpl
def register_backends(register):
    register("cuda", "lumen_cuda.backend:CUDABackend")


@hookimpl
def register_ops(register):
    for name in CONTRACT:
        if name != "linear":
            register(name, "cuda", _lazy(name))
    for fmt in (*LINEAR_FORMATS, None):
        register("linear", "cuda", _lazy("linear"), variant=fmt)


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
    return call
