"""Token sampling: small pure numpy functions on 1-D logits, chained by `make_sampler`.

Order (as `transformers.generate` runs them): repetition penalty on the raw logits, then temperature,
then top-k, top-p, min-p (HF's order for top-k/top-p; min-p last so its threshold is relative to the
top token after the other filters), then a float64 softmax and one draw from a seeded PCG64 stream.
Filters mask to -inf and never remove the most likely token.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import numpy as np

from lumen_core.errors import InputError

Sampler = Callable[[np.ndarray, Iterable[int]], int]


# Bounds that keep every step of the float64 chain finite for any finite float32 logits (|x| < 3.5e38): a
# temperature >= MIN_TEMPERATURE and a repetition penalty within [1/MAX_PENALTY, MAX_PENALTY] scale a logit by at
# most 1e10, so no logit overflows to inf and no softmax sees inf - inf (the CUDA sampler runs the same float64
# chain). Below MIN_TEMPERATURE sampling is argmax in all but name: send 0 for greedy.
MIN_TEMPERATURE = 1e-5
MAX_PENALTY = 1e5


class SamplingError(InputError):
    """A sampling value out of range; ``field`` names the option (its Python/API name, e.g. ``top_k``)."""

    def __init__(self, field: str, value, allowed: str):
        self.field = field
        super().__init__(f"{field} must be {allowed}, got {_show(value)}")


@dataclass
class SamplingParams:
    temperature: float = 1.0  # 0 = greedy (argmax)
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    min_p: float = 0.0  # 0 = off
    seed: int | None = None  # None = fresh entropy
    repetition_penalty: float = 1.0  # 1 = off

    def validate(self) -> SamplingParams:
        """Raise SamplingError (an InputError) naming the first bad field, its allowed range and the value given;
        return self. Every value it accepts samples without overflow (see MIN_TEMPERATURE)."""
        t, k, p, m, r, seed = (self.temperature, self.top_k, self.top_p, self.min_p, self.repetition_penalty,
                               self.seed)
        _check(_is_finite(t) and (t == 0 or t >= MIN_TEMPERATURE), "temperature", t,
               f"0 (greedy) or a finite number >= {MIN_TEMPERATURE:g}")
        _check(_is_int(k) and k >= 0, "top_k", k, "an integer >= 0 (0 means off)")
        _check(_is_finite(p) and 0 < p <= 1, "top_p", p, "a number in (0, 1] (1 means off)")
        _check(_is_finite(m) and 0 <= m <= 1, "min_p", m, "a number in [0, 1] (0 means off)")
        _check(_is_finite(r) and 1 / MAX_PENALTY <= r <= MAX_PENALTY, "repetition_penalty", r,
               f"a number in [{1 / MAX_PENALTY:g}, {MAX_PENALTY:g}] (1 means off)")
        _check(seed is None or (_is_int(seed) and seed >= 0), "seed", seed,
               "an integer >= 0 (left out: a random seed)")
        return self


def _is_int(value) -> bool:
    return isinstance(value, int | np.integer) and not isinstance(value, bool)


def _is_finite(value) -> bool:
    # The type first, so a string fails with our message, not a TypeError from a comparison; NaN, inf and an int
    # past the float range (which numpy cannot divide by) fail.
    if not isinstance(value, int | float | np.integer | np.floating) or isinstance(value, bool):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


def _show(value) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _check(ok: bool, field: str, value, allowed: str) -> None:
    if not ok:
        raise SamplingError(field, value, allowed)


# --- filters: each returns new float64 logits with removed tokens at -inf ------------------------------


def apply_top_k(logits: np.ndarray, k: int) -> np.ndarray:
    """Keep the k largest logits (ties with the k-th are kept, as HF does). k <= 0 disables."""
    logits = np.asarray(logits, dtype=np.float64)
    if k <= 0 or k >= logits.size:
        return logits.copy()
    kth = np.partition(logits, -k)[-k]
    return np.where(logits < kth, -np.inf, logits)


def apply_top_p(logits: np.ndarray, p: float) -> np.ndarray:
    """Keep the smallest set of most likely tokens whose probability sums to >= p (at least one)."""
    logits = np.asarray(logits, dtype=np.float64)
    if p >= 1.0:
        return logits.copy()
    order = np.argsort(-logits, kind="stable")
    probs = softmax(logits)[order]
    mass_before = np.cumsum(probs) - probs
    drop = order[mass_before >= p]
    out = logits.copy()
    out[drop] = -np.inf
    return out


def apply_min_p(logits: np.ndarray, p: float) -> np.ndarray:
    """Keep tokens whose probability is >= p times the top token's probability."""
    logits = np.asarray(logits, dtype=np.float64)
    if p <= 0.0:
        return logits.copy()
    probs = softmax(logits)
    return np.where(probs < p * probs.max(), -np.inf, logits)


def apply_repetition_penalty(logits: np.ndarray, previous_ids: Iterable[int], penalty: float) -> np.ndarray:
    """HF (CTRL) semantics: for each seen token, positive logits are divided, negative multiplied."""
    logits = np.asarray(logits, dtype=np.float64).copy()
    ids = np.unique(np.fromiter(previous_ids, dtype=np.int64))
    if penalty == 1.0 or ids.size == 0:
        return logits
    seen = logits[ids]
    logits[ids] = np.where(seen < 0, seen * penalty, seen / penalty)
    return logits


def softmax(logits: np.ndarray) -> np.ndarray:
    """Float64 softmax; -inf entries get probability 0."""
    x = np.asarray(logits, dtype=np.float64)
    e = np.exp(x - x.max())
    return e / e.sum()


# --- the chain -----------------------------------------------------------------------------------------


def make_sampler(params: SamplingParams) -> Sampler:
    """A `sampler(logits_1d, previous_ids) -> token id`; one RNG per sampler, so a seed replays exactly."""
    params.validate()
    rng = np.random.Generator(np.random.PCG64(params.seed))

    def sample(logits: np.ndarray, previous_ids: Iterable[int] = ()) -> int:
        logits = apply_repetition_penalty(logits, previous_ids, params.repetition_penalty)
        if params.temperature == 0:
            return int(np.argmax(logits))  # numpy returns the lowest index on ties
        logits = filtered_logits(logits / params.temperature, params)
        return draw(softmax(logits), rng)

    return sample


def filtered_logits(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """Temperature-scaled logits through top-k, top-p, min-p, in that order."""
    logits = apply_top_k(logits, params.top_k)
    logits = apply_top_p(logits, params.top_p)
    return apply_min_p(logits, params.min_p)


def draw(probs: np.ndarray, rng: np.random.Generator) -> int:
    """Inverse-CDF draw over the kept tokens: one uniform number per token, never a masked id."""
    kept = np.flatnonzero(probs > 0)
    cdf = np.cumsum(probs[kept])
    j = int(np.searchsorted(cdf, rng.random() * cdf[-1], side="right"))
    return int(kept[min(j, kept.size - 1)])
