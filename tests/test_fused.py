"""The CPU's fused GGUF kernels: dequantization bit-equal to gguf's, matmuls equal to dequantize-then-matmul."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, quants
from lumen_cpu import fused

from lumen_core.backend import Weight

TYPES = ["Q8_0", "Q5_0", "Q4_0", "Q4_K", "Q5_K", "Q6_K"]
SCALE_OFFSETS = {"Q6_K": (208,), "Q4_K": (0, 2), "Q5_K": (0, 2)}  # where each block keeps its f16 scales


def random_blocks(name: str, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """Random quantized rows whose f16 scales are finite and small (random bytes could be inf/NaN)."""
    rng = np.random.default_rng(seed)
    block, size = GGML_QUANT_SIZES[GGMLQuantizationType[name]]
    raw = rng.integers(0, 256, size=(rows, cols // block * size), dtype=np.uint8)
    blocks = raw.reshape(rows, -1, size)
    for off in SCALE_OFFSETS.get(name, (0,)):
        scales = rng.uniform(-0.05, 0.05, size=blocks.shape[:2]).astype(np.float16)
        blocks[:, :, off:off + 2] = scales.view(np.uint8).reshape(*blocks.shape[:2], 2)
    return raw


def reference(name: str, raw: np.ndarray, cols: int) -> np.ndarray:
    return quants.dequantize(raw, GGMLQuantizationType[name]).reshape(raw.shape[0], cols)


@pytest.mark.parametrize("name", TYPES)
def test_dequantize_is_bit_equal_to_gguf(name):
    raw = random_blocks(name, 64, 512)
    w = Weight(raw, name.lower(), (64, 512))
    assert np.array_equal(fused.dequantize_rows(w), reference(name, raw, 512))


@pytest.mark.parametrize("name", TYPES)
@pytest.mark.parametrize("tokens", [1, 3, 40], ids=["gemv", "gemv-batch", "tiled"])
def test_linear_equals_dequantize_then_matmul(name, tokens):
    raw = random_blocks(name, 300, 512, seed=1)
    ref = reference(name, raw, 512)
    x = np.random.default_rng(2).normal(size=(tokens, 512)).astype(np.float32)
    out = fused.linear(x, Weight(raw, name.lower(), (300, 512)))
    expected = x @ ref.T
    assert np.abs(out - expected).max() <= 1e-5 * np.abs(expected).max()


@pytest.mark.parametrize("name", TYPES)
def test_embedding_dequantizes_only_the_rows_asked_for(name):
    raw = random_blocks(name, 50, 256, seed=3)
    ids = [7, 0, 49, 7]
    out = fused.embedding(ids, Weight(raw, name.lower(), (50, 256)))
    assert np.array_equal(out, reference(name, raw, 256)[ids])


def test_fused_kernels_are_registered_above_the_reference():
    from lumen_core.plugins import get_registry

    reg = get_registry()
    for fmt in ("q8_0", "q4_k", "q6_k"):
        entries = reg.ops[("linear", "cpu", fmt)]
        assert entries[0].value.__name__ == "fused_linear" and entries[0].priority > 0


# -- fp8 e4m3 (HF weight_scale_inv layouts) -----------------------------------------------------------------
def fp8_weight(N, K, layout, seed=0):
    import ml_dtypes

    from lumen_core.backend import scale_block

    rng = np.random.default_rng(seed)
    data = (rng.normal(size=(N, K)) * 0.5).astype(ml_dtypes.float8_e4m3fn)
    shape = {"block128": (-(-N // 128), -(-K // 128)), "block32": (-(-N // 32), -(-K // 32)),
             "per-channel": (N, 1), "per-tensor": (1,)}[layout]
    scale = rng.uniform(0.5, 2.0, size=shape).astype(np.float32) * 0.01
    return Weight(data, "fp8", (N, K), scale, scale_block((N, K), scale.shape))


@pytest.mark.parametrize("layout", ["block128", "block32", "per-channel", "per-tensor"])
@pytest.mark.parametrize("N,K", [(300, 272), (129, 1040), (1024, 2048), (7, 16)])
def test_fp8_linear_equals_dequantize_then_matmul(layout, N, K):
    """lumen_cpu.fp8: the decoded matrix equals ops.dequantize exactly; linear (GEMV for T <= 8, tiles + BLAS
    above) equals x @ dequantize(w).T to f32 summation order (<= 1e-5 x max |y|)."""
    from lumen_cpu import fp8, ops

    w = fp8_weight(N, K, layout)
    ref_w = ops.dequantize(w)
    np.testing.assert_array_equal(fp8.dequantize_rows(w), ref_w)
    np.testing.assert_array_equal(fp8.dequantize_rows(w, 3, 5), ref_w[3:5])
    rng = np.random.default_rng(1)
    for T in (1, 3, 8, 9, 40):
        x = rng.normal(size=(T, K)).astype(np.float32)
        want = x.astype(np.float64) @ ref_w.astype(np.float64).T
        got = fp8.linear(x, w)
        assert got.shape == (T, N) and got.dtype == np.float32
        assert np.abs(got - want).max() <= 1e-5 * max(1.0, np.abs(want).max())


def test_fp8_linear_is_the_registered_cpu_op():
    from lumen_core.plugins import get_registry

    w = fp8_weight(64, 256, "block32")
    x = np.random.default_rng(2).normal(size=(2, 256)).astype(np.float32)
    from lumen_cpu import fp8

    np.testing.assert_array_equal(get_registry().op("linear", "cpu", "fp8")(x, w), fp8.linear(x, w))


# -- NVFP4 -------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("N,K", [(300, 272), (129, 1040), (512, 2048), (3, 16)])
def test_nvfp4_kernels_equal_dequantize_then_matmul(N, K):
    """lumen_cpu.nvfp4_fused: tiles equal nvfp4.dequantize exactly; linear (one-token GEMV, tiles + BLAS above)
    equals x @ dequantize(w).T to f32 summation order (<= 1e-5 x max |y|), for 1-D to 3-D x."""
    from lumen_cpu import nvfp4, nvfp4_fused

    from lumen_core.plugins import get_registry
    from lumen_core.quantize import quantize_nvfp4

    rng = np.random.default_rng(N + K)
    packed, bs, gs = quantize_nvfp4(rng.normal(size=(N, K)).astype(np.float32))
    w = nvfp4.weight(packed, (bs, gs), (N, K), "ram")
    ref = nvfp4.dequantize(w)
    np.testing.assert_array_equal(nvfp4_fused.dequantize_rows(w, 0, N), ref)
    np.testing.assert_array_equal(nvfp4_fused.dequantize_rows(w, 1, min(N, 3)), ref[1:3])
    for shape in ((1, K), (5, K), (40, K), (2, 3, K)):
        x = rng.normal(size=shape).astype(np.float32)
        want = x.astype(np.float64) @ ref.astype(np.float64).T
        got = get_registry().op("linear", "cpu", "nvfp4")(x, w)
        assert got.shape == (*shape[:-1], N) and got.dtype == np.float32
        assert np.abs(got - want).max() <= 1e-5 * max(1.0, np.abs(want).max())


# -- routed experts (lumen_cpu.moe_fused) ------------------------------------------------------------------------
def expert_lists(fmt, E, H, I, seed=0):
    from lumen_cpu import nvfp4

    from lumen_core.quantize import quantize_nvfp4

    rng = np.random.default_rng(seed)

    def one(N, K, i):
        if fmt == "fp8":
            return fp8_weight(N, K, "block32", seed=seed * 1000 + i)
        if fmt == "bf16":
            import ml_dtypes

            return Weight((rng.normal(size=(N, K)) * 0.1).astype(ml_dtypes.bfloat16), "bf16", (N, K))
        packed, bs, gs = quantize_nvfp4(rng.normal(size=(N, K)).astype(np.float32) * 0.1)
        return nvfp4.weight(packed, (bs, gs), (N, K), "ram")

    gate_up = [(one(I, H, 3 * e), one(I, H, 3 * e + 1)) for e in range(E)]
    down = [one(H, I, 3 * e + 2) for e in range(E)]
    return gate_up, down


@pytest.mark.parametrize("fmt", ["fp8", "nvfp4", "bf16"])
@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("T", [1, 3, 37])
def test_fused_moe_experts_equal_the_per_expert_reference(fmt, act, T):
    """moe_fused (two parallel kernels over every routed expert) equals ops.moe_experts_per_expert (one expert at
    a time through linear) to f32 summation order: <= 1e-4 x max |y|. Some experts get no token, some several;
    I and H are not multiples of the kernels' row chunk (64), so both end in a partial chunk."""
    from lumen_cpu import moe_fused, ops

    E, H, I, k = 12, 96, 80, 4
    gate_up, down = expert_lists(fmt, E, H, I)
    rng = np.random.default_rng(T)
    x = rng.normal(size=(T, H)).astype(np.float32)
    ids = np.stack([rng.choice(E - 2, size=k, replace=False) for _ in range(T)])  # experts E-2, E-1 unused
    w = rng.uniform(0.1, 1.0, size=(T, k)).astype(np.float32)
    want = ops.moe_experts_per_expert(x, ids, w, gate_up, down, act)
    got = moe_fused.experts(x, ids, w, gate_up, down, act)
    assert got.shape == (T, H) and got.dtype == np.float32
    assert np.abs(got - want).max() <= 1e-4 * max(1.0, np.abs(want).max())
    np.testing.assert_array_equal(ops.moe_experts(x, ids, w, gate_up, down, act), got)  # the op uses it


def test_fused_moe_declines_what_it_does_not_cover():
    """Mixed formats (or shapes) go to the per-expert path: moe_fused returns None, the op still answers."""
    from lumen_cpu import moe_fused, ops

    gate_up, down = expert_lists("fp8", 4, 64, 32)
    nv_gate_up, _ = expert_lists("nvfp4", 4, 64, 32)
    gate_up[1] = nv_gate_up[1]
    x = np.ones((1, 64), np.float32)
    ids, w = np.array([[0, 1]]), np.array([[0.5, 0.5]], np.float32)
    assert moe_fused.experts(x, ids, w, gate_up, down) is None
    assert ops.moe_experts(x, ids, w, gate_up, down).shape == (1, 64)


@pytest.mark.parametrize("T", [1, 5, 40])
def test_fused_packed_bf16_experts_equal_the_per_expert_reference(T):
    """Gemma 4's packed bf16 experts (gate_up (E, 2I, H), down (E, H, I)) through moe_fused equal the per-expert
    BLAS reference (<= 1e-4 x max |y|), and the registered op uses them. I = 30 and ~13 tokens an expert at T = 40:
    the 4 x 4 blocks of rows x tokens and both of their edges (rows, tokens) are used."""
    import ml_dtypes
    from lumen_cpu import gemma_ops, moe_fused

    E, H, I, k = 6, 64, 30, 2
    rng = np.random.default_rng(T)
    gate_up = Weight((rng.normal(size=(E, 2 * I, H)) * 0.1).astype(ml_dtypes.bfloat16), "bf16", (E, 2 * I, H))
    down = Weight((rng.normal(size=(E, H, I)) * 0.1).astype(ml_dtypes.bfloat16), "bf16", (E, H, I))
    x = rng.normal(size=(T, H)).astype(np.float32)
    ids = np.stack([rng.choice(E, size=k, replace=False) for _ in range(T)])
    w = rng.uniform(0.1, 1.0, size=(T, k)).astype(np.float32)
    want = gemma_ops.moe_experts_packed_per_expert(x, ids, w, gate_up, down)
    got = moe_fused.experts_packed(x, ids, w, gate_up, down)
    assert np.abs(got - want).max() <= 1e-4 * max(1.0, np.abs(want).max())
    np.testing.assert_array_equal(gemma_ops.moe_experts_packed(x, ids, w, gate_up, down), got)
