"""Per-token log-probabilities: what OpenAI's ``logprobs``/``top_logprobs`` return and what scoring harnesses read.

A token's logprob is the float64 log-softmax of the model's raw logits at that step (before the sampling filters,
a grammar's mask or the repetition penalty), so a generated token scores what ``lumen perplexity`` gives the same
token after the same text. ``top``: the ``k`` most likely tokens at that step, most likely first (ties: lower id
first).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass
class TokenLogprob:
    token: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)  # (token id, logprob), most likely first


def log_softmax(row: np.ndarray) -> np.ndarray:
    """float64 log-softmax of one row of logits (-inf stays -inf)."""
    x = np.asarray(row, dtype=np.float64)
    m = x.max()
    return x - (m + np.log(np.exp(x - m).sum()))


def token_logprob(row: np.ndarray, token: int, top: int = 0) -> TokenLogprob:
    """``token``'s logprob under the logits ``row``, with the ``top`` most likely (0: none)."""
    lp = log_softmax(row)
    best: list[tuple[int, float]] = []
    if top > 0:
        k = min(top, lp.size)
        ids = np.argpartition(-lp, k - 1)[:k]
        ids = ids[np.lexsort((ids, -lp[ids]))]  # most likely first, the lower id on a tie
        best = [(int(i), float(lp[i])) for i in ids]
    return TokenLogprob(int(token), float(lp[token]), best)
