"""The tensor-core prefill kernels of kernels/gemm_fp8.cu: selection and launch (lumen_cuda.fp8_mma_model states
their arithmetic, models it in numpy, and documents ``LUMEN_CUDA_MMA_PREFILL``). Compiled for sm_89 / sm_90 / sm_120
/ sm_120a; run and measured on sm_90 (H100, docs/cuda.md, "Tensor-core prefill for fp8 and routed experts");
tests/test_cuda_fp8_mma.py checks them against the model on a GPU.

Routed experts (the default; off with ``LUMEN_CUDA_MMA_PREFILL=0``): moe.py's grouped path (``exact_experts``;
``moe_role`` for fp8, ``moe_role_bf16`` for bf16 lists and packed experts, ``moe_role_nvfp4``, ``moe_act`` between).
Dense fp8 weights (``mode``; ``exact`` or ``e4m3`` only): a device of capability 8.9 or later whose compiled module
reports the e4m3 instructions, an fp8 Weight with 128 x 128 block scales and K a multiple of 128; ``gemv.linear_fp8``
takes a kernel from ``gemv.GEMM_MIN_T`` tokens instead of ``gemm_split``. Nothing is kept per weight: the kernels
read the stored codes and scales as they are. Dense NVFP4 weights (``exact`` only): ``nvfp4_exact``,
``linear_nvfp4`` for ``gemv.linear_nvfp4``.

The x3 kernels' pipeline depth is compiled in (``x3_pipe``: fp8_mma_model.x3_pipe's choice for the device's shared
memory; ``_fn`` passes it to NVRTC and returns the block's dynamic shared memory with the kernel).
"""

from __future__ import annotations

import os

import cupy as cp
import numpy as np

from lumen_core.backend import Weight

from . import kernels
from .fp8_mma_model import BLOCK, applies, capable, experts_requested, requested, slot_block, x3_smem
from .fp8_mma_model import x3_pipe as pipe_for

FILE = "gemm_fp8"
BM, BN = 128, 64  # the GEMM block's weight rows and tokens (FP8_BM, FP8_BN in the .cu file)
MOE_BLOCKS = {64: ("", 128), 32: ("_s32", 256), 16: ("_s16", 256)}  # slots a block -> kernel suffix, weight rows
_ATTR_SMEM_OPTIN, _ATTR_SMEM_SM, _ATTR_SMEM_KEPT = 97, 81, 111  # cudaDevAttr*: per block (opt-in), per SM, kept


def x3_pipe() -> tuple[int, int]:
    """The x3 kernels' pipeline (stages, column multiple) for this device's shared memory: fp8_mma_model.x3_pipe's
    choice (``benchmarks/cuda_moe_prefill.py --pipes`` replaces this function to time others)."""
    return pipe_for(kernels.device_attribute(_ATTR_SMEM_OPTIN, kernels.DEFAULT_SMEM),
                    kernels.device_attribute(_ATTR_SMEM_SM, 2 * kernels.DEFAULT_SMEM),
                    kernels.device_attribute(_ATTR_SMEM_KEPT, 1024))


def _fn(kernel: str, fmt: str = "", rows: int = 0, slots: int = 0, planes: int = 3):
    """A kernel of the module compiled with this device's pipeline and ``planes`` activation planes (3: exact; 1:
    bf16 activations), and the dynamic shared memory an x3 block of ``fmt`` (rows x slots) takes (0 for the other
    kernels)."""
    pipe = x3_pipe()
    smem = x3_smem(fmt, rows, slots, pipe, planes) if fmt else 0
    options = (f"-DX3_STAGES={pipe[0]}", f"-DX3_KMUL={pipe[1]}", f"-DX3_PLANES={planes}")
    return kernels.function(FILE, kernel, options, smem), smem


class SlotBlocks:
    """One grouped call's work list for the routed experts' kernels: the block width in ``slots`` (``slot_block``)
    and, for S slots over E experts, ``blocks`` (ceil(S / slots) + E,) int32 on the device, each (expert, run of
    ``slots`` of its bucket) as c << 16 | e, then -1 (moe.cu's ``moe_slot_blocks``, from the buckets' offsets
    ``off``): a launch's grid is the list, so no block looks for slots an expert does not have."""

    def __init__(self, off, S: int, E: int, slot_fn, threads: int, planes: int = 3):
        """slot_fn: moe.cu's ``moe_slot_blocks``, launched as one block of ``threads`` (its BUCKET_THREADS);
        ``planes``: the activation planes the kernels read (``planes_for``)."""
        self.slots, self.planes = slot_block(os.environ), planes
        self.blocks = cp.empty(-(-S // self.slots) + E, dtype=cp.int32)
        slot_fn((1,), (threads,), (off, np.int32(E), np.int32(self.slots), self.blocks, np.int32(self.blocks.size)))

    def launch(self, kernel: str, fmt: str, N: int, roles: int = 1):
        """The width's variant of ``kernel`` (experts in ``fmt``), its grid (the list's length, roles x ceil(N /
        rows)) and its dynamic shared memory."""
        suffix, rows = MOE_BLOCKS[self.slots]
        fn, smem = _fn(kernel + suffix, fmt, rows, self.slots, self.planes)
        return fn, (self.blocks.size, roles * -(-N // rows)), smem


def _native() -> bool:
    """Whether the module compiled for the current device has the e4m3 instructions (its ``fp8_mma_native`` flag),
    asked once per device (``kernels.device_fact``): a module without them would trap."""

    def ask() -> int:
        flag = cp.zeros(1, dtype=cp.int32)
        _fn("fp8_mma_native")[0]((1,), (32,), (flag,))
        return int(flag.get()[0])

    return kernels.device_fact("fp8_mma_native", ask) == 1


def mode(w: Weight) -> str:
    """The kernel ``w``'s prefill GEMM runs on here: "exact", "e4m3", or "" (``gemm_split``). The option is read
    at each call; a bad value raises."""
    chosen = requested(os.environ)
    if not chosen or w.format != "fp8" or not applies(w.shape, w.block):
        return ""
    return chosen if _here() else ""


def exact_experts(fmt: str, shape_gate, shape_down, block_gate=None, block_down=None) -> bool:
    """Whether moe.py's grouped path runs routed experts (gate / up (I, H), down (H, I)) on the tensor cores
    (``moe_fp8_x3`` / ``moe_bf16_x3`` / ``moe_nvfp4_x3``): LUMEN_CUDA_MMA_PREFILL other than 0 and a device that
    has the instructions; fp8 with 128 x 128 scale blocks (``block_*``: (rows, columns)) and H, I multiples of 128;
    bf16 with H, I multiples of 16; NVFP4 of 32."""
    if not experts_requested(os.environ):
        return False
    if fmt == "fp8":
        ok = (applies(shape_gate, block_gate) and applies(shape_down, block_down)
              and shape_gate[0] % BLOCK == 0 and shape_down[0] % BLOCK == 0)
    else:
        step = {"bf16": 16, "nvfp4": 32}.get(fmt)
        ok = step is not None and shape_gate[1] % step == 0 and shape_down[1] % step == 0
    return ok and _here()


def nvfp4_exact(w: Weight) -> bool:
    """Whether an NVFP4 Weight's prefill GEMM runs as ``gemm_nvfp4_x3`` here: LUMEN_CUDA_MMA_PREFILL=exact, K a
    multiple of 32, its e4m3 block scales (N, K/16) uint8 C-contiguous on the device, a device that has the
    instructions."""
    if requested(os.environ) != "exact" or w.format != "nvfp4":
        return False
    N, K = w.shape
    b = getattr(w.scale, "block", None)
    ok = (K % 32 == 0 and isinstance(b, cp.ndarray) and b.dtype == cp.uint8 and b.shape == (N, K // 16)
          and b.flags.c_contiguous and w.data.dtype == cp.uint8 and w.data.flags.c_contiguous)
    return ok and _here()


def _here() -> bool:
    return capable(cp.cuda.Device().compute_capability) and _native()


def quantize_x(x):
    """x (T, K) f32 device -> (codes (T, K) uint8, scales (T, K/128) f32), as fp8_mma_model.quantize_x."""
    x = cp.ascontiguousarray(x, dtype=cp.float32)
    T, K = x.shape
    xq = cp.empty((T, K), dtype=cp.uint8)
    sx = cp.empty((T, K // BLOCK), dtype=cp.float32)
    if T:
        _fn("fp8_quantize_x")[0]((T, K // BLOCK), (32,), (x, xq, sx, np.int32(K)))
    return xq, sx


def gemm(xq, sx, data, scale):
    """y (T, N) f32 from quantized activations and an fp8 weight (codes (N, K) uint8, block scales
    (ceil(N/128), K/128) f32), as fp8_mma_model.gemm."""
    T, K = xq.shape
    N = data.shape[0]
    y = cp.empty((T, N), dtype=cp.float32)
    if T and N:
        grid = (-(-T // BN), -(-N // BM))
        _fn("gemm_fp8_mma")[0](grid, (256,), (
            cp.ascontiguousarray(data), cp.ascontiguousarray(scale, dtype=cp.float32), xq, sx, y, np.int32(N),
            np.int32(K), np.int32(T)))
    return y


def planes_for(w: Weight) -> int:
    """The activation planes a product with ``w`` reads: 1 for a weight of cuda.compute-quantization bf16 (x rounded
    to bf16), else 3 (f32-exact)."""
    return 1 if w.activations == "bf16" else 3


_bf16_round = cp.ElementwiseKernel(
    "float32 x", "uint16 hi",
    "const unsigned int u = __float_as_uint(x); hi = (u + (((u >> 16) & 1u) + 0x7FFFu)) >> 16", "lumen_bf16_round")


def bf16_round(x, out=None):
    """x f32 (any strides) -> bf16 bits, rounded to nearest even (the planes' hi alone): one kernel, into ``out``
    (e.g. a bf16 KV cache's rows) or a fresh C-contiguous array."""
    hi = cp.empty(x.shape, cp.uint16) if out is None else out
    _bf16_round(x.astype(cp.float32, copy=False), hi)
    return hi


def x_planes(x, planes: int = 3):
    """x (T, K) f32 device -> (3, T, K) bf16 bits (hi, mid, lo), as fp8_mma_model.x_planes; ``planes`` 1: (1, T, K),
    the hi plane alone (x rounded to bf16)."""
    if planes == 1:
        return bf16_round(x)[None]
    x = cp.ascontiguousarray(x, dtype=cp.float32)
    xp = cp.empty((3, *x.shape), dtype=cp.uint16)
    if x.size:
        _fn("fp8_x_planes")[0]((min(-(-x.size // 256), 65535),), (256,), (x, xp, np.int64(x.size)))
    return xp


def gemm_x3(xp, data, scale):
    """y (T, N) f32 from the activations' planes (3 or 1, T, K) and an fp8 weight, as fp8_mma_model.gemm_x3."""
    _, T, K = xp.shape
    N = data.shape[0]
    y = cp.empty((T, N), dtype=cp.float32)
    if T and N:
        grid = (-(-T // BN), -(-N // BM))
        fn, smem = _fn("gemm_fp8_x3", "fp8", BM, BN, xp.shape[0])
        fn(grid, (256,), (cp.ascontiguousarray(data), cp.ascontiguousarray(scale, dtype=cp.float32), xp, y,
                          np.int32(N), np.int32(K), np.int32(T)), shared_mem=smem)
    return y


def moe_role(tab, data_row: int, scale_row: int, E: int, work: SlotBlocks, off, order, div: int, planes, y, N: int,
             K: int, roles: int = 1):
    """``roles`` matrix roles of fp8 routed experts over their buckets (``moe_fp8_x3``; 2: gate and up in one
    launch): y (roles, S, N) f32 rows of the bucketed slots, role r from the table's rows data_row + r and
    scale_row + r; planes (3, rows, K) bf16 bits, a slot's row slot // div; ``work`` the call's blocks."""
    fn, grid, smem = work.launch("moe_fp8_x3", "fp8", N, roles)
    fn(grid, (256,), (
        tab, np.int32(data_row), np.int32(scale_row), np.int32(E), work.blocks, off, order, np.int32(div), planes,
        np.int64(planes.shape[1] * planes.shape[2]), y, np.int32(N), np.int32(K), *_roles(y, roles)),
       shared_mem=smem)


def moe_role_bf16(tab, data_row: int, base, stride: int, row_off: int, E: int, work: SlotBlocks, off, order,
                  div: int, planes, y, N: int, K: int, roles: int = 1):
    """``moe_role`` for bf16 experts (``moe_bf16_x3``): role r's matrices from the table's row ``data_row`` + r
    (``tab`` not None) or at ``base`` + (e * stride + (row_off + r N) * K) values (packed experts)."""
    fn, grid, smem = work.launch("moe_bf16_x3", "bf16", N, roles)
    null = np.uint64(0)
    fn(grid, (256,), (
        null if tab is None else tab, np.int32(data_row), null if base is None else base, np.int64(stride),
        np.int32(row_off), np.int32(E), work.blocks, off, order, np.int32(div), planes,
        np.int64(planes.shape[1] * planes.shape[2]), y, np.int32(N), np.int32(K), *_roles(y, roles)),
       shared_mem=smem)


def moe_role_nvfp4(tab, data_row: int, scale_row: int, gs_row: int, E: int, work: SlotBlocks, off, order,
                   div: int, planes, y, N: int, K: int, roles: int = 1):
    """``moe_role`` for NVFP4 experts (``moe_nvfp4_x3``): role r's codes, block scales and global scales from the
    table's rows ``data_row`` + r, ``scale_row`` + r, ``gs_row`` + r."""
    fn, grid, smem = work.launch("moe_nvfp4_x3", "nvfp4", N, roles)
    fn(grid, (256,), (
        tab, np.int32(data_row), np.int32(scale_row), np.int32(gs_row), np.int32(E), work.blocks, off, order,
        np.int32(div), planes, np.int64(planes.shape[1] * planes.shape[2]), y, np.int32(N), np.int32(K),
        *_roles(y, roles)), shared_mem=smem)


def _roles(y, roles: int):
    """The kernels' (roles, values between two roles' outputs) for y (roles, S, N) or (S, N)."""
    if roles < 1 or (roles > 1 and (y.ndim != 3 or y.shape[0] != roles)):
        raise ValueError(f"{roles} roles into an output of shape {y.shape}")
    return np.int32(roles), np.int64(y[0].size if roles > 1 else 0)


def moe_act(g, u, act: int):
    """h = act(g) * u elementwise (0: silu, 1: gelu_tanh; moe.cu's act_mul)."""
    h = cp.empty_like(g)
    if g.size:
        _fn("moe_x3_act")[0]((min(-(-g.size // 256), 65535),), (256,), (
            g, u, h, np.int64(g.size), np.int32(act)))
    return h


def gemm_nvfp4_x3(xp, data, block, global_scale):
    """y (T, N) f32 from the activations' planes (3, T, K) and an NVFP4 weight (codes (N, K/2), e4m3 block scales
    (N, K/16), global scale): f32-exact products (``gemm_nvfp4_x3``)."""
    _, T, K = xp.shape
    N = data.shape[0]
    y = cp.empty((T, N), dtype=cp.float32)
    if T and N:
        grid = (-(-T // BN), -(-N // BM))
        fn, smem = _fn("gemm_nvfp4_x3", "nvfp4", BM, BN, xp.shape[0])
        fn(grid, (256,), (data, block, np.float32(global_scale), xp, y, np.int32(N), np.int32(K), np.int32(T)),
           shared_mem=smem)
    return y


def linear_nvfp4(x2, w: Weight):
    """``gemv.linear_nvfp4``'s prefill here: x2 (T, K) f32 device, w an NVFP4 Weight that ``nvfp4_exact`` took."""
    return gemm_nvfp4_x3(x_planes(x2, planes_for(w)), w.data, w.scale.block, w.scale.global_scale)


def linear(x2, w: Weight, how: str):
    """``gemv.linear_fp8``'s prefill here: x2 (T, K) f32 device, w an fp8 Weight (N, K) that ``mode`` took, ``how``
    its answer."""
    data = w.data.view(cp.uint8) if w.data.dtype != cp.uint8 else w.data
    if how == "exact":
        return gemm_x3(x_planes(x2, planes_for(w)), data, w.scale)
    xq, sx = quantize_x(x2)
    return gemm(xq, sx, data, w.scale)
