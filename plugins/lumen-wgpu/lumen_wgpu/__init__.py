"""Lumen's wgpu backend: WebGPU compute shaders (WGSL) through wgpu-py, on Vulkan, Metal or DX12.

Importing this package touches no driver: the backend class is registered by name and the ops' module is imported
when the registry first asks for them (every op is a plain function of ``lumen_wgpu.ops``' table).
"""

from lumen_core import hookimpl


@hookimpl
def register_backends(register):
    register("wgpu", "lumen_wgpu.backend:WGPUBackend")


@hookimpl
def register_ops(register):
    from . import ops

    for name, fn, variant in ops.table():
        register(name, "wgpu", fn, variant=variant)
