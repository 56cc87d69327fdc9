"""The chunked Gated-DeltaNet prefill kernels (lumen_cuda.gdn_prefill: kernels/gdn_chunk.cu) against the CuPy op
they replace (lumen_cuda.delta.gated_delta_rule), each on its own copy of the state, from a zero and from a random
state: outputs and final states within 1e-4 × max(1, max |reference|). Inputs are non-contiguous views; decays are
realistic (g = -softplus(normal) × uniform(0.1, 1)). GPU tests carry the ``gpu`` marker and skip without CuPy or a
CUDA device.
"""

from __future__ import annotations

import zlib

import gpu_util
import numpy as np
import pytest

pytest.importorskip("lumen_cuda")

TOL = 1e-4


@pytest.fixture(scope="module")
def mods(cp):
    from lumen_cuda import delta, gdn_prefill

    return delta, gdn_prefill


def close(got, want, tol=TOL):
    return gpu_util.close(got, want, tol)


def strided(cp, rng, shape):
    """A random normal f32 device array of ``shape`` (T, H, D) that is a non-contiguous view."""
    a = cp.asarray(rng.normal(size=(shape[1], shape[0], *shape[2:])).astype(np.float32))
    return a.swapaxes(0, 1)


def gdn_inputs(cp, rng, T, Hk, Hv, Dk, Dv):
    q, k = strided(cp, rng, (T, Hk, Dk)), strided(cp, rng, (T, Hk, Dk))
    v = strided(cp, rng, (T, Hv, Dv))
    softplus = np.logaddexp(0.0, rng.normal(size=(Hv, T)))
    g = -softplus * rng.uniform(0.1, 1.0, size=(Hv, T))
    g = cp.asarray(g.astype(np.float32)).T  # log decay, a strided view
    beta = cp.asarray((1 / (1 + np.exp(-rng.normal(size=(Hv, T))))).astype(np.float32)).T
    return q, k, v, g, beta


def start_state(cp, delta, rng, Hv, Dk, Dv, random):
    if not random:
        return delta.delta_state(Hv, Dk, Dv)
    return delta.DeltaState(cp.asarray(rng.normal(size=(Hv, Dk, Dv)).astype(np.float32) * 0.5))


def check(cp, mods, T, Hk, Hv, Dk, Dv, random):
    delta, gdn_prefill = mods
    rng = np.random.default_rng(zlib.crc32(repr((T, Hk, Hv, Dk, Dv, random)).encode()))
    ref = start_state(cp, delta, rng, Hv, Dk, Dv, random)
    mine = delta.DeltaState(ref.s.copy())
    args = gdn_inputs(cp, rng, T, Hk, Hv, Dk, Dv)
    got = gdn_prefill.gated_delta_chunked(*args, mine)
    want = delta.gated_delta_rule(*args, ref)
    close(got, want)
    close(mine.s, ref.s)


@pytest.mark.gpu
@pytest.mark.parametrize("random", [False, True], ids=["zero-state", "random-state"])
@pytest.mark.parametrize("Hk,Hv,Dk,Dv", [(2, 4, 128, 128), (2, 2, 64, 32), (1, 3, 40, 16)])
@pytest.mark.parametrize("T", [1, 5, 64, 65, 200, 513])
def test_gated_delta_chunked_against_the_cupy_op(cp, mods, T, Hk, Hv, Dk, Dv, random):
    check(cp, mods, T, Hk, Hv, Dk, Dv, random)


@pytest.mark.gpu
@pytest.mark.parametrize("random", [False, True], ids=["zero-state", "random-state"])
def test_gated_delta_chunked_at_the_production_shape(cp, mods, random):
    """Qwen3.5-9B linear attention: 16 k heads, 32 v heads, head dims 128."""
    check(cp, mods, 300, 16, 32, 128, 128, random)


@pytest.mark.gpu
@pytest.mark.parametrize("Hk,Hv,Dk,Dv", [(1, 2, 16, 32), (2, 2, 32, 40), (1, 1, 256, 256), (1, 1, 24, 200)])
def test_gated_delta_chunked_other_head_dims(cp, mods, Hk, Hv, Dk, Dv):
    _, gdn_prefill = mods
    need = max(gdn_prefill.prep_smem(Dk), gdn_prefill.scan_smem(Dk))
    if need > gdn_prefill._smem_limit():
        pytest.skip(f"Dk {Dk} needs {need} bytes of shared memory per block: more than this device has")
    check(cp, mods, 130, Hk, Hv, Dk, Dv, True)


@pytest.mark.gpu
def test_two_calls_equal_one(cp, mods):
    """T = 100 then T = 37 from the state the first left, against one call of T = 137 (and the CuPy op)."""
    delta, gdn_prefill = mods
    Hk, Hv, Dk, Dv, T = 2, 4, 64, 64, 137
    rng = np.random.default_rng(137)
    start = start_state(cp, delta, rng, Hv, Dk, Dv, True)
    args = gdn_inputs(cp, rng, T, Hk, Hv, Dk, Dv)
    one, two, ref = (delta.DeltaState(start.s.copy()) for _ in range(3))
    whole = gdn_prefill.gated_delta_chunked(*args, one)
    first = gdn_prefill.gated_delta_chunked(*(a[:100] for a in args), two)
    second = gdn_prefill.gated_delta_chunked(*(a[100:] for a in args), two)
    close(cp.concatenate([first, second]), whole)
    close(two.s, one.s)
    close(whole, delta.gated_delta_rule(*args, ref))
    close(one.s, ref.s)


@pytest.mark.gpu
def test_long_input_runs_in_segments(cp, mods):
    """More tokens than one pair of launches takes (gdn_prefill.SEGMENT): the state carries across segments."""
    _, gdn_prefill = mods
    T = gdn_prefill.SEGMENT + 70
    check(cp, mods, T, 1, 2, 32, 32, True)


@pytest.mark.gpu
def test_gated_delta_chunked_refuses_what_it_does_not_support(cp, mods):
    delta, gdn_prefill = mods
    rng = np.random.default_rng(0)
    with pytest.raises(ValueError, match="head dims"):
        gdn_prefill.gated_delta_chunked(*gdn_inputs(cp, rng, 4, 1, 1, 264, 8), delta.delta_state(1, 264, 8))
    with pytest.raises(ValueError, match="head dims"):
        gdn_prefill.gated_delta_chunked(*gdn_inputs(cp, rng, 4, 1, 1, 8, 300), delta.delta_state(1, 8, 300))
    with pytest.raises(ValueError, match="multiple"):
        gdn_prefill.gated_delta_chunked(*gdn_inputs(cp, rng, 4, 2, 3, 8, 8), delta.delta_state(3, 8, 8))
    with pytest.raises(ValueError, match="C-contiguous"):
        s = cp.zeros((2, 16, 8), cp.float32).transpose(0, 2, 1)  # (2, 8, 16) non-contiguous
        gdn_prefill.gated_delta_chunked(*gdn_inputs(cp, rng, 4, 1, 2, 8, 16), delta.DeltaState(s))
