"""The CUDA backend's vision-tower ops (issue 17) against the CPU's (the reference): layer norm with bias, the erf
and tanh GELUs, bidirectional attention within one image (GQA), concat, and attention / attention_shared with
``blocks`` (an image's tokens that see each other, Gemma 3 / 4) over full and ring KV caches. All f32: <= 1e-5 x
max(1, max |want|). GPU tests carry the ``gpu`` marker and skip without CuPy or a CUDA device."""

from __future__ import annotations

import numpy as np
import pytest
from gpu_util import close

from lumen_core.plugins import get_registry

pytest.importorskip("lumen_cuda")


@pytest.fixture(scope="module")
def backends(cp):
    reg = get_registry()
    return reg.backend_class("cpu")("cpu", reg), reg.backend_class("cuda")("cuda:0", reg)


def rand(rng, *shape):
    return rng.normal(size=shape).astype(np.float32)


@pytest.mark.gpu
def test_norm_and_activations(backends):
    cpu, gpu = backends
    rng = np.random.default_rng(0)
    x, w, b = rand(rng, 7, 33, 48) * 3, rand(rng, 48), rand(rng, 48)
    for args in ((w, b), (w, None), (None, None)):
        want = cpu.ops.layer_norm(x, *args, 1e-6)
        got = gpu.ops.layer_norm(gpu.tensor(x), *(None if a is None else gpu.tensor(a) for a in args), 1e-6)
        close(got, want)
    for op in ("gelu", "gelu_tanh"):
        close(getattr(gpu.ops, op)(gpu.tensor(x)), getattr(cpu.ops, op)(x))
    parts = [rand(rng, n, 16) for n in (3, 1, 5)]
    close(gpu.ops.concat([gpu.tensor(p) for p in parts]), cpu.ops.concat(parts))


@pytest.mark.gpu
@pytest.mark.parametrize("heads", [(4, 4), (8, 2)])
def test_bidirectional_attention(backends, heads):
    cpu, gpu = backends
    rng = np.random.default_rng(1)
    H, Hkv = heads
    q, k, v = rand(rng, 150, H, 32), rand(rng, 150, Hkv, 32), rand(rng, 150, Hkv, 24)
    want = cpu.ops.bidirectional_attention(q, k, v, 32 ** -0.5)
    close(gpu.ops.bidirectional_attention(*map(gpu.tensor, (q, k, v)), 32 ** -0.5), want)
    from lumen_cuda import vision_ops  # the cuBLAS path the flash kernel falls back to

    close(vision_ops._bidirectional_cublas(*map(gpu.tensor, (q, k, v)), 32 ** -0.5), want)


@pytest.mark.gpu
@pytest.mark.parametrize("window", [None, 6])
def test_attention_with_image_blocks(backends, window):
    """A prompt of text, an image's 8 tokens (seeing each other), text, another image's 5 tokens; then a decode
    step. The ring cache serves the sliding window."""
    cpu, gpu = backends
    rng = np.random.default_rng(2)
    Hq, Hkv, D, T = 4, 2, 16, 24
    blocks = [(3, 11), (15, 20)]
    make = "kv_cache" if window is None else "sliding_kv_cache"
    size = 64 if window is None else window
    caches = getattr(cpu.ops, make)(size, Hkv, D), getattr(gpu.ops, make)(size, Hkv, D)
    start = 0
    for n, bl in ((T, blocks), (1, None)):
        q, k, v = rand(rng, n, Hq, D), rand(rng, n, Hkv, D), rand(rng, n, Hkv, D)
        kw = {"blocks": bl} if bl else {}
        want = cpu.ops.attention(q, k, v, caches[0], start, D ** -0.5, window, **kw)
        got = gpu.ops.attention(*map(gpu.tensor, (q, k, v)), caches[1], start, D ** -0.5, window, **kw)
        close(got, want)
        close(gpu.ops.attention_shared(gpu.tensor(q), caches[1], start, D ** -0.5, window, **kw),
              cpu.ops.attention_shared(q, caches[0], start, D ** -0.5, window, **kw))
        start += n
    # the blocks changed something: without them the prefill differs
    q, k, v = rand(rng, T, Hq, D), rand(rng, T, Hkv, D), rand(rng, T, Hkv, D)
    c1, c2 = getattr(cpu.ops, make)(size, Hkv, D), getattr(cpu.ops, make)(size, Hkv, D)
    assert not np.allclose(cpu.ops.attention(q, k, v, c1, 0, D ** -0.5, window, blocks=blocks),
                           cpu.ops.attention(q, k, v, c2, 0, D ** -0.5, window))
