"""wgpu attention against the CPU reference (lumen_cpu.attention, lumen_cpu.vision_ops.bidirectional_attention).

Tolerance: 1e-5 x max(1, max |out|) (``gpu_util.close``) for every KV type: the caches hold the same bits as the
CPU's (f16 / bf16 / fp8 rounded to nearest even on write, fp8 saturating at ±448; checked bit for bit), so only
the summation order differs. Shapes: head dims 16..512, GQA 8:1 and 2:1, an 80-token prefill then T=1 decode,
windows, softcap, bidirectional image blocks, rings with prefills longer than the window read by
``attention_shared``, split-K decode over long contexts, caches split over several buffers.
"""

from __future__ import annotations

import numpy as np
import pytest
from gpu_util import close

pytest.importorskip("lumen_wgpu")

from lumen_cpu.attention import store as cpu_store  # noqa: E402
from lumen_wgpu import attention as wattn  # noqa: E402

pytestmark = pytest.mark.wgpu
TOL = 1e-5


@pytest.fixture(scope="module")
def pair(wgpu_pair):
    wgpu_pair[0].use()
    return wgpu_pair


def rand(rng, *shape):
    return rng.normal(size=shape).astype(np.float32)


def bits(a):
    """A cache array as comparable integers (numpy's == would call NaN bits unequal and -0 equal to 0)."""
    a = np.asarray(a)
    return a.view({1: np.uint8, 2: np.uint16, 4: np.uint32}[a.dtype.itemsize])


def qkv_views(gpu, rng, n, hq, hkv, d):
    """q, k, v as host arrays and as strided head-slices of one device tensor (what a fused projection gives)."""
    x = rand(rng, n, hq + 2 * hkv, d)
    t = gpu.tensor(x)
    host = x[:, :hq], x[:, hq:hq + hkv], x[:, hq + hkv:]
    return host, (t[:, :hq], t[:, hq:hq + hkv], t[:, hq + hkv:])


def run_sequence(pair, caches, chunks, hq, hkv, d, window, softcap, seed, blocks_of=None):
    """Attention then attention_shared for each chunk length, on both backends, from position 0."""
    gpu, cpu = pair
    rng = np.random.default_rng(seed)
    start = 0
    for n in chunks:
        (q, k, v), (gq, gk, gv) = qkv_views(gpu, rng, n, hq, hkv, d)
        blocks = blocks_of(start, n) if blocks_of else None
        want = cpu.ops.attention(q, k, v, caches[0], start, d ** -0.5, window, softcap, blocks)
        close(gpu.ops.attention(gq, gk, gv, caches[1], start, d ** -0.5, window, softcap, blocks), want, TOL)
        close(gpu.ops.attention_shared(gq, caches[1], start, d ** -0.5, window, softcap, blocks),
              cpu.ops.attention_shared(q, caches[0], start, d ** -0.5, window, softcap, blocks), TOL)
        written = min(start + n, caches[0].k.shape[1])  # slots 0.. hold positions 0..start+n-1 (a ring: wrapped)
        for name in ("k", "v"):  # every entry written, rounded as the CPU rounds (the CPU's other slots are garbage:
            np.testing.assert_array_equal(bits(getattr(caches[1], name)[:, :written]),  # its caches are not zeroed)
                                          bits(getattr(caches[0], name)[:, :written]))
        start += n
    return start


# -- full caches --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("kv", "hq", "hkv", "d", "window", "softcap"), [
    ("f32", 4, 2, 16, None, None),
    ("f32", 4, 2, 16, 5, None),
    ("f32", 4, 2, 16, None, 0.7),
    ("f32", 8, 1, 256, 24, 0.7),  # GQA 8:1, Qwen 3.5's head dim
    ("f32", 4, 2, 512, None, None),  # GQA 2:1, Gemma 4's global head dim
    ("f16", 4, 2, 64, 5, 0.7),
    ("bf16", 8, 1, 64, None, None),
    ("fp8", 4, 2, 64, 5, None),
])
def test_prefill_then_decode(pair, kv, hq, hkv, d, window, softcap):
    gpu, cpu = pair
    caches = cpu.ops.kv_cache(96, hkv, d, kv), gpu.ops.kv_cache(96, hkv, d, kv)
    run_sequence(pair, caches, (80, 1, 1, 3), hq, hkv, d, window, softcap, seed=1)


def test_value_dim_and_types_may_differ_from_keys(pair):
    gpu, cpu = pair
    rng = np.random.default_rng(2)
    T, hq, hkv, d, dv = 40, 6, 3, 32, 48
    caches = (cpu.ops.kv_cache(64, hkv, d, "bf16", "f32", head_dim_v=dv),
              gpu.ops.kv_cache(64, hkv, d, "bf16", "f32", head_dim_v=dv))
    start = 0
    for n in (T, 1):
        q, k, v = rand(rng, n, hq, d), rand(rng, n, hkv, d), rand(rng, n, hkv, dv)
        want = cpu.ops.attention(q, k, v, caches[0], start, 0.2)
        got = gpu.ops.attention(gpu.tensor(q), gpu.tensor(k), gpu.tensor(v), caches[1], start, 0.2)
        assert got.shape == (n, hq, dv)
        close(got, want, TOL)
        start += n


def test_split_k_decode_over_a_long_context(pair, monkeypatch):
    """Long keys with few rows split over several workgroups; their partial softmaxes are combined, also where a
    row sees none of a split's keys (window) and with strided keys read back as the CPU wrote them."""
    gpu, cpu = pair
    monkeypatch.setattr(wattn, "SPLIT_MIN_KEYS", 32)
    for window in (None, 100):
        caches = cpu.ops.kv_cache(360, 2, 128), gpu.ops.kv_cache(360, 2, 128)
        run_sequence(pair, caches, (300, 1, 3, 1), 8, 2, 128, window, 1.5, seed=3)


def test_decode_records_no_submit(pair):
    """Attention only records: nothing is submitted until the caller reads a value back (one command buffer a
    decode step), ring gathers and image blocks included."""
    gpu, _ = pair
    rng = np.random.default_rng(4)
    ring = gpu.ops.sliding_kv_cache(8, 1, 32)
    gpu.ops.attention(gpu.tensor(rand(rng, 20, 2, 32)), gpu.tensor(rand(rng, 20, 1, 32)),
                      gpu.tensor(rand(rng, 20, 1, 32)), ring, 0, 0.3, 8, None).get()
    before = gpu.ctx.submits
    q, k, v = (gpu.tensor(rand(rng, n, h, 32)) for n, h in ((12, 2), (12, 1), (12, 1)))
    out = gpu.ops.attention(q, k, v, ring, 20, 0.3, 8, None, [(22, 28)])
    out = gpu.ops.attention_shared(q[:1], ring, 20, 0.3, 8)
    assert gpu.ctx.submits == before
    assert np.isfinite(out.get()).all() and gpu.ctx.submits == before + 1


# -- ring caches --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("kv", "cap", "window", "d"), [("f32", 6, 6, 8), ("f32", 8, 5, 64), ("f16", 16, 16, 256),
                                                        ("fp8", 6, 6, 16)])
def test_ring_past_the_window_and_sharing(pair, kv, cap, window, d):
    """Prefill longer than the window (the keys gathered out of the ring), decode wrapping round the ring, a chunk
    longer than the ring; attention_shared reads each call's keys after it."""
    gpu, cpu = pair
    rings = cpu.ops.sliding_kv_cache(cap, 1, d, kv), gpu.ops.sliding_kv_cache(cap, 1, d, kv)
    start = run_sequence(pair, rings, (20, 1, 1, 2, 9, 1), 4, 1, d, window, None, seed=5)
    q = gpu.tensor(np.zeros((1, 4, d), np.float32))
    with pytest.raises(ValueError, match="cannot serve"):
        gpu.ops.attention(q, q[:, :1], q[:, :1], rings[1], start, 0.3, cap + 1, None)
    with pytest.raises(ValueError, match="not in the shared ring's last call"):
        gpu.ops.attention_shared(q, rings[1], start + 1, 0.3, window)


def test_ring_prefill_longer_than_the_window_gqa_512(pair):
    """Gemma 4's shape: a long prefill into a ring (head dim 512, GQA 2:1), then a KV-sharing reader."""
    gpu, cpu = pair
    rings = cpu.ops.sliding_kv_cache(32, 2, 512), gpu.ops.sliding_kv_cache(32, 2, 512)
    run_sequence(pair, rings, (80, 1), 4, 2, 512, 32, 30.0, seed=6)


# -- image blocks -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("window", [None, 12])
def test_blocks_see_their_whole_range(pair, window):
    gpu, cpu = pair

    def blocks_of(start, n):  # an image inside each prefill chunk, and one that the chunk ends inside of
        return [(start + 10, start + 30), (start + n - 6, start + n)] if n > 1 else None

    caches = cpu.ops.kv_cache(140, 2, 64), gpu.ops.kv_cache(140, 2, 64)
    run_sequence(pair, caches, (80, 1, 40, 1), 8, 2, 64, window, 0.9, seed=7, blocks_of=blocks_of)
    rings = cpu.ops.sliding_kv_cache(16, 2, 64), gpu.ops.sliding_kv_cache(16, 2, 64)
    run_sequence(pair, rings, (80, 1, 40, 1), 8, 2, 64, 16, None, seed=8, blocks_of=blocks_of)


def test_overlapping_blocks_match_the_cpu(pair):
    gpu, cpu = pair
    caches = cpu.ops.kv_cache(64, 1, 16), gpu.ops.kv_cache(64, 1, 16)
    run_sequence(pair, caches, (40,), 2, 1, 16, None, None, seed=9, blocks_of=lambda s, n: [(5, 20), (15, 30)])


# -- bidirectional ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("T", "S", "h", "hkv", "d", "dv"), [(50, 70, 4, 2, 64, 32), (33, 33, 2, 2, 512, 512),
                                                              (7, 300, 8, 1, 72, 72)])
def test_bidirectional_attention(pair, T, S, h, hkv, d, dv):
    gpu, cpu = pair
    rng = np.random.default_rng(10)
    q, kv = rand(rng, T, h, d), rand(rng, S, hkv, d + dv)
    k, v = kv[..., :d], kv[..., d:]
    t = gpu.tensor(kv)  # k and v as strided views of one tensor
    close(gpu.ops.bidirectional_attention(gpu.tensor(q), t[..., :d], t[..., d:], 0.125),
          cpu.ops.bidirectional_attention(q, np.ascontiguousarray(k), np.ascontiguousarray(v), 0.125), TOL)


# -- caches: element types, layout, host access ---------------------------------------------------------------------
SPECIAL = np.array([0.0, -0.0, 1e-8, -3e-6, 6.1e-5, 5.96e-8, 2.98e-8, 8.94e-8, 1.0 + 2 ** -11, 1.0 + 3 * 2 ** -11,
                    1.0 + 2 ** -8, 1.0 + 3 * 2 ** -8, 65504.0, 65519.0, 65520.0, 1e6, -1e9, 448.0, 464.0, 470.0, 500.0,
                    -1e4, 2 ** -9, 2 ** -10, 3 * 2 ** -10, 0.0146, 0.015625, 1.0625, 1.1875, 3.14159, -2.71828,
                    240.0, 1e-40, 3e38], np.float32)


@pytest.mark.filterwarnings("ignore:overflow encountered in cast")  # the CPU's f16 cast of 1e6: inf, as wanted
@pytest.mark.parametrize("kv", ["f16", "bf16", "fp8"])
def test_entries_round_as_the_cpu_rounds(pair, kv):
    """Ties, subnormals, overflow and fp8 saturation: the written bits equal numpy's / ml_dtypes' casts."""
    gpu, _ = pair
    x = np.concatenate([SPECIAL, -SPECIAL, np.random.default_rng(11).normal(size=60).astype(np.float32) * 50])
    x = x[:len(x) // 4 * 4].reshape(1, 1, -1)  # one position, one head
    cache = gpu.ops.kv_cache(1, 1, x.shape[2], kv)
    wattn._store(gpu.tensor(x), cache.k, 0, 0, 1)
    np.testing.assert_array_equal(bits(cache.k), bits(cpu_store(x.transpose(1, 0, 2), wattn.KV_TYPES[kv])))


def test_other_kv_types_are_refused(pair):
    gpu, _ = pair
    with pytest.raises(ValueError, match=r"'q8_0' KV cache.*f32, f16, bf16, fp8"):
        gpu.ops.kv_cache(8, 1, 16, "q8_0")
    with pytest.raises(ValueError, match="type_v"):
        gpu.ops.sliding_kv_cache(8, 1, 16, "f32", "int4")


def test_caches_split_over_several_buffers(pair, monkeypatch):
    """A cache larger than one storage binding keeps whole heads a buffer (K and V split differently here)."""
    gpu, cpu = pair
    monkeypatch.setattr(wattn, "binding_limit", lambda ctx: 2 * 24 * 32 * 4 + 16)  # two K heads (24 x 32) a buffer
    caches = (cpu.ops.kv_cache(24, 5, 32, head_dim_v=48), gpu.ops.kv_cache(24, 5, 32, head_dim_v=48))
    assert len(caches[1].k.parts) == 3 and len(caches[1].v.parts) == 5
    rng = np.random.default_rng(12)
    start = 0
    for n in (20, 1):
        q, k, v = rand(rng, n, 10, 32), rand(rng, n, 5, 32), rand(rng, n, 5, 48)
        close(gpu.ops.attention(gpu.tensor(q), gpu.tensor(k), gpu.tensor(v), caches[1], start, 0.2),
              cpu.ops.attention(q, k, v, caches[0], start, 0.2), TOL)
        start += n
    np.testing.assert_array_equal(np.asarray(caches[1].v)[:, :start], caches[0].v[:, :start])
    rings = cpu.ops.sliding_kv_cache(12, 5, 32), gpu.ops.sliding_kv_cache(12, 5, 32)
    rng = np.random.default_rng(13)
    start = 0
    for n in (20, 1):
        q, k, v = rand(rng, n, 10, 32), rand(rng, n, 5, 32), rand(rng, n, 5, 32)
        close(gpu.ops.attention(gpu.tensor(q), gpu.tensor(k), gpu.tensor(v), rings[1], start, 0.2, 12),
              cpu.ops.attention(q, k, v, rings[0], start, 0.2, 12), TOL)
        close(gpu.ops.attention_shared(gpu.tensor(q), rings[1], start, 0.2, 12),
              cpu.ops.attention_shared(q, rings[0], start, 0.2, 12), TOL)
        start += n


@pytest.mark.parametrize("kv", ["f32", "bf16"])
def test_rows_read_and_written_from_the_host(pair, kv):
    """``cache.k[:, a:b]`` reads rows back and ``cache.k[:, a:b] = rows`` writes them (a prefix cache's save and
    restore); attention then reads what was written."""
    gpu, cpu = pair
    rng = np.random.default_rng(14)
    caches = cpu.ops.kv_cache(32, 2, 16, kv), gpu.ops.kv_cache(32, 2, 16, kv)
    rows_k, rows_v = rand(rng, 2, 10, 16), rand(rng, 2, 10, 16)
    for c in caches:
        c.k[:, 3:13] = cpu_store(rows_k, c.k.dtype)
        c.v[:, 3:13] = rows_v
    got = caches[1].k[:, 3:13]
    assert got.dtype == wattn.KV_TYPES[kv] and got.shape == (2, 10, 16)
    np.testing.assert_array_equal(bits(got), bits(caches[0].k[:, 3:13]))
    np.testing.assert_array_equal(bits(caches[1].v[...])[:, 3:13], bits(caches[0].v[:, 3:13]))
    q = rand(rng, 1, 4, 16)  # a window of 10 at position 12: keys 3..12, the rows written
    close(gpu.ops.attention_shared(gpu.tensor(q), caches[1], 12, 0.25, 10),
          cpu.ops.attention_shared(q, caches[0], 12, 0.25, 10), TOL)


def test_table_rows(pair):
    rows = wattn.table()
    assert all(variant is None for _, _, variant in rows)
    assert {name for name, _, _ in rows} == {"kv_cache", "sliding_kv_cache", "attention", "attention_shared",
                                             "bidirectional_attention"}


# -- captured decode steps ----------------------------------------------------------------------------------------
@pytest.mark.parametrize(("ring", "window"), [(False, None), (False, 50), (True, 8)])
def test_a_captured_decode_step_replays_at_later_positions(pair, monkeypatch, ring, window):
    """The runner's capture of one decode step predicts the next exactly (only params move with the position,
    split-K layout included), and replaying it at later positions gives the CPU's numbers."""
    from lumen_wgpu.runner import mismatch
    from lumen_wgpu.tensor import elementwise

    gpu, cpu = pair
    monkeypatch.setattr(wattn, "SPLIT_MIN_KEYS", 32)  # several splits as the keys grow past 32, 64, ...
    rng = np.random.default_rng(15)
    hq, hkv, d, n0 = 4, 2, 32, 40
    caches = tuple(b.ops.sliding_kv_cache(window, hkv, d) if ring else b.ops.kv_cache(200, hkv, d) for b in (cpu, gpu))
    caches[0].k[:], caches[0].v[:] = 0, 0  # the replays below skip positions: both sides read those slots as zeros
    run_sequence(pair, caches, (n0,), hq, hkv, d, window, 2.0, seed=16)
    step = [gpu.tensor(np.zeros((1, h, d), np.float32)) for h in (hq, hkv, hkv)]  # the step's input buffers
    ctx = gpu.ctx

    def feed():
        host = [rand(rng, 1, h, d) for h in (hq, hkv, hkv)]
        for t, x in zip(step, host, strict=True):
            elementwise("a", [gpu.tensor(x)], out=t)
        return host

    def want(pos, host):
        q, k, v = host
        return (cpu.ops.attention(q, k, v, caches[0], pos, 0.3, window, 2.0),
                cpu.ops.attention_shared(q, caches[0], pos, 0.3, window, 2.0))

    captures, outs = [], None
    for pos in (n0, n0 + 1):
        host = feed()
        ctx.begin_capture()
        got = (gpu.ops.attention(*step, caches[1], pos, 0.3, window, 2.0),
               gpu.ops.attention_shared(step[0], caches[1], pos, 0.3, window, 2.0))
        captures.append(ctx.end_capture())
        outs = outs or got
        for g, w in zip(got, want(pos, host), strict=True):
            close(g, w, TOL)
    assert mismatch(captures[0], captures[1], {"delta": 1, "token": 0}) is None
    ctx.release(captures[1])
    for pos in range(n0 + 2, n0 + 90, 7):
        host = feed()
        ctx.replay(captures[0], {"delta": pos - n0, "token": 0})
        for g, w in zip(outs, want(pos, host), strict=True):
            close(g, w, TOL)
    ctx.release(captures[0])
