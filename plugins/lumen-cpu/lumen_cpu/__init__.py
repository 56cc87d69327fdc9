"""Lumen's CPU backend: numpy, f32 compute. The reference every other backend is checked against."""

from lumen_core import hookimpl

# GGUF block formats with a fused dequantizing kernel (numba) in lumen_cpu.fused.
FUSED_FORMATS = ("q8_0", "q5_0", "q4_0", "q4_k", "q5_k", "q6_k")
FUSED_PRIORITY = 10  # above the plain dequantize-then-matmul reference implementations


@hookimpl
def register_backends(register):
    register("cpu", "lumen_cpu.backend:CPUBackend")


@hookimpl
def register_ops(register):
    from . import ops

    for name, fn, variant in ops.table():
        register(name, "cpu", fn, variant=variant)
    for fmt in FUSED_FORMATS:
        for op in ("linear", "embedding"):
            register(op, "cpu", _lazy_fused(op), variant=fmt, priority=FUSED_PRIORITY)
    register("linear", "cpu", _lazy_fused("linear", "fp8"), variant="fp8", priority=FUSED_PRIORITY)
    for op in ("linear", "embedding"):  # GGUF block formats repacked to int8 codes at load (store ram)
        register(op, "cpu", _lazy_fused(op, "int8"), variant="i8", priority=FUSED_PRIORITY)
    # q/k/v, gate/up: int8 matrices in one parallel region a decode step (any other format: one linear each)
    register("linear_group", "cpu", _lazy_fused("linear_group", "int8"))
    # Gemma 3's layer: one compiled call a decode step where its matrices are int8 (the composite otherwise)
    register("sandwich_layer", "cpu", _lazy_fused("sandwich_layer", "layer"))


def _lazy_fused(op: str, module: str = "fused"):
    """Importing numba costs ~0.5 s: only a plan that uses a quantized weight pays it. The function is looked up
    once, on the first call (a decode step makes ~120 of these calls)."""
    found = []

    def call(*args, **kwargs):
        if not found:
            from importlib import import_module

            found.append(getattr(import_module(f"lumen_cpu.{module}"), op))
        return found[0](*args, **kwargs)

    call.__name__ = f"{module}_{op}"
    return call
