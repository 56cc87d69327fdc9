"""lumen_cpu's C row kernels (lumen_cpu/_native.c, _native_i8.c, lumen_cpu/native.py) against float64 references,
at every instruction-set level this CPU runs (AVX-512 VNNI, AVX-512, AVX2, scalar), on shapes with tails (columns not
a multiple of 32, blocks not a multiple of 16), every e4m3 code (subnormals included), every int8 code, and the paths
that use them: the dense one-token GEMVs, the int8 layout's GEMVs (f32 and 8-bit activations) and one token's routed
experts. The package's install builds the library; a missing build fails here."""

from __future__ import annotations

import os
import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest

from lumen_core.backend import Weight, scale_block
from lumen_core.quantize import quantize_nvfp4

native = pytest.importorskip("lumen_cpu.native")
F32 = np.float32
E4M3 = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float64)
FINITE = np.array([b for b in range(256) if b & 0x7F != 0x7F], np.uint8)  # every code but the two NaNs


def levels() -> list[str]:
    """The levels this CPU runs (use() caps a request at the CPU's support)."""
    got = []
    for isa in native.LEVELS:
        if native.use(isa) == isa:
            got.append(isa)
    native.use(native.HIGHEST)
    return got


@pytest.fixture(params=["amx", "avx512vnni", "avx512", "avx2", "scalar"])
def isa(request):
    assert native.available, ("lumen_cpu's C kernels were not built: `pip install -e plugins/lumen-cpu` compiles "
                              "lumen_cpu/_native.c and needs a C compiler (gcc / clang)")
    if request.param not in levels():
        pytest.skip(f"this CPU does not run {request.param}")
    native.use(request.param)
    yield request.param
    native.use(native.HIGHEST)


def rel(got, ref) -> float:
    return float(np.abs(np.asarray(got, np.float64) - ref).max() / max(np.abs(ref).max(), 1e-30))


@pytest.mark.parametrize("K,block", [(2048, (128, 128)), (80, (16, 48)), (200, (1, 200)), (48, (7, 16))])
def test_fp8_rows_equal_float64(isa, K, block):
    from lumen_cpu import fp8

    rng = np.random.default_rng(K)
    N = 37
    raw = rng.choice(FINITE, size=(N, K)).astype(np.uint8)
    br, bc = block
    S = rng.uniform(0.25, 4, size=(-(-N // br), -(-K // bc))).astype(F32)
    x = rng.normal(size=K).astype(F32)
    ref = (E4M3[raw] * np.repeat(np.repeat(S, br, 0), bc, 1)[:N, :K]) @ x.astype(np.float64)
    out = np.full(N, np.nan, F32)
    native.gemv_fp8(raw, x, out, S, br, bc, 8, 2)
    assert rel(out, ref) < 1e-5, isa
    w = Weight(raw.view(ml_dtypes.float8_e4m3fn), "fp8", (N, K), S, (br, bc))
    assert rel(fp8.linear(x[None], w)[0], ref) < 1e-5  # the registered op takes this path for one token


def test_every_e4m3_code_decodes_exactly(isa):
    """One row per code, x one-hot: the dot is the code's value (zero, subnormals, the largest normals, signs)."""
    K = 64
    raw = np.zeros((len(FINITE), K), np.uint8)
    raw[:, 5] = FINITE
    x = np.zeros(K, F32)
    x[5] = 1
    out = np.full(len(FINITE), np.nan, F32)
    native.gemv_fp8(raw, x, out, np.ones((1, 1), F32), len(FINITE), K, 16, 1)
    assert np.array_equal(out, E4M3[FINITE].astype(F32))


@pytest.mark.parametrize("K", [2048, 512, 48, 16, 96])
def test_nvfp4_rows_equal_float64(isa, K):
    from lumen_cpu import nvfp4, nvfp4_fused

    rng = np.random.default_rng(K)
    N = 45
    packed, bs, gs = quantize_nvfp4(rng.normal(size=(N, K)).astype(F32))
    w = nvfp4.weight(packed, (bs, gs), (N, K), "ram")
    # every e4m3 code as a block scale somewhere (subnormal scales included), positive only as quantizers write
    block = np.asarray(w.scale.block).view(np.uint8)
    codes = FINITE[FINITE < 0x7F]
    block.reshape(-1)[:min(block.size, len(codes))] = codes[:block.size]
    dense = nvfp4.dequantize(w).astype(np.float64)
    x = rng.normal(size=K).astype(F32)
    ref = dense @ x.astype(np.float64)
    out = np.full(N, np.nan, F32)
    nvfp4_fused.gemv(w, x, out)
    assert rel(out, ref) < 1e-5, isa


def expert_matrix(rng, fmt, N, K, block=128):
    """An expert matrix (N, K): fp8 (e4m3 values ~ N(0, 40), f32 scales per block x block), bf16 or NVFP4."""
    from lumen_cpu import nvfp4

    if fmt == "bf16":
        return Weight((rng.normal(size=(N, K)) * 0.1).astype(ml_dtypes.bfloat16), "bf16", (N, K))
    if fmt == "fp8":
        data = (rng.normal(size=(N, K)) * 40).astype(ml_dtypes.float8_e4m3fn)
        s = rng.uniform(0.5, 2, size=(-(-N // block), -(-K // block))).astype(F32) * 0.01
        return Weight(data, "fp8", (N, K), s, scale_block((N, K), s.shape))
    packed, bs, gs = quantize_nvfp4(rng.normal(size=(N, K)).astype(F32) * 0.1)
    return nvfp4.weight(packed, (bs, gs), (N, K), "ram")


@pytest.mark.parametrize("fmt", ["fp8", "nvfp4"])
@pytest.mark.parametrize("H,I", [(2048, 512), (80, 48)])
def test_one_token_experts_equal_the_per_expert_path(isa, fmt, H, I):
    """moe_fused's one-token path (one compiled call a layer) against ops.moe_experts_per_expert (each matrix
    dequantized, f32 matmuls)."""
    from lumen_cpu import moe_fused, ops

    rng = np.random.default_rng(H + I)
    E, k = 12, 4

    gate_up = [(expert_matrix(rng, fmt, I, H, 32), expert_matrix(rng, fmt, I, H, 32)) for _ in range(E)]
    down = [expert_matrix(rng, fmt, H, I, 32) for _ in range(E)]
    x = rng.normal(size=(1, H)).astype(F32)
    ids = np.array([[3, 11, 7, 0]])
    w = rng.uniform(size=(1, k)).astype(F32)
    for act in ("silu", "gelu_tanh"):
        ref = ops.moe_experts_per_expert(x, ids, w, gate_up, down, act)
        got = moe_fused.experts(x, ids, w, gate_up, down, act)
        assert got.shape == (1, H)
        assert rel(got, ref.astype(np.float64)) < 2e-5, (fmt, act)


@pytest.mark.parametrize("K", [2048, 48])
def test_nvfp4_decode_rows_equal_dequantize(isa, K):
    """The several-token kernels' row decoder: bit for bit nvfp4.dequantize, rows written ldo apart."""
    from lumen_cpu import nvfp4

    rng = np.random.default_rng(K + 1)
    N = 9
    packed, bs, gs = quantize_nvfp4(rng.normal(size=(N, K)).astype(F32))
    w = nvfp4.weight(packed, (bs, gs), (N, K), "ram")
    block = np.asarray(w.scale.block).view(np.uint8)
    out = np.full((N - 2, K + 5), np.nan, F32)
    decode_rows(packed, block, 2, N - 2, np.float32(gs), out)
    assert np.array_equal(out[:, :K], nvfp4.dequantize(w)[2:])
    assert np.isnan(out[:, K:]).all()  # nothing past each row's K values


def decode_rows(packed, block, r0, n, gs, out):
    from numba import njit

    @njit
    def run(packed, block, r0, n, gs, out):
        native.nvfp4_decode_rows(packed.ctypes.data, packed.shape[1], block.ctypes.data, block.shape[1], r0, n,
                                 2 * packed.shape[1], gs, out.ctypes.data, out.shape[1])

    run(packed, block, r0, n, gs, out)


@pytest.mark.parametrize("T", [5, 40])
def test_several_token_nvfp4_experts_equal_the_per_expert_path(isa, T):
    """Several tokens (prefill): the sorted kernels decode each chunk's rows with the C decoder."""
    from lumen_cpu import moe_fused, nvfp4, ops

    rng = np.random.default_rng(T)
    H, I, E, k = 96, 80, 8, 3

    def one(N, K):
        packed, bs, gs = quantize_nvfp4(rng.normal(size=(N, K)).astype(F32) * 0.1)
        return nvfp4.weight(packed, (bs, gs), (N, K), "ram")

    gate_up = [(one(I, H), one(I, H)) for _ in range(E)]
    down = [one(H, I) for _ in range(E)]
    x = rng.normal(size=(T, H)).astype(F32)
    ids = np.stack([rng.choice(E, k, replace=False) for _ in range(T)])
    w = rng.uniform(size=(T, k)).astype(F32)
    got = moe_fused.experts(x, ids, w, gate_up, down, "gelu_tanh")
    assert moe_fused._LAYERS[id(gate_up[0][0])].dense
    ref = ops.moe_experts_per_expert(x, ids, w, gate_up, down, "gelu_tanh")
    assert rel(got, ref.astype(np.float64)) < 2e-5


def int8_matrix(rng, R, K, bs, s16, mins):
    """Random int8-layout arrays (every code -128..127) and their float64 values."""
    q = rng.integers(-128, 128, size=(R, K), dtype=np.int8)
    s = rng.uniform(0.001, 0.01, size=(R, K // bs)).astype(F32)
    if s16:
        s = s.astype(np.float16).view(np.uint16)
    m = rng.uniform(0, 0.1, size=(R, K // 32)).astype(F32) if mins else np.empty((R, 0), F32)
    values = q.astype(np.float64) * np.repeat(s.view(np.float16) if s16 else s, bs, 1).astype(np.float64)
    if mins:
        values -= np.repeat(m, 32, 1)
    return q, s, m, values


# (rows, columns, scale block, f16 scales, minimums): Q8_0 / Q4_0 / Q5_0 (f16 a 32), Q6_K (f32 a 16), Q4_K / Q5_K
# (f32 a 32 with minimums); columns not a multiple of 64 or 128 (the steps' tails) and rows below the prefetch distance
INT8_SHAPES = [(300, 640, 32, True, False), (300, 512, 16, False, False), (77, 2048, 32, False, True),
               (50, 96, 32, True, False), (50, 96, 16, False, False), (9, 32, 32, False, True)]


@pytest.mark.parametrize("R,K,bs,s16,mins", INT8_SHAPES)
@pytest.mark.parametrize("T", [1, 3])
def test_int8_rows_equal_float64(isa, R, K, bs, s16, mins, T):
    from lumen_cpu import int8

    rng = np.random.default_rng(K + bs)
    q, s, m, values = int8_matrix(rng, R, K, bs, s16, mins)
    x = rng.normal(size=(T, K)).astype(F32)
    out = np.empty((T, R), F32)
    int8.gemv(q, s, m, x, out, 2)
    assert rel(out, x.astype(np.float64) @ values.T) < 1e-6


@pytest.mark.parametrize("R,K,bs,s16,mins", INT8_SHAPES)
@pytest.mark.parametrize("T", [1, 3])
def test_int8_rows_with_8_bit_activations(isa, R, K, bs, s16, mins, T):
    """gemv_q8 is the exact product of the weights with x as quantize_x rounds it (integer block sums: the same
    integers at every level), and within the quantization's error of the f32 product; quantize_x's codes stay in
    [-127, 127] and reproduce x within half a step."""
    from lumen_cpu import int8

    rng = np.random.default_rng(K + bs)
    q, s, m, values = int8_matrix(rng, R, K, bs, s16, mins)
    x = rng.normal(size=(T, K)).astype(F32)
    if K > 32:
        x[0, :32] = 0  # an all-zero block: scale 0, codes 0
    out = np.empty((T, R), F32)
    int8.gemv_q8(q, s, m, x, out, 2)
    xq, dx, xsq = int8.quantize_x(x, bs)
    assert np.abs(xq.astype(np.int32)).max() <= 127 and (K == 32 or np.all(xq[0, :32] == 0))
    step = np.repeat(dx, 32, 1).astype(np.float64)
    assert np.all(np.abs(xq * step - x) <= 0.5 * step * (1 + 1e-6))
    assert np.array_equal(xsq, xq.reshape(T, -1, bs).sum(2).astype(F32))
    want = (xq * step) @ (values + (np.repeat(m, 32, 1) if mins else 0)).T
    if mins:
        want -= x.astype(np.float64).reshape(T, -1, 32).sum(2) @ m.astype(np.float64).T
    assert rel(out, want) < 1e-6
    exact = x.astype(np.float64) @ values.T
    assert 1e-5 < rel(out, exact) < 3e-2


@pytest.mark.parametrize("R,K,bs,s16,mins", INT8_SHAPES)
@pytest.mark.parametrize("T,chunk", [(4, 64), (7, 4), (37, 8)])
def test_int8_gemm_equals_float64(isa, R, K, bs, s16, mins, T, chunk):
    """Many tokens (prefill): the C kernel (AVX-512: four rows by four tokens; rows and tokens past a multiple of
    four, token chunks) or, below AVX-512, the numba kernel it declines to."""
    from lumen_cpu import int8

    rng = np.random.default_rng(K + bs + T)
    q, s, m, values = int8_matrix(rng, R, K, bs, s16, mins)
    x = rng.normal(size=(T, K)).astype(F32)
    out = np.full((T, R), np.nan, F32)
    int8.gemm(q, s, m, x, out, chunk, 2)
    assert rel(out, x.astype(np.float64) @ values.T) < 1e-6


def test_a_bad_isa_is_named():
    env = dict(os.environ, LUMEN_CPU_ISA="avx9000")
    r = subprocess.run([sys.executable, "-c", "import lumen_cpu.native"], env=env, capture_output=True, text=True)
    assert r.returncode != 0
    assert "LUMEN_CPU_ISA='avx9000': expected one of scalar, avx2, avx512, avx512vnni" in r.stderr


def test_disabled_library_leaves_the_numba_kernels():
    """LUMEN_CPU_NATIVE=0 (as where no compiler built the library): fp8 rows and several-token NVFP4 experts run on
    the numba kernels (the latter link against the cfunc that stands in for the C row decoder), and the int8
    layout's GEMVs on the cfuncs that stand in for its C rows."""
    code = ("import numpy as np, ml_dtypes\n"
            "from lumen_cpu import native, fp8\n"
            "from lumen_core.backend import Weight\n"
            "assert not native.available\n"
            "raw = np.arange(64 * 32, dtype=np.uint8).reshape(64, 32) % 0x70\n"
            "w = Weight(raw.view(ml_dtypes.float8_e4m3fn), 'fp8', (64, 32), np.float32(0.5))\n"
            "x = np.linspace(-1, 1, 32, dtype=np.float32)\n"
            "ref = raw.view(ml_dtypes.float8_e4m3fn).astype(np.float64) * 0.5 @ x\n"
            "assert np.abs(fp8.linear(x[None], w)[0] - ref).max() < 1e-4 * np.abs(ref).max()\n"
            "from lumen_core.quantize import quantize_nvfp4\n"
            "from lumen_cpu import moe_fused, nvfp4, ops\n"
            "rng = np.random.default_rng(0)\n"
            "def mk(N, K):\n"
            "    packed, bs, gs = quantize_nvfp4(rng.normal(size=(N, K)).astype(np.float32))\n"
            "    return nvfp4.weight(packed, (bs, gs), (N, K), 'ram')\n"
            "gu, dn = [(mk(32, 64), mk(32, 64)) for _ in range(4)], [mk(64, 32) for _ in range(4)]\n"
            "xs, ws = rng.normal(size=(6, 64)).astype(np.float32), np.ones((6, 2), np.float32)\n"
            "ids = np.stack([np.arange(6) % 4, (np.arange(6) + 1) % 4], axis=1)\n"
            "ref = ops.moe_experts_per_expert(xs, ids, ws, gu, dn)\n"
            "assert np.abs(moe_fused.experts(xs, ids, ws, gu, dn) - ref).max() < 1e-4 * np.abs(ref).max()\n"
            "from lumen_cpu import int8\n"
            "q = rng.integers(-128, 128, size=(40, 96), dtype=np.int8)\n"
            "s = rng.uniform(0.01, 0.1, size=(40, 3)).astype(np.float32)\n"
            "m = rng.uniform(0, 0.1, size=(40, 3)).astype(np.float32)\n"
            "vals = q * np.repeat(s, 32, 1).astype(np.float64) - np.repeat(m, 32, 1)\n"
            "x = rng.normal(size=(2, 96)).astype(np.float32)\n"
            "out = np.empty((2, 40), np.float32)\n"
            "int8.gemv(q, s, m, x, out, 2)\n"
            "ref = x @ vals.T\n"
            "assert np.abs(out - ref).max() < 1e-5 * np.abs(ref).max()\n"
            "int8.gemv_q8(q, s, m, x, out, 2)\n"
            "assert np.abs(out - ref).max() < 3e-2 * np.abs(ref).max()\n"
            "x = rng.normal(size=(9, 96)).astype(np.float32)\n"
            "out = np.empty((9, 40), np.float32)\n"
            "int8.gemm(q, s, m, x, out, 8, 2)\n"
            "ref = x @ vals.T\n"
            "assert np.abs(out - ref).max() < 1e-5 * np.abs(ref).max()\n"
            "print('ok')\n")
    env = dict(os.environ, LUMEN_CPU_NATIVE="0")
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "ok"


def test_release_threads_frees_the_pool_and_kernels_still_run():
    """CPUBackend.release_threads (called by a GPU graph's runner before each replay with host calls) frees the
    calling thread's OpenMP pool; the next parallel kernel makes it again and computes the same values."""
    from lumen_cpu import moe_fused
    from lumen_cpu.backend import CPUBackend, _gomp

    rng = np.random.default_rng(0)
    raw = rng.choice(FINITE, size=(64, 256)).astype(np.uint8)
    x = rng.normal(size=256).astype(F32)
    out1, out2 = np.empty(64, F32), np.empty(64, F32)
    native.gemv_fp8(raw, x, out1, np.ones((1, 1), F32), 64, 256, 16, 2)
    import numba

    if numba.threading_layer() == "omp":
        assert _gomp() is not None, "numba runs GNU OpenMP here, but its omp_pause_resource_all was not found"
    CPUBackend.release_threads(object.__new__(CPUBackend))
    native.gemv_fp8(raw, x, out2, np.ones((1, 1), F32), 64, 256, 16, 2)
    assert np.array_equal(out1, out2)
    assert moe_fused is not None


def test_strided_block_scales_take_the_sorted_kernels():
    """NVFP4 experts whose block scales are a strided view (not whole rows in a row): the C rows step by whole rows,
    so the one-token path declines and the sorted numba kernels answer, equal to the per-expert path."""
    import copy

    from lumen_cpu import moe_fused, nvfp4, ops

    rng = np.random.default_rng(5)
    H, I, E = 64, 32, 6

    def one(N, K):
        packed, bs, gs = quantize_nvfp4(rng.normal(size=(N, K)).astype(F32) * 0.1)
        w = nvfp4.weight(packed, (bs, gs), (N, K), "ram")
        wide = np.zeros((N, 2 * (K // 16)), np.asarray(w.scale.block).dtype)
        wide[:, ::2] = np.asarray(w.scale.block)
        w.scale = copy.copy(w.scale)
        w.scale.block = wide[:, ::2]
        assert not w.scale.block.flags.c_contiguous
        return w

    gate_up = [(one(I, H), one(I, H)) for _ in range(E)]
    down = [one(H, I) for _ in range(E)]
    x = rng.normal(size=(1, H)).astype(F32)
    ids, w = np.array([[1, 4]]), np.array([[0.3, 0.7]], F32)
    got = moe_fused.experts(x, ids, w, gate_up, down)
    assert not moe_fused._LAYERS[id(gate_up[0][0])].dense
    assert rel(got, ops.moe_experts_per_expert(x, ids, w, gate_up, down).astype(np.float64)) < 2e-5


# -- NVFP4 with 8-bit activations (cpu.compute-quantization int8), the one-token experts' worker, prefill products --
E2M1_2 = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], np.int64)  # 2 e2m1(code)


def quant16_ref(x):
    """lumen_quant16 in numpy: per 16 values the scale max|x| / 127 and x / scale rounded half to even."""
    b = np.asarray(x, F32).reshape(-1, 16)
    m = np.abs(b).max(axis=1)
    inv = np.where(m > 0, F32(127) / np.where(m > 0, m, 1), 0).astype(F32)
    return np.rint(b * inv[:, None]).astype(np.int8).reshape(-1), (m / F32(127)).astype(F32)


def rows_q8_ref(packed, block, gs, xq, xs):
    """NVFP4 rows . x from the integers: gs / 2 * sum_b e4m3(s_b) xs_b sum_{k in b} 2 e2m1(code_k) xq_k (float64)."""
    codes = np.stack([packed & 15, packed >> 4], axis=-1).reshape(packed.shape[0], -1)
    ints = (E2M1_2[codes] * xq.astype(np.int64)).reshape(packed.shape[0], -1, 16).sum(axis=2)
    return float(gs) / 2 * (ints * E4M3[block] * xs.astype(np.float64)).sum(axis=1)


def test_quant16_equals_numpy():
    from numba import njit

    rng = np.random.default_rng(5)
    x = (rng.normal(size=96) * rng.choice([1e-3, 1, 50], size=96)).astype(F32)
    x[16:32] = 0  # an all-zero block: scale 0, codes 0

    @njit
    def q(x, xq, xs):
        native.quant16(x.ctypes.data, x.shape[0], xq.ctypes.data, xs.ctypes.data)

    xq, xs = np.empty(96, np.int8), np.empty(6, F32)
    q(x, xq, xs)
    ref_q, ref_s = quant16_ref(x)
    assert np.array_equal(xq, ref_q) and np.array_equal(xs, ref_s)
    assert np.abs(xq).max() == 127 and not xq[16:32].any()


@pytest.mark.parametrize("K", [2048, 80, 48])  # tails past the 64 / 32 columns a vector step takes
def test_nvfp4_rows_q8_equal_their_integer_model(isa, K):
    """The 8-bit-activation NVFP4 rows at every level against the integer model (exact sums per block); the levels
    differ only in the order of the f32 sums over blocks."""
    from numba import njit

    rng = np.random.default_rng(K + 3)
    N = 21
    packed, bs, gs = quantize_nvfp4(rng.normal(size=(N, K)).astype(F32))
    block = np.ascontiguousarray(bs).view(np.uint8)
    xq = rng.integers(-127, 128, size=K).astype(np.int8)
    xs = rng.uniform(0.001, 0.1, size=K // 16).astype(F32)

    @njit
    def rows(p, b, xq, xs, gs, out, r0, n):
        native.nvfp4_rows_q8(p.ctypes.data, p.shape[1], b.ctypes.data, b.shape[1], r0, n, p.shape[1] * 2,
                             xq.ctypes.data, xs.ctypes.data, gs, out.ctypes.data, 4096)

    out = np.full(N - 2, np.nan, F32)
    rows(packed, block, xq, xs, F32(gs), out, 2, N - 2)
    ref = rows_q8_ref(packed[2:], block[2:], gs, xq, xs)
    assert rel(out, ref) < 1e-6, isa


def _nvfp4_experts(rng, E, H, I, qx):
    from lumen_cpu import nvfp4

    def one(N, K):
        packed, bs, gs = quantize_nvfp4(rng.normal(size=(N, K)).astype(F32) * 0.1)
        return nvfp4.weight(packed, (bs, gs), (N, K), "ram", qx=qx)

    return [(one(I, H), one(I, H)) for _ in range(E)], [one(H, I) for _ in range(E)]


@pytest.mark.parametrize("H,I", [(2048, 512), (80, 48)])
def test_one_token_nvfp4_experts_with_8_bit_activations_equal_their_model(isa, H, I):
    """cpu.compute-quantization int8 on NVFP4 experts: x quantized per 16, each expert's gate and up rows in
    integers, h = silu(gate) * up quantized per 16, the down rows in integers, the weighted sum in slot order,
    against that model in numpy (float64 between the quantizations); and not the exact path's result."""
    from lumen_cpu import moe_fused

    rng = np.random.default_rng(H * 3 + I)
    E, k = 10, 4
    gate_up, down = _nvfp4_experts(rng, E, H, I, qx=True)
    x = rng.normal(size=(1, H)).astype(F32)
    ids, w = np.array([[4, 9, 0, 7]]), rng.uniform(size=(1, k)).astype(F32)

    def rows(wt, xq, xs):
        return rows_q8_ref(np.asarray(wt.data), np.asarray(wt.scale.block).view(np.uint8), wt.scale.global_scale,
                           xq, xs)

    xq, xs = quant16_ref(x[0])
    ref = np.zeros(H)
    for j, e in enumerate(ids[0]):
        g, u = rows(gate_up[e][0], xq, xs), rows(gate_up[e][1], xq, xs)
        h = (g / (1 + np.exp(-g)) * u).astype(F32)
        hq, hs = quant16_ref(h)
        ref += w[0, j] * rows(down[e], hq, hs)
    got = moe_fused.experts(x, ids, w, gate_up, down, "silu")
    assert rel(got[0], ref) < 1e-4, isa  # h's rounding to 8 bits can flip where f32 sums land near a half step
    exact_up, exact_down = _nvfp4_experts(np.random.default_rng(H * 3 + I), E, H, I, qx=False)
    exact = moe_fused.experts(x, ids, w, exact_up, exact_down, "silu")
    assert 1e-4 < rel(got[0], exact[0].astype(np.float64)) < 0.05


@pytest.mark.parametrize("R,m,K", [(64, 16, 2048), (7, 5, 48), (3, 1, 16)])
def test_f32_dots_equal_numpy(R, m, K):
    """The several-token experts' products (C = B X[idx]^T, rows and tokens past multiples of 4 included) at the
    AVX-512 level; below it, or K not a multiple of 16, the kernel declines (returns 0) and writes nothing."""
    from numba import njit

    rng = np.random.default_rng(R * m + K)
    B, X = rng.normal(size=(R, K)).astype(F32), rng.normal(size=(40, K)).astype(F32)
    idx = rng.choice(40, size=m, replace=False).astype(np.int64)

    @njit
    def dots(B, X, idx, C):
        return native.f32_dots(B.ctypes.data, B.shape[0], B.shape[1], X.ctypes.data, X.shape[1], idx.ctypes.data,
                               idx.shape[0], C.ctypes.data, C.shape[1])

    for isa in levels():
        native.use(isa)
        C = np.full((R, m + 3), np.nan, F32)
        done = dots(B, X, idx, C)
        native.use(native.HIGHEST)
        if native.LEVELS[isa] < native.LEVELS["avx512"]:
            assert done == 0 and np.isnan(C).all(), isa
            continue
        assert done == 1 and np.isnan(C[:, m:]).all()
        assert rel(C[:, :m], B.astype(np.float64) @ X[idx].T.astype(np.float64)) < 1e-5, isa
    assert dots(B[:, :K - 8] if K > 8 else B, X[:, :K - 8] if K > 8 else X, idx, np.empty((R, m), F32)) == 0


def bf16_ref(a):
    """f32 -> bf16 (round to nearest even) -> float64."""
    u = np.asarray(a, F32).view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16 << 16).astype(np.uint32).view(F32).astype(np.float64)


@pytest.mark.parametrize("H,I,T", [(2048, 512, 40), (64, 96, 3)])
def test_several_token_nvfp4_experts_in_amx_tiles_equal_their_model(H, I, T):
    """cpu.compute-quantization bf16: the prompt's NVFP4 experts in AMX tiles (exact bf16 weights, tokens and h
    rounded to bf16, f32 sums) against that model in float64; and not the exact path's result."""
    from lumen_cpu import moe_fused, nvfp4

    if "amx" not in levels():
        pytest.skip("this CPU (or its OS) does not offer AMX-BF16")
    native.use("amx")
    rng = np.random.default_rng(H + I + T)
    E, k = 6, 3

    def layer(bf16):
        r = np.random.default_rng(7)

        def one(N, K):
            packed, bs, gs = quantize_nvfp4(r.normal(size=(N, K)).astype(F32) * 0.1)
            return nvfp4.weight(packed, (bs, gs), (N, K), "ram", bf16=bf16)

        return [(one(I, H), one(I, H)) for _ in range(E)], [one(H, I) for _ in range(E)]

    gate_up, down = layer(True)
    x = rng.normal(size=(T, H)).astype(F32)
    ids = np.stack([rng.choice(E, size=k, replace=False) for _ in range(T)])
    w = rng.uniform(size=(T, k)).astype(F32)

    def dense(wt):  # the weight's values without its global scale (exact in bf16), and the global scale
        return nvfp4.dequantize(wt).astype(np.float64) / float(wt.scale.global_scale), float(wt.scale.global_scale)

    ref = np.zeros((T, H))
    routed = np.bincount(ids.reshape(-1), minlength=E)
    for t in range(T):
        for j, e in enumerate(ids[t]):
            # an expert routed one token keeps the one-token (f32) rows: only shared rows go through the tiles
            tiles = bf16_ref if routed[e] > 1 else (lambda a: np.asarray(a, np.float64))
            (G, gg), (U, gu), (D, gd) = dense(gate_up[e][0]), dense(gate_up[e][1]), dense(down[e])
            g, u = gg * (G @ tiles(x[t])), gu * (U @ tiles(x[t]))
            h = (g / (1 + np.exp(-g)) * u).astype(F32)
            ref[t] += w[t, j] * gd * (D @ tiles(h))
    got = moe_fused.experts(x, ids, w, gate_up, down, "silu")
    assert rel(got, ref) < 2e-5
    exact = moe_fused.experts(x, ids, w, *layer(False), "silu")
    assert 1e-5 < rel(got, exact.astype(np.float64)) < 0.02


@pytest.mark.parametrize("H,I,T,block", [(2048, 512, 40, 128), (128, 192, 3, 64), (96, 64, 5, 0)])
def test_several_token_fp8_experts_in_amx_tiles_equal_their_model(H, I, T, block):
    """cpu.compute-quantization bf16 on fp8 experts: e4m3 rows exact in bf16, each token rounded to bf16, f32 sums in
    AMX tiles, each column block's sum times its scale, against that model in float64; not the exact path's result.
    Block 0: one scale a tensor (the scales cover the whole matrix)."""
    from lumen_cpu import moe_fused
    from lumen_cpu.backend import CPUBackend

    if "amx" not in levels():
        pytest.skip("this CPU (or its OS) does not offer AMX-BF16")
    native.use("amx")
    rng = np.random.default_rng(H + I + T)
    E, k = 6, 3

    def layer(bf16):
        r, be = np.random.default_rng(7), CPUBackend("cpu", None)
        be.configure_compute_quantization("bf16" if bf16 else "none")

        def one(N, K):
            data = (r.normal(size=(N, K)) * 40).astype(ml_dtypes.float8_e4m3fn)
            shape = (-(-N // block), -(-K // block)) if block else (1, 1)
            return be.weight(data, "fp8", "ram", r.uniform(0.5, 2, size=shape).astype(F32) * 0.01, (N, K))

        return [(one(I, H), one(I, H)) for _ in range(E)], [one(H, I) for _ in range(E)]

    gate_up, down = layer(True)
    assert all(getattr(wt.scale, "bf16", False) for wt in down)
    x = rng.normal(size=(T, H)).astype(F32)
    ids = np.stack([rng.choice(E, size=k, replace=False) for _ in range(T)])
    w = rng.uniform(size=(T, k)).astype(F32)

    def rows(wt, vec, tokens):  # W vec, vec rounded (tokens), each (row block, column block)'s sum times its scale
        N, K = wt.shape
        q = np.asarray(wt.data).astype(np.float64)
        s = np.asarray(wt.scale, F32).astype(np.float64)
        br, bc = (block, block) if block else (N, K)
        out, xs = np.zeros(N), tokens(vec)
        for rb in range(-(-N // br)):
            for cb in range(-(-K // bc)):
                cols = slice(cb * bc, (cb + 1) * bc)
                out[rb * br:(rb + 1) * br] += s[rb, cb] * (q[rb * br:(rb + 1) * br, cols] @ xs[cols])
        return out

    ref = np.zeros((T, H))
    routed = np.bincount(ids.reshape(-1), minlength=E)
    for t in range(T):
        for j, e in enumerate(ids[t]):
            # an expert routed one token keeps the one-token (f32) rows: only shared rows go through the tiles
            tiles = bf16_ref if routed[e] > 1 else (lambda a: np.asarray(a, F32).astype(np.float64))
            g, u = rows(gate_up[e][0], x[t], tiles), rows(gate_up[e][1], x[t], tiles)
            h = (g / (1 + np.exp(-g)) * u).astype(F32)
            ref[t] += w[t, j] * rows(down[e], h, tiles)
    got = moe_fused.experts(x, ids, w, gate_up, down, "silu")
    # the tokens are rounded to bf16 without the scales, once (the scales multiply each column block's sum): the
    # model's tolerance holds at H = 2048 too (it needed 3e-4 when each row block rounded h times its scales anew)
    assert rel(got, ref) < 2e-5, rel(got, ref)
    exact = moe_fused.experts(x, ids, w, *layer(False), "silu")
    assert 1e-5 < rel(got, exact.astype(np.float64)) < 0.02


@pytest.mark.parametrize("fmt", ["fp8", "nvfp4", "bf16"])
@pytest.mark.parametrize("H,I,T", [(2048, 512, 40), (64, 96, 5)])
def test_several_token_experts_default_amx_path_is_exact(fmt, H, I, T, monkeypatch):
    """The default prefill of fp8 / NVFP4 / bf16 experts on a CPU with AMX (bf16 rows read in place, or copied where
    a chunk is short of 64 rows: I = 96): the tokens as three bf16 planes (hi + mid + lo =
    the f32 value), so each product is exact in f32: against float64 within f32 summation error, and against the f32
    path (the ISA capped below amx) within the same bound, both far below the bf16 mode's ~1e-3."""
    from lumen_cpu import moe_fused, nvfp4

    if "amx" not in levels():
        pytest.skip("this CPU (or its OS) does not offer AMX-BF16")
    rng = np.random.default_rng(H + I + T + len(fmt))
    E, k = 6, 3

    gate_up = [(expert_matrix(rng, fmt, I, H), expert_matrix(rng, fmt, I, H)) for _ in range(E)]
    down = [expert_matrix(rng, fmt, H, I) for _ in range(E)]
    x = rng.normal(size=(T, H)).astype(F32)
    ids = np.stack([rng.choice(E, size=k, replace=False) for _ in range(T)])
    w = rng.uniform(size=(T, k)).astype(F32)

    def dense(wt):
        if fmt == "fp8":
            s, (n, kk) = np.asarray(wt.scale, np.float64), wt.shape
            br, bc = wt.block or (n, kk)  # None: one scale for the matrix
            return np.asarray(wt.data).astype(np.float64) * np.repeat(np.repeat(s, br, 0), bc, 1)[:n, :kk]
        if fmt == "bf16":
            return np.asarray(wt.data).astype(np.float64)
        return nvfp4.dequantize(wt).astype(np.float64)

    ref = np.zeros((T, H))
    for t in range(T):
        for j, e in enumerate(ids[t]):
            g, u = dense(gate_up[e][0]) @ x[t], dense(gate_up[e][1]) @ x[t]
            ref[t] += w[t, j] * (dense(down[e]) @ (g / (1 + np.exp(-g)) * u))
    parts = []
    kernel = "_gate_up_nvfp4" if fmt == "nvfp4" else "_gate_up_scaled"
    real = getattr(moe_fused, kernel)

    def spy(*args):
        parts.append(args[-1])
        return real(*args)

    monkeypatch.setattr(moe_fused, kernel, spy)
    native.use("amx")
    got = moe_fused.experts(x, ids, w, gate_up, down, "silu")
    native.use("avx512vnni")
    try:
        f32 = moe_fused.experts(x, ids, w, gate_up, down, "silu")
    finally:
        native.use(native.HIGHEST)
    assert parts == [3, 0]  # the tiles with three planes, then the f32 path
    assert rel(got, ref) < 3e-6 and rel(f32, ref) < 3e-6, (rel(got, ref), rel(f32, ref))
    assert rel(got, f32.astype(np.float64)) < 3e-6


def test_fp8_rows_to_bf16_give_every_e4m3_code_exactly():
    """lumen_fp8_decode_rows_bf16 (the prompt path's weight rows on AMX machines; 16-bit lanes, the subnormals from a
    table) on all 256 codes, in rows of 32-multiples and at a row offset: each the bf16 of ml_dtypes' e4m3 value,
    exactly; the two NaN codes give +-480 (the f32 kernels' e4m3x16 does the same; checkpoints hold none)."""
    import ctypes

    lib = native.lib()
    rows = np.arange(512, dtype=np.uint16).astype(np.uint8).reshape(4, 128)[:, ::-1].copy()  # codes in two orders
    N, K = rows.shape
    out = np.zeros((3, K + 16), dtype=np.uint16)
    i = ctypes.c_int64
    lib.lumen_fp8_decode_rows_bf16.argtypes = [ctypes.c_void_p, i, i, i, i, i, ctypes.c_void_p, i]
    values = rows[1:].view(ml_dtypes.float8_e4m3fn).astype(F32)
    nan = np.isnan(values)
    values[nan] = np.copysign(480.0, np.where(rows[1:][nan] & 0x80, -1.0, 1.0))
    want = (values.view(np.uint32) >> 16).astype(np.uint16)
    assert (values.view(np.uint32) & 0xFFFF == 0).all()  # every e4m3 value is exact in bf16
    for isa in levels():  # the AVX-512 kernel at the amx level, the scalar loop below it
        native.use(isa)
        out[...] = 0
        lib.lumen_fp8_decode_rows_bf16(rows.ctypes.data, K, 1, 3, K, N, out.ctypes.data, K + 16)
        np.testing.assert_array_equal(out[:, :K], want, err_msg=isa)
        assert not out[:, K:].any()  # nothing past K
    native.use(native.HIGHEST)


@pytest.mark.parametrize("R,K,m,parts,pad,bc", [(64, 2048, 27, 1, 32, 0), (64, 2048, 27, 3, 32, 128),
                                                (40, 512, 5, 1, 0, 128), (100, 96, 16, 3, 32, 0),
                                                (64, 96, 20, 3, 0, 32)])
def test_amx_dots_token_major_padded_rows_and_column_block_scales(R, K, m, parts, pad, bc):
    """lumen_amx_dots with the weight rows K + pad apart (the callers' padding against L1 set conflicts) writes the
    same values row-major (tm 0) and token-major (tm 1: what moe_fused hands ys directly), nothing past the R x m
    products; they are the float64 products of the bf16 rows with the tokens' planes (3 planes: exact tokens), each
    block of bc columns times its scale (bc 0: no scales), within f32 summation error."""
    import ctypes

    if "amx" not in levels():
        pytest.skip("this CPU (or its OS) does not offer AMX-BF16")
    native.use("amx")
    lib, i, p = native.lib(), ctypes.c_int64, ctypes.c_void_p
    lib.lumen_amx_dots.argtypes = [p, i, i, i, p, i, i, p, i, p, i, i, ctypes.c_float]
    lib.lumen_amx_dots.restype = i
    lib.lumen_f32_pairs.argtypes = [p, i, p, i, i, p]
    lib.lumen_bf16_from_pairs.argtypes = [p, i, i, i, p]
    rng = np.random.default_rng(R + K + m)
    W = rng.integers(0, 0x3F00, size=((R + 63) // 64 * 64, K + pad)).astype(np.uint16)  # positive normal bf16
    x = rng.normal(size=(m, K)).astype(F32)
    srow = rng.uniform(0.5, 2.0, size=-(-K // bc)).astype(F32) * 0.01 if bc else None
    nt = (m + 15) // 16
    F = np.empty(nt * (K // 2) * 32, F32)
    idx = np.arange(m, dtype=np.int64)
    lib.lumen_f32_pairs(x.ctypes.data, K, idx.ctypes.data, m, K, F.ctypes.data)
    P = np.empty(parts * nt * (K // 2) * 32, np.uint16)
    lib.lumen_bf16_from_pairs(F.ctypes.data, m, K, parts, P.ctypes.data)
    rows, toks = np.full((R, m + 3), np.nan, F32), np.full((m, R + 5), np.nan, F32)
    s = None if srow is None else srow.ctypes.data
    assert lib.lumen_amx_dots(W.ctypes.data, K + pad, R, K, P.ctypes.data, m, parts, s, bc, rows.ctypes.data, m + 3,
                              0, 0.5)
    assert lib.lumen_amx_dots(W.ctypes.data, K + pad, R, K, P.ctypes.data, m, parts, s, bc, toks.ctypes.data, R + 5,
                              1, 0.5)
    assert lib.lumen_amx_dots(W.ctypes.data, K + pad, R, K, P.ctypes.data, m, parts, s, 48, toks.ctypes.data, R + 5,
                              1, 0.5) == (srow is None)  # a column block of 48 is not whole k steps: refused
    native.use(native.HIGHEST)
    np.testing.assert_array_equal(rows[:, :m], toks[:, :R].T)
    assert np.isnan(rows[:, m:]).all() and np.isnan(toks[:, R:]).all()
    wf = (W[:R, :K].astype(np.uint32) << 16).view(F32).astype(np.float64)
    xs = x.astype(np.float64) if parts == 3 else x.astype(ml_dtypes.bfloat16).astype(np.float64)
    if srow is not None:
        wf = wf * np.repeat(srow.astype(np.float64), bc)[:K]
    want = 0.5 * wf @ xs.T
    assert np.abs(rows[:, :m] - want).max() <= 3e-6 * np.abs(want).max()


def test_moe_workers_share_tasks_by_estimated_cost():
    """moe_fused._bounds: contiguous task ranges covering every task once, in order, whose estimated costs are
    closer to equal than equal task counts give when one expert holds many tokens (AMX path, 3 planes)."""
    from lumen_cpu import moe_fused

    counts = np.array([100, 1, 2, 17, 16, 3, 40, 5, 9, 12, 30, 2])  # tokens of each used expert
    offs = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    nch, parts, nw = 8, 3, 6
    bounds = moe_fused._bounds.py_func(offs, nch, parts, nw)
    assert bounds[0] == 0 and bounds[-1] == len(counts) * nch and (np.diff(bounds) >= 0).all()

    def cost(c):  # the estimate _bounds documents
        return 3.0 + (parts * ((c + 15) // 16) if c > 1 else 3.0 * c / 16)

    task = np.repeat([cost(c) for c in counts], nch)
    by_cost = [task[bounds[w]:bounds[w + 1]].sum() for w in range(nw)]
    n = len(task)
    by_count = [task[w * n // nw:(w + 1) * n // nw].sum() for w in range(nw)]
    assert max(by_cost) / np.mean(by_cost) < max(by_count) / np.mean(by_count)
    assert max(by_cost) / np.mean(by_cost) < 1.1


def test_nvfp4_rows_to_bf16_equal_the_scalar_decoder():
    """lumen_nvfp4_decode_rows_bf16 at the amx level (AVX-512) against its scalar loop (below amx) and float64, bit
    for bit: every code in every column position, every finite e4m3 block scale (0x00 .. 0x7E), rows at an offset,
    nothing written past K."""
    import ctypes

    if "amx" not in levels():
        pytest.skip("this CPU (or its OS) does not offer AMX-BF16")
    from lumen_cpu import nvfp4

    lib, i, p = native.lib(), ctypes.c_int64, ctypes.c_void_p
    lib.lumen_nvfp4_decode_rows_bf16.argtypes = [p, i, p, i, i, i, i, i, p, i]
    rng = np.random.default_rng(5)
    N, K = 127, 256  # 127 x 16 blocks: every scale byte 0x00 .. 0x7E at least once
    packed = rng.integers(0, 256, size=(N, K // 2), dtype=np.uint8)
    scales = (np.arange(N * K // 16) % 127).astype(np.uint8).reshape(N, K // 16)
    got = {}
    for isa in ("amx", "avx512vnni"):
        native.use(isa)
        out = np.full((N - 3, K + 16), 0xABCD, np.uint16)
        lib.lumen_nvfp4_decode_rows_bf16(packed.ctypes.data, K // 2, scales.ctypes.data, K // 16, 3, N - 3, K, N,
                                         out.ctypes.data, K + 16)
        assert (out[:, K:] == 0xABCD).all(), isa  # nothing past K
        got[isa] = out[:, :K].copy()
    native.use(native.HIGHEST)
    np.testing.assert_array_equal(got["amx"], got["avx512vnni"])
    codes = np.stack([packed & 15, packed >> 4], axis=-1).reshape(N, K)[3:]
    sc = E4M3[np.repeat(scales, 16, axis=1)[3:]]
    want = nvfp4.E2M1[codes].astype(np.float64) * sc
    values = (got["amx"].astype(np.uint32) << 16).view(F32)
    np.testing.assert_array_equal(values.astype(np.float64), want)
