"""Per-token log-probabilities: what OpenAI's ``logprobs``/``top_logprobs`` return and what scoring harnesses read.

A token's logprob is the float64 log-softmax of the model's raw logits at that step (before the sampling filters,
a grammar's mask or the repetition penalty), so a generated token scores what ``lumen perplexity`` gives the same
token after the same text. ``top``: the ``k`` most likely tokens at that step, most likely first (ties: lower id
first).

* ``prompt_logprobs(engine, ids, top)``: every token of a text scored given the ones before it (the first: None),
  the ``Engine.perplexity`` loop per token (``echo`` with ``logprobs`` on ``/v1/completions``).
* ``with_logprobs(engine, events)``: a generation's events (``Engine.generate`` pieces, ``Engine.chat`` events),
  each paired with the tokens generated since the previous one (``Scored``), then the tokens that made no event:
  how the server puts each token's logprob in the chunk that carries its text.
* ``token_bytes`` / ``token_text``: the bytes a token stands for (a SentencePiece word's leading space kept, a
  byte-fallback or byte-level token that holds part of a UTF-8 character as its raw bytes) and their text, such
  bytes written ``\\xNN`` as OpenAI writes them; ``Offsets``: where each token's text starts in a reply.
* ``chat_logprobs`` / ``completion_logprobs``: OpenAI's chat ``logprobs.content`` items and completions' legacy
  ``logprobs`` object.
"""

from __future__ import annotations

import json
import math
import re
import time
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

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
    return TokenLogprob(int(token), float(lp[token]), _top(lp, top))


def _top(lp: np.ndarray, k: int) -> list[tuple[int, float]]:
    """The ``k`` most likely of one row of logprobs, most likely first (ties: the lower id first)."""
    if k <= 0:
        return []
    k = min(k, lp.size)
    ids = np.argpartition(-lp, k - 1)[:k]
    ids = ids[np.lexsort((ids, -lp[ids]))]
    return [(int(i), float(lp[i])) for i in ids]


# --- scoring a prompt ------------------------------------------------------------------------------------

SCORE_ROWS = 16  # rows of logits made float64 logprobs at a time: bounds the host memory (16 x vocab x 8 B)


def prompt_logprobs(engine, ids: list[int], top: int = 0) -> list[TokenLogprob | None]:
    """Each token of ``ids`` scored given the ones before it: ``None`` for the first (nothing precedes it), then a
    ``TokenLogprob`` with the ``top`` most likely tokens at that position. The model runs over a fresh cache in
    chunks of ``PREFILL_CHUNK`` tokens with every position's logits, as ``Engine.perplexity`` does (the sum of the
    logprobs is ``-nll * (len(ids) - 1)`` of ``engine.perplexity(ids)``), through ``engine.exclusive`` (the model to
    itself: safe beside a running batcher). Sets this thread's ``engine.stats`` (``prompt_tokens``: ``len(ids)``,
    finish ``scored``), as a generation does."""
    from .engine import PREFILL_CHUNK, Stats, check_logits

    ids = [int(i) for i in ids]
    if not ids:
        return []
    engine.check_length(len(ids))

    def score() -> list[TokenLogprob | None]:
        out: list[TokenLogprob | None] = [None]
        cache = engine.model.new_cache(engine.context_size)
        for s in range(0, len(ids) - 1, PREFILL_CHUNK):
            chunk = ids[s:min(s + PREFILL_CHUNK, len(ids) - 1)]
            logits = np.asarray(engine.model.forward(chunk, cache, all_logits=True))
            for b in range(0, len(chunk), SCORE_ROWS):
                x = np.asarray(logits[b:b + SCORE_ROWS], dtype=np.float64)
                with np.errstate(invalid="ignore", over="ignore"):  # non-finite logits: reported just below
                    m = x.max(axis=-1)
                    lse = m + np.log(np.exp(x - m[:, None]).sum(axis=-1))
                    lp = x - lse[:, None]
                finite = np.isfinite(x).all(axis=-1)  # as generation checks each row (perplexity: the picked)
                if not finite.all():
                    r = int(np.argmin(finite))
                    check_logits(x[r], s + b + r + 1, engine.config.model_path, "scoring")
                for r in range(x.shape[0]):
                    tok = ids[s + b + r + 1]
                    out.append(TokenLogprob(tok, float(lp[r, tok]), _top(lp[r], top)))
        return out

    t0 = time.perf_counter()
    out = engine.exclusive(score)
    engine.stats = Stats(prompt_tokens=len(ids), prefill_seconds=time.perf_counter() - t0, finish_reason="scored")
    return out


# --- pairing a generation's events with its tokens -------------------------------------------------------


@dataclass
class Scored:
    """One event of a generation (a text piece, a chat event; ``None``: the end, no text) with the logprobs of the
    tokens generated since the previous event."""
    event: Any
    logprobs: list[TokenLogprob]


def with_logprobs(engine, events: Iterator) -> Iterator[Scored]:
    """``events`` (of ``Engine.generate`` / ``Engine.chat`` asked for ``logprobs``), each as a ``Scored`` carrying
    the tokens generated since the previous event, read from ``engine.stats`` on this thread as they come; then one
    ``Scored(None, rest)`` with the tokens that made no event (an end-of-turn token, the tokens of a stop string or
    held back by one), when there are any. Every generated token is in exactly one. Closing it closes ``events``."""
    before = engine.stats  # the thread's previous stats until the generation starts (events a chat yields first)
    taken = 0
    try:
        for event in events:
            st = engine.stats
            new: list[TokenLogprob] = []
            if st is not before:
                new = st.token_logprobs[taken:]
                taken = len(st.token_logprobs)
            yield Scored(event, new)
        st = engine.stats
        rest = st.token_logprobs[taken:] if st is not before else []
        if rest:
            yield Scored(None, rest)
    finally:
        close = getattr(events, "close", None)
        if close is not None:
            close()


# --- token text ------------------------------------------------------------------------------------------

_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")
_SPELLERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's printable spelling of the 256 byte values, as character -> byte."""
    from .gguf_tokenizer import _byte_alphabet

    return {c: b for b, c in _byte_alphabet().items()}


class _Speller:
    """The bytes each token of one tokenizer stands for, from its vocabulary entry and its decoder's steps."""

    KNOWN = {"Sequence", "ByteLevel", "Replace", "ByteFallback", "Fuse", "Strip", "Metaspace"}

    def __init__(self, tokenizer):
        self.tokenizer, backend = tokenizer, tokenizer.backend
        self.cache: dict[int, bytes] = {}
        try:
            self.added = {int(i): t.content for i, t in backend.get_added_tokens_decoder().items()}
        except AttributeError:  # an older tokenizers
            self.added = {}
        steps: list[dict] = []
        decoder = backend.decoder
        if decoder is not None:
            todo = [json.loads(decoder.__getstate__())]
            while todo:
                step = todo.pop(0)
                if step.get("type") == "Sequence":
                    todo[:0] = step.get("decoders") or []
                else:
                    steps.append(step)
        types = {s.get("type") for s in steps}
        self.byte_level = _byte_level_alphabet() if "ByteLevel" in types else None
        self.byte_fallback = "ByteFallback" in types
        self.replace: list[tuple[str, str]] = []
        for s in steps:
            if s.get("type") == "Replace" and isinstance(s.get("pattern"), dict) and "String" in s["pattern"]:
                self.replace.append((s["pattern"]["String"], s.get("content", "")))
            elif s.get("type") == "Metaspace":
                self.replace.append((s.get("replacement", "\u2581"), " "))
        # a decoder this does not read (WordPiece, CTC, a regex Replace...): a token's own decoding
        self.generic = not types <= self.KNOWN or any(
            s.get("type") == "Replace" and "String" not in (s.get("pattern") or {}) for s in steps)

    def __call__(self, token: int) -> bytes:
        token = int(token)
        out = self.cache.get(token)
        if out is None:
            out = self.cache[token] = self._spell(token)
        return out

    def _spell(self, token: int) -> bytes:
        if token in self.added:
            return self.added[token].encode("utf-8")
        piece = self.tokenizer.backend.id_to_token(token)
        if piece is None:
            return b""
        if self.generic:
            return self.tokenizer.decode([token]).encode("utf-8")
        if self.byte_level is not None:
            alphabet = self.byte_level
            if all(c in alphabet for c in piece):
                return bytes(alphabet[c] for c in piece)
            return piece.encode("utf-8")
        if self.byte_fallback:
            m = _BYTE_TOKEN.fullmatch(piece)
            if m:
                return bytes([int(m.group(1), 16)])
        for pattern, content in self.replace:
            piece = piece.replace(pattern, content)
        return piece.encode("utf-8")


def token_bytes(tokenizer, token: int) -> bytes:
    """The bytes ``token`` stands for in text: byte-level BPE tokens through the byte alphabet, SentencePiece
    pieces with ``▁`` as a space (a word's leading space kept, which a whole decoding strips at the start of a
    text), byte-fallback tokens (``<0xE2>``) as their one byte, added and special tokens as written
    (``<|im_end|>``). A byte-level token can hold part of a UTF-8 character: these are its raw bytes."""
    speller = _SPELLERS.get(tokenizer)
    if speller is None:
        speller = _SPELLERS[tokenizer] = _Speller(tokenizer)
    return speller(token)


def token_text(tokenizer, token: int) -> str:
    """``token_bytes`` as a string; bytes that are not whole UTF-8 (part of a character) written ``\\xNN``, as
    OpenAI writes them (``"\\xe4\\xbd"``)."""
    return token_bytes(tokenizer, token).decode("utf-8", "backslashreplace")


class Offsets:
    """Where each token's text starts in a text decoded as ``Engine.generate`` streams it (a ``StreamDecoder``,
    special tokens skipped), plus ``base`` (what comes before it in the reply: an echoed prompt); fed the tokens in
    order, in as many calls as the reply has chunks. A token whose text is held back (part of a character) starts
    where its character is written."""

    def __init__(self, tokenizer, base: int = 0, skip_special_tokens: bool = True):
        from .tokenizer import StreamDecoder

        self.decoder = StreamDecoder(tokenizer, skip_special_tokens)
        self.base, self.n, self.pieces = base, 0, []

    def take(self, ids, limit: int | None = None) -> list[int]:
        """The offsets of ``ids`` (the next tokens), each at most ``limit`` (the reply's length: a stop string cuts
        the text its last tokens wrote)."""
        out = []
        for tok in ids:
            out.append(self.base + self.n if limit is None else min(self.base + self.n, limit))
            piece = self.decoder.push(tok)
            self.pieces.append(piece)
            self.n += len(piece)
        return out

    def text(self) -> str:
        """The decoding of every token taken (the held-back end included)."""
        return "".join(self.pieces) + self.decoder.flush()


# --- OpenAI's shapes -------------------------------------------------------------------------------------


def _number(x: float) -> float:
    """A logprob for JSON: -inf (a token the model rules out) as OpenAI writes it, -9999.0."""
    return x if math.isfinite(x) else -9999.0


def chat_logprobs(tokenizer, lps: list[TokenLogprob]) -> list[dict]:
    """Chat completions' ``logprobs.content`` items: ``{"token", "logprob", "bytes", "top_logprobs": [{"token",
    "logprob", "bytes"}...]}`` (the alternatives most likely first)."""
    def item(tok: int, lp: float) -> dict:
        raw = token_bytes(tokenizer, tok)
        return {"token": raw.decode("utf-8", "backslashreplace"), "logprob": _number(lp), "bytes": list(raw)}

    return [{**item(e.token, e.logprob), "top_logprobs": [item(t, lp) for t, lp in e.top]} for e in lps]


def completion_logprobs(tokenizer, lps: list[TokenLogprob | None], offsets: list[int]) -> dict:
    """Completions' legacy ``logprobs``: ``tokens``, ``token_logprobs``, ``top_logprobs`` (per token a dict token ->
    logprob of the most likely ones, the chosen token added when it is not among them, as OpenAI does) and
    ``text_offset``; an entry ``None`` (the first token of an echoed prompt) is null in both lists."""
    tokens, values, tops = [], [], []
    for e in lps:
        if e is None:
            tokens.append(None)
            values.append(None)
            tops.append(None)
            continue
        tokens.append(token_text(tokenizer, e.token))
        values.append(_number(e.logprob))
        top: dict[str, float] = {}
        for t, lp in e.top:
            top.setdefault(token_text(tokenizer, t), _number(lp))
        top.setdefault(tokens[-1], values[-1])
        tops.append(top)
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": list(offsets)}
