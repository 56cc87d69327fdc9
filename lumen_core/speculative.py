"""Speculative decoding: a drafter proposes ``k`` tokens, the main model scores them all in one forward over the
``k + 1`` positions (reading its weights once for up to ``k + 1`` tokens), and the longest prefix the main model
agrees with is kept. Lossless: greedy output equals plain greedy decoding token for token, and sampled output
follows the standard rejection rule (Leviathan et al. 2023, Chen et al. 2023), whose output distribution is
plain sampling's.

Drafters (``Drafter``): a smaller model of the same tokenizer (``DraftModel``, the ``draft`` block) or the main
model's own multi-token-prediction head (``MTPDrafter``, Qwen 3.5's ``mtp.*``).

Falling back (``Fallback``): speculation does not always pay (an MoE verify reads the experts of every token; a
draft that is rarely right costs its steps for nothing). The engine times each round and, unless the draft block
says ``fallback: false``, runs plain rounds (the main model alone, one token; the drafter told with ``skip``)
while they are faster; docs/speculative.md explains the policy.

Rolling a cache back (``Checkpoint``): after a verify that fed ``k + 1`` tokens and kept ``keep`` of them, a cache
must hold exactly its first ``pos + keep`` tokens again.

* A full-context K/V cache needs nothing: rows past ``pos`` are rewritten before anything reads them.
* A sliding-window ring loses the rows the rejected tokens overwrote: they are copied before the forward (``k + 1``
  rows per ring) and written back.
* A recurrent state (Gated-DeltaNet's conv and delta states) cannot be cut back. A model that sets
  ``records_states`` keeps its state after each token of a forward run under ``recording()`` (``kept``): the
  rewind copies back the state after the last kept token. A model that does not is rolled back by a snapshot of
  its states taken before the forward and a re-run of the kept tokens (a second forward: correct, slower); the
  docs compare the two.

States are read generically (as ``lumen_core.prefix_cache`` does): a layer's state is a dataclass of arrays (numpy
or CuPy: anything with ``copy()`` and item assignment) or a tuple/list of them; a K/V cache is one with ``k``, ``v``
and ``capacity``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass

import numpy as np

from .sampling import SamplingParams, apply_repetition_penalty, draw, filtered_logits, softmax

_TRAIL: ContextVar[dict | None] = ContextVar("lumen_speculative_trail", default=None)


# -- per-token states of a forward ---------------------------------------------------------------------------------
@contextmanager
def recording():
    """Within the block, recurrent layers of a ``records_states`` model keep their state after each token
    (``kept``) in the yielded dict: ``id(state object) -> [copies, one per token]``. Per thread (a ContextVar)."""
    trail: dict = {}
    token = _TRAIL.set(trail)
    try:
        yield trail
    finally:
        _TRAIL.reset(token)


def trail() -> dict | None:
    """The recording in progress on this thread, or None (a model then runs its usual multi-token path)."""
    return _TRAIL.get()


def kept(trail: dict, state, result):
    """Record a copy of ``state``'s arrays (after the token just computed) and return ``result`` unchanged."""
    trail.setdefault(id(state), []).append(state_copy(state))
    return result


def keep_all(trail: dict, state, copies: list) -> None:
    """Record ``copies`` (one list of ``state``'s arrays per token, as the ``*_kept`` ops return them)."""
    trail.setdefault(id(state), []).extend(copies)


def state_copy(state) -> list:
    """Copies of a state's arrays, in the order ``rewind`` restores them."""
    return [a.copy() for _, _, a in _arrays(state)]


def _arrays(obj) -> Iterator[tuple]:
    """(holder, key, array) of every array in a state: a dataclass's fields, a tuple's or list's items."""
    if isinstance(obj, (tuple, list)):
        for o in obj:
            yield from _arrays(o)
    elif dataclasses.is_dataclass(obj):
        for f in dataclasses.fields(obj):
            value = getattr(obj, f.name)
            if _is_array(value):
                yield obj, f.name, value
            elif dataclasses.is_dataclass(value) or isinstance(value, (tuple, list)):
                yield from _arrays(value)


def _is_array(value) -> bool:
    return hasattr(value, "shape") and hasattr(value, "copy") and hasattr(value, "__setitem__")


def _restore(obj, copies) -> None:
    for (_, _, dst), src in zip(_arrays(obj), copies, strict=True):
        dst[...] = src


def _leaves(cache) -> Iterator:
    """Each state object of ``cache`` once, in layer order: its K/V caches (full or rings) and its recurrent states
    (dataclasses holding arrays, e.g. Gated-DeltaNet's conv and delta states, inside tuples or lists)."""
    seen: set[int] = set()

    def walk(obj):
        if obj is None or id(obj) in seen:
            return
        seen.add(id(obj))
        if _is_kv(obj):
            yield obj
        elif isinstance(obj, (tuple, list)):
            for o in obj:
                yield from walk(o)
        elif any(True for _ in _arrays(obj)):
            yield obj

    for state in cache.layers:
        yield from walk(state)


def record_states(trail: dict, cache) -> None:
    """Record every recurrent state of ``cache`` as it stands (``kept``): for steps that ran without recording
    (a replayed CUDA graph of a one-token step)."""
    for obj in _leaves(cache):
        if not _is_kv(obj):
            kept(trail, obj, None)


def _is_kv(obj) -> bool:
    return all(hasattr(obj, n) for n in ("k", "v", "capacity")) and _is_array(obj.k)


# -- rewinding a cache ---------------------------------------------------------------------------------------------
class Checkpoint:
    """What a forward of ``T`` tokens from ``cache.pos`` overwrites that a position reset cannot undo; ``rewind``
    makes the cache hold its first ``pos + keep`` tokens again. ``records``: the model keeps per-token recurrent
    states under ``recording()`` (else recurrent states are snapshotted here and ``rewind`` asks for a re-run)."""

    def __init__(self, cache, T: int, records: bool):
        self.cache, self.pos, self.T = cache, cache.pos, T
        self.rings: list[tuple] = []  # (ring, slots of positions pos.., saved k rows, saved v rows)
        self.states: list[tuple] = []  # (recurrent state object, its arrays' copies or None when recorded)
        for obj in _leaves(cache):
            if not _is_kv(obj):
                self.states.append((obj, None if records else state_copy(obj)))
            elif obj.capacity < cache.capacity:  # a ring: position p lives in slot p % capacity
                slots = [(self.pos + t) % obj.capacity for t in range(T)]
                self.rings.append((obj, slots, obj.k[:, slots].copy(), obj.v[:, slots].copy()))

    def rewind(self, keep: int, trail: dict | None = None) -> int:
        """Keep the first ``keep`` (>= 1) tokens of the forward. Returns how many tokens the caller must run again
        from ``cache.pos`` (0, or ``keep`` when recurrent states came back from a snapshot)."""
        if not 1 <= keep <= self.T:
            raise ValueError(f"keep must be in 1..{self.T}, got {keep}")
        rerun = any(saved is not None for _, saved in self.states) and keep < self.T
        first = self.pos if rerun else self.pos + keep  # ring rows of positions >= first come back
        for ring, slots, k_rows, v_rows in self.rings:
            for t in reversed(range(self.T)):
                if self.pos + t >= first:
                    ring.k[:, slots[t]] = k_rows[:, t]
                    ring.v[:, slots[t]] = v_rows[:, t]
        for obj, saved in self.states:
            if saved is not None:
                if rerun:
                    _restore(obj, saved)
            elif keep < self.T:
                copies = (trail or {}).get(id(obj))
                if copies is None or len(copies) < keep:
                    raise RuntimeError(f"no per-token state was recorded for a {type(obj).__name__} (run the "
                                       "forward under speculative.recording())")
                _restore(obj, copies[keep - 1])
        self.cache.pos = first
        return keep if rerun else 0


# -- the acceptance rules ------------------------------------------------------------------------------------------
def target_probs(row: np.ndarray, params: SamplingParams, seen) -> np.ndarray:
    """The distribution plain sampling draws from for this row of logits (float64): repetition penalty, temperature,
    top-k/top-p/min-p, softmax — ``lumen_core.sampling.make_sampler``'s chain without the draw."""
    logits = apply_repetition_penalty(row, seen, params.repetition_penalty)
    return softmax(filtered_logits(logits / params.temperature, params))


def greedy_token(row: np.ndarray, params: SamplingParams, seen) -> int:
    """The token plain greedy decoding picks from this row (argmax after the repetition penalty)."""
    return int(np.argmax(apply_repetition_penalty(row, seen, params.repetition_penalty)))


def accept_greedy(targets: list[int], drafts: list[int]) -> int:
    """How many drafts agree with the main model's greedy choices ``targets`` (``len(drafts) + 1`` of them)."""
    a = 0
    while a < len(drafts) and drafts[a] == targets[a]:
        a += 1
    return a


def accept_sampled(p_rows, q_rows, drafts: list[int], rng: np.random.Generator) -> tuple[int, int]:
    """The rejection rule: draft ``i`` (drawn from ``q_rows[i]``) is kept with probability
    ``min(1, p_i(d) / q_i(d))``; at the first rejection the next token is drawn from ``max(p_i - q_i, 0)``
    renormalised, and when every draft is kept, from ``p_k``. ``p_rows``: a callable ``i -> p_i`` (the target's
    distribution at row ``i``, computed lazily: it may depend on the drafts before it). Returns (kept, next token)."""
    for i, d in enumerate(drafts):
        p, q = p_rows(i), q_rows[i]
        if q[d] > 0 and rng.random() * q[d] < p[d]:  # u < p/q without dividing
            continue
        residual = np.maximum(p - q, 0.0)
        total = residual.sum()
        # p == q (up to rounding) leaves nothing: any draw from p is then as right as from the residual
        return i, draw(residual / total if total > 0 else p, rng)
    return len(drafts), draw(p_rows(len(drafts)), rng)


# -- statistics ----------------------------------------------------------------------------------------------------
@dataclass
class SpecStats:
    verifies: int = 0  # main-model forwards over drafted tokens
    drafted: int = 0
    accepted: int = 0
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    plain_rounds: int = 0  # tokens decoded without drafts because plain decoding was faster (Fallback, probes too)

    @property
    def acceptance(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tokens_per_verify(self) -> float:
        """Tokens each verify produced: the kept drafts and the main model's own next token."""
        return (self.accepted + self.verifies) / self.verifies if self.verifies else 0.0

    def summary(self) -> str:
        return (f"speculative: {self.verifies} verify steps, {self.drafted} drafted, acceptance "
                f"{100 * self.acceptance:.1f}%, {self.tokens_per_verify:.2f} tokens per verify, "
                f"{self.plain_rounds} tokens decoded plainly (fallback)")


# -- falling back to plain decoding ---------------------------------------------------------------------------------
@dataclass
class Pace:
    """Seconds per emitted token of one kind of round, as decayed sums: a new round weighs 1, the one before
    ``decay``, the one before that ``decay**2``...; the ratio is the time per token over the last few rounds (a
    round that emitted 5 tokens counts 5 times as much as one that emitted 1, as a total time per total tokens)."""

    seconds: float = 0.0
    tokens: float = 0.0
    rounds: int = 0

    def add(self, seconds: float, tokens: int, decay: float) -> None:
        self.seconds = self.seconds * decay + seconds
        self.tokens = self.tokens * decay + tokens
        self.rounds += 1

    @property
    def per_token(self) -> float | None:
        """Seconds per emitted token; None before the first round."""
        return self.seconds / self.tokens if self.rounds else None


class Fallback:
    """Chooses, round by round, between a speculative round (drafts and a verify) and a plain one (the main model
    alone, one token), by which emitted tokens faster lately (docs/speculative.md §Falling back).

    It runs one kind (``drafting``: speculative at first, or what the memory of earlier generations found faster)
    and probes the other every ``interval`` emitted tokens for ``PROBE_ROUNDS`` timed rounds; after a probe it
    switches if the other kind was more than ``MARGIN`` faster per token (hysteresis: noise does not make it flap).
    A probe that confirms the kind doubles the interval (up to ``MAX_INTERVAL``: a settled choice costs little
    probing); a switch starts it again at ``FIRST_PROBE``. The first speculative round of each stretch is not timed:
    it also feeds the drafter what it skipped (a draft model's prompt, the tokens of the plain rounds before), in
    one batched forward, which plain rounds put off rather than cost. ``memory``: a dict kept by the caller across
    generations (the paces and the interval), so a generation starts from what the last one found.
    ``enabled`` False: always speculative, nothing measured."""

    PROBE_ROUNDS = 4
    FIRST_PROBE = 16  # emitted tokens before the first probe
    MAX_INTERVAL = 512
    MARGIN = 0.1
    DECAY = 0.8

    def __init__(self, memory: dict | None = None, enabled: bool = True):
        self.enabled = enabled
        self.memory = memory if memory is not None else {}
        self.paces = self.memory.setdefault("paces", {True: Pace(), False: Pace()})
        self.interval = self.memory.setdefault("interval", self.FIRST_PROBE)
        spec, plain = self.paces[True].per_token, self.paces[False].per_token
        self.drafting = spec is None or plain is None or spec <= plain
        self.probing = 0  # timed rounds of the other kind left in the probe under way
        self.since = 0  # tokens emitted since the last probe (or the start)
        self.previous: bool | None = None  # the kind of the last round

    def speculate(self) -> bool:
        """Whether the next round drafts."""
        return not self.enabled or self.drafting != (self.probing > 0)

    def record(self, drafted: bool, tokens: int, seconds: float) -> None:
        """A round of that kind emitted ``tokens`` in ``seconds`` (wall clock, the result on the host)."""
        if not self.enabled:
            return
        timed = not drafted or self.previous is True  # a stretch's first speculative round also catches up
        self.previous = drafted
        if timed:
            self.paces[drafted].add(seconds, tokens, self.DECAY)
        if self.probing and drafted != self.drafting:  # a round of the probe
            self.probing -= timed
            if not self.probing:
                self._decide()
        else:
            self.since += tokens
            if self.since >= self.interval:
                self.probing, self.since = self.PROBE_ROUNDS, 0

    def _decide(self) -> None:
        now, other = self.paces[self.drafting].per_token, self.paces[not self.drafting].per_token
        if now is not None and other is not None and other < now * (1 - self.MARGIN):
            self.drafting, self.interval = not self.drafting, self.FIRST_PROBE
        else:
            self.interval = min(2 * self.interval, self.MAX_INTERVAL)
        self.memory["interval"] = self.interval


# -- drafters ------------------------------------------------------------------------------------------------------
class Drafter:
    """Proposes tokens for one generation. ``start`` after the main prefill; ``propose(last, k, ...)`` -> (k drafts,
    their distributions or None when greedy) given ``last``, the newest token (not yet in the main cache);
    ``accept(fed, keep, rows)`` after the verify fed ``fed`` = [last] + drafts and kept ``keep`` of them (``rows``:
    the main model's hidden rows of that forward, for drafters with ``needs_hidden``); ``skip(fed, rows)`` after a
    plain round, a forward of ``fed`` = [last] without drafts (``rows`` as for ``accept``): the drafter proposed
    nothing and must still learn the token, so that a later ``propose`` starts from the right context. ``skip`` runs
    no model: it queues what the next ``propose`` catches up on (a plain round must cost what a plain step does).
    A drafter class that does not override ``skip`` is never skipped: the engine's fallback stays off for it."""

    needs_hidden = False

    def start(self, prompt_ids: list[int], computed: int, rows) -> None:
        raise NotImplementedError

    def propose(self, last: int, k: int, params: SamplingParams, seen: list[int], rng) -> tuple[list[int], list | None]:
        raise NotImplementedError

    def accept(self, fed: list[int], keep: int, rows) -> None:
        raise NotImplementedError

    def skip(self, fed: list[int], rows) -> None:
        raise NotImplementedError


def host_rows(x) -> np.ndarray:
    """Logits on the host as f32 (a CuPy array is copied over), in their shape."""
    return np.asarray(x.get() if hasattr(x, "get") else x, dtype=np.float32)


def host_row(row) -> np.ndarray:
    """One row of logits on the host as f32, flat."""
    return host_rows(row).reshape(-1)


def _pick(row, params: SamplingParams, seen: list[int], rng) -> tuple[int, np.ndarray | None]:
    """A drafter's token from its row of logits (host or device): greedy, or a draw from the same chain plain
    sampling uses (its distribution returned for the rejection rule). Greedy without a penalty reads one integer
    back from a device row."""
    if params.temperature == 0 and params.repetition_penalty == 1.0:
        return int(row.reshape(-1).argmax()), None
    row = host_row(row)
    if params.temperature == 0:
        return greedy_token(row, params, seen), None
    q = target_probs(row, params, seen)
    return draw(q, rng), q


class DraftModel(Drafter):
    """A smaller model of the same tokenizer with its own cache. Its cache holds every token the generation kept
    except ``pending`` (tokens it has not fed yet: the prompt at first, the last draft after a verify that kept all
    of them); a proposal feeds ``last`` and then each draft but the last, one forward each, recorded so that
    ``accept`` can rewind it to the kept ones. Greedy drafting on a replayed step (a CUDA graph) chains the steps
    on the device (``_chains``)."""

    def __init__(self, model, context_size: int, runner=None):
        self.model, self.context_size, self.runner = model, context_size, runner
        self.records = getattr(model, "records_states", False) or runner is not None
        self.cache = None
        self.pending: list[int] = []
        self._checkpoint = self._trail = None
        self._fed: list[int] = []

    def start(self, prompt_ids: list[int], computed: int, rows) -> None:
        if self.runner is not None:  # the draft's replayable one-token step (a CUDA graph) and its cache
            self.runner.reset()
            self.cache = self.runner.cache
        else:
            self.cache = self.model.new_cache(self.context_size)
        self.pending = list(prompt_ids)

    def _step(self, token: int, trail: dict):
        if self.runner is None:
            return self.model.forward([token], self.cache, host=False)[-1]
        row = self.runner.step(token)
        record_states(trail, self.cache)  # the replayed step records nothing itself
        return row

    def _chains(self, params: SamplingParams) -> bool:
        """Whether greedy drafting runs as the runner's device chain (``greedy_chain``: each argmax feeds the next
        replay on the device; the host reads the k tokens once) rather than step by step with a read per token."""
        return (self.runner is not None and hasattr(self.runner, "greedy_chain") and params.temperature == 0
                and params.repetition_penalty == 1.0)

    def propose(self, last, k, params, seen, rng):
        if self.pending:  # what the generation kept that this cache has not seen
            if self.runner is not None and len(self.pending) <= 2:  # the last draft of a verify that kept them all
                for token in self.pending:
                    self.runner.step(token)
            else:  # the prompt
                self.model.forward(self.pending, self.cache)
            self.pending = []
        self._checkpoint = Checkpoint(self.cache, k, self.records)
        drafts, dists, feed = [], [], last
        with recording() as self._trail:
            if self._chains(params):  # greedy on a replayed step: the k steps back to back, one read at the end
                trail = self._trail
                drafts = self.runner.greedy_chain(k, token=last, after=lambda: record_states(trail, self.cache))
            else:
                for _ in range(k):
                    feed, q = _pick(self._step(feed, self._trail), params, seen + drafts, rng)
                    drafts.append(feed)
                    dists.append(q)
        self._fed = [last] + drafts[:-1]
        return drafts, (None if params.temperature == 0 else dists)

    def accept(self, fed, keep, rows) -> None:
        k = len(self._fed)
        if keep > k:  # every draft kept: the last one was never fed here
            self.pending = [fed[-1]]
            return
        rerun = self._checkpoint.rewind(keep, self._trail)
        if rerun:
            self.model.forward(self._fed[:rerun], self.cache)

    def skip(self, fed, rows) -> None:
        self.pending.extend(fed)  # fed at the next propose, with what else is pending, in one forward


class MTPDrafter(Drafter):
    """The main model's multi-token-prediction head (``model.mtp``: Qwen 3.5's ``mtp.*``). Its entry at a position
    combines a token with the main model's final hidden state of the position before it, so it catches up on
    what the main model kept (``pending``: those tokens and rows) in one forward, then drafts recursively on its
    own output rows; a verify's kept tokens replace its drafting steps' entries (their hidden came from the head,
    not the main model)."""

    needs_hidden = True

    def __init__(self, model, context_size: int):
        self.head, self.context_size = model.mtp, context_size
        self.cache = None
        self.ids: list[int] = []
        self.rows = None
        self.base = 0  # the head's cache position after the catch-up of the current proposal

    def start(self, prompt_ids: list[int], computed: int, rows) -> None:
        # rows: the main model's hidden rows of the prompt tokens it computed (after any restored prefix)
        self.cache = self.head.new_cache(self.context_size)
        first = len(prompt_ids) - computed
        self.ids, self.rows = list(prompt_ids[first + 1:]), rows

    def propose(self, last, k, params, seen, rng):
        logits, out = self.head.forward(self.ids + [last], self.rows, self.cache, host=False)
        self.base = self.cache.pos
        drafts, dists = [], []
        for i in range(k):
            tok, q = _pick(logits[-1], params, seen + drafts, rng)
            drafts.append(tok)
            dists.append(q)
            if i + 1 < k:
                logits, out = self.head.forward([tok], out, self.cache, host=False)
        return drafts, (None if params.temperature == 0 else dists)

    def accept(self, fed, keep, rows) -> None:
        self.cache.pos = self.base
        # a copy: rows may be a captured verify's output buffer, which a plain round's replay (skip) can overwrite
        self.ids, self.rows = list(fed[1:keep]), rows[:keep].copy()

    def skip(self, fed, rows) -> None:
        # the head has not seen fed[0] (no propose ran): it joins the catch-up with the main model's row at it, and
        # the next token pairs with the last of rows. A copy (concat makes one): rows may be a replay's buffer.
        self.ids += list(fed)
        self.rows = rows.copy() if self.rows is None or not len(self.rows) else self.head.ops.concat([self.rows, rows])
