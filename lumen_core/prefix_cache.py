"""The prefix cache: a new prompt that starts with the tokens of an earlier one resumes from that one's saved state
instead of prefilling them again (a chat's next turn, a tool loop, a shared system prompt).

What is saved is a snapshot of a whole cache at one position ``n``: every attention layer's K/V rows ``[0, n)``,
a sliding layer's ring as it stands, and every Gated-DeltaNet layer's conv and recurrent state. A recurrent state
exists only at the position where it was taken (it cannot be cut back), and a sliding window's ring neither, so
a prompt resumes only from a snapshot position, the longest one that is a prefix of it (and shorter than it: the
last prompt token is always computed, it gives the first logits). Snapshots are taken

* where a prompt's prefill ends, and where a generation ends (its prompt and reply as the cache holds them: the
  next turn of a chat starts with exactly those tokens, then the new message);
* at a shared point: when a prompt shares a longer prefix with an earlier prompt than any snapshot covers (two
  requests with one system prompt and different questions), its prefill stops at the end of the shared part and
  saves a snapshot there, so the third and later such requests resume from it.

Snapshots live in host RAM (``kv-cache.prefix-cache-mb``, counted by the plan), least recently used out. Each holds
its own copy of the K/V rows (no block sharing between snapshots yet: a chain of turns keeps each turn's prefix
once per snapshot; the budget bounds it). Output is the same with and without the cache: a restored cache holds the
same values the prefill would have written (tests compare the tokens).

A cache state is read generically: a layer's state is a dataclass of arrays (or a tuple of them); a full-context
K/V cache (``capacity`` equal to the cache's) is saved up to ``n``, anything else whole; CuPy arrays are copied to
the host and back in place (a captured decode graph keeps reading the same device memory).
"""

from __future__ import annotations

import collections
import dataclasses
import threading
from dataclasses import dataclass

import numpy as np

MIN_SHARED = 16  # tokens a shared prefix must exceed the best snapshot by, to be worth a snapshot of its own


def _to_host(a) -> np.ndarray:
    return np.array(a, copy=True) if isinstance(a, np.ndarray) else a.get()


def _write(dst, rows: int | None, src: np.ndarray) -> None:
    """``dst[:, :rows] = src`` (``rows`` None: the whole array), in place, on dst's own device."""
    if not isinstance(dst, np.ndarray):
        import cupy

        with dst.device:
            src = cupy.asarray(src)
            if rows is None:
                dst[...] = src
            else:
                dst[:, :rows] = src
        return
    if rows is None:
        dst[...] = src
    else:
        dst[:, :rows] = src


@dataclass
class Snapshot:
    tokens: tuple
    layers: list  # per layer: the saved state (shared layers: the same object), see _save
    rope_offset: int
    nbytes: int

    @property
    def n(self) -> int:
        return len(self.tokens)


def _save(state, capacity: int, n: int, memo: dict):
    if id(state) in memo:
        return memo[id(state)]
    if isinstance(state, (tuple, list)):
        out = tuple(_save(s, capacity, n, memo) for s in state)
    elif dataclasses.is_dataclass(state):
        full = getattr(state, "capacity", None) == capacity  # a full-context K/V cache: only [0, n) is written
        out = {}
        for f in dataclasses.fields(state):
            value = getattr(state, f.name)
            if hasattr(value, "shape") and hasattr(value, "dtype"):
                out[f.name] = (n if full else None, _to_host(value[:, :n] if full else value))
    else:
        raise TypeError(f"the prefix cache cannot save a cache state of type {type(state).__name__}")
    memo[id(state)] = out
    return out


def _restore(state, saved, memo: set) -> None:
    if id(state) in memo:
        return
    memo.add(id(state))
    if isinstance(state, (tuple, list)):
        for s, v in zip(state, saved, strict=True):
            _restore(s, v, memo)
        return
    for name, (rows, array) in saved.items():
        _write(getattr(state, name), rows, array)
    if hasattr(state, "recent"):
        state.recent = None  # what the last call attended over: the next call sets it before anyone reads it


def _nbytes(saved, seen: set) -> int:
    if id(saved) in seen:
        return 0
    seen.add(id(saved))
    if isinstance(saved, tuple):
        return sum(_nbytes(s, seen) for s in saved)
    return sum(array.nbytes for _, array in saved.values())


class PrefixCache:
    """Snapshots of caches keyed by the tokens they hold, within ``budget`` bytes of host RAM (LRU)."""

    def __init__(self, budget: int):
        self.budget = int(budget)
        self._snaps: collections.OrderedDict[tuple, Snapshot] = collections.OrderedDict()
        self._lock = threading.Lock()  # generations on several threads (the solo path) look up and store
        self.bytes = 0
        self.lookups = 0
        self.hits = 0
        self.hit_tokens = 0
        self.stored = 0
        self.evicted = 0

    def __len__(self) -> int:
        return len(self._snaps)

    def lookup(self, ids: list[int]) -> tuple[Snapshot | None, int]:
        """(the longest snapshot whose tokens start ``ids`` and are fewer, or None; the longest prefix ``ids``
        shares with any snapshot's tokens, where a snapshot of its own would pay: else 0)."""
        ids = tuple(ids)
        best, shared = None, 0
        with self._lock:
            self.lookups += 1
            for tokens, snap in self._snaps.items():
                n = _common(tokens, ids)
                if n == len(tokens) and n < len(ids) and (best is None or n > best.n):
                    best = snap
                shared = max(shared, n)
            if best is not None:
                self._snaps.move_to_end(best.tokens)
                self.hits += 1
                self.hit_tokens += best.n
        have = best.n if best is not None else 0
        split = shared if MIN_SHARED < shared - have and shared < len(ids) else 0
        return best, split

    def restore(self, snap: Snapshot, cache) -> int:
        """Write ``snap`` into ``cache`` (fresh or reset, of the same model): it then holds ``snap.n`` tokens."""
        memo: set = set()
        for state, saved in zip(cache.layers, snap.layers, strict=True):
            _restore(state, saved, memo)
        cache.pos = snap.n
        if hasattr(cache, "rope_offset"):
            cache.rope_offset = snap.rope_offset
        return snap.n

    def store(self, tokens, cache) -> None:
        """Save ``cache``, which holds exactly ``tokens`` (``cache.pos == len(tokens)``)."""
        tokens = tuple(tokens)
        if not tokens or len(tokens) != cache.pos:
            return
        with self._lock:
            if tokens in self._snaps:
                self._snaps.move_to_end(tokens)
                return
        memo: dict = {}
        layers = [_save(state, cache.capacity, cache.pos, memo) for state in cache.layers]
        nbytes = _nbytes(tuple(layers), set())
        if nbytes > self.budget:
            return
        snap = Snapshot(tokens, layers, getattr(cache, "rope_offset", 0), nbytes)
        with self._lock:
            if tokens in self._snaps:
                return
            self._snaps[tokens] = snap
            self.bytes += nbytes
            self.stored += 1
            while self.bytes > self.budget:
                _, old = self._snaps.popitem(last=False)
                self.bytes -= old.nbytes
                self.evicted += 1

    def metric_lines(self) -> list[str]:
        rate = self.hits / self.lookups if self.lookups else 0.0
        return ["# HELP lumen_prefix_cache_lookups_total Prompts looked up in the prefix cache.",
                "# TYPE lumen_prefix_cache_lookups_total counter", f"lumen_prefix_cache_lookups_total {self.lookups}",
                "# HELP lumen_prefix_cache_hits_total Prompts that resumed from a snapshot.",
                "# TYPE lumen_prefix_cache_hits_total counter", f"lumen_prefix_cache_hits_total {self.hits}",
                "# HELP lumen_prefix_cache_hit_rate Hits / lookups so far.",
                "# TYPE lumen_prefix_cache_hit_rate gauge", f"lumen_prefix_cache_hit_rate {rate:.6f}",
                "# HELP lumen_prefix_cache_bytes Host RAM the snapshots hold.",
                "# TYPE lumen_prefix_cache_bytes gauge", f"lumen_prefix_cache_bytes {self.bytes}",
                "# HELP lumen_prefix_cache_snapshots Snapshots held.",
                "# TYPE lumen_prefix_cache_snapshots gauge", f"lumen_prefix_cache_snapshots {len(self._snaps)}"]


def _common(a: tuple, b: tuple) -> int:
    """Length of the common prefix of two token tuples."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo], a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid
    return lo
