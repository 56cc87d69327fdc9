"""Token sampling on the device: lumen_core.sampling's chain (repetition penalty, temperature, top-k, top-p,
min-p, float64 softmax, inverse-CDF draw) in CuPy float64, token for token equal to ``make_sampler`` for a seed.

The uniform number comes from the same host PCG64 stream as ``make_sampler`` (one ``rng.random()`` per sampled
token, none for greedy), so a seed replays the CPU sampler exactly. The only traffic per call: the previous ids
(uploaded once, only when the repetition penalty is on) and the final token id. Sums and scans run in another
order than numpy's, so probabilities may differ from the CPU's in the last bits; a token can differ only if
the drawn point or a top-p / min-p threshold falls within those few ulps of a boundary.
Runs eagerly (outside the CUDA graph); each step is a plain CuPy call, no hand-written kernel.
"""

from __future__ import annotations

from collections.abc import Iterable

import cupy as cp
import numpy as np

from lumen_core.sampling import SamplingParams

F64 = cp.float64


def sample_greedy(logits) -> int:
    """Argmax of 1-D device logits; the lowest index on ties (as numpy)."""
    return int(cp.argmax(logits))


class DeviceSampler:
    """``sampler(logits, previous_ids) -> token id`` for 1-D device logits; one RNG per sampler, like
    ``make_sampler``, so the same seed gives the same tokens as the CPU sampler."""

    def __init__(self, params: SamplingParams):
        self.params = params.validate()
        self._rng = np.random.Generator(np.random.PCG64(params.seed))

    def __call__(self, logits, previous_ids: Iterable[int] = ()) -> int:
        p = self.params
        logits = cp.asarray(logits)
        if logits.ndim != 1:
            raise ValueError(f"DeviceSampler takes 1-D logits (vocab,), got shape {logits.shape}")
        x = _repetition_penalty(logits, previous_ids, p.repetition_penalty)
        if p.temperature == 0:
            return sample_greedy(logits if x is None else x)
        x = (logits.astype(F64) if x is None else x) / p.temperature
        x = _top_k(x, p.top_k)
        x = _top_p(x, p.top_p)
        x = _min_p(x, p.min_p)
        return _draw(_softmax(x), self._rng.random())


# -- the steps (float64 device arrays in and out, removed tokens at -inf) ------------------------------------
def _repetition_penalty(logits, previous_ids: Iterable[int], penalty: float):
    """HF (CTRL): each seen id once, positive logits divided, negative multiplied; None when nothing applies."""
    if penalty == 1.0:
        return None
    ids = np.unique(np.fromiter(previous_ids, dtype=np.int64))
    if ids.size == 0:
        return None
    n = logits.size
    if ids[0] < -n or ids[-1] >= n:  # numpy's indexing raises here; CuPy's would wrap silently
        bad = ids[0] if ids[0] < -n else ids[-1]
        raise IndexError(f"previous id {int(bad)} is out of bounds for a vocabulary of {n}")
    idx = cp.asarray(np.unique(ids % n))  # negative ids wrap as numpy's do; the single upload
    x = logits.astype(F64)
    seen = x[idx]
    x[idx] = cp.where(seen < 0, seen * penalty, seen / penalty)
    return x


def _top_k(x, k: int):
    """Keep the k largest (ties with the k-th kept)."""
    n = x.size
    if k <= 0 or k >= n:
        return x
    kth = cp.sort(x)[n - k]  # a 0-d device array: no sync (a full sort: exact, and cheap at vocab sizes)
    return cp.where(x < kth, -cp.inf, x)


def _top_p(x, p: float):
    """Drop tokens whose probability mass before them (stable descending order) is >= p."""
    if p >= 1.0:
        return x
    order = cp.argsort(-x)  # CuPy's sort is stable, as numpy's kind="stable"
    probs = _softmax(x)[order]
    mass_before = cp.cumsum(probs) - probs
    drop = cp.empty(x.size, dtype=cp.bool_)
    drop[order] = mass_before >= p  # back to token order (a permutation: no boolean indexing, no sync)
    return cp.where(drop, -cp.inf, x)


def _min_p(x, p: float):
    """Keep tokens whose probability is >= p times the top probability."""
    if p <= 0.0:
        return x
    probs = _softmax(x)
    return cp.where(probs < p * probs.max(), -cp.inf, x)


def _softmax(x):
    e = cp.exp(x - x.max())
    return e / e.sum()


def _draw(probs, u: float) -> int:
    """lumen_core.sampling.draw on the device: cdf over the kept tokens (probability > 0) in ascending id
    order, j = searchsorted(cdf, u * cdf[-1], 'right'), the j-th kept id (clamped). The kept tokens are
    compacted by scatter (not boolean indexing) so nothing but the answer is read back."""
    n = probs.size
    keep = probs > 0
    rank = cp.cumsum(keep, dtype=cp.int64) - 1  # position among the kept tokens
    last = rank[-1:]  # (1,): the number kept - 1 (>= 0: the filters never drop the top token)
    slot = cp.where(keep, rank, n)  # every dropped token goes to the spare slot n
    kept_probs = cp.zeros(n + 1, dtype=F64)
    kept_probs[slot] = probs
    kept_ids = cp.zeros(n + 1, dtype=cp.int64)
    kept_ids[slot] = cp.arange(n, dtype=cp.int64)  # slot n gets some dropped id; never read
    cdf = cp.cumsum(kept_probs[:n])
    cdf = cp.where(cp.arange(n) <= last, cdf, cp.inf)  # past the kept tokens: never found
    j = cp.searchsorted(cdf, cdf[last] * u, side="right")
    return int(kept_ids[cp.minimum(j, last)][0])
