"""The cuda backend's projection groups (``lumen_cuda.fuse_plan``, used by ``gemv.linear_group``), on the CPU with
numpy as the array module: which members become one matrix, where each starts, and that the fused matrix holds every
member's values and block scales where the fp8 GEMV / GEMM kernels read them (scale row = row // block rows)."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from lumen_cuda.fuse_plan import fuse_group, fuse_key, fuse_plan, partial_fusion

from lumen_core.backend import Weight

A, B = ("fp8", 2048, "f32", (128, 128)), ("bf16", 2048, "f32", None)


def test_gated_deltanet_fp8_inputs_are_one_part_with_b_padded_to_a_scale_block():
    # Qwen3.5-35B-A3B: in_proj_qkv 8192, in_proj_z 4096, in_proj_b 32, in_proj_a 32 rows, 128x128 scale blocks
    assert fuse_plan([A] * 4, [8192, 4096, 32, 32], {A: 128}) == [([0, 1, 2, 3], [0, 8192, 12288, 12416], 12448)]


def test_members_that_differ_make_parts_in_group_order():
    assert fuse_plan([A, A, B, B], [8192, 4096, 32, 32], {A: 128, B: 1}) == [
        ([0, 1], [0, 8192], 12288), ([2, 3], [0, 32], 64)]
    assert fuse_plan([None, A, None, A], [5, 256, 7, 32], {A: 128}) == [
        ([0], [0], 5), ([1, 3], [0, 256], 288), ([2], [0], 7)]
    assert fuse_plan([B, B, B], [3, 5, 7], {B: 1}) == [([0, 1, 2], [0, 3, 8], 15)]  # no blocks: no padding


def fp8(rows: int, K: int, block, rng) -> tuple[Weight, np.ndarray]:
    """A random fp8 Weight (e4m3 bytes, f32 scales per block or per row) and the values it stands for."""
    q = rng.standard_normal((rows, K)).astype(ml_dtypes.float8_e4m3fn)
    if block is None:
        scale = rng.uniform(0.5, 2, rows).astype(np.float32)
        dense = q.astype(np.float32) * scale[:, None]
    else:
        scale = rng.uniform(0.5, 2, (-(-rows // block[0]), -(-K // block[1]))).astype(np.float32)
        dense = q.astype(np.float32) * np.repeat(np.repeat(scale, block[0], 0), block[1], 1)[:rows, :K]
    return Weight(q.view(np.uint8), "fp8", (rows, K), scale, block), dense


def dequantize(w: Weight) -> np.ndarray:
    """The values an fp8 Weight stands for, read as the kernels read them: scale[row // BR, col // BC]."""
    rows, K = w.shape
    v = w.data.view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    if w.block is None:
        return v * w.scale.reshape(rows, 1)
    r, c = np.arange(rows)[:, None] // w.block[0], np.arange(K)[None, :] // w.block[1]
    return v * w.scale[r, c]


@pytest.mark.parametrize("block", [(128, 128), None])
def test_fused_fp8_matrix_holds_each_member_where_the_kernels_read_it(block):
    rng = np.random.default_rng(0)
    made = [fp8(n, 256, block, rng) for n in (256, 128, 32, 32)]
    ws = [w for w, _ in made]
    originals = [(w.data.copy(), w.scale.copy()) for w in ws]
    parts = fuse_group(ws, np)
    assert len(parts) == 1
    fused, members = parts[0]
    starts = [0, 256, 384, 512] if block else [0, 256, 384, 416]
    assert members == [(i, r, n) for i, (r, n) in enumerate(zip(starts, (256, 128, 32, 32), strict=True))]
    assert fused.shape == (starts[-1] + 32, 256) and fused.block == block
    full = dequantize(fused)
    x = rng.standard_normal((3, 256)).astype(np.float32)
    for (_, r, n), (w, dense), (data, scale) in zip(members, made, originals, strict=True):
        np.testing.assert_array_equal(full[r:r + n], dense)  # the member's values, its scales where they belong
        np.testing.assert_allclose(x @ full.T[:, r:r + n], x @ dense.T, rtol=1e-6, atol=1e-5)
        # the member now views the fused buffers, with its own bytes and scales
        assert np.shares_memory(w.data, fused.data) and np.shares_memory(w.scale, fused.scale)
        np.testing.assert_array_equal(w.data, data)
        np.testing.assert_array_equal(w.scale, scale)
        np.testing.assert_array_equal(dequantize(w), dense)
    if block:  # b is followed by zero rows up to a's block
        assert not full[416:512].any()


def test_mixed_group_fuses_each_agreeing_set_and_leaves_the_rest():
    rng = np.random.default_rng(1)
    q, _ = fp8(256, 128, (128, 128), rng)
    z, _ = fp8(128, 128, (128, 128), rng)
    b = Weight(rng.integers(0, 1 << 16, (32, 128), dtype=np.uint16), "bf16", (32, 128))
    a = Weight(rng.integers(0, 1 << 16, (32, 128), dtype=np.uint16), "bf16", (32, 128))
    t, _ = fp8(64, 128, None, rng)
    t.scale = np.ones(1, np.float32)  # per-tensor: never fused
    b_data, t_data = b.data, t.data
    parts = fuse_group([q, b, z, a, t], np)
    assert [m for _, m in parts] == [[(0, 0, 256), (2, 256, 128)], [(1, 0, 32), (3, 32, 32)], [(4, 0, 64)]]
    assert parts[0][0].format == "fp8" and parts[1][0].format == "bf16" and parts[2][0] is None
    np.testing.assert_array_equal(parts[1][0].data[:32], b_data)
    assert t.data is t_data  # a member alone is untouched
    assert fuse_key(t) is None and fuse_key(Weight(np.zeros((4, 8), np.uint8), "q4_k", (4, 16))) is None
    assert fuse_key(Weight(np.zeros((4, 8), np.uint8), "fp8", (4, 8))) is None  # no scale
    assert fuse_key(Weight(np.zeros((8, 4), np.uint16)[:, :2], "bf16", (8, 2))) is None  # not contiguous


def test_without_partial_fusion_only_a_whole_group_in_whole_blocks_is_one_matrix():
    rng = np.random.default_rng(2)
    gdn = [fp8(n, 128, (128, 128), rng)[0] for n in (256, 128, 32, 32)]
    assert [(f, m) for f, m in fuse_group(gdn, np, partial=False)] == [(None, [(i, 0, w.shape[0])])
                                                                        for i, w in enumerate(gdn)]
    whole = [fp8(n, 128, (128, 128), rng)[0] for n in (256, 128)]
    (fused, members), = fuse_group(whole, np, partial=False)
    assert members == [(0, 0, 256), (1, 256, 128)] and fused.shape == (384, 128)
    mixed = [whole[0], Weight(np.zeros((128, 128), np.uint16), "bf16", (128, 128))]
    assert all(f is None for f, _ in fuse_group(mixed, np, partial=False))


def test_partial_fusion_setting_is_checked():
    assert partial_fusion({}) is False and partial_fusion({"LUMEN_CUDA_PARTIAL_FUSION": "1"}) is True
    with pytest.raises(ValueError, match="LUMEN_CUDA_PARTIAL_FUSION='yes'"):
        partial_fusion({"LUMEN_CUDA_PARTIAL_FUSION": "yes"})
