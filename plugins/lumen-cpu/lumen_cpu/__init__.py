"""Lumen's CPU backend: numpy, f32 compute. The reference every other backend is checked against."""

from lumen_core import hookimpl


@hookimpl
def register_backends(register):
    register("cpu", "lumen_cpu.backend:CPUBackend")


@hookimpl
def register_ops(register):
    from . import ops

    for name, fn, variant in ops.table():
        register(name, "cpu", fn, variant=variant)
