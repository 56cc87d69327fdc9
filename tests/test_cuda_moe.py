"""The MoE decode kernels (plugins/lumen-cuda/lumen_cuda/kernels/moe.cu, launched from lumen_cuda.moe) against the
CuPy ops they replace at T = 1 (lumen_cuda.ops.moe_route / moe_experts / moe_experts_packed), and the property
they exist for: no host sync, so a call can be captured in a CUDA graph and replayed with new ids / logits.

GPU tests carry the ``gpu`` marker and skip without CuPy or a CUDA device.
Tolerance: f32 accumulation in another order: <= 1e-5 x max(1, max |reference|); route ids exactly.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from gpu_util import close, host

from lumen_core.errors import LumenError
from lumen_core.plugins import get_registry

pytest.importorskip("lumen_cuda")


@pytest.fixture(scope="module")
def gpu(cp):
    reg = get_registry()
    return reg.backend_class("cuda")("cuda:0", reg)


@pytest.fixture(scope="module")
def cpu():
    reg = get_registry()
    return reg.backend_class("cpu")("cpu", reg)


@pytest.fixture(scope="module")
def moe(cp):
    from lumen_cuda import moe

    return moe


@pytest.fixture(scope="module")
def ops(cp):
    from lumen_cuda import ops

    return ops


def nvfp4_host(rng, N, K):
    """An NVFP4 matrix (N, K) on the host: random packed e2m1 codes (every nibble, -0 included), e4m3 block scales
    and a global scale of its own (|values| <= 6 x 2 x 0.015, so the MLP output stays O(1))."""
    packed = rng.integers(0, 256, size=(N, K // 2), dtype=np.uint8)
    block = rng.uniform(0.25, 2.0, size=(N, K // 16)).astype(ml_dtypes.float8_e4m3fn)
    return packed, (block, np.float32(rng.uniform(0.005, 0.015)))


def matrix(gpu, rng, N, K, kind):
    """One expert matrix (N, K) as a cuda Weight: bf16 / f16 / f32, fp8 with 128x128 block or per-channel
    scales (values ~ N(0, 0.5) x scale ~ 0.05, so the MLP output stays O(1)), or nvfp4 (``nvfp4_host``)."""
    if kind == "nvfp4":
        packed, scale = nvfp4_host(rng, N, K)
        return gpu.weight(packed, "nvfp4", "vram", scale=scale)
    if kind.startswith("fp8"):
        w8 = (rng.normal(size=(N, K)) * 0.5).astype(ml_dtypes.float8_e4m3fn)
        shape = (-(-N // 128), -(-K // 128)) if kind == "fp8-block128" else (N, 1)
        scale = (rng.uniform(0.5, 2.0, size=shape) * 0.05).astype(np.float32)
        return gpu.weight(w8, "fp8", "vram", scale=scale)
    dtype = {"bf16": ml_dtypes.bfloat16, "f16": np.float16, "f32": np.float32}[kind]
    return gpu.weight((rng.normal(size=(N, K)) * 0.05).astype(dtype), kind, "vram")


def experts(gpu, rng, E, H, I, kind):
    gate_up = [(matrix(gpu, rng, I, H, kind), matrix(gpu, rng, I, H, kind)) for _ in range(E)]
    down = [matrix(gpu, rng, H, I, kind) for _ in range(E)]
    return gate_up, down


def routing(cp, rng, E, k, dtype=np.int64, T=1):
    """(T, k) distinct expert ids per token and weights summing to 1 per token."""
    ids = np.stack([rng.choice(E, size=k, replace=False) for _ in range(T)]).astype(dtype)
    w = rng.uniform(0.1, 1.0, size=(T, k)).astype(np.float32)
    return cp.asarray(ids), cp.asarray(w / w.sum(axis=1, keepdims=True))


# -- routing ------------------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("normalize", [True, False])
@pytest.mark.parametrize("E,k,tied", [(8, 2, False), (256, 8, False), (128, 8, True), (512, 16, False),
                                      (60, 4, True)])
def test_route_matches_ops(cp, moe, ops, E, k, tied, normalize):
    rng = np.random.default_rng(E + k)
    for T in (1, 3, 9):
        if tied:  # few distinct values: many equal probabilities, ties -> the lower index first
            logits = rng.integers(0, 3, size=(T, E)).astype(np.float32)
        else:
            logits = (rng.normal(size=(T, E)) * 3).astype(np.float32)
        lg = cp.asarray(logits)
        w, ids = moe.route(lg, k, normalize)
        w_ref, ids_ref = ops.moe_route_cupy(lg, k, normalize)
        assert ids.dtype == cp.int64 and w.dtype == cp.float32 and ids.shape == w.shape == (T, k)
        np.testing.assert_array_equal(host(ids), host(ids_ref))
        np.testing.assert_allclose(host(w), host(w_ref), rtol=0, atol=1e-6)


# -- experts ------------------------------------------------------------------------------------------------------
SIZES = [(8, 2, 256, 128), (64, 8, 512, 256), (8, 2, 256, 256)]  # (E, k, H, I)


@pytest.mark.gpu
@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("kind", ["bf16", "f16", "f32", "fp8-block128", "fp8-per-channel", "nvfp4"])
@pytest.mark.parametrize("E,k,H,I", SIZES)
def test_experts_decode_matches_ops(cp, gpu, moe, ops, kind, act, E, k, H, I):
    rng = np.random.default_rng(E * k + H + I + len(kind) + len(act))
    gate_up, down = experts(gpu, rng, E, H, I, kind)
    assert moe._table(gate_up, True) is not None and moe._table(down, False) is not None  # the kernel path
    x = cp.asarray(rng.normal(size=(1, H)).astype(np.float32))
    for dtype in (np.int64, np.int32):
        ids, w = routing(cp, rng, E, k, dtype)
        out = cp.full((1, H), np.nan, dtype=cp.float32)
        y = moe.experts_decode(x, ids, w, gate_up, down, act, out=out)
        assert y is out
        close(y, ops.moe_experts_grouped(x, ids.astype(cp.int64), w, gate_up, down, act))
        close(moe.experts_decode(x, ids, w, gate_up, down, act), y, 0)  # deterministic, fresh output


@pytest.mark.gpu
@pytest.mark.parametrize("act", ["gelu_tanh", "silu"])
@pytest.mark.parametrize("fmt", ["bf16", "f16"])
@pytest.mark.parametrize("E,k,H,I", SIZES)
def test_experts_packed_decode_matches_ops(cp, gpu, moe, ops, fmt, act, E, k, H, I):
    rng = np.random.default_rng(E + k + H + I + len(fmt))
    dtype = ml_dtypes.bfloat16 if fmt == "bf16" else np.float16
    gate_up = gpu.weight((rng.normal(size=(E, 2 * I, H)) * 0.05).astype(dtype), fmt, "vram")
    down = gpu.weight((rng.normal(size=(E, H, I)) * 0.05).astype(dtype), fmt, "vram")
    x = cp.asarray(rng.normal(size=(1, H)).astype(np.float32))
    ids, w = routing(cp, rng, E, k)
    y = moe.experts_packed_decode(x, ids, w, gate_up, down, act, out=cp.full((1, H), np.nan, dtype=cp.float32))
    close(y, ops.moe_experts_packed_grouped(x, ids, w, gate_up, down, act))


@pytest.mark.gpu
def test_fallbacks_agree(cp, gpu, moe, ops):
    """Where the kernels do not apply (K not a multiple of the 16-byte load) the CuPy ops answer; T = 2 now runs
    the kernels and agrees too."""
    rng = np.random.default_rng(3)
    E, k, H, I = 4, 2, 72, 40  # fp8 needs H, I % 16: not met
    gate_up, down = experts(gpu, rng, E, H, I, "fp8-per-channel")
    assert moe._table(gate_up, True) is None
    x = cp.asarray(rng.normal(size=(1, H)).astype(np.float32))
    ids, w = routing(cp, rng, E, k)
    close(moe.experts_decode(x, ids, w, gate_up, down), ops.moe_experts_grouped(x, ids, w, gate_up, down))
    gate_up, down = experts(gpu, rng, E, 64, 32, "bf16")
    x2 = cp.asarray(rng.normal(size=(2, 64)).astype(np.float32))
    ids2 = cp.asarray(np.array([[0, 1], [3, 1]], np.int64))
    w2 = cp.asarray(np.full((2, 2), 0.5, np.float32))
    close(moe.experts_decode(x2, ids2, w2, gate_up, down), ops.moe_experts_grouped(x2, ids2, w2, gate_up, down))
    gate_up, down = experts(gpu, rng, E, H, I, "fp8-per-channel")  # fallback for T = 2 as well, into out
    x2 = cp.asarray(rng.normal(size=(2, H)).astype(np.float32))
    out = cp.full((2, H), np.nan, dtype=cp.float32)
    assert moe.experts(x2, ids2, w2, gate_up, down, out=out) is out
    close(out, ops.moe_experts_grouped(x2, ids2, w2, gate_up, down))


@pytest.mark.gpu
def test_ids_changed_in_place_change_the_result(cp, gpu, moe, ops):
    """The kernels read ids from device memory on every launch: writing new ids into the same array between
    calls (what graph replay does) routes to the new experts."""
    rng = np.random.default_rng(5)
    E, k, H, I = 16, 4, 256, 128
    gate_up, down = experts(gpu, rng, E, H, I, "bf16")
    x = cp.asarray(rng.normal(size=(1, H)).astype(np.float32))
    ids, w = routing(cp, rng, E, k)
    out = cp.empty((1, H), dtype=cp.float32)
    first = moe.experts_decode(x, ids, w, gate_up, down, out=out).copy()
    close(first, ops.moe_experts_grouped(x, ids, w, gate_up, down))
    ids[...] = cp.asarray(np.array([[15, 0, 7, 3]], np.int64))
    second = moe.experts_decode(x, ids, w, gate_up, down, out=out)
    close(second, ops.moe_experts_grouped(x, ids, w, gate_up, down))
    assert np.abs(host(second) - host(first)).max() > 1e-3


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["bf16", "fp8-block128", "nvfp4"])
def test_graph_capture_and_replay(cp, gpu, moe, ops, kind):
    """route + experts captured once as a CUDA graph (possible only without host syncs or host copies), then
    replayed after new logits are written in place: the replay matches an eager call on the new logits."""
    rng = np.random.default_rng(9)
    E, k, H, I = 32, 4, 256, 256
    gate_up, down = experts(gpu, rng, E, H, I, kind)
    x = cp.asarray(rng.normal(size=(1, H)).astype(np.float32))
    logits = cp.asarray(rng.normal(size=(1, E)).astype(np.float32))
    w, ids = cp.empty((1, k), dtype=cp.float32), cp.empty((1, k), dtype=cp.int64)
    y = cp.empty((1, H), dtype=cp.float32)

    def step():
        moe.route(logits, k, True, out=(w, ids))
        moe.experts_decode(x, ids, w, gate_up, down, "silu", out=y)

    step()  # warm-up: compiles the kernels, builds the pointer tables and the scratch (host->device copies)
    cp.cuda.Device().synchronize()
    eager = y.copy()
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        stream.begin_capture()
        step()
        graph = stream.end_capture()
    y.fill(np.nan)
    cp.cuda.Device().synchronize()  # the fill ran on the legacy stream, which a non-blocking one does not wait for
    graph.launch(stream)
    stream.synchronize()
    close(y, eager, 0)  # the replay computes what the eager call did

    for seed in (1, 2):  # new logits written in place drive the replay to other experts
        logits[...] = cp.asarray(np.random.default_rng(seed).normal(size=(1, E)).astype(np.float32) * 3)
        cp.cuda.Device().synchronize()
        graph.launch(stream)
        stream.synchronize()
        w_ref, ids_ref = ops.moe_route_cupy(logits, k, True)
        np.testing.assert_array_equal(host(ids), host(ids_ref))
        close(y, ops.moe_experts_grouped(x, ids_ref, w_ref, gate_up, down, "silu"))


@pytest.mark.gpu
def test_packed_graph_capture(cp, gpu, moe, ops):
    rng = np.random.default_rng(11)
    E, k, H, I = 8, 2, 256, 128
    gate_up = gpu.weight((rng.normal(size=(E, 2 * I, H)) * 0.05).astype(ml_dtypes.bfloat16), "bf16", "vram")
    down = gpu.weight((rng.normal(size=(E, H, I)) * 0.05).astype(ml_dtypes.bfloat16), "bf16", "vram")
    x = cp.asarray(rng.normal(size=(1, H)).astype(np.float32))
    ids, w = routing(cp, rng, E, k)
    y = cp.empty((1, H), dtype=cp.float32)
    moe.experts_packed_decode(x, ids, w, gate_up, down, out=y)
    cp.cuda.Device().synchronize()
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        stream.begin_capture()
        moe.experts_packed_decode(x, ids, w, gate_up, down, out=y)
        graph = stream.end_capture()
    ids[...] = cp.asarray(np.array([[E - 1, 0]], np.int64))
    cp.cuda.Device().synchronize()
    graph.launch(stream)
    stream.synchronize()
    close(y, ops.moe_experts_packed_grouped(x, ids, w, gate_up, down))


# -- experts over T tokens ------------------------------------------------------------------------------------------
TS = [1, 2, 7, 64, 300]  # T < moe.GROUPED_MIN_T: per-slot kernels; from it on: bucketed by expert
# the grouped path's kernels: "" the default (bf16 / fp8 / NVFP4 on the tensor cores, lumen_cuda.fp8_mma, where the
# device has them), "0" the CUDA-core grouped kernels (LUMEN_CUDA_MMA_PREFILL=0, and devices before 8.9)


def with_mma(ts, grouped_from: int = 8):
    """(T, mma) pairs: every T by default, and with the option off where the call takes the grouped path (T >=
    moe.GROUPED_MIN_T, 8): the option changes nothing else."""
    return [(T, m) for T in ts for m in ("", "0") if m == "" or T >= grouped_from]


@pytest.mark.gpu
@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("kind", ["bf16", "f16", "fp8-block128", "f32", "nvfp4"])
@pytest.mark.parametrize("T,mma", with_mma(TS))
def test_experts_tokens_match_grouped(cp, gpu, moe, ops, T, kind, act, mma, monkeypatch):
    assert moe.GROUPED_MIN_T == 8
    monkeypatch.setenv("LUMEN_CUDA_MMA_PREFILL", mma)
    rng = np.random.default_rng(T * 7 + len(kind) + len(act))
    E, k, H, I = 16, 4, 256, 384
    gate_up, down = experts(gpu, rng, E, H, I, kind)
    assert moe._table(gate_up, True) is not None and moe._table(down, False) is not None  # the kernel path
    x = cp.asarray(rng.normal(size=(T, H)).astype(np.float32))
    for dtype in (np.int64, np.int32):
        ids, w = routing(cp, rng, E, k, dtype, T)
        out = cp.full((T, H), np.nan, dtype=cp.float32)
        y = moe.experts(x, ids, w, gate_up, down, act, out=out)
        assert y is out
        close(y, ops.moe_experts_grouped(x, ids.astype(cp.int64), w, gate_up, down, act))
        close(moe.experts(x, ids, w, gate_up, down, act), y, 0)  # deterministic, fresh output


@pytest.mark.gpu
@pytest.mark.parametrize("grouped_min_t,mma", [(1, ""), (1, "0"), (10**9, "")])
@pytest.mark.parametrize("kind", ["bf16", "fp8-block128", "nvfp4"])
def test_experts_both_paths_skewed_and_chunked(cp, gpu, moe, ops, monkeypatch, kind, grouped_min_t, mma):
    """Either path forced for every T (grouped from T = 1, or per-slot up to T = 300); skewed routing (every
    token to the same few experts: buckets of 300 slots) and the grouped path cut into token chunks; the grouped
    path's tensor-core and CUDA-core kernels (mma "0")."""
    monkeypatch.setenv("LUMEN_CUDA_MMA_PREFILL", mma)
    monkeypatch.setattr(moe, "GROUPED_MIN_T", grouped_min_t)
    rng = np.random.default_rng(21)
    E, k, H, I = 8, 2, 256, 128
    gate_up, down = experts(gpu, rng, E, H, I, kind)
    for T in (1, 3, 300):
        x = cp.asarray(rng.normal(size=(T, H)).astype(np.float32))
        ids, w = routing(cp, rng, E, k, np.int64, T)
        close(moe.experts(x, ids, w, gate_up, down, "silu", out=cp.full((T, H), np.nan, dtype=cp.float32)),
              ops.moe_experts_grouped(x, ids, w, gate_up, down, "silu"))
        skew = cp.asarray(np.tile(np.array([[5, 2]], np.int64), (T, 1)))
        close(moe.experts(x, skew, w, gate_up, down, "gelu_tanh"),
              ops.moe_experts_grouped(x, skew, w, gate_up, down, "gelu_tanh"))
    monkeypatch.setattr(moe, "CHUNK_FLOATS", 64 * k * max(H, I))  # 64 tokens per launch: 5 chunks of T = 300
    out = cp.full((300, H), np.nan, dtype=cp.float32)
    close(moe.experts(x, ids, w, gate_up, down, "silu", out=out), ops.moe_experts_grouped(x, ids, w, gate_up, down))


@pytest.mark.gpu
@pytest.mark.parametrize("slots", ["16", "32", "64"])
@pytest.mark.parametrize("kind", ["bf16", "fp8-block128", "nvfp4", "packed"])
def test_experts_slot_blocks(cp, gpu, moe, ops, monkeypatch, kind, slots):
    """Each tensor-core block width (LUMEN_CUDA_X3_SLOTS: 16 / 32 slots x 256 weight rows, 64 x 128): its work list
    (moe_slot_blocks: every run of a bucket once, experts in order, then -1) and its results against the reference:
    buckets smaller than a block, several blocks a bucket (skewed routing: 100-slot buckets), and weight rows past a
    block's end (H 384, I 128: a 256-row block's last warps hold no row; fp8's scale rows clamped)."""
    from lumen_cuda import fp8_mma

    monkeypatch.setenv("LUMEN_CUDA_MMA_PREFILL", "")
    monkeypatch.setenv("LUMEN_CUDA_X3_SLOTS", slots)
    n = int(slots)
    sizes = np.array([0, 1, n, n + 1, 3 * n, 0, 5, 70])  # an expert's bucket: empty, under, at and over a block
    off = cp.asarray(np.concatenate([[0], np.cumsum(sizes)]).astype(np.int32))
    work = fp8_mma.SlotBlocks(off, int(sizes.sum()), len(sizes), moe._fn("moe_slot_blocks"), moe.BUCKET_THREADS)
    want = [c << 16 | e for e, m in enumerate(sizes) for c in range(-(-m // n))]
    assert work.slots == n and work.blocks.size == -(-sizes.sum() // n) + len(sizes)
    assert cp.asnumpy(work.blocks).tolist() == want + [-1] * (work.blocks.size - len(want))
    fn, grid, smem = work.launch("moe_fp8_x3", "fp8", 384)
    rows = 128 if slots == "64" else 256
    assert (fn, smem) == fp8_mma._fn("moe_fp8_x3" + {"16": "_s16", "32": "_s32", "64": ""}[slots], "fp8", rows, n)
    assert smem == fp8_mma.x3_smem("fp8", rows, n, fp8_mma.x3_pipe())
    assert grid == (work.blocks.size, 3 if slots == "64" else 2)
    rng = np.random.default_rng(int(slots) + len(kind))
    E, k, H, I = 8, 2, 384, 128
    if kind == "packed":
        gate_up = gpu.weight((rng.normal(size=(E, 2 * I, H)) * 0.05).astype(ml_dtypes.bfloat16), "bf16", "vram")
        down = gpu.weight((rng.normal(size=(E, H, I)) * 0.05).astype(ml_dtypes.bfloat16), "bf16", "vram")
        run, ref = moe.experts_packed, ops.moe_experts_packed_grouped
    else:
        gate_up, down = experts(gpu, rng, E, H, I, kind)
        run, ref = moe.experts, ops.moe_experts_grouped
    for T in (9, 100):
        x = cp.asarray(rng.normal(size=(T, H)).astype(np.float32))
        ids, w = routing(cp, rng, E, k, np.int64, T)
        close(run(x, ids, w, gate_up, down, "silu", out=cp.full((T, H), np.nan, dtype=cp.float32)),
              ref(x, ids, w, gate_up, down, "silu"))
        skew = cp.asarray(np.tile(np.array([[5, 2]], np.int64), (T, 1)))
        close(run(x, skew, w, gate_up, down, "gelu_tanh"), ref(x, skew, w, gate_up, down, "gelu_tanh"))
    monkeypatch.setenv("LUMEN_CUDA_X3_SLOTS", "8")  # not a compiled width: named, never a silent default
    with pytest.raises(LumenError, match="LUMEN_CUDA_X3_SLOTS='8'"):
        run(x, ids, w, gate_up, down, "silu")


@pytest.mark.gpu
@pytest.mark.parametrize("act", ["gelu_tanh", "silu"])
@pytest.mark.parametrize("T,mma", with_mma([5, 64]))
def test_experts_packed_tokens_match_grouped(cp, gpu, moe, ops, T, act, mma, monkeypatch):
    monkeypatch.setenv("LUMEN_CUDA_MMA_PREFILL", mma)
    rng = np.random.default_rng(T + len(act))
    E, k, H, I = 16, 4, 256, 128
    gate_up = gpu.weight((rng.normal(size=(E, 2 * I, H)) * 0.05).astype(ml_dtypes.bfloat16), "bf16", "vram")
    down = gpu.weight((rng.normal(size=(E, H, I)) * 0.05).astype(ml_dtypes.bfloat16), "bf16", "vram")
    x = cp.asarray(rng.normal(size=(T, H)).astype(np.float32))
    ids, w = routing(cp, rng, E, k, np.int64, T)
    out = cp.full((T, H), np.nan, dtype=cp.float32)
    y = moe.experts_packed(x, ids, w, gate_up, down, act, out=out)
    assert y is out
    close(y, ops.moe_experts_packed_grouped(x, ids, w, gate_up, down, act))


@pytest.mark.gpu
@pytest.mark.parametrize("T,mma", with_mma([4, 64]))
def test_tokens_graph_capture(cp, gpu, moe, ops, T, mma, monkeypatch):
    """A T-token call (per-call scratch from the allocator) captured under a private pool, as lumen_cuda.graph
    does, replays to the eager result, and to the new experts after ids are rewritten in place."""
    monkeypatch.setenv("LUMEN_CUDA_MMA_PREFILL", mma)
    rng = np.random.default_rng(13 + T)
    E, k, H, I = 16, 4, 256, 128
    gate_up, down = experts(gpu, rng, E, H, I, "bf16")
    x = cp.asarray(rng.normal(size=(T, H)).astype(np.float32))
    ids, w = routing(cp, rng, E, k, np.int64, T)
    y = cp.empty((T, H), dtype=cp.float32)
    pool = cp.cuda.MemoryPool()
    stream = cp.cuda.Stream(non_blocking=True)
    with stream, cp.cuda.using_allocator(pool.malloc):
        moe.experts(x, ids, w, gate_up, down, "silu", out=y)  # warm-up: kernels, tables, the pool's blocks
        stream.synchronize()
        stream.begin_capture()
        moe.experts(x, ids, w, gate_up, down, "silu", out=y)
        graph = stream.end_capture()
    eager = y.copy()  # outside the private pool: the graph's blocks stay its own
    cp.cuda.Device().synchronize()
    y.fill(np.nan)
    cp.cuda.Device().synchronize()
    graph.launch(stream)
    stream.synchronize()
    close(y, eager, 0)
    ids[...] = cp.asarray(np.stack([np.random.default_rng(t).choice(E, size=k, replace=False) for t in range(T)]))
    cp.cuda.Device().synchronize()
    graph.launch(stream)
    stream.synchronize()
    close(y, ops.moe_experts_grouped(x, ids, w, gate_up, down, "silu"))


# -- T = 1: the down kernel's slot chunks ---------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["bf16", "f16", "f32", "fp8-block128", "fp8-per-channel", "nvfp4"])
@pytest.mark.parametrize("k", [1, 2, 8, 10])
def test_decode_slot_chunks(cp, gpu, moe, ops, kind, k):
    """T = 1 through the per-slot kernels (ROWS = 1 down, the k slots in chunks of up to 8, 4 for f32 / nvfp4):
    k = 10 spans two or three chunks; the same result for int32 ids and run to run; an invalid id (-1) inside a
    chunk is skipped (the reference is the call without that slot)."""
    rng = np.random.default_rng(100 * k + len(kind))
    E, H, I = 16, 256, 512
    gate_up, down = experts(gpu, rng, E, H, I, kind)
    assert moe._table(gate_up, True) is not None and moe._table(down, False) is not None  # the kernel path
    x = cp.asarray(rng.normal(size=(1, H)).astype(np.float32))
    ids, w = routing(cp, rng, E, k)
    want = ops.moe_experts_grouped(x, ids, w, gate_up, down, "silu")
    y = moe.experts_decode(x, ids, w, gate_up, down, "silu", out=cp.full((1, H), np.nan, dtype=cp.float32))
    close(y, want)
    close(moe.experts_decode(x, ids.astype(cp.int32), w, gate_up, down, "silu"), y, 0)
    close(moe.experts_decode(x, ids, w, gate_up, down, "silu"), y, 0)
    if k > 1:
        bad = ids.copy()
        bad[0, k // 2] = -1
        keep = [j for j in range(k) if j != k // 2]
        close(moe.experts_decode(x, bad, w, gate_up, down, "silu"),
              ops.moe_experts_grouped(x, ids[:, keep], w[:, keep], gate_up, down, "silu"))


# -- NVFP4 experts ----------------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("grouped_min_t", [None, 1, 10**9])
@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
def test_experts_nvfp4_against_ops_and_cpu(cp, gpu, cpu, moe, ops, monkeypatch, act, grouped_min_t):
    """NVFP4 expert lists (the same packed codes and scales on both backends, a global scale per matrix) through
    the device kernels for T = 1, 3, 8, 37: the default split, everything grouped, everything per slot; against
    ``ops.moe_experts_grouped`` (the CuPy reference) and the CPU backend's ``moe_experts``."""
    if grouped_min_t is not None:
        monkeypatch.setattr(moe, "GROUPED_MIN_T", grouped_min_t)
    rng = np.random.default_rng(31 + len(act) + (grouped_min_t or 0) % 7)
    E, k, H, I = 16, 4, 256, 384
    host_gu = [(nvfp4_host(rng, I, H), nvfp4_host(rng, I, H)) for _ in range(E)]
    host_d = [nvfp4_host(rng, H, I) for _ in range(E)]
    gate_up = [tuple(gpu.weight(p, "nvfp4", "vram", scale=s) for p, s in pair) for pair in host_gu]
    down = [gpu.weight(p, "nvfp4", "vram", scale=s) for p, s in host_d]
    cgate_up = [tuple(cpu.weight(p, "nvfp4", "ram", scale=s) for p, s in pair) for pair in host_gu]
    cdown = [cpu.weight(p, "nvfp4", "ram", scale=s) for p, s in host_d]
    tg = moe._table(gate_up, True)
    assert tg is not None and moe._table(down, False) is not None  # the kernel path, not the host-sync fallback
    assert tg.fmt == "nvfp4" and tg.block == (1, 16, H // 16) and tuple(tg.ptrs.shape) == (6, E)
    for T in (1, 3, 8, 37):
        xh = rng.normal(size=(T, H)).astype(np.float32)
        x = cp.asarray(xh)
        ids, w = routing(cp, rng, E, k, np.int64, T)
        out = cp.full((T, H), np.nan, dtype=cp.float32)
        y = moe.experts(x, ids, w, gate_up, down, act, out=out)
        assert y is out
        close(y, ops.moe_experts_grouped(x, ids, w, gate_up, down, act))
        close(y, cpu.ops.moe_experts(xh, host(ids), host(w), cgate_up, cdown, act))
        close(moe.experts(x, ids.astype(cp.int32), w, gate_up, down, act), y, 0)  # deterministic


@pytest.mark.gpu
def test_nvfp4_fallback_and_global_scale_row(cp, gpu, moe, ops):
    """K not a multiple of 32 (one 16-byte load = 32 nvfp4 values): no table, the CuPy op answers. With K % 32:
    the table's last rows hold the global scales' f32 bits."""
    rng = np.random.default_rng(41)
    E, k, H, I = 4, 2, 272, 48  # 272 % 32 = 16, 48 % 32 = 16
    gate_up, down = experts(gpu, rng, E, H, I, "nvfp4")
    assert moe._table(gate_up, True) is None and moe._table(down, False) is None
    x = cp.asarray(rng.normal(size=(2, H)).astype(np.float32))
    ids, w = routing(cp, rng, E, k, np.int64, 2)
    close(moe.experts(x, ids, w, gate_up, down), ops.moe_experts_grouped(x, ids, w, gate_up, down))
    gate_up, down = experts(gpu, rng, E, 256, 64, "nvfp4")
    td = moe._table(down, False)
    assert td is not None and tuple(td.ptrs.shape) == (3, E)
    bits = host(td.ptrs[2]).astype(np.uint32).view(np.float32)
    np.testing.assert_array_equal(bits, np.array([d.scale.global_scale for d in down], np.float32))


# -- the shared expert as slot k (ops.moe_shared) -------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("normalize", [True, False])
def test_route_with_shared_column(cp, moe, ops, normalize):
    """The k routed columns as moe.route's, then id E and sigmoid(shared logit) (the CPU's form, within 2 ulp of
    tanh: an absolute bound, as 0.5 (tanh + 1) cancels for large negative logits)."""
    rng = np.random.default_rng(5)
    E, k = 256, 8
    for T in (1, 3, 9):
        lg = cp.asarray((rng.normal(size=(T, E)) * 3).astype(np.float32))
        sh = (rng.normal(size=(T, 1)) * 4).astype(np.float32)
        w, ids = moe.route(lg, k, normalize, shared=cp.asarray(sh))
        w_ref, ids_ref = moe.route(lg, k, normalize)
        assert w.shape == ids.shape == (T, k + 1) and ids.dtype == cp.int64
        np.testing.assert_array_equal(host(ids)[:, :k], host(ids_ref))
        assert (host(ids)[:, k] == E).all()
        np.testing.assert_array_equal(host(w)[:, :k], host(w_ref))
        expect = (0.5 * (np.tanh(0.5 * sh) + 1.0)).astype(np.float32)[:, 0]
        np.testing.assert_allclose(host(w)[:, k], expect, rtol=0, atol=2.4e-7)  # 2 ulp of tanh near +-1


def shared_block(gpu, rng, E, H, I, kind, shared_kind=None):
    gate_up, down = experts(gpu, rng, E + 1, H, I, kind)
    if shared_kind is not None:  # a shared expert the routed experts' table cannot hold
        gate_up[E] = (matrix(gpu, rng, I, H, shared_kind), matrix(gpu, rng, I, H, shared_kind))
        down[E] = matrix(gpu, rng, H, I, shared_kind)
    return gate_up, down


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["bf16", "fp8-block128", "nvfp4"])
@pytest.mark.parametrize("T,mma", with_mma([1, 3, 40]))
def test_moe_shared_equals_the_composite(cp, gpu, moe, ops, monkeypatch, kind, T, mma):
    """The fused op (the shared expert as slot k of the routed kernels) against lumen_core's composite over the same
    backend's ops (route, routed experts, the shared MLP times its gate, the sum): per-slot kernels (T < 8) and the
    grouped ones (tensor-core and CUDA-core). Another order of f32 sums: 1e-5 of the scale."""
    from lumen_core.ops import COMPOSITES

    monkeypatch.setenv("LUMEN_CUDA_MMA_PREFILL", mma)
    monkeypatch.setenv("LUMEN_CUDA_DECODE_FUSION", "1")
    rng = np.random.default_rng(T + len(kind))
    E, k, H, I = 32, 4, 256, 384
    gate_up, down = shared_block(gpu, rng, E, H, I, kind)
    x = cp.asarray(rng.normal(size=(T, H)).astype(np.float32))
    logits = cp.asarray((rng.normal(size=(T, E)) * 2).astype(np.float32))
    sg = cp.asarray(rng.normal(size=(T, 1)).astype(np.float32))
    assert moe.fits_one_table(gate_up, down)
    y = gpu.ops.moe_shared(x, logits, sg, k, gate_up, down)
    ref = COMPOSITES["moe_shared"](gpu.ops, x, logits, sg, k, gate_up, down)
    assert y.shape == (T, H)
    close(y, ref)
    close(gpu.ops.moe_shared(x, logits, sg, k, gate_up, down), y, 0)  # deterministic; the cached tables reused
    # the routed list alone (as the composite passes it) keeps its own table beside the E + 1 list's
    assert moe._table(gate_up[:E], True) is not moe._table(gate_up, True)


@pytest.mark.gpu
@pytest.mark.parametrize("with_shared", [True, False], ids=["with-shared-expert", "routed-only"])
@pytest.mark.parametrize("kind,E,k,tied", [("fp8-block128", 256, 8, False), ("nvfp4", 256, 8, False),
                                           ("bf16", 256, 8, False), ("f16", 128, 8, True), ("f32", 60, 4, True),
                                           ("fp8-block128", 512, 16, False), ("bf16", 8, 1, False)])
def test_experts_routed_equals_route_then_experts(cp, gpu, moe, kind, with_shared, E, k, tied):
    """moe.experts_routed (the gate/up kernel routes for itself) writes the routing kernel's ids and weights bit for
    bit (its warp sums the exponentials in the block kernel's order) and so the same output as moe.route then
    moe.experts; ties (integer logits) go to the lower index in both."""
    rng = np.random.default_rng(E + k + len(kind))
    H, I = 128, 64
    if kind == "nvfp4" or kind.startswith("fp8"):
        H, I = 256, 128
    gate_up, down = experts(gpu, rng, E + with_shared, H, I, kind)
    for _trial in range(3):
        x = cp.asarray(rng.normal(size=(1, H)).astype(np.float32))
        if tied:
            logits = cp.asarray(rng.integers(0, 3, size=(1, E)).astype(np.float32))
        else:
            logits = cp.asarray((rng.normal(size=(1, E)) * 3).astype(np.float32))
        sg = cp.asarray(rng.normal(size=(1, 1)).astype(np.float32) * 3) if with_shared else None
        for normalize in (True, False):
            n = k + with_shared
            got = (cp.full((1, n), -7.0, dtype=cp.float32), cp.full((1, n), -7, dtype=cp.int64))
            y = moe.experts_routed(x, logits, sg, k, gate_up, down, "silu", normalize, route_out=got)
            assert y is not None and y.shape == (1, H)
            w_ref, ids_ref = moe.route(logits, k, normalize, shared=sg)
            np.testing.assert_array_equal(host(got[1]), host(ids_ref))
            np.testing.assert_array_equal(host(got[0]), host(w_ref))
            close(y, moe.experts(x, ids_ref, w_ref, gate_up, down, "silu"), 0)


@pytest.mark.gpu
def test_experts_routed_declines_what_it_cannot_run(cp, gpu, moe):
    """None (the caller routes first) for more than one token, more logits than a warp routes, lists that do not
    match the logits; the setting's bad values are named."""
    rng = np.random.default_rng(11)
    E, k, H, I = 16, 2, 128, 64
    gate_up, down = experts(gpu, rng, E + 1, H, I, "bf16")
    x3 = cp.asarray(rng.normal(size=(3, H)).astype(np.float32))
    lg3 = cp.asarray(rng.normal(size=(3, E)).astype(np.float32))
    sg3 = cp.asarray(rng.normal(size=(3, 1)).astype(np.float32))
    assert moe.experts_routed(x3, lg3, sg3, k, gate_up, down) is None  # T = 3
    x, lg, sg = x3[:1], lg3[:1], sg3[:1]
    assert moe.experts_routed(x, lg, None, k, gate_up, down) is None  # E + 1 experts for E logits, no shared
    assert moe.experts_routed(x, lg, sg, k, gate_up[:E], down[:E]) is None  # no slot for the shared expert
    big = cp.zeros((1, moe.ROUTED_MAX_E + 1), dtype=cp.float32)
    assert moe.experts_routed(x, big, None, k, gate_up, down) is None
    assert moe.route_in_experts({}) is False and moe.route_in_experts({"LUMEN_CUDA_ROUTE_IN_EXPERTS": "1"}) is True
    with pytest.raises(ValueError, match="LUMEN_CUDA_ROUTE_IN_EXPERTS='on'"):
        moe.route_in_experts({"LUMEN_CUDA_ROUTE_IN_EXPERTS": "on"})


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["bf16", "fp8-block128", "nvfp4", "f32"])
def test_gate_up_blocks_setting_changes_no_bit(cp, gpu, moe, monkeypatch, kind):
    """LUMEN_CUDA_MOE_GATE_UP_BLOCKS=5 (the gate/up kernels built to fit 5 blocks an SM) changes the registers, not
    the arithmetic: the per-slot path (T = 1, 3) and the routed one equal the default build bit for bit. Bad values
    are named."""
    rng = np.random.default_rng(31 + len(kind))
    E, k, H, I = 16, 4, 256, 128
    gate_up, down = experts(gpu, rng, E, H, I, kind)
    outs = {}
    for blocks in ("", "5"):
        monkeypatch.setenv("LUMEN_CUDA_MOE_GATE_UP_BLOCKS", blocks)
        rs = np.random.default_rng(7)
        got = []
        for T in (1, 3):
            ids, w = routing(cp, rs, E, k, T=T)
            x = cp.asarray(rs.normal(size=(T, H)).astype(np.float32))
            got.append(moe.experts(x, ids, w, gate_up, down, "silu"))
        x1 = cp.asarray(rs.normal(size=(1, H)).astype(np.float32))
        lg = cp.asarray(rs.normal(size=(1, E)).astype(np.float32))
        got.append(moe.experts_routed(x1, lg, None, k, gate_up, down))
        outs[blocks] = got
    for a, b in zip(outs[""], outs["5"], strict=True):
        close(b, a, 0)
    assert moe.gate_up_blocks({}) == 0 and moe.gate_up_blocks({"LUMEN_CUDA_MOE_GATE_UP_BLOCKS": "5"}) == 5
    for bad in ("17", "-1", "five"):
        with pytest.raises(ValueError, match=f"LUMEN_CUDA_MOE_GATE_UP_BLOCKS='{bad}'"):
            moe.gate_up_blocks({"LUMEN_CUDA_MOE_GATE_UP_BLOCKS": bad})


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["bf16", "fp8-block128", "fp8-channel", "f32", "nvfp4", "packed-bf16"])
@pytest.mark.parametrize("E,k,H,I", [(16, 4, 256, 128), (64, 9, 512, 256), (40, 13, 272, 64), (48, 40, 64, 32),
                                      (48, 41, 64, 32)])
def test_down_split_changes_no_bit(cp, gpu, moe, monkeypatch, kind, E, k, H, I):
    """LUMEN_CUDA_MOE_DOWN_SPLIT=1 (a token's slots over the block's warps, moe_down_split_*) gives the chunked
    kernel's bits for one token: k from 4 to SPLIT_MAX_S (one round of loads, two, several; 41 declines), an id
    outside [0, E) among the slots (skipped); NVFP4 declines (not built). Also through the routed path
    (experts_routed, k <= MAX_K). The split kernel is seen to run (moe._fn watched). Bad values are named."""
    rng = np.random.default_rng(E + k + H)
    if kind == "packed-bf16":
        gate_up = gpu.weight((rng.normal(size=(E, 2 * I, H)) * 0.05).astype(ml_dtypes.bfloat16), "bf16", "vram")
        down = gpu.weight((rng.normal(size=(E, H, I)) * 0.05).astype(ml_dtypes.bfloat16), "bf16", "vram")
        run = moe.experts_packed
    else:
        gate_up, down = experts(gpu, rng, E, H, I, kind)
        run = moe.experts
    x = cp.asarray(rng.normal(size=(1, H)).astype(np.float32))
    ids, w = routing(cp, rng, E, k)
    bad = ids.copy()
    bad[0, k // 2] = E + 3  # an id outside [0, E): its slot contributes nothing
    logits = cp.asarray((rng.normal(size=(1, E)) * 2).astype(np.float32))
    outs, launched, fn = {}, [], moe._fn

    def spy(name):
        launched.append(name)
        return fn(name)

    monkeypatch.setattr(moe, "_fn", spy)
    for v in ("0", "1"):
        monkeypatch.setenv("LUMEN_CUDA_MOE_DOWN_SPLIT", v)
        got = [run(x, ids, w, gate_up, down, "silu", out=cp.full((1, H), np.nan, dtype=cp.float32)),
               run(x, bad, w, gate_up, down, "silu")]
        if kind != "packed-bf16" and k <= moe.MAX_K:
            got.append(moe.experts_routed(x, logits, None, k, gate_up, down))
        outs[v] = got
    for a, b in zip(outs["0"], outs["1"], strict=True):
        np.testing.assert_array_equal(host(b), host(a))
        assert np.isfinite(host(a)).all()
    split = [n for n in launched if n.startswith("moe_down_split_")]
    if kind == "nvfp4" or k > moe.SPLIT_MAX_S:
        assert not split
    else:  # it ran: every call with the setting on (none with it off)
        fmt = "packed_bf16" if kind == "packed-bf16" else kind.split("-")[0]
        assert split == [f"moe_down_split_{fmt}"] * len(outs["1"]), launched
    assert moe.down_split({}) is False and moe.down_split({"LUMEN_CUDA_MOE_DOWN_SPLIT": "1"}) is True
    with pytest.raises(ValueError, match="LUMEN_CUDA_MOE_DOWN_SPLIT='yes'"):
        moe.down_split({"LUMEN_CUDA_MOE_DOWN_SPLIT": "yes"})


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["bf16", "fp8-block128", "nvfp4"])
def test_moe_shared_routing_in_the_gate_up_kernel_changes_no_bit(cp, gpu, moe, monkeypatch, kind):
    """ops.moe_shared with LUMEN_CUDA_ROUTE_IN_EXPERTS=1 equals it with 0 at T = 1 (bit for bit) and at T = 3 (the
    option does not apply: the routing kernel runs)."""
    monkeypatch.setenv("LUMEN_CUDA_DECODE_FUSION", "1")
    rng = np.random.default_rng(21 + len(kind))
    E, k, H, I = 64, 6, 256, 128
    gate_up, down = shared_block(gpu, rng, E, H, I, kind)
    for T in (1, 3):
        x = cp.asarray(rng.normal(size=(T, H)).astype(np.float32))
        logits = cp.asarray((rng.normal(size=(T, E)) * 2).astype(np.float32))
        sg = cp.asarray(rng.normal(size=(T, 1)).astype(np.float32))
        monkeypatch.setenv("LUMEN_CUDA_ROUTE_IN_EXPERTS", "0")
        ref = gpu.ops.moe_shared(x, logits, sg, k, gate_up, down)
        monkeypatch.setenv("LUMEN_CUDA_ROUTE_IN_EXPERTS", "1")
        close(gpu.ops.moe_shared(x, logits, sg, k, gate_up, down), ref, 0)


@pytest.mark.gpu
def test_moe_shared_falls_back_where_the_table_cannot_hold_the_shared_expert(cp, gpu, moe, monkeypatch):
    """fp8 routed experts with a bf16 shared expert: the composite (the same numbers as calling it directly)."""
    from lumen_core.ops import COMPOSITES

    monkeypatch.setenv("LUMEN_CUDA_DECODE_FUSION", "1")
    rng = np.random.default_rng(3)
    E, k, H, I = 16, 2, 256, 128
    gate_up, down = shared_block(gpu, rng, E, H, I, "fp8-block128", shared_kind="bf16")
    assert not moe.fits_one_table(gate_up, down)
    x = cp.asarray(rng.normal(size=(1, H)).astype(np.float32))
    logits = cp.asarray(rng.normal(size=(1, E)).astype(np.float32))
    sg = cp.asarray(rng.normal(size=(1, 1)).astype(np.float32))
    close(gpu.ops.moe_shared(x, logits, sg, k, gate_up, down),
          COMPOSITES["moe_shared"](gpu.ops, x, logits, sg, k, gate_up, down), 0)



@pytest.mark.gpu
def test_moe_shared_off_runs_the_composite_and_bad_values_are_named(cp, gpu, moe, monkeypatch):
    from lumen_cuda.state import derived

    from lumen_core.ops import COMPOSITES

    rng = np.random.default_rng(4)
    E, k, H, I = 16, 2, 256, 128
    gate_up, down = shared_block(gpu, rng, E, H, I, "bf16")
    x = cp.asarray(rng.normal(size=(1, H)).astype(np.float32))
    logits = cp.asarray(rng.normal(size=(1, E)).astype(np.float32))
    sg = cp.asarray(rng.normal(size=(1, 1)).astype(np.float32))
    for off in ("0",):  # 0: the composite, no E + 1 table built
        monkeypatch.setenv("LUMEN_CUDA_DECODE_FUSION", off)
        close(gpu.ops.moe_shared(x, logits, sg, k, gate_up, down),
              COMPOSITES["moe_shared"](gpu.ops, x, logits, sg, k, gate_up, down), 0)
        assert ("moe_table_pairs", E + 1) not in derived(gate_up[0][0])
    monkeypatch.setenv("LUMEN_CUDA_DECODE_FUSION", "yes")
    with pytest.raises(ValueError, match="LUMEN_CUDA_DECODE_FUSION='yes'"):
        gpu.ops.moe_shared(x, logits, sg, k, gate_up, down)
