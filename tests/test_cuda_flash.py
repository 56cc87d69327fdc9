"""The prefill attention kernel (lumen_cuda.flash: kernels/flash_attention.cu) against the CuPy path it replaces
(lumen_cuda.attention._attend_cupy, which materialises the scores): outputs within 1e-5 × max(1, max |reference|)
over head dims, GQA groups, lengths, offsets, windows and softcaps; the tile sizes a 99 KB part gets; and the
public ops (full and ring caches, bf16) equal with LUMEN_CUDA_FLASH on and off. The tensor-core kernel
(``flash.attend_mma``, kernels/flash_mma.cu) against the same CuPy path over keys and values that are bf16 values,
every variant of it, and the public ops over bf16 and fp8 caches with ``LUMEN_CUDA_FLASH=mma``.

GPU tests carry the ``gpu`` marker and skip without CuPy or a CUDA device.
"""

from __future__ import annotations

import zlib

import numpy as np
import pytest
from gpu_util import close

pytest.importorskip("lumen_cuda")


@pytest.fixture(scope="module")
def mods(cp):
    from lumen_cuda import attention, flash

    return attention, flash


def case(cp, rng, T, Hq, Hkv, D, Dv, start, window, views=False):
    """q (T, Hq, D), keys (Hkv, S, D), vals (Hkv, S, Dv) at lo.. as attention() would pass them."""
    lo = 0 if window is None else max(0, start - window + 1)
    S = start - lo + T
    q = cp.asarray(rng.normal(size=(Hq, T, D)).astype(np.float32)).swapaxes(0, 1)  # a non-contiguous view
    if views:  # keys / values sliced along S out of a longer buffer (attention_shared on a ring's record)
        keys = cp.asarray(rng.normal(size=(Hkv, S + 7, D)).astype(np.float32))[:, 3:3 + S]
        vals = cp.asarray(rng.normal(size=(Hkv, S + 7, Dv)).astype(np.float32))[:, 4:4 + S]
    else:
        keys = cp.asarray(rng.normal(size=(Hkv, S, D)).astype(np.float32))
        vals = cp.asarray(rng.normal(size=(Hkv, S, Dv)).astype(np.float32))
    return q, keys, vals, lo


def check(attention, flash, q, keys, vals, start, lo, scale, window, softcap):
    got = flash.attend(q, keys, vals, start, lo, scale, window, softcap)
    assert got is not None, "the kernel declined a supported case"
    want = attention._attend_cupy(q, keys, vals, start, lo, scale, window, softcap)
    return close(got, want)


@pytest.mark.gpu
@pytest.mark.parametrize("softcap", [None, 30.0])
@pytest.mark.parametrize("window", [None, 32, 100])
@pytest.mark.parametrize("start", [0, 37])
@pytest.mark.parametrize("T", [2, 17, 64, 129, 600])
@pytest.mark.parametrize("G", [1, 2, 8])
@pytest.mark.parametrize("D", [64, 128, 256, 512])
def test_flash_against_the_cupy_path(cp, mods, D, G, T, start, window, softcap):
    attention, flash = mods
    rng = np.random.default_rng(zlib.crc32(repr((D, G, T, start, window, softcap)).encode()))
    Hkv = 2
    q, keys, vals, lo = case(cp, rng, T, G * Hkv, Hkv, D, D, start, window)
    scale = (4.0 if softcap else 1.0) * D ** -0.5  # scores up to ~15 with the softcap: it bends them
    check(attention, flash, q, keys, vals, start, lo, scale, window, softcap)


@pytest.mark.gpu
@pytest.mark.parametrize("dims", [(512, 128), (128, 96), (96, 256), (20, 36)])
@pytest.mark.parametrize(("T", "start", "window", "softcap"), [(129, 37, None, None), (70, 300, 100, 30.0)])
def test_flash_other_head_dims_and_views(cp, mods, dims, T, start, window, softcap):
    """Dv != D, head dims that are no power of two, keys / values as views sliced along S, one kv head."""
    attention, flash = mods
    (D, Dv) = dims
    rng = np.random.default_rng(zlib.crc32(repr((dims, T, start, window)).encode()))
    for Hq, Hkv in ((4, 2), (3, 1)):
        q, keys, vals, lo = case(cp, rng, T, Hq, Hkv, D, Dv, start, window, views=True)
        check(attention, flash, q, keys, vals, start, lo, 0.7 * D ** -0.5, window, softcap)


@pytest.mark.gpu
@pytest.mark.parametrize("D", [64, 128, 256, 512])
def test_flash_tiles_of_a_99_kb_part(cp, mods, monkeypatch, D):
    """The smaller key tiles (BN = 32 at D = 256, 16 at D = 512) that a 99 KB-per-block GPU (sm_120) gets."""
    attention, flash = mods
    monkeypatch.setattr(flash, "_smem_limit", lambda: 99 * 1024)
    name, smem = flash.kernel_name(D, D, 99 * 1024)
    assert smem <= 99 * 1024
    rng = np.random.default_rng(D)
    for T, start, window, softcap in ((129, 0, None, None), (64, 37, 32, 30.0)):
        q, keys, vals, lo = case(cp, rng, T, 8, 2, D, D, start, window)
        check(attention, flash, q, keys, vals, start, lo, D ** -0.5, window, softcap)


@pytest.mark.gpu
def test_flash_long_prefill(cp, mods):
    """T = 2048, D = 256, G = 4 (correctness; the two timings are printed, not asserted)."""
    attention, flash = mods
    rng = np.random.default_rng(2048)
    T, Hkv, G, D = 2048, 2, 4, 256
    q, keys, vals, lo = case(cp, rng, T, G * Hkv, Hkv, D, D, 0, None)
    scale = D ** -0.5
    check(attention, flash, q, keys, vals, 0, lo, scale, None, None)
    times = {}
    for name, fn in (("flash", flash.attend), ("cupy", attention._attend_cupy)):
        fn(q, keys, vals, 0, lo, scale, None, None)
        a, b = cp.cuda.Event(), cp.cuda.Event()
        a.record()
        for _ in range(3):
            fn(q, keys, vals, 0, lo, scale, None, None)
        b.record()
        b.synchronize()
        times[name] = cp.cuda.get_elapsed_time(a, b) / 3
    flops = 4 * G * Hkv * D * T * (T + 1) / 2  # causal: QK and PV over the attended pairs
    print(f"\nT={T} D={D} Hq={G * Hkv}: flash {times['flash']:.3f} ms ({flops / times['flash'] / 1e9:.1f} TFLOP/s), "
          f"cupy {times['cupy']:.3f} ms")


@pytest.mark.gpu
def test_flash_declines_what_it_does_not_support(cp, mods, monkeypatch):
    """Disabled, head dims it has no variant for, and a few queries over a long cache (left to the CuPy path)."""
    attention, flash = mods
    rng = np.random.default_rng(3)
    q, keys, vals, lo = case(cp, rng, 5, 4, 2, 64, 64, 0, None)
    monkeypatch.setenv("LUMEN_CUDA_FLASH", "0")
    assert flash.attend(q, keys, vals, 0, lo, 0.1, None, None) is None
    close(attention._attend(q, keys, vals, 0, lo, 0.1, None, None),
          attention._attend_cupy(q, keys, vals, 0, lo, 0.1, None, None))
    monkeypatch.setenv("LUMEN_CUDA_FLASH", "1")
    q6, k6, v6, _ = case(cp, rng, 5, 4, 2, 6, 6, 0, None)  # D % 4 != 0
    assert flash.attend(q6, k6, v6, 0, 0, 0.1, None, None) is None
    q9, k9, v9, _ = case(cp, rng, 5, 4, 2, 64, 516, 0, None)  # Dv > 512
    assert flash.attend(q9, k9, v9, 0, 0, 0.1, None, None) is None
    close(attention._attend(q6, k6, v6, 0, 0, 0.1, None, None),
          attention._attend_cupy(q6, k6, v6, 0, 0, 0.1, None, None))
    ql, kl, vl, lo = case(cp, rng, 2, 2, 1, 64, 64, flash.LONG_KEYS + 100, None)  # one block over a long cache
    assert flash.attend(ql, kl, vl, flash.LONG_KEYS + 100, lo, 0.1, None, None) is None


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["full", "ring"])
@pytest.mark.parametrize("softcap", [None, 30.0])
def test_attention_op_with_flash_on_and_off(cp, mods, monkeypatch, kind, softcap):
    """attention / attention_shared over a bf16 KVCache (window None and 48) and a bf16 RingKVCache (window 48):
    a prefill, one decode token, then two more prefill chunks; the same with the kernel on and off."""
    attention, _ = mods
    Hq, Hkv, D, W = 8, 2, 128, 48
    scale = (4.0 if softcap else 1.0) * D ** -0.5
    for window in ((None, W) if kind == "full" else (W,)):
        results, caches = [], []
        for flag in ("1", "0"):
            monkeypatch.setenv("LUMEN_CUDA_FLASH", flag)
            rng = np.random.default_rng(7)
            cache = (attention.kv_cache(512, Hkv, D, "bf16") if kind == "full"
                     else attention.sliding_kv_cache(W, Hkv, D, "bf16"))
            outs, start = [], 0
            for T in (100, 1, 33, 65):
                q, k, v = (cp.asarray(rng.normal(size=(T, h, D)).astype(np.float32)) for h in (Hq, Hkv, Hkv))
                outs.append(attention.attention(q, k, v, cache, start, scale, window, softcap))
                outs.append(attention.attention_shared(q, cache, start, scale, window, softcap))
                start += T
            results.append(outs)
            caches.append(cache)
        for got, want in zip(*results, strict=True):
            close(got, want)
        assert cp.array_equal(caches[0].k, caches[1].k) and cp.array_equal(caches[0].v, caches[1].v)


def bf16_case(cp, rng, T, Hq, Hkv, D, Dv, start, window, views=False):
    """``case`` with keys and values rounded to bf16: (q, keys bits, vals bits, keys f32, vals f32, lo)."""
    from lumen_cuda import attention, fp8_mma

    q, keys, vals, lo = case(cp, rng, T, Hq, Hkv, D, Dv, start, window)
    kb, vb = fp8_mma.bf16_round(keys), fp8_mma.bf16_round(vals)
    if views:  # sliced along S out of a longer buffer, as a cache's rows are
        S = kb.shape[1]
        pad = (cp.zeros((Hkv, 3, D), cp.uint16), kb, cp.zeros((Hkv, 5, D), cp.uint16))
        kb = cp.concatenate(pad, axis=1)[:, 3:3 + S]
        vb = cp.concatenate([cp.zeros((Hkv, 1, Dv), cp.uint16), vb], axis=1)[:, 1:]
    return q, kb, vb, attention.decode(kb), attention.decode(vb), lo


def check_mma(attention, flash, q, kb, vb, kf, vf, start, lo, scale, window, softcap):
    got = flash.attend_mma(q, kb, vb, start, lo, scale, window, softcap)
    assert got is not None, "the tensor-core kernel declined a supported case"
    return close(got, attention._attend_cupy(q, kf, vf, start, lo, scale, window, softcap))


@pytest.mark.gpu
@pytest.mark.parametrize("softcap", [None, 30.0])
@pytest.mark.parametrize("window", [None, 100])
@pytest.mark.parametrize("start", [0, 37])
@pytest.mark.parametrize("T", [2, 17, 129, 600])
@pytest.mark.parametrize("G", [1, 4])
@pytest.mark.parametrize("D", [64, 128, 256, 512])
def test_flash_mma_against_the_cupy_path(cp, mods, D, G, T, start, window, softcap):
    attention, flash = mods
    rng = np.random.default_rng(zlib.crc32(repr(("mma", D, G, T, start, window, softcap)).encode()))
    Hkv = 2
    q, kb, vb, kf, vf, lo = bf16_case(cp, rng, T, G * Hkv, Hkv, D, D, start, window)
    scale = (4.0 if softcap else 1.0) * D ** -0.5
    check_mma(attention, flash, q, kb, vb, kf, vf, start, lo, scale, window, softcap)


@pytest.mark.gpu
@pytest.mark.parametrize("variant", [(w, bn, c) for w, bn in ((4, 64), (4, 32), (2, 64), (2, 32)) for c in (128, 256)])
def test_flash_mma_every_variant(cp, mods, monkeypatch, variant):
    """Each compiled variant (warps, keys a tile, value columns a block) at D = Dv = 128 / 256 / 512 (a head wider
    than the block's columns runs in chunks), a partial last tile and row block, GQA 4, a window."""
    attention, flash = mods
    warps, bn, dvc = variant
    monkeypatch.setattr(flash, "MMA_VARIANTS", ((warps, bn),))
    monkeypatch.setattr(flash, "mma_kernel", lambda D, Dv, limit=None: (
        f"flash_mma_w{warps}_n{bn}_c{dvc}", flash.mma_smem(D, dvc, warps, bn), warps, dvc))
    rng = np.random.default_rng(zlib.crc32(repr(variant).encode()))
    for D in (128, 256, 512):
        if flash.mma_smem(D, dvc, warps, bn) > flash._smem_limit():
            continue
        for T, start, window in ((77, 0, None), (45, 300, 64)):
            q, kb, vb, kf, vf, lo = bf16_case(cp, rng, T, 8, 2, D, D, start, window)
            check_mma(attention, flash, q, kb, vb, kf, vf, start, lo, D ** -0.5, window, None)


@pytest.mark.gpu
@pytest.mark.parametrize("dims", [(512, 128), (128, 96), (96, 256), (256, 512)])
def test_flash_mma_other_head_dims_and_views(cp, mods, dims):
    """Dv != D, head dims that are no power of two, keys / values sliced along S, one kv head (G = 3)."""
    attention, flash = mods
    D, Dv = dims
    rng = np.random.default_rng(zlib.crc32(repr(("mma", dims)).encode()))
    for Hq, Hkv in ((4, 2), (3, 1)):
        for T, start, window, softcap in ((129, 37, None, None), (70, 300, 100, 30.0)):
            q, kb, vb, kf, vf, lo = bf16_case(cp, rng, T, Hq, Hkv, D, Dv, start, window, views=True)
            check_mma(attention, flash, q, kb, vb, kf, vf, start, lo, 0.7 * D ** -0.5, window, softcap)


@pytest.mark.gpu
def test_flash_mma_declines_and_the_99_kb_part(cp, mods, monkeypatch):
    """f32 keys, D % 16 != 0, Dv % 8 != 0: None (the f32 kernel's); on a 99 KB-per-block part (SM120) D = 256 runs
    a variant that fits and D = 512 declines."""
    attention, flash = mods
    rng = np.random.default_rng(5)
    q, kb, vb, kf, vf, lo = bf16_case(cp, rng, 9, 4, 2, 64, 64, 0, None)
    assert flash.attend_mma(q, kf, vf, 0, lo, 0.1, None, None) is None
    q, kb, vb, kf, vf, lo = bf16_case(cp, rng, 9, 4, 2, 40, 36, 0, None)
    assert flash.attend_mma(q, kb, vb, 0, lo, 0.1, None, None) is None
    monkeypatch.setattr(flash, "_smem_limit", lambda: 99 * 1024)
    name, smem, _, _ = flash.mma_kernel(256, 256, 99 * 1024)
    assert smem <= 99 * 1024
    q, kb, vb, kf, vf, lo = bf16_case(cp, rng, 129, 8, 2, 256, 256, 0, None)
    check_mma(attention, flash, q, kb, vb, kf, vf, 0, lo, 256 ** -0.5, None, None)
    assert flash.mma_kernel(512, 512, 99 * 1024) is None
    q, kb, vb, kf, vf, lo = bf16_case(cp, rng, 9, 4, 2, 512, 512, 0, None)
    assert flash.attend_mma(q, kb, vb, 0, lo, 0.1, None, None) is None


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
@pytest.mark.parametrize("kind", ["full", "ring"])
def test_attention_op_with_the_tensor_core_kernel(cp, mods, monkeypatch, dtype, kind):
    """attention / attention_shared over a bf16 or fp8 cache (full: window None and 48; ring: 48), a prefill, one
    decode token, two more chunks: LUMEN_CUDA_FLASH=mma against the f32 kernel (=1); the caches equal."""
    attention, _ = mods
    Hq, Hkv, D, W = 8, 2, 256, 48
    for window in ((None, W) if kind == "full" else (W,)):
        results, caches = [], []
        for flag in ("mma", "1"):
            monkeypatch.setenv("LUMEN_CUDA_FLASH", flag)
            rng = np.random.default_rng(11)
            cache = (attention.kv_cache(512, Hkv, D, dtype) if kind == "full"
                     else attention.sliding_kv_cache(W, Hkv, D, dtype))
            outs, start = [], 0
            for T in (100, 1, 33, 65):
                q, k, v = (cp.asarray(rng.normal(size=(T, h, D)).astype(np.float32)) for h in (Hq, Hkv, Hkv))
                outs.append(attention.attention(q, k, v, cache, start, D ** -0.5, window, 30.0))
                outs.append(attention.attention_shared(q, cache, start, D ** -0.5, window, 30.0))
                start += T
            results.append(outs)
            caches.append(cache)
        for got, want in zip(*results, strict=True):
            close(got, want)
        assert cp.array_equal(caches[0].k, caches[1].k) and cp.array_equal(caches[0].v, caches[1].v)


def fp8_case(cp, rng, T, Hq, Hkv, D, Dv, start, window):
    """q (T, Hq, D) f32 and an fp8 cache's keys / values as e4m3 bytes on the device and as f32 values on the host."""
    import ml_dtypes

    lo = 0 if window is None else max(0, start - window + 1)
    S = start - lo + T
    q = rng.normal(size=(T, Hq, D)).astype(np.float32)
    k8 = rng.normal(size=(Hkv, S, D)).astype(ml_dtypes.float8_e4m3fn)
    v8 = (rng.normal(size=(Hkv, S, Dv)) * 2).astype(ml_dtypes.float8_e4m3fn)
    return (q, cp.asarray(k8.view(np.uint8)), cp.asarray(v8.view(np.uint8)), k8.astype(np.float32),
            v8.astype(np.float32), lo)


def close_fp8(got, want):
    """The FP8 kernel against ``attend_tiled`` (the same arithmetic; the e4m3 MMA sums in its own order and, on Hopper,
    not to full f32 precision, so some p land on the other side of an e4m3 rounding boundary and move their row by
    up to one step of that p): the mean |Δ| within 1e-3 of the scale, none beyond 5%. A layout or mask mistake moves
    outputs by O(1) of the scale."""
    got = cp_host(got)
    scale = max(1.0, float(np.abs(want).max()))
    diff = np.abs(got.astype(np.float64) - want)
    assert np.isfinite(got).all()
    assert diff.max() <= 0.05 * scale, f"max |Δ| {diff.max():.3g} of a scale {scale:.3g}"
    assert diff.mean() <= 1e-3 * scale, f"mean |Δ| {diff.mean():.3g} of a scale {scale:.3g}"


def cp_host(x):
    return x.get() if hasattr(x, "get") else np.asarray(x)


@pytest.mark.gpu
@pytest.mark.parametrize("softcap", [None, 30.0])
@pytest.mark.parametrize(("start", "window"), [(0, None), (37, None), (37, 100), (300, 64)])
@pytest.mark.parametrize("T", [2, 17, 129, 300])
@pytest.mark.parametrize("G", [1, 4])
@pytest.mark.parametrize("D", [64, 128, 256, 512])
def test_flash_fp8_against_its_tiled_model(cp, mods, D, G, T, start, window, softcap):
    """``flash.attend_fp8`` (attention.compute-quantization fp8) against fp8_attention_model.attend_tiled in the
    kernel's blocks and tiles."""
    from lumen_cuda import fp8_attention_model

    attention, flash = mods
    rng = np.random.default_rng(zlib.crc32(repr(("fp8", D, G, T, start, window, softcap)).encode()))
    q, kc, vc, kf, vf, lo = fp8_case(cp, rng, T, 2 * G, 2, D, D, start, window)
    scale = (4.0 if softcap else 1.0) * D ** -0.5
    got = flash.attend_fp8(cp.asarray(q), kc, vc, start, lo, scale, window, softcap, checked=True)
    assert got is not None, "the FP8 kernel declined a supported case"
    want = fp8_attention_model.attend_tiled(q, kf, vf, start, lo, scale, window, softcap,
                                            bn=flash.FP8_TILE, rows=flash.FP8_ROWS)
    close_fp8(got, want)


@pytest.mark.gpu
@pytest.mark.parametrize("dims", [(128, 512), (512, 128), (96, 256), (256, 80)])
def test_flash_fp8_other_head_dims(cp, mods, dims):
    """Dv != D (a 512-wide value head runs in two column chunks), D = 96, Dv = 80, one kv head (G = 3)."""
    from lumen_cuda import fp8_attention_model

    attention, flash = mods
    D, Dv = dims
    rng = np.random.default_rng(zlib.crc32(repr(("fp8", dims)).encode()))
    for Hq, Hkv, T, start, window in ((4, 2, 129, 37, None), (3, 1, 70, 300, 100)):
        q, kc, vc, kf, vf, lo = fp8_case(cp, rng, T, Hq, Hkv, D, Dv, start, window)
        got = flash.attend_fp8(cp.asarray(q), kc, vc, start, lo, D ** -0.5, window, None, checked=True)
        assert got is not None
        close_fp8(got, fp8_attention_model.attend_tiled(q, kf, vf, start, lo, D ** -0.5, window, None,
                                                        bn=flash.FP8_TILE, rows=flash.FP8_ROWS))


@pytest.mark.gpu
def test_fp8_vt_layout_and_declines(cp, mods):
    """fp8_vt: (Hkv, Dv, S16), each 16 keys in the MMA's order, zero past S; attend_fp8 declines bf16 / f32 keys,
    D % 32 and Dv % 16."""
    attention, flash = mods
    rng = np.random.default_rng(8)
    v = rng.integers(0, 0x7F, size=(3, 37, 48), dtype=np.uint8)
    vt = flash.fp8_vt(cp.asarray(v)).get()
    assert vt.shape == (3, 48, 48)
    order = [2 * (L >> 2) + (L & 1) + 8 * ((L >> 1) & 1) for L in range(16)]
    for g in range(3):
        for L in range(16):
            key = 16 * g + order[L]
            want = v[:, key, :] if key < 37 else np.zeros((3, 48), np.uint8)
            assert np.array_equal(vt[:, :, 16 * g + L], want)
    q, kc, vc, kf, vf, lo = fp8_case(cp, rng, 9, 4, 2, 64, 64, 0, None)
    qd = cp.asarray(q)
    assert flash.attend_fp8(qd, cp.asarray(kf), cp.asarray(vf), 0, lo, 0.1, None, None) is None
    q, kc, vc, kf, vf, lo = fp8_case(cp, rng, 9, 4, 2, 48, 40, 0, None)
    assert flash.attend_fp8(cp.asarray(q), kc, vc, 0, lo, 0.1, None, None) is None


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["full", "ring"])
def test_attention_op_with_fp8_attention(cp, mods, kind):
    """A cache made with fp8_attention (the cuda backend's, under attention.compute-quantization fp8): prefill
    chunks take the FP8 kernel (close to the f32 path over the same cache, not equal), one decode token the f32
    decode path (equal); the caches' bytes are the same either way; a non-fp8 cache refuses the flag."""
    attention, _ = mods
    Hq, Hkv, D, W = 8, 2, 128, 48
    results, caches = [], []
    for fp8 in (True, False):
        rng = np.random.default_rng(13)
        cache = (attention.kv_cache(512, Hkv, D, "fp8", fp8_attention=fp8) if kind == "full"
                 else attention.sliding_kv_cache(W, Hkv, D, "fp8", fp8_attention=fp8))
        outs, start = [], 0
        for T in (100, 1, 33, 65):
            q, k, v = (cp.asarray(rng.normal(size=(T, h, D)).astype(np.float32)) for h in (Hq, Hkv, Hkv))
            window = None if kind == "full" else W
            outs.append(attention.attention(q, k, v, cache, start, D ** -0.5, window))
            outs.append(attention.attention_shared(q, cache, start, D ** -0.5, window))
            start += T
        results.append(outs)
        caches.append(cache)
    for i, (got, want) in enumerate(zip(*results, strict=True)):
        if i in (2, 3):  # the decode token
            assert cp.array_equal(got, want)
        else:
            close(got, want, tol=0.06)
            assert not cp.array_equal(got, want)
    assert cp.array_equal(caches[0].k, caches[1].k) and cp.array_equal(caches[0].v, caches[1].v)
    with pytest.raises(ValueError, match="fp8 KV cache"):
        attention.kv_cache(16, Hkv, D, "bf16", fp8_attention=True)


@pytest.mark.gpu
def test_fp8_attention_through_the_backend(cp, mods):
    """The device check passes here (sm_90); a CUDABackend configured for fp8 makes its KV caches with the flag
    through its bound ops (the plan's way), and refuses a bad value."""
    from lumen_cuda.backend import CUDABackend

    from lumen_core.plugins import get_registry

    _, flash = mods
    assert flash.fp8_check() is None
    backend = CUDABackend("cuda:0", get_registry())
    assert backend.ops.kv_cache(64, 2, 128, "fp8", "fp8").fp8_attention is False
    backend.configure_attention_quantization("fp8")
    assert backend.ops.kv_cache(64, 2, 128, "fp8", "fp8").fp8_attention is True
    assert backend.ops.sliding_kv_cache(16, 2, 128, "fp8", "fp8").fp8_attention is True
    with pytest.raises(ValueError, match="fp8 KV cache"):
        backend.ops.kv_cache(64, 2, 128, "bf16", "bf16")
