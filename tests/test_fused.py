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
