"""Continuous batching: generations join and leave one running batch between decode steps.

One thread (the batcher's) owns the model while batching runs. Each step it runs one ``Model.forward_batch`` over
every running generation's next token, plus chunks of prompts still being prefilled, ``PREFILL_CHUNK`` tokens in
all (several short prompts are admitted in one step), so a long new prompt never stalls the streams already
running; then it samples each finished row on
the host with the generation's own sampler (its parameters and seed), logprobs and grammar, and hands the token to
the generation's thread. The generations themselves stay plain iterators (``Engine.generate_tokens``): a caller's
thread blocks on its sequence's queue, so chat parsing, stop strings and the server's jobs are unchanged.

Each generation holds its own cache of the full context (``kv-cache.sequences`` of them at most, counted by the
plan), made when it is admitted and dropped when it ends; a generation that would exceed ``sequences`` waits in
arrival order. Greedy outputs equal the solo ones: every op of a batched step computes each row as a solo step
does (the token mixers per sequence, on its own state); only a GEMM's reduction order may change with the number of
rows, which f32 keeps far below a token flip and bf16 states as its tolerance.

A generation leaves the batch at the next step once it hit EOS, its ``max_tokens`` or the context, its caller
closed it (a stop string, a client gone) or its ``should_stop`` says so (the server's time limit); an error in a
step (a corrupt checkpoint's NaN logits) ends the generations of that step with the error.
"""

from __future__ import annotations

import collections
import queue
import threading
import time
from dataclasses import dataclass, field

import numpy as np

from .prefix_cache import save_points
from .sampling import SamplingParams, make_sampler

PREFILL_CHUNK = 512  # prompt tokens per step (over one or more prompts) while others decode


@dataclass
class Sequence:
    ids: list[int]
    media: list | None
    max_tokens: int
    params: SamplingParams
    logprobs: int | None
    constraint: object
    should_stop: object
    out: queue.SimpleQueue = field(default_factory=queue.SimpleQueue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    cache: object = None
    generated: int = 0
    next_input: int | None = None  # the token the next decode step feeds (None: still prefilling)
    seen: list = field(default_factory=list)
    cached: int = 0  # prompt tokens restored from the prefix cache
    save_at: int | None = None  # a prompt position to save a snapshot at (a chat's history end)
    splits: list = field(default_factory=list)  # where the prefill stops to save snapshots, in order

    def __post_init__(self):
        self.sampler = make_sampler(self.params)
        self.seen = list(self.ids)


class Batcher:
    """Runs the generations of one engine in shared steps (``Engine.start_batching``)."""

    def __init__(self, engine, sequences: int):
        self.engine, self.model, self.sequences = engine, engine.model, max(1, int(sequences))
        self._pending: collections.deque[Sequence] = collections.deque()
        self._active: list[Sequence] = []
        self._calls: collections.deque = collections.deque()  # (fn, result queue): run between steps
        self._cond = threading.Condition()
        self._closed = False
        self.steps = 0  # batched forwards run
        self.batch_sizes = 0  # sum over steps of the sequences in the step (mean batch = batch_sizes / steps)
        self._thread = threading.Thread(target=self._loop, name="lumen-batcher", daemon=True)
        self._thread.start()

    # -- the callers' side -------------------------------------------------------------------------------
    @property
    def running(self) -> int:
        return len(self._active)

    @property
    def waiting(self) -> int:
        return len(self._pending)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout=60)

    def call(self, fn):
        """Run ``fn()`` on the batcher's thread between two steps and return its result (or raise its error): work
        that needs the model alone (scoring a prompt, the vision tower)."""
        if threading.current_thread() is self._thread:
            return fn()
        box: queue.SimpleQueue = queue.SimpleQueue()
        with self._cond:
            if self._closed:
                raise RuntimeError("the batcher is closed")
            self._calls.append((fn, box))
            self._cond.notify_all()
        ok, value = box.get()
        if not ok:
            raise value
        return value

    def generate(self, ids, media, max_tokens, params, stats, logprobs=None, constraint=None, should_stop=None,
                 save_at=None):
        """The tokens of one generation (see ``Engine.generate_tokens``), filling ``stats`` as a solo run does."""
        seq = Sequence(list(ids), media, max_tokens, params, logprobs, constraint, should_stop, save_at=save_at)
        eos = self.engine._eos()
        t0 = time.perf_counter()
        t1 = None
        with self._cond:
            if self._closed:
                raise RuntimeError("the batcher is closed")
            self._pending.append(seq)
            self._cond.notify_all()
        try:
            while True:
                item = seq.out.get()
                if isinstance(item, BaseException):
                    raise item
                if item[0] == "end":
                    stats.finish_reason = item[1]
                    break
                _, tok, lp = item
                if t1 is None:
                    stats.cached_tokens = seq.cached
                    t1 = time.perf_counter()
                    stats.prefill_seconds = t1 - t0  # time to the first token, queueing in the batch included
                    stats.finish_reason = "length"
                stats.generated_tokens += 1
                if lp is not None:
                    stats.token_logprobs.append(lp)
                if tok in eos:
                    stats.finish_reason = "stop"
                    break
                yield tok
                if should_stop is not None and should_stop():  # as a solo run checks, after each token
                    stats.finish_reason = "cancelled"
                    break
        finally:
            seq.cancelled.set()  # the caller is done with it: it leaves the batch at the next step
            with self._cond:
                self._cond.notify_all()
            if t1 is not None:
                stats.decode_seconds = time.perf_counter() - t1

    # -- the batcher's thread ----------------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._closed and not self._pending and not self._active and not self._calls:
                    self._cond.wait()
                if self._closed:
                    break
                calls = list(self._calls)
                self._calls.clear()
                while self._pending and len(self._active) < self.sequences:
                    self._active.append(self._pending.popleft())
            for fn, box in calls:
                try:
                    box.put((True, fn()))
                except BaseException as exc:  # noqa: BLE001 - handed to the caller
                    box.put((False, exc))
            try:
                self._drop_finished()
                if self._active:
                    self._step()
            except BaseException as exc:  # noqa: BLE001 - a bug outside a step's own guards (a should_stop that
                self._fail(list(self._active), exc)  # raised, a cache the prefix cache cannot read): the running
                # generations get the error; the batcher lives on for the next ones
        for seq in list(self._pending) + self._active:
            seq.out.put(RuntimeError("the server is shutting down"))

    def _drop_finished(self) -> None:
        for seq in list(self._active):
            if seq.cancelled.is_set():
                self._release(seq)
            elif seq.next_input is not None and seq.should_stop is not None and seq.should_stop():
                self._end(seq, "cancelled")

    def _step(self) -> None:
        segments = [([s.next_input], s) for s in self._active if s.next_input is not None]
        prefills, budget = [], PREFILL_CHUNK  # prompt chunks of this step: PREFILL_CHUNK tokens in all
        for seq in [s for s in self._active if s.next_input is None]:
            if budget <= 0:
                break
            try:
                if seq.cache is None:
                    self._admit(seq)
                if seq.media:  # a prompt with images goes in whole, alone (the tower's embeddings replace rows)
                    logits = self.model.forward(seq.ids, seq.cache, images=seq.media)
                    self._emit(seq, np.asarray(logits[-1], dtype=np.float32))
                    budget = 0
                    continue
            except BaseException as exc:  # noqa: BLE001 - that generation's error (no memory for its cache...)
                self._fail([seq], exc)
                continue
            fed = seq.cache.pos
            limit = next((p for p in seq.splits if p > fed), len(seq.ids))
            chunk = seq.ids[fed:min(fed + budget, limit)]
            budget -= len(chunk)
            segments.append((chunk, seq))
            prefills.append(seq)
        if not segments:
            return
        self.steps += 1
        self.batch_sizes += len(segments)
        try:
            rows = self.model.forward_batch([(ids, s.cache) for ids, s in segments])
        except BaseException as exc:  # noqa: BLE001 - every generation of the step gets the error
            self._fail([s for _, s in segments], exc)
            return
        prefix = self.engine.prefix_cache
        for seq in prefills:
            if prefix is not None and (seq.cache.pos in seq.splits or seq.cache.pos == len(seq.ids)):
                prefix.store(seq.ids[:seq.cache.pos], seq.cache)  # a save point, or the whole prompt
        for (_, seq), row in zip(segments, rows, strict=True):
            if seq.next_input is None and seq.cache.pos < len(seq.ids):
                continue  # more of its prompt to go
            try:
                self._emit(seq, np.asarray(row, dtype=np.float32))
            except BaseException as exc:  # noqa: BLE001 - a bad row (NaN logits): that generation's error
                self._fail([seq], exc)

    def _admit(self, seq: Sequence) -> None:
        """Give ``seq`` its cache, resumed from the prefix cache where an earlier prompt left a snapshot."""
        seq.cache = self.model.new_cache(self.engine.context_size)
        prefix = self.engine.prefix_cache
        if prefix is not None and not seq.media:
            snap, split = prefix.lookup(seq.ids)
            if snap is not None:
                seq.cached = prefix.restore(snap, seq.cache)
            seq.splits = save_points(seq.cached, len(seq.ids), split, seq.save_at)

    def _fail(self, seqs, exc: BaseException) -> None:
        for seq in seqs:
            seq.out.put(exc)
            self._release(seq, save=False)

    def _emit(self, seq: Sequence, row: np.ndarray) -> None:
        """Sample ``row`` for ``seq``, hand the token over, and end the sequence where a solo run would."""
        from .engine import check_logits, pick_token

        engine = self.engine
        check_logits(row, seq.generated + 1, engine.config.model_path)
        tok, lp = pick_token(row, seq.sampler, seq.seen, seq.logprobs, seq.constraint)
        seq.generated += 1
        seq.out.put(("tok", tok, lp))
        if tok in engine._eos():
            self._release(seq)
            return
        seq.seen.append(tok)
        fed = len(seq.ids) + seq.generated - 1
        if fed >= engine.context_size or seq.generated >= seq.max_tokens:
            self._end(seq, "length")
            return
        seq.next_input = tok

    def _end(self, seq: Sequence, reason: str) -> None:
        seq.out.put(("end", reason))
        self._release(seq)

    def _release(self, seq: Sequence, save: bool = True) -> None:
        if seq in self._active:
            self._active.remove(seq)
        prefix, cache = self.engine.prefix_cache, seq.cache
        if save and prefix is not None and cache is not None and not seq.media and 0 < cache.pos <= len(seq.seen):
            prefix.store(seq.seen[:cache.pos], cache)  # the prompt and the reply as the cache holds them
        seq.cache = None
