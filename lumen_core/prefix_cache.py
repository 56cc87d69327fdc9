"""The prefix cache: a new prompt that starts with the tokens of an earlier one resumes from that one's saved state
instead of prefilling them again (a chat's next turn, a tool loop, a shared system prompt).

What is saved is a snapshot of a whole cache at one position ``n``: every attention layer's K/V rows ``[0, n)``,
a sliding layer's ring as it stands, and every Gated-DeltaNet layer's conv and recurrent state. A recurrent state
exists only at the position where it was taken (it cannot be cut back), and a sliding window's ring neither, so
a prompt resumes only from a snapshot position, the longest one that is a prefix of it (and shorter than it: the
last prompt token is always computed, it gives the first logits). Snapshots are taken

* where a prompt's prefill ends, and where a generation ends (its prompt and reply as the cache holds them: the
  next turn of a chat starts with exactly those tokens, then the new message);
* where a chat's conversation so far ends (``Engine.chat`` passes it): the next turn starts with it even where
  the template renders the reply differently (Qwen 3.5 drops the reasoning of earlier turns);
* at a shared point: when a prompt shares a longer prefix with an earlier prompt than any snapshot covers (two
  requests with one system prompt and different questions), its prefill stops at the end of the shared part and
  saves a snapshot there, so the third and later such requests resume from it.

Snapshots live in host RAM (``kv-cache.prefix-cache-mb``, counted by the plan), least recently used out. The K/V
rows of full-context caches are kept in blocks of ``block`` tokens (256), keyed by a hash chained over every
token up to the block's end, and shared: the snapshots of a chat's turns, or of a prompt and its reply, hold their
common blocks once. A snapshot's own bytes are its partial last block, its sliding rings and its recurrent states.
A restored cache holds bit for bit what the earlier request's forwards wrote. Those ran the same tokens in other
pieces (its prompt, then its reply token by token) than one prefill of the new prompt would, so with the cache the
values can differ from a full prefill in the last bits of f32 (the Gated-DeltaNet chunked scan and the GEMMs sum
in another order): the tests compare tokens, which agree.

A cache state is read generically: a layer's state is a dataclass of arrays (or a tuple of them); a full-context
K/V cache (``capacity`` equal to the cache's) is saved up to ``n``, anything else whole; CuPy arrays are copied to
the host and back in place (a captured decode graph keeps reading the same device memory).
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import threading
from dataclasses import dataclass

import numpy as np

MIN_SHARED = 16  # tokens a shared prefix must exceed the best snapshot by, to be worth a snapshot of its own
BLOCK = 256  # tokens per shared K/V block


def _to_host(a) -> np.ndarray:
    return np.array(a, copy=True) if isinstance(a, np.ndarray) else a.get()


def _write(dst, at: int | None, src: np.ndarray) -> None:
    """``dst[:, at:at + rows] = src`` (``at`` None: ``dst[...] = src``), in place, on dst's own device."""
    if at is not None and not src.shape[1]:
        return
    if not isinstance(dst, np.ndarray):
        import cupy

        with dst.device:
            src = cupy.asarray(src)
            if at is None:
                dst[...] = src
            else:
                dst[:, at:at + src.shape[1]] = src
        return
    if at is None:
        dst[...] = src
    else:
        dst[:, at:at + src.shape[1]] = src


@dataclass
class Snapshot:
    tokens: tuple
    layers: list  # per layer: the saved state (shared layers: the same object), see PrefixCache._save
    rope_offset: int
    nbytes: int  # its own arrays (partial last block, rings, recurrent states), not the shared blocks
    keys: list  # the shared K/V blocks of its full-context caches, in order

    @property
    def n(self) -> int:
        return len(self.tokens)


@dataclass
class Block:
    arrays: dict  # field path -> one block's rows, (heads, block, dim), on the host
    nbytes: int
    refs: int = 0  # snapshots holding it


def block_keys(tokens: tuple, block: int) -> list[bytes]:
    """One key per whole block of ``tokens``, chained: a block's key names every token up to its end."""
    keys, h = [], b""
    for k in range(len(tokens) // block):
        chunk = np.asarray(tokens[k * block:(k + 1) * block], np.int64).tobytes()
        h = hashlib.blake2b(h + chunk, digest_size=16).digest()
        keys.append(h)
    return keys


def save_points(restored: int, length: int, *points) -> list[int]:
    """The positions a prefill stops at to save a snapshot: each of ``points`` (None/0: none) strictly between the
    restored prefix and the prompt's end, in order."""
    return sorted({p for p in points if p and restored < p < length})


def _nbytes(saved, seen: set) -> int:
    if id(saved) in seen:
        return 0
    seen.add(id(saved))
    if isinstance(saved, tuple):
        return sum(_nbytes(s, seen) for s in saved)
    return sum(array.nbytes for _, array in saved.values())


class PrefixCache:
    """Snapshots of caches keyed by the tokens they hold, within ``budget`` bytes of host RAM (LRU), their K/V
    rows in shared blocks of ``block`` tokens."""

    def __init__(self, budget: int, block: int = BLOCK):
        self.budget, self.block = int(budget), int(block)
        self._snaps: collections.OrderedDict[tuple, Snapshot] = collections.OrderedDict()
        self._blocks: dict[bytes, Block] = {}
        self._lock = threading.Lock()  # generations on several threads (the solo path) look up and store
        self.bytes = 0
        self.lookups = 0
        self.hits = 0
        self.hit_tokens = 0
        self.stored = 0
        self.evicted = 0

    def __len__(self) -> int:
        return len(self._snaps)

    @property
    def blocks(self) -> int:
        return len(self._blocks)

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
        with self._lock:  # its blocks, taken now, stay valid even if it is evicted while being written
            blocks = [self._blocks[key] for key in snap.keys]
        memo: set = set()
        for state, saved in zip(cache.layers, snap.layers, strict=True):
            self._restore(state, saved, blocks, memo)
        cache.pos = snap.n
        if hasattr(cache, "rope_offset"):
            cache.rope_offset = snap.rope_offset
        return snap.n

    def _restore(self, state, saved, blocks, memo: set) -> None:
        if id(state) in memo:
            return
        memo.add(id(state))
        if isinstance(state, (tuple, list)):
            for s, v in zip(state, saved, strict=True):
                self._restore(s, v, blocks, memo)
            return
        for name, (path, array) in saved.items():
            dst = getattr(state, name)
            if path is None:  # saved whole
                _write(dst, None, array)
                continue
            for k, block in enumerate(blocks):
                _write(dst, k * self.block, block.arrays[path])
            _write(dst, len(blocks) * self.block, array)  # the partial last block
        if hasattr(state, "recent"):
            state.recent = None  # what the last call attended over: the next call sets it before anyone reads it

    def store(self, tokens, cache) -> None:
        """Save ``cache``, which holds exactly ``tokens`` (``cache.pos == len(tokens)``)."""
        tokens = tuple(tokens)
        if not tokens or len(tokens) != cache.pos:
            return
        keys = block_keys(tokens, self.block)
        with self._lock:
            if tokens in self._snaps:
                self._snaps.move_to_end(tokens)
                return
            fresh: dict[bytes, dict] = {}  # the blocks this snapshot adds: key -> {field path: rows}
            memo: dict = {}
            layers = [self._save(state, (i,), cache.capacity, len(tokens), keys, fresh, memo)
                      for i, state in enumerate(cache.layers)]
            own = _nbytes(tuple(layers), set())
            added = {key: sum(a.nbytes for a in arrays.values()) for key, arrays in fresh.items()}
            if own + sum(added.values()) > self.budget:
                return
            for key in keys:
                block = self._blocks.get(key)
                if block is None:
                    block = self._blocks[key] = Block(fresh.get(key, {}), added.get(key, 0))
                    self.bytes += block.nbytes
                block.refs += 1
            self._snaps[tokens] = Snapshot(tokens, layers, getattr(cache, "rope_offset", 0), own, keys)
            self.bytes += own
            self.stored += 1
            while self.bytes > self.budget and len(self._snaps) > 1:
                self._evict()

    def _evict(self) -> None:
        _, old = self._snaps.popitem(last=False)
        self.bytes -= old.nbytes
        for key in old.keys:
            block = self._blocks[key]
            block.refs -= 1
            if block.refs == 0:
                del self._blocks[key]
                self.bytes -= block.nbytes
        self.evicted += 1

    def _save(self, state, path: tuple, capacity: int, n: int, keys: list, fresh: dict, memo: dict):
        """The host copy of one layer's state at ``n`` tokens: per array field (None, the whole array), or for a
        full-context K/V cache (``capacity`` equal to the cache's) (its path, the rows past the last whole block),
        its whole blocks going to ``fresh`` unless already held."""
        if id(state) in memo:
            return memo[id(state)]
        if isinstance(state, (tuple, list)):
            out = tuple(self._save(s, path + (j,), capacity, n, keys, fresh, memo) for j, s in enumerate(state))
        elif dataclasses.is_dataclass(state):
            full = getattr(state, "capacity", None) == capacity  # only [0, n) is written
            out = {}
            for f in dataclasses.fields(state):
                value = getattr(state, f.name)
                if not (hasattr(value, "shape") and hasattr(value, "dtype")):
                    continue
                if not full:
                    out[f.name] = (None, _to_host(value))
                    continue
                where = path + (f.name,)
                for k, key in enumerate(keys):
                    if key not in self._blocks:
                        fresh.setdefault(key, {})[where] = _to_host(value[:, k * self.block:(k + 1) * self.block])
                out[f.name] = (where, _to_host(value[:, len(keys) * self.block:n]))
        else:
            raise TypeError(f"the prefix cache cannot save a cache state of type {type(state).__name__}")
        memo[id(state)] = out
        return out

    def metric_lines(self) -> list[str]:
        rate = self.hits / self.lookups if self.lookups else 0.0
        return ["# HELP lumen_prefix_cache_lookups_total Prompts looked up in the prefix cache.",
                "# TYPE lumen_prefix_cache_lookups_total counter", f"lumen_prefix_cache_lookups_total {self.lookups}",
                "# HELP lumen_prefix_cache_hits_total Prompts that resumed from a snapshot.",
                "# TYPE lumen_prefix_cache_hits_total counter", f"lumen_prefix_cache_hits_total {self.hits}",
                "# HELP lumen_prefix_cache_hit_rate Hits / lookups so far.",
                "# TYPE lumen_prefix_cache_hit_rate gauge", f"lumen_prefix_cache_hit_rate {rate:.6f}",
                "# HELP lumen_prefix_cache_bytes Host RAM the snapshots and their blocks hold.",
                "# TYPE lumen_prefix_cache_bytes gauge", f"lumen_prefix_cache_bytes {self.bytes}",
                "# HELP lumen_prefix_cache_snapshots Snapshots held.",
                "# TYPE lumen_prefix_cache_snapshots gauge", f"lumen_prefix_cache_snapshots {len(self._snaps)}",
                "# HELP lumen_prefix_cache_blocks Shared K/V blocks held.",
                "# TYPE lumen_prefix_cache_blocks gauge", f"lumen_prefix_cache_blocks {len(self._blocks)}"]


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
