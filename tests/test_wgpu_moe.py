"""wgpu MoE ops (moe_route, moe_experts, moe_experts_packed) against the CPU backend.

The router runs on the device and its ids/weights feed the expert ops there: no op may submit the recording (a
read-back would break the one-command-buffer decode step), which the tests check through ``ctx.submits``. Expert
weights are the same f32 or bf16 values on both sides (ml_dtypes arrays through each backend's ``weight``), so the
tolerance is f32's: 1e-5 relative. Covered: T = 1 and 5 (the GEMV path) and 80 (the tiled path), E = 8 and 4 with
k = 2, both activations, odd sizes (16-bit rows that straddle words when packed), Gemma's GGUF row views as
(gate, up), experts split over several storage bindings, the per-expert matrices reading from the packed buffers
afterwards, and the GGUF block formats kept as stored (per expert, as row views and packed).
"""

from __future__ import annotations

from dataclasses import replace

import ml_dtypes
import numpy as np
import pytest
from gpu_util import close

pytestmark = pytest.mark.wgpu

SHAPES = {"small": (40, 24), "odd": (33, 17), "qwen-like": (512, 128)}  # (H, I)


def test_wgpu_registers_the_moe_ops(wgpu_pair):
    from lumen_core.plugins import get_registry

    assert {"moe_route", "moe_experts", "moe_experts_packed"} <= get_registry().ops_of("wgpu")


@pytest.mark.parametrize("T,E,k", [(1, 8, 2), (80, 256, 8), (3, 300, 10), (5, 4, 4)])
@pytest.mark.parametrize("normalize", [True, False])
def test_moe_route_matches_cpu(wgpu_pair, T, E, k, normalize):
    wg, cpu = wgpu_pair
    rng = np.random.default_rng(T * E + k)
    logits = (rng.standard_normal((T, E + 3)) * 3).astype(np.float32)
    submits = wg.ctx.submits
    weights, ids = wg.ops.moe_route(wg.tensor(logits)[:, 1:1 + E], k, normalize)  # a column view
    assert wg.ctx.submits == submits
    want_w, want_ids = cpu.ops.moe_route(logits[:, 1:1 + E], k, normalize)
    assert ids.dtype == "i32" and ids.shape == (T, k) and weights.shape == (T, k)
    assert np.array_equal(ids.get(), want_ids)
    close(weights, want_w, 1e-6)


def test_moe_route_breaks_ties_by_the_lower_expert(wgpu_pair):
    """Equal probabilities come out in expert order, as the CPU's stable argsort of -p gives them."""
    wg, cpu = wgpu_pair
    rng = np.random.default_rng(3)
    logits = np.round(rng.standard_normal((16, 24))).astype(np.float32)  # a handful of distinct values a row
    logits[0] = 1.0  # every expert tied
    weights, ids = wg.ops.moe_route(wg.tensor(logits), 6)
    want_w, want_ids = cpu.ops.moe_route(logits, 6)
    assert np.array_equal(ids.get(), want_ids)
    assert list(ids.get()[0]) == [0, 1, 2, 3, 4, 5]
    close(weights, want_w, 1e-6)


def host_weights(rng, fmt, shape, scale=0.2):
    a = (rng.standard_normal(shape) * scale).astype(np.float32)
    return a.astype(ml_dtypes.bfloat16) if fmt == "bf16" else a


def experts(rng, fmt, E, H, I):  # noqa: E741
    """Per expert: a (2I, H) gate+up matrix (gate rows first) and an (H, I) down matrix, as host arrays."""
    return [host_weights(rng, fmt, (2 * I, H)) for _ in range(E)], [host_weights(rng, fmt, (H, I)) for _ in range(E)]


def routed(wg, cpu, rng, T, E, k, H):
    """x and the router's outputs on both backends (the wgpu ones computed on the device)."""
    x = rng.standard_normal((T, H)).astype(np.float32)
    logits = rng.standard_normal((T, E)).astype(np.float32)
    w_w, w_ids = wg.ops.moe_route(wg.tensor(logits), k)
    c_w, c_ids = cpu.ops.moe_route(logits, k)
    assert np.array_equal(w_ids.get(), c_ids)
    return (wg.tensor(x), w_ids, w_w), (x, c_ids, c_w)


def no_submit(wg, fn, *args):
    submits = wg.ctx.submits
    out = fn(*args)
    assert wg.ctx.submits == submits, "the op read something back to the host"
    return out


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("fmt", ["f32", "bf16"])
@pytest.mark.parametrize("E,k", [(8, 2), (4, 2)])
def test_moe_experts_match_cpu(wgpu_pair, shape, fmt, E, k):
    """Per-expert (gate, up) and down Weights, and the same numbers packed (E, 2I, H) / (E, H, I)."""
    wg, cpu = wgpu_pair
    H, I = SHAPES[shape]  # noqa: E741
    rng = np.random.default_rng(E + H)
    gu, dn = experts(rng, fmt, E, H, I)
    w_pairs = [(wg.weight(g[:I], fmt, "vram"), wg.weight(g[I:], fmt, "vram")) for g in gu]
    c_pairs = [(cpu.weight(g[:I], fmt, "ram"), cpu.weight(g[I:], fmt, "ram")) for g in gu]
    w_down, c_down = [wg.weight(d, fmt, "vram") for d in dn], [cpu.weight(d, fmt, "ram") for d in dn]
    w_packed = wg.weight(np.stack(gu), fmt, "vram"), wg.weight(np.stack(dn), fmt, "vram")
    c_packed = cpu.weight(np.stack(gu), fmt, "ram"), cpu.weight(np.stack(dn), fmt, "ram")
    for T in (1, 5, 80):
        for act in ("silu", "gelu_tanh"):
            w_in, c_in = routed(wg, cpu, rng, T, E, k, H)
            want = cpu.ops.moe_experts(*c_in, c_pairs, c_down, act)
            close(no_submit(wg, wg.ops.moe_experts, *w_in, w_pairs, w_down, act), want)
            close(no_submit(wg, wg.ops.moe_experts_packed, *w_in, *w_packed, act), want)
            close(cpu.ops.moe_experts_packed(*c_in, *c_packed, act), want)  # the CPU's two forms agree


def test_moe_experts_gemma_row_views_and_several_bindings(wgpu_pair):
    """Gemma's GGUF path: (gate, up) as row views of one (2I, H) matrix per expert; with the adapter's binding
    limit shrunk to three experts, the packed experts span several buffers (a dispatch each) and the packed Weight
    several chunks. After the first call every expert's own matrices read from the packed buffers and ``linear``
    on them still gives the CPU's numbers."""
    wg, cpu = wgpu_pair
    E, k, H, I, fmt = 8, 2, 40, 24, "bf16"  # noqa: E741
    rng = np.random.default_rng(11)
    gu, dn = experts(rng, fmt, E, H, I)
    ctx = wg.ctx
    saved = ctx.max_binding
    ctx.max_binding = 3 * 2 * I * H * 2 + 64  # three experts' gate_up a binding (activations must stay tiny)
    try:
        whole = [wg.weight(g, fmt, "vram") for g in gu]
        w_pairs = [tuple(replace(w, data=w.data[a:b], shape=(I, H)) for a, b in ((0, I), (I, 2 * I)))
                   for w in whole]
        w_down = [wg.weight(d, fmt, "vram") for d in dn]
        w_packed = wg.weight(np.stack(gu), fmt, "vram"), wg.weight(np.stack(dn), fmt, "vram")
        assert len(w_packed[0].data.chunks) == 3
        c_pairs = [(cpu.weight(g[:I], fmt, "ram"), cpu.weight(g[I:], fmt, "ram")) for g in gu]
        c_down = [cpu.weight(d, fmt, "ram") for d in dn]
        w_in, c_in = routed(wg, cpu, rng, 1, E, k, H)
        want = cpu.ops.moe_experts(*c_in, c_pairs, c_down, "gelu_tanh")
        close(no_submit(wg, wg.ops.moe_experts, *w_in, w_pairs, w_down, "gelu_tanh"), want)
        close(no_submit(wg, wg.ops.moe_experts_packed, *w_in, *w_packed, "gelu_tanh"), want)
    finally:
        ctx.max_binding = saved
    packed = w_pairs[0][0]._wgpu_experts[1]
    assert (len(packed.gate_up), len(packed.down)) == (3, 2)
    bufs = {id(g.buf) for g in packed.gate_up + packed.down}
    assert all(id(m.chunks[0][0]) in bufs for w in whole + w_down for m in [w.data])
    for T in (1, 80):  # the tiled path over several groups
        w_in, c_in = routed(wg, cpu, rng, T, E, k, H)
        want = cpu.ops.moe_experts(*c_in, c_pairs, c_down, "gelu_tanh")
        close(wg.ops.moe_experts(*w_in, w_pairs, w_down, "gelu_tanh"), want)
        close(wg.ops.moe_experts_packed(*w_in, *w_packed, "gelu_tanh"), want)
    x = rng.standard_normal((3, H)).astype(np.float32)
    h = rng.standard_normal((3, I)).astype(np.float32)
    for e in (0, 4, 7):
        close(wg.ops.linear(wg.tensor(x), w_pairs[e][1]), cpu.ops.linear(x, c_pairs[e][1]))
        close(wg.ops.linear(wg.tensor(h), w_down[e]), cpu.ops.linear(h, c_down[e]))


def test_moe_experts_refuse_what_they_cannot_compute(wgpu_pair):
    wg, _ = wgpu_pair
    rng = np.random.default_rng(5)
    gu, dn = experts(rng, "f32", 2, 8, 4)
    pairs = [(wg.weight(g[:4], "f32", "vram"), wg.weight(g[4:], "f32", "vram")) for g in gu]
    down = [wg.weight(d, "f32", "vram") for d in dn]
    x, ids, w = wg.tensor(np.ones((1, 8), np.float32)), wg.tensor(np.array([[0, 1]], np.int32)), \
        wg.tensor(np.ones((1, 2), np.float32))
    with pytest.raises(ValueError, match="activation"):
        wg.ops.moe_experts(x, ids, w, pairs, down, "relu")
    mixed = [pairs[0], (pairs[1][0], wg.weight(gu[1][4:].astype(np.float16), "f16", "vram"))]
    with pytest.raises(NotImplementedError, match="one format"):
        wg.ops.moe_experts(x, ids, w, mixed, down, "silu")
    fp8 = [tuple(wg.weight(a.astype(ml_dtypes.float8_e4m3fn), "fp8", "vram") for a in (g[:4], g[4:])) for g in gu]
    fp8_down = [wg.weight(d.astype(ml_dtypes.float8_e4m3fn), "fp8", "vram") for d in dn]
    with pytest.raises(NotImplementedError, match="not 'fp8'"):
        wg.ops.moe_experts(x, ids, w, fp8, fp8_down, "silu")


GGUF_F16_FIELDS = {"q8_0": (0,), "q4_0": (0,), "q5_0": (0,), "q4_k": (0, 2), "q5_k": (0, 2), "q6_k": (208,)}


def gguf_rows(rng, fmt, rows, cols):
    """Random raw GGUF blocks (rows, bytes a row) with sane f16 scales (every payload code occurs)."""
    from lumen_wgpu.quant import gguf_block

    values, size = gguf_block(fmt)
    blocks = rng.integers(0, 256, size=(rows * cols // values, size), dtype=np.uint8)
    for off in GGUF_F16_FIELDS[fmt]:
        d = (rng.uniform(1e-3, 2e-2, size=len(blocks)) * rng.choice([-1, 1], size=len(blocks))).astype(np.float16)
        blocks[:, off:off + 2] = d.view(np.uint8).reshape(-1, 2)
    return blocks.reshape(rows, -1)


@pytest.mark.parametrize("fmt", list(GGUF_F16_FIELDS))
def test_moe_experts_read_gguf_blocks_as_stored(wgpu_pair, fmt):
    """GGUF experts stay blocks on wgpu: per expert as whole (gate, up) matrices, as Gemma's row views of one
    (2I, H) matrix, and packed (E, 2I, H) / (E, H, I) — all against the CPU's per-expert reference (its fused GGUF
    linear decodes the same blocks)."""
    wg, cpu = wgpu_pair
    E, k = 4, 2
    H, I = (256, 256) if fmt.endswith("_k") else (64, 96)  # noqa: E741 (rows of whole blocks)
    rng = np.random.default_rng(sum(map(ord, fmt)))
    gu = [gguf_rows(rng, fmt, 2 * I, H) for _ in range(E)]
    dn = [gguf_rows(rng, fmt, H, I) for _ in range(E)]

    def pairs(backend, store):
        out = []
        for g in gu:
            half = g.shape[0] // 2
            out.append(tuple(backend.weight(np.ascontiguousarray(h), fmt, store, shape=(I, H))
                             for h in (g[:half], g[half:])))
        return out

    w_pairs, c_pairs = pairs(wg, "vram"), pairs(cpu, "ram")
    w_down = [wg.weight(d, fmt, "vram", shape=(H, I)) for d in dn]
    c_down = [cpu.weight(d, fmt, "ram", shape=(H, I)) for d in dn]
    whole = [wg.weight(g, fmt, "vram", shape=(2 * I, H)) for g in gu]
    w_views = [tuple(replace(w, data=w.data[a:b], shape=(I, H)) for a, b in ((0, I), (I, 2 * I))) for w in whole]
    w_down2 = [wg.weight(d, fmt, "vram", shape=(H, I)) for d in dn]
    w_packed = (wg.weight(np.stack(gu), fmt, "vram", shape=(E, 2 * I, H)),
                wg.weight(np.stack(dn), fmt, "vram", shape=(E, H, I)))
    for T in (1, 80):
        w_in, c_in = routed(wg, cpu, rng, T, E, k, H)
        want = cpu.ops.moe_experts(*c_in, c_pairs, c_down, "silu")
        close(no_submit(wg, wg.ops.moe_experts, *w_in, w_pairs, w_down, "silu"), want)
        close(no_submit(wg, wg.ops.moe_experts, *w_in, w_views, w_down2, "silu"), want)
        close(no_submit(wg, wg.ops.moe_experts_packed, *w_in, *w_packed, "silu"), want)
    # the experts' own matrices now read the packed buffers (whole matrices and row views alike)
    assert w_pairs[1][1].data.chunks[0][0] is w_pairs[0][0]._wgpu_experts[1].gate_up[0].buf
    assert whole[2].data.chunks[0][0] is w_views[0][0]._wgpu_experts[1].gate_up[0].buf
    x, h = rng.standard_normal((3, H)).astype(np.float32), rng.standard_normal((3, I)).astype(np.float32)
    for w in (w_pairs[1][1], w_views[2][1]):
        close(wg.ops.linear(wg.tensor(x), w), cpu.ops.linear(x, c_pairs[1 if w is w_pairs[1][1] else 2][1]))
    close(wg.ops.linear(wg.tensor(h), w_down2[3]), cpu.ops.linear(h, c_down[3]))
