"""The cuda backend against the CPU reference: every op on random inputs, then whole models end to end.

GPU tests carry the ``gpu`` marker and skip where CuPy or a CUDA device is absent; the first few tests need
neither (registration, no CUDA at import, a cuda:N plan refused on a machine without a GPU).
Tolerances: f32 on both sides. Elementwise ops agree to ~1e-6; GEMM-based ones (cuBLAS vs OpenBLAS sum in other
orders) to ~1e-5 relative; whole models ≤ 1e-3 absolute on the logits and the same greedy tokens.
"""

from __future__ import annotations

import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest
from gpu_util import greedy_run

import lumen_core as lumen
from lumen_core.errors import ConfigError
from lumen_core.ops import CONTRACT
from lumen_core.plugins import get_registry

pytest.importorskip("lumen_cuda")

CONTEXT = 256
DECODE_STEPS = 8
MOE = {"enable_moe_block": True, "num_experts": 4, "top_k_experts": 2, "moe_intermediate_size": 32}
E2B = {"hidden_size_per_layer_input": 8, "num_kv_shared_layers": 2, "use_double_wide_mlp": True}
MODELS = {  # name: (tiny checkpoint kind, overrides, prompt length)
    "qwen3_5": ("qwen3_5", {}, 80),  # 80 > one 64-token Gated-DeltaNet chunk
    "qwen3_5_moe": ("qwen3_5_moe", {}, 80),
    "gemma3": ("gemma3", {}, 48),  # six sliding windows of 8
    "gemma4": ("gemma4", {}, 48),
    "gemma4-moe": ("gemma4", MOE, 48),
    "gemma4-e2b": ("gemma4", E2B, 48),  # per-layer inputs and KV-shared layers (attention_shared)
}


# -- no GPU needed ---------------------------------------------------------------------------------------------
def test_cuda_registers_every_op_in_the_contract():
    assert set(CONTRACT) <= get_registry().ops_of("cuda")


def test_ops_that_take_a_weight_hand_host_weights_to_hostweights(monkeypatch):
    """linear, embedding and linear_group are registered through ``_host_aware``: a Weight whose store is 'ram'
    (kept in page-locked host RAM) goes to lumen_cuda.hostweights.dispatch, anything else to the op itself, whatever
    its array's type (the Weight says where it lives; the op does not sniff); other ops are registered as they are.
    Stand-ins for the op and the module: no GPU needed."""
    import types

    import lumen_cuda

    from lumen_core.backend import Weight

    def op(*args, **kwargs):
        return "op"

    fake = types.ModuleType("lumen_cuda.hostweights")
    fake.dispatch = lambda name, call, *args, **kwargs: f"host {name}"
    monkeypatch.setitem(sys.modules, "lumen_cuda.hostweights", fake)
    monkeypatch.setattr(lumen_cuda, "hostweights", fake, raising=False)
    device, host = Weight(object(), "bf16", (2, 2), store="vram"), Weight(object(), "bf16", (2, 2), store="ram")
    unknown = Weight(np.zeros((2, 2), np.uint16), "bf16", (2, 2))  # a numpy array, no store: not sniffed as host
    linear, group = lumen_cuda._host_aware("linear", op), lumen_cuda._host_aware("linear_group", op)
    assert (linear("x", device), linear("x", host), linear("x", w=host)) == ("op", "host linear", "op")
    assert linear("x", unknown) == "op"
    assert lumen_cuda._host_aware("embedding", op)("ids", host) == "host embedding"
    assert (group("x", [device, device]), group("x", [device, host])) == ("op", "host linear_group")
    assert lumen_cuda._host_aware("rms_norm", op) is op


def test_importing_the_plugin_does_not_import_cupy():
    code = ("import sys; from lumen_core.plugins import get_registry; r = get_registry(); "
            "assert 'cuda' in r.backends; import lumen_cuda; assert 'cupy' not in sys.modules, 'cupy imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_a_cuda_plan_is_refused_without_a_gpu(tiny_checkpoint):
    if get_registry().backend_class("cuda").devices():
        pytest.skip("this machine has a CUDA device")
    with pytest.raises(ConfigError, match=r"device 'cuda:0' does not exist|'cuda:0' cannot be used until then"):
        lumen.load({"model": {"path": str(tiny_checkpoint("qwen3_5")), "compute": "cuda:0", "store": "vram"}},
                   progress=False)


# -- fixtures and helpers --------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def gpu():
    cp = pytest.importorskip("cupy")
    try:
        n = cp.cuda.runtime.getDeviceCount()
    except Exception:  # CuPy without a driver or device
        n = 0
    if n == 0:
        pytest.skip("no CUDA device")
    reg = get_registry()
    return reg.backend_class("cuda")("cuda:0", reg)


@pytest.fixture(scope="module")
def cpu():
    reg = get_registry()
    return reg.backend_class("cpu")("cpu", reg)


def host(x):
    """numpy of a cuda array, a tuple of them, or a numpy array."""
    if isinstance(x, tuple):
        return tuple(host(a) for a in x)
    return x.get() if hasattr(x, "get") and not isinstance(x, np.ndarray) else np.asarray(x)


def close(got, want, tol=1e-5):
    """max |got - want| <= tol × max(1, max |want|) (relative for large values, absolute near zero)."""
    got, want = host(got).astype(np.float64), np.asarray(want, dtype=np.float64)
    assert got.shape == want.shape
    assert np.isfinite(got).all()
    err, scale = np.abs(got - want).max(initial=0.0), max(1.0, np.abs(want).max(initial=0.0))
    assert err <= tol * scale, f"max |Δ| {err:.3g} > {tol * scale:.3g}"
    return err


def rand(rng, *shape, lo=None, hi=None):
    if lo is not None:
        return rng.uniform(lo, hi, size=shape).astype(np.float32)
    return rng.normal(size=shape).astype(np.float32)


def both(cpu, gpu, fn):
    """fn(backend, put) on each backend; put moves a host array onto that backend."""
    return fn(cpu.ops, cpu.tensor), fn(gpu.ops, gpu.tensor)


# -- op by op ----------------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["f32", "bf16", "f16"])
def test_linear_and_embedding(gpu, cpu, fmt):
    rng = np.random.default_rng(0)
    dtype = {"f32": np.float32, "bf16": ml_dtypes.bfloat16, "f16": np.float16}[fmt]
    w = rand(rng, 96, 64).astype(dtype)
    x = rand(rng, 7, 64)
    wc, wg = cpu.weight(w, fmt, "ram"), gpu.weight(w, fmt, "vram")
    close(gpu.ops.linear(gpu.tensor(x), wg), cpu.ops.linear(x, wc))
    ids = [5, 0, 95, 5]
    close(gpu.ops.embedding(ids, wg), cpu.ops.embedding(ids, wc), 0)


@pytest.mark.gpu
def test_weight_refuses_other_stores_and_formats(gpu):
    w = np.zeros((4, 4), np.float32)
    with pytest.raises(ValueError, match="vram"):
        gpu.weight(w, "f32", "mmap")
    # store "ram": a copy in page-locked host memory (streamed experts, lumen_cuda.hostweights)
    host = gpu.weight(np.arange(16, dtype=np.float32).reshape(4, 4), "f32", "ram")
    assert isinstance(host.data, np.ndarray) and host.data.tolist() == np.arange(16).reshape(4, 4).tolist()
    with pytest.raises(NotImplementedError, match="not yet supported on cuda"):
        gpu.weight(np.zeros((4, 4), np.int8), "i8", "vram")
    # GGUF blocks are dequantized to bf16 on upload (tests/test_cuda_gguf.py)
    assert gpu.weight(np.zeros((4, 34), np.uint8), "q8_0", "vram", shape=(4, 32)).format == "bf16"
    with pytest.raises(ValueError, match="does not make"):
        gpu.weight(np.zeros((4, 8), np.uint8), "nvfp4", "vram", scale=(np.zeros((4, 2), np.uint8), 1.0))


# -- quantized weights: fp8 (block / per-channel / per-tensor scales) and NVFP4 --------------------------------
def fp8_case(rng, N, K, kind):
    w8 = (rng.normal(size=(N, K)) * 0.5).astype(ml_dtypes.float8_e4m3fn)
    shape = {"block128": (-(-N // 128), -(-K // 128)), "block32": (-(-N // 32), -(-K // 32)),
             "per-channel": (N, 1), "per-tensor": (1,)}[kind]
    return w8, rng.uniform(0.5, 2.0, size=shape).astype(np.float32)


def nvfp4_case(rng, N, K):
    packed = rng.integers(0, 256, size=(N, K // 2), dtype=np.uint8)
    block = rng.uniform(0.05, 3.0, size=(N, K // 16)).astype(ml_dtypes.float8_e4m3fn)
    return packed, (block, np.float32(0.0123))


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["block128", "block32", "per-channel", "per-tensor"])
def test_fp8_linear_and_embedding_against_the_cpu(gpu, cpu, kind):
    """The same e4m3 bytes and scales on both backends: the block is inferred alike, linear agrees (the GEMV at
    T <= 8; above, gemm_split on the tensor cores: bf16 hi + lo of x and W, so 2e-5 as for bf16 prefill),
    embedding rows are bit-identical."""
    rng = np.random.default_rng(21)
    for N, K in [(300, 272), (130, 40), (257, 1040)]:
        w8, scale = fp8_case(rng, N, K, kind)
        wc, wg = cpu.weight(w8, "fp8", "ram", scale=scale), gpu.weight(w8, "fp8", "vram", scale=scale)
        assert wg.format == "fp8" and wg.shape == (N, K) and wg.block == wc.block
        assert wg.nbytes == N * K + scale.size * 4
        for T in (1, 2, 4, 7, 9):
            x = rand(rng, T, K)
            close(gpu.ops.linear(gpu.tensor(x), wg), cpu.ops.linear(x, wc), 2e-5 if T > 8 else 1e-5)
        ids = [0, N - 1, 5, 0, N // 2]
        close(gpu.ops.embedding(ids, wg), cpu.ops.embedding(ids, wc), 0)
    assert gpu.ops.resolve("linear", "fp8").__name__ == "cuda_kernel_linear_fp8"


@pytest.mark.gpu
def test_nvfp4_linear_and_embedding_against_the_cpu(gpu, cpu):
    """Random packed codes (every nibble, -0 included) and e4m3 block scales: the dequantized matrix is
    bit-identical to the CPU's; linear agrees to f32 GEMM rounding for T <= 8 (1e-5) and to the tensor-core
    gemm_split's bf16 hi + lo accuracy above (2e-5); embedding rows exactly."""
    from lumen_cpu import nvfp4
    from lumen_cuda import gemv

    rng = np.random.default_rng(22)
    for N, K in [(96, 64), (257, 1040), (33, 16)]:
        packed, scale = nvfp4_case(rng, N, K)
        wc, wg = cpu.weight(packed, "nvfp4", "ram", scale=scale), gpu.weight(packed, "nvfp4", "vram", scale=scale)
        assert wg.format == "nvfp4" and wg.shape == (N, K) and wg.block == (1, 16)
        np.testing.assert_array_equal(host(gemv.dequantize_nvfp4(wg)).view(np.uint32),
                                      nvfp4.dequantize(wc).view(np.uint32))
        for T in (1, 3, 9):
            x = rand(rng, T, K)
            close(gpu.ops.linear(gpu.tensor(x), wg), cpu.ops.linear(x, wc), 2e-5 if T > 4 else 1e-5)
        ids = [0, N - 1, 5, 5]
        close(gpu.ops.embedding(ids, wg), cpu.ops.embedding(ids, wc), 0)
    # slabs: a matrix larger than one dequantization slab, on the tensor-core path (T = 9) and on the f32
    # fallback (T = 2 with K = 16: no GEMV, K % 32 != 0)
    old = gemv.NVFP4_SLAB, gemv.SPLIT_SLAB
    gemv.NVFP4_SLAB = gemv.SPLIT_SLAB = 16 * 8  # 8 rows of (33, 16) a slab
    try:
        close(gpu.ops.linear(gpu.tensor(x), wg), cpu.ops.linear(x, wc), 2e-5)
        close(gpu.ops.linear(gpu.tensor(x[:2]), wg), cpu.ops.linear(x[:2], wc))
    finally:
        gemv.NVFP4_SLAB, gemv.SPLIT_SLAB = old
    assert gpu.ops.resolve("linear", "nvfp4").__name__ == "cuda_kernel_linear_nvfp4"


@pytest.mark.gpu
def test_elementwise_and_norms(gpu, cpu):
    rng = np.random.default_rng(1)
    x, y = rand(rng, 5, 3, 32), rand(rng, 5, 3, 32)
    w = rand(rng, 32)
    g = gpu.tensor
    cases = [
        ("rms_norm", (x, w, 1e-6), (g(x), g(w), 1e-6)),
        ("rms_norm", (x, w, 1e-6, 1.0), (g(x), g(w), 1e-6, 1.0)),
        ("rms_norm", (x, None, 1e-6), (g(x), None, 1e-6)),
        ("rms_norm_gated", (x, y, w, 1e-6), (g(x), g(y), g(w), 1e-6)),
        ("l2norm", (x,), (g(x),)),
        ("sigmoid", (x,), (g(x),)),
        ("silu", (x,), (g(x),)),
        ("softplus", (x * 10,), (g(x * 10),)),
        ("exp", (x,), (g(x),)),
        ("silu_mul", (x, y), (g(x), g(y))),
        ("gelu_tanh_mul", (x, y), (g(x), g(y))),
        ("softcap", (x * 30, 15.0), (g(x * 30), 15.0)),
    ]
    for op, cargs, gargs in cases:
        close(getattr(gpu.ops, op)(*gargs), getattr(cpu.ops, op)(*cargs), 2e-6)


@pytest.mark.gpu
@pytest.mark.parametrize("mrope", [None, "sections", "interleaved"])
def test_rope(gpu, cpu, mrope):
    rng = np.random.default_rng(2)
    T, heads, D, rot = 9, 3, 32, 24  # partial rotary: dims 24..31 pass through
    inv = (1.0 / 10000 ** (np.arange(0, rot, 2) / rot)).tolist()
    if mrope is None:
        pos, kw = list(range(40, 40 + T)), {}
    else:
        pos = rng.integers(0, 50, size=(3, T))
        kw = {"mrope_section": [4, 4, 4], "interleaved": mrope == "interleaved"}
    cc, sc = cpu.ops.rope_tables(pos, inv, **kw)
    cg, sg = gpu.ops.rope_tables(pos, inv, **kw)
    close(cg, cc, 2.5e-7)  # the same f32 angles; CUDA's cosf / sinf within 2 ulp of numpy's
    close(sg, sc, 2.5e-7)
    x = rand(rng, T, heads, D)
    close(gpu.ops.apply_rope(gpu.tensor(x), cg, sg), cpu.ops.apply_rope(x, cc, sc), 2e-6)


def _kv_bits(a):
    """A cache array as comparable numbers: bf16 caches compare by their bits."""
    a = host(a)
    if a.dtype == ml_dtypes.float8_e4m3fn:
        return a.view(np.uint8)
    return a.view(np.uint16) if a.dtype == ml_dtypes.bfloat16 else a


@pytest.mark.gpu
@pytest.mark.parametrize("kv", ["f32", "f16", "bf16", "fp8"])
@pytest.mark.parametrize(("window", "softcap"), [(None, None), (5, None), (None, 0.7), (5, 0.7)])
def test_attention_prefill_then_decode(gpu, cpu, kv, window, softcap):
    rng = np.random.default_rng(3)
    T, Hq, Hkv, D = 20, 4, 2, 16
    caches = cpu.ops.kv_cache(64, Hkv, D, kv), gpu.ops.kv_cache(64, Hkv, D, kv)
    start = 0
    for n in (T, 1, 1, 3):
        q, k, v = (rand(rng, n, h, D) for h in (Hq, Hkv, Hkv))
        want = cpu.ops.attention(q, k, v, caches[0], start, D ** -0.5, window, softcap)
        got = gpu.ops.attention(*map(gpu.tensor, (q, k, v)), caches[1], start, D ** -0.5, window, softcap)
        close(got, want, 1e-5)
        close(gpu.ops.attention_shared(gpu.tensor(q), caches[1], start, D ** -0.5, window, softcap),
              cpu.ops.attention_shared(q, caches[0], start, D ** -0.5, window, softcap), 1e-5)
        start += n
    # the positions written (the CPU's caches are allocated, not zeroed: the rest is whatever memory held)
    np.testing.assert_array_equal(_kv_bits(caches[1].k)[:, :start], _kv_bits(caches[0].k)[:, :start])
    np.testing.assert_array_equal(_kv_bits(caches[1].v)[:, :start], _kv_bits(caches[0].v)[:, :start])


@pytest.mark.gpu
@pytest.mark.parametrize("kv", ["f32", "bf16", "fp8"])
def test_ring_cache_attention_and_sharing(gpu, cpu, kv):
    rng = np.random.default_rng(4)
    W, Hq, Hkv, D = 6, 4, 1, 8
    rings = cpu.ops.sliding_kv_cache(W, Hkv, D, kv), gpu.ops.sliding_kv_cache(W, Hkv, D, kv)
    start = 0
    for n in (20, 1, 1, 2, 9):  # past the window in prefill and in decode, then a chunk longer than the ring
        q, k, v = (rand(rng, n, h, D) for h in (Hq, Hkv, Hkv))
        want = cpu.ops.attention(q, k, v, rings[0], start, 0.3, W, None)
        close(gpu.ops.attention(*map(gpu.tensor, (q, k, v)), rings[1], start, 0.3, W, None), want, 1e-5)
        close(gpu.ops.attention_shared(gpu.tensor(q), rings[1], start, 0.3, W),
              cpu.ops.attention_shared(q, rings[0], start, 0.3, W), 1e-5)
        start += n
    np.testing.assert_array_equal(_kv_bits(rings[1].k), _kv_bits(rings[0].k))
    with pytest.raises(ValueError, match="cannot serve"):
        gpu.ops.attention(*map(gpu.tensor, (q, k, v)), rings[1], start, 0.3, W + 1, None)


@pytest.mark.gpu
def test_causal_conv1d_prefill_then_decode(gpu, cpu):
    rng = np.random.default_rng(5)
    C, K = 24, 4
    w = rand(rng, C, K)
    states = cpu.ops.conv_state(C, K), gpu.ops.conv_state(C, K)
    for n in (11, 1, 1, 2):
        x = rand(rng, n, C)
        close(gpu.ops.causal_conv1d(gpu.tensor(x), gpu.tensor(w), states[1]),
              cpu.ops.causal_conv1d(x, w, states[0]), 2e-6)
    close(states[1].x, states[0].x, 0)


@pytest.mark.gpu
@pytest.mark.parametrize("T", [150, 64, 5])
def test_gated_delta_rule_chunked_then_recurrent(gpu, cpu, T):
    rng = np.random.default_rng(6)
    Hk, Hv, Dk, Dv = 2, 4, 16, 8
    states = cpu.ops.delta_state(Hv, Dk, Dv), gpu.ops.delta_state(Hv, Dk, Dv)
    for n in (T, 1, 1):
        q, k = rand(rng, n, Hk, Dk), rand(rng, n, Hk, Dk)
        v = rand(rng, n, Hv, Dv)
        g, beta = rand(rng, n, Hv, lo=-0.5, hi=-0.01), rand(rng, n, Hv, lo=0, hi=1)
        want = cpu.ops.gated_delta_rule(q, k, v, g, beta, states[0])
        got = gpu.ops.gated_delta_rule(*map(gpu.tensor, (q, k, v, g, beta)), states[1])
        close(got, want, 1e-4)
    close(states[1].s, states[0].s, 1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["f32", "bf16"])
def test_moe(gpu, cpu, fmt):
    rng = np.random.default_rng(7)
    T, H, I, E, k = 9, 32, 16, 6, 2
    dtype = np.float32 if fmt == "f32" else ml_dtypes.bfloat16
    logits = rand(rng, T, E)
    (wc, ic), (wg, ig) = cpu.ops.moe_route(logits, k), gpu.ops.moe_route(gpu.tensor(logits), k)
    np.testing.assert_array_equal(host(ig), ic)
    close(wg, wc, 2e-6)
    close(gpu.ops.moe_route(gpu.tensor(logits), k, False)[0], cpu.ops.moe_route(logits, k, False)[0], 2e-6)
    x = rand(rng, T, H)
    per = [(rand(rng, I, H).astype(dtype), rand(rng, I, H).astype(dtype), rand(rng, H, I).astype(dtype))
           for _ in range(E)]

    def experts(b, store):
        gate_up = [(b.weight(g, fmt, store), b.weight(u, fmt, store)) for g, u, _ in per]
        return gate_up, [b.weight(d, fmt, store) for _, _, d in per]

    (cgu, cd), (ggu, gd) = experts(cpu, "ram"), experts(gpu, "vram")
    for act in ("silu", "gelu_tanh"):
        close(gpu.ops.moe_experts(gpu.tensor(x), ig, wg, ggu, gd, act), cpu.ops.moe_experts(x, ic, wc, cgu, cd, act))
    packed_gu = np.stack([np.concatenate([g, u]) for g, u, _ in per])  # (E, 2I, H)
    packed_d = np.stack([d for _, _, d in per])  # (E, H, I)
    want = cpu.ops.moe_experts_packed(x, ic, wc, cpu.weight(packed_gu, fmt, "ram"), cpu.weight(packed_d, fmt, "ram"))
    got = gpu.ops.moe_experts_packed(gpu.tensor(x), ig, wg, gpu.weight(packed_gu, fmt, "vram"),
                                     gpu.weight(packed_d, fmt, "vram"))
    close(got, want)
    scale = rand(rng, E)
    close(gpu.ops.gather(gpu.tensor(scale), ig), cpu.ops.gather(scale, ic), 0)
    # ids that crossed from the CPU keep their integer type
    crossed = gpu.ops.moe_experts(gpu.take(x), gpu.take(ic), gpu.take(wc), ggu, gd)
    close(crossed, cpu.ops.moe_experts(x, ic, wc, cgu, cd))


# -- whole models ------------------------------------------------------------------------------------------------
def engine(path, compute: str, store: str, **hidden):
    model = {"path": str(path), "compute": compute, "store": store,
             "hidden-layers": {"kv-cache": {"context-size": CONTEXT}, **hidden}}
    return lumen.load({"model": model}, progress=False)


def run(model, ids):
    """Prefill logits (all rows), then DECODE_STEPS greedy tokens and their logits."""
    return greedy_run(model, ids, CONTEXT, DECODE_STEPS)


@pytest.fixture(scope="module", params=list(MODELS))
def model_pair(request, tiny_checkpoint, gpu):
    kind, overrides, n = MODELS[request.param]
    path = tiny_checkpoint(kind, **overrides)
    ref = engine(path, "cpu", "ram")
    ids = np.random.RandomState(0).randint(3, ref.model.vocab_size, n).tolist()
    return request.param, path, ids, run(ref.model, ids)


@pytest.mark.gpu
def test_model_on_cuda_equals_cpu(model_pair):
    _, path, ids, (prefill, tokens, steps) = model_pair
    on_gpu = engine(path, "cuda:0", "vram")
    assert {e.backend for e in on_gpu.plan.entries} == {"cuda"}
    p, t, s = run(on_gpu.model, ids)
    assert isinstance(p, np.ndarray)
    errs = close(p, prefill, 1e-3), close(s, steps, 1e-3)
    assert t == tokens
    print(f"max |Δlogit| prefill {errs[0]:.2e}, decode {errs[1]:.2e}")  # shown with -rP


@pytest.fixture(scope="module", params=["fp8", "nvfp4"])
def quantized_pair(request, tiny_checkpoint, tmp_path_factory, gpu):
    """A tiny Qwen 3.5 quantized by ``lumen quantize`` (fp8 with 32×32 blocks, or nvfp4), run on the CPU."""
    from lumen_core.cli import main

    out = tmp_path_factory.mktemp(f"qwen3_5-{request.param}") / "q"
    try:
        rc = main(["quantize", "--input", str(tiny_checkpoint("qwen3_5")), "--output", str(out),
                   "--format", request.param, "--block", "32"])
    except SystemExit as exc:
        rc = exc.code
    assert not rc, f"lumen quantize exited with {rc}"
    ref = engine(out, "cpu", "ram")
    ids = np.random.RandomState(1).randint(3, ref.model.vocab_size, 80).tolist()
    return request.param, out, ids, run(ref.model, ids)


@pytest.mark.gpu
def test_quantized_model_on_cuda_equals_cpu(quantized_pair):
    fmt, path, ids, (prefill, tokens, steps) = quantized_pair
    on_gpu = engine(path, "cuda:0", "vram")
    assert {e.backend for e in on_gpu.plan.entries} == {"cuda"}
    assert any(fmt in e.format for e in on_gpu.plan.entries)
    p, t, s = run(on_gpu.model, ids)
    errs = close(p, prefill, 1e-3), close(s, steps, 1e-3)
    assert t == tokens
    print(f"{fmt}: max |Δlogit| prefill {errs[0]:.2e}, decode {errs[1]:.2e}")


@pytest.mark.gpu
def test_mixed_placement_equals_cpu(model_pair):
    name, path, ids, (prefill, tokens, steps) = model_pair
    if MODELS[name][1].get("num_kv_shared_layers"):
        pytest.skip("KV-shared layers must sit on their producer's device (a plan rule)")
    mixed = engine(path, "cuda:0", "vram", ranges=[{"start": 0, "end": 2, "compute": "cpu", "store": "ram"}])
    backends = {e.component: e.backend for e in mixed.plan.entries}
    assert backends["layers.0"] == backends["layers.1"] == "cpu" and backends["layers.2"] == "cuda"
    p, t, s = run(mixed.model, ids)
    errs = close(p, prefill, 1e-3), close(s, steps, 1e-3)
    assert t == tokens
    print(f"max |Δlogit| prefill {errs[0]:.2e}, decode {errs[1]:.2e}")


@pytest.mark.gpu
def test_fp8_kv_cache_model_on_cuda_equals_cpu(model_pair):
    """An fp8 (E4M3) KV cache: the model on cuda:0 (its decode through the CUDA graph, the fused decode attention
    reading E4M3 bytes) against the CPU with the same fp8 cache. Keys and values are rounded to E4M3 on both from
    f32 values that differ by the backends' rounding, so a value at a rounding boundary can land one E4M3 step apart,
    and on these tiny random models one such step moves later logits by a good part of what the whole cache's
    rounding does (gemma4-moe, H100, 2026-12-06: 0.25 where the fp8 cache moves the CPU's logits by 1.25 from its f32
    cache; the same with the routed experts' tensor-core kernels off and with the CPU's AMX off). So the tolerance
    is 1e-2 x max(1, max |logit|) plus a quarter of the fp8 cache's own effect on the CPU, and the greedy tokens
    equal."""
    _, path, ids, exact = model_pair
    kv = {"context-size": CONTEXT, "type-k": "fp8", "type-v": "fp8"}

    def load(compute, store):
        return lumen.load({"model": {"path": str(path), "compute": compute, "store": store,
                                     "hidden-layers": {"kv-cache": kv}}}, progress=False)

    ref, on_gpu = load("cpu", "ram"), load("cuda:0", "vram")
    want, got = run(ref.model, ids), run(on_gpu.model, ids)
    effect = float(np.abs(np.asarray(want[0], np.float64) - np.asarray(exact[0], np.float64)).max())
    scale = max(1.0, float(np.abs(want[0]).max()))
    tol = 1e-2 + 0.25 * effect / scale
    errs = close(got[0], want[0], tol), close(got[2], want[2], tol)
    assert got[1] == want[1]
    assert list(on_gpu.generate_tokens(ids, DECODE_STEPS)) == list(ref.generate_tokens(ids, DECODE_STEPS))
    print(f"fp8 KV: max |Δlogit| prefill {errs[0]:.2e}, decode {errs[1]:.2e} (the cache's own effect {effect:.2e}); "
          f"graph {bool(on_gpu.decode_runner())}")
