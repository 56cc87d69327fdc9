"""The engine: validate → plan → load → prefill → decode → sample → detokenize. No screen, no socket:
the CLI and the server are thin faces over this."""

from __future__ import annotations

import math
import os
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np

from .architecture import Architecture, Model
from .chat import ChatFormat, format_for
from .checkpoint import open_checkpoint
from .config import Config, config_from_path_or_model
from .errors import CheckpointError, ConfigError, InputError
from .loader import load_weights
from .plan import Plan, make_plan, mixer_components
from .plugins import get_registry
from .prefix_cache import PrefixCache, save_points
from .progress import Progress
from .sampling import SamplingParams, make_sampler
from .speculative import (
    Checkpoint,
    Drafter,
    DraftModel,
    Fallback,
    MTPDrafter,
    SpecStats,
    accept_greedy,
    accept_sampled,
    draw,
    greedy_token,
    host_rows,
    recording,
    target_probs,
)
from .tensors import LoadReport
from .tokenizer import StopMatcher, StreamDecoder, Tokenizer

PREFILL_CHUNK = 512  # tokens per forward call when scoring long texts (bounds activation memory)
WARM_UP_CONTEXT = 16  # tokens of the throwaway cache `Engine.warm_up` runs on


@dataclass
class Stats:
    prompt_tokens: int = 0
    generated_tokens: int = 0
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    finish_reason: str = ""
    images: int = 0
    image_seconds: float = 0.0  # preprocessing and the vision tower, before the prefill
    cached_tokens: int = 0  # prompt tokens taken from the prefix cache instead of prefilled
    # per generated token (EOS included) when the generation asked for logprobs: lumen_core.logprobs.TokenLogprob
    token_logprobs: list = field(default_factory=list)
    speculative: SpecStats | None = None  # a speculative generation's verify steps and acceptance

    def summary(self) -> str:
        pre = self.prompt_tokens / self.prefill_seconds if self.prefill_seconds else 0.0
        if self.finish_reason == "scored":  # perplexity: one prefill pass, nothing generated
            return f"scored {self.prompt_tokens} tok in {self.prefill_seconds:.2f} s, {pre:.1f} tok/s"
        dec = (self.generated_tokens - 1) / self.decode_seconds if self.decode_seconds else 0.0
        images = f"{self.images} image(s) encoded in {self.image_seconds:.2f} s; " if self.images else ""
        spec = f"; {self.speculative.summary()}" if self.speculative is not None else ""
        return (f"{images}prompt {self.prompt_tokens} tok, {pre:.1f} tok/s; generated {self.generated_tokens} tok, "
                f"{dec:.1f} tok/s; finish: {self.finish_reason}{spec}")


class Engine:
    """A loaded model with its tokenizer, ready to generate and score text."""

    def __init__(self, config: Config, arch: Architecture, model: Model, tokenizer: Tokenizer | None,
                 plan: Plan, report: LoadReport):
        self.config, self.arch, self.model, self.tokenizer = config, arch, model, tokenizer
        self.plan, self.report = plan, report
        self.context_size = plan.context_size
        # per thread: the server runs several generations at once (one thread each), each with its own stats and
        # stop check
        self._local = threading.local()
        self.batcher = None  # a running lumen_core.batching.Batcher: generations then share its batched steps
        kv = config.kv_cache()
        # snapshots of earlier prompts' caches that a prompt starting with the same tokens resumes from
        self.prefix_cache = PrefixCache(int(kv.prefix_cache_mb * 1e6)) if kv.prefix_cache_mb else None
        self.backends: dict = {}
        self._runner = None  # the backend's DecodeRunner, prepared on the first generation (False: none)
        self._template_noted = False  # the stderr note about a template the checkpoint did not carry
        self._image_processor = None  # built on the first image, from the checkpoint's preprocessor config
        self._preprocessor_config: dict | None = None
        self._image_stats = (0, 0.0)
        # speculative decoding (config ``draft``): tokens drafted per verify, and a new Drafter per generation
        self.draft_tokens = 0
        self.drafter_factory = None
        self.draft_engine: Engine | None = None  # a draft model's own engine (not for MTP)
        self._spec_noted = False
        # falling back to plain rounds where they are faster (config draft.fallback; speculative.Fallback): the
        # round timer (a test may swap it) and what earlier generations measured, per drafter and draft length
        self.draft_fallback = True
        self.spec_clock = time.perf_counter
        self._spec_memory: dict = {}

    @property
    def stats(self) -> Stats:
        """The statistics of this thread's last generation (prompt and generated tokens, times, finish reason)."""
        st = getattr(self._local, "stats", None)
        if st is None:
            st = self._local.stats = Stats()
        return st

    @stats.setter
    def stats(self, value: Stats) -> None:
        self._local.stats = value

    @property
    def should_stop(self):
        """Checked once per generated token: True ends the generation (finish "cancelled"). The server sets it
        (per thread) for the job it runs (a client that left, a time limit): a reply that yields no event for many
        tokens (a long tool call) still stops within a token."""
        return getattr(self._local, "should_stop", None)

    @should_stop.setter
    def should_stop(self, fn) -> None:
        self._local.should_stop = fn

    @classmethod
    def load(cls, source, progress: bool | Progress = True, chat_template: str | os.PathLike | None = None,
             chat: bool = False, think: bool | None = None) -> Engine:
        """See `load`. Everything that needs no weight (config, plan, tokenizer, chat template, ``chat`` checks)
        is done before the first weight is read."""
        progress = progress if isinstance(progress, Progress) else Progress(bool(progress))
        config, ckpt, arch, plan, resolved = prepare(source)
        for note in plan.notes:  # show-plan prints them in its table instead
            print(f"lumen: note: {note}", file=sys.stderr)
        registry = get_registry()
        fmt = format_for(registry, arch.model_type or arch.config.get("model_type"))
        template, origin = (choose_chat_template(ckpt, fmt, chat_template) if chat_template is not None else
                            choose_chat_template(ckpt, fmt, config.chat_template_path, "model.chat-template"))
        if chat:  # from the checkpoint's metadata: a refusal comes before the tokenizer is built
            check_chat(template, fmt, think, config.model_path)
        with progress.phase("tokenizer") as phase:
            tokenizer = ckpt.load_tokenizer()
            phase.note = getattr(tokenizer, "load_note", "")
        if tokenizer is not None:
            tokenizer.chat_template, tokenizer.chat_template_origin = template, origin
        elif chat:
            raise InputError(f"{config.model_path} has no tokenizer, so it cannot chat")
        backends = _backends(resolved["placements"], registry)
        _configure_cpu(config, backends)
        _configure_cuda(config, backends)
        _configure_attention(config, backends)
        for comp, p in resolved["placements"].items():  # routed experts streamed from a host store to a GPU
            if comp[0] == "experts" and p.store in registry.backend_class(p.backend).expert_stores:
                backends[comp].configure_expert_cache(config.expert_cache())
        report = resolved["report"]
        with progress.phase("weights", live_line=False) as phase:
            weights = load_weights(ckpt, arch, resolved["layout"], resolved["placements"], backends, report,
                                   progress)
            phase.note = _plan_bytes_note(plan)
        _note_unused_quantization(config, backends)
        model = arch.build(weights, backends, resolved["kv"])
        engine = cls(config, arch, model, tokenizer, plan, report)
        engine.weights = weights  # what the loader put on each component's backend
        reader = getattr(ckpt, "preprocessor_config", None)
        engine._preprocessor_config = reader() if reader is not None and ("vision", None) in weights else None
        engine.backends = backends
        engine._set_up_drafting(resolved, progress)
        if any(b.compiles_on_first_use for b in set(backends.values())):
            with progress.phase("warm-up") as phase:
                phase.note = "first forward: compiles the CPU kernels on a first run, cached after"
                engine.warm_up()
        return engine

    def _set_up_drafting(self, resolved: dict, progress: Progress) -> None:
        """The config's ``draft`` block: the MTP head the model loaded, or a draft model loaded as an engine of its
        own (its plan was counted with the main one), whose tokenizer must be the main model's."""
        spec = self.config.draft()
        if spec is None:
            return
        self.draft_tokens, self.draft_fallback = spec.tokens, spec.fallback
        if spec.mtp:
            if getattr(self.model, "mtp", None) is None:
                raise CheckpointError(f"{self.config.model_path}: the model was loaded without a multi-token-"
                                      "prediction head, so draft.mtp cannot draft; use a draft model (draft.path)")
            model = self.model
            self.drafter_factory = lambda context: MTPDrafter(model, context)
            return
        from .draft import check_draft_tokenizer

        draft = Engine.load(resolved["draft_config"], progress=progress)
        if self.tokenizer is not None:
            check_draft_tokenizer(self.tokenizer, draft.tokenizer, self.config.model_path, draft.config.model_path)
        self.draft_engine = draft
        self.drafter_factory = lambda context: DraftModel(draft.model, context, draft.decode_runner() or None)

    def warm_up(self) -> None:
        """One short prefill and one decode step on a throwaway cache: kernels that compile on first use (numba)
        do it now, while loading, instead of inside the first request's prefill."""
        n = min(WARM_UP_CONTEXT, self.context_size)
        cache = self.model.new_cache(n)
        first = self.tokenizer.bos_id if self.tokenizer and self.tokenizer.bos_id is not None else 0
        logits = self.model.forward([first] * min(2, n), cache)
        # a corrupt checkpoint (NaN weights, a zeroed output layer) is refused here, while loading
        check_logits(np.asarray(logits[-1], dtype=np.float32), 1, self.config.model_path, "warming up")
        if n > 2:
            self.model.forward([first], cache)

    # -- tokens ------------------------------------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; ``add_special_tokens=False`` for a rendered chat prompt, whose template already
        wrote every special token (BOS included), as transformers tokenizes it."""
        if self.tokenizer is None:
            raise InputError(f"{self.config.model_path} has no tokenizer: pass token ids instead of text")
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def chat_prompt(self, messages: list[dict], **template_kwargs) -> str:
        check_chat(self._template(), self.chat_format(), None, self.config.model_path)
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, **template_kwargs)

    def check_length(self, n: int) -> None:
        if n > self.context_size:
            raise InputError(
                f"the prompt has {n} tokens but the context size is {self.context_size}; shorten it or raise "
                "model.hidden-layers.kv-cache.context-size"
            )
        if n == 0:
            raise InputError("the prompt is empty (0 tokens)")

    # -- generation --------------------------------------------------------------------------------------
    def images_in(self, images: list) -> list:
        """Each image (a path, bytes, a PIL image or a ``data:`` URI) loaded and preprocessed for this model's
        vision tower (``ImageInput``); an InputError naming the image where one is bad or the engine has none."""
        from .images import images_from

        if not images:
            return []
        if ("vision", None) not in self.backends:
            raise InputError(
                f"this engine has no vision tower loaded, so it cannot take images ({len(images)} given): add a "
                'vision block to the config, e.g. "vision": {"compute": "cpu"} (its placement, like any component)'
                + ("" if self.arch.has_vision() else f"; and {self.config.model_path} has no vision tower at all"))
        if self._image_processor is None:
            self._image_processor = self.arch.image_processor(self._preprocessor_config)
            if self._image_processor is None:
                raise InputError(f"the {self.arch.model_type} architecture loaded a vision tower but has no image "
                                 f"preprocessor for {self.config.model_path}, so it cannot take images")
        return [self._image_processor.preprocess(image, label=f"image {i}")
                for i, image in enumerate(images_from(list(images)), 1)]

    def with_images(self, prompt_ids: list[int], images: list | None) -> tuple[list[int], list | None]:
        """The prompt with each image's placeholder expanded into its tokens, and the ``(ImageInput, embeddings)``
        pairs the model's forward takes (None without images)."""
        if not images:
            return list(prompt_ids), None
        t0 = time.perf_counter()
        inputs = self.images_in(images)
        ids = self.arch.expand_image_tokens(list(prompt_ids), inputs)
        self.check_length(len(ids))  # before the tower runs: a prompt that cannot fit costs nothing
        media = list(zip(inputs, self.model.encode_images(inputs), strict=True))
        self._image_stats = (len(inputs), time.perf_counter() - t0)
        return ids, media

    def generate_tokens(self, prompt_ids: list[int], max_tokens: int = 256,
                        params: SamplingParams | None = None, images: list | None = None,
                        logprobs: int | None = None, constraint=None, save_at: int | None = None) -> Iterator[int]:
        """Yield new token ids until EOS, ``max_tokens`` or the context is full. ``images``: for a model with a
        vision tower, one image per placeholder in the prompt, in order (paths, bytes, PIL images, data URIs).
        ``logprobs``: record each generated token's logprob with that many most likely alternatives (0: the
        token's own only) in ``stats.token_logprobs``. ``constraint``: an object with ``mask(row) -> row`` (the
        logits with the tokens it forbids at -inf) and ``advance(token)`` (a grammar: ``lumen_core.grammar``).
        ``save_at``: a prompt position where the prefix cache (when on) saves a snapshot on the way: ``chat`` passes
        where the conversation so far ends, which its next turn starts with.

        With a running ``batcher`` (the server, ``kv-cache.sequences`` > 1) the generation joins its batch: the
        tokens are the same, computed in steps shared with the other running generations."""
        params = params or SamplingParams(temperature=0.0)
        params.validate()
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
            raise InputError(f"max_tokens must be an integer >= 1, got {max_tokens!r}")
        if logprobs is not None and (not isinstance(logprobs, int) or isinstance(logprobs, bool) or logprobs < 0):
            raise InputError(f"logprobs must be an integer >= 0 (alternatives per token), got {logprobs!r}")
        image_stats = (0, 0.0)
        if images:  # the tower runs with the model to itself; its stats read there (generations run concurrently)
            prompt_ids, media, image_stats = self.exclusive(
                lambda: (*self.with_images(prompt_ids, images), self._image_stats))
        else:
            prompt_ids, media = list(prompt_ids), None
        self.check_length(len(prompt_ids))
        self.stats = st = Stats(prompt_tokens=len(prompt_ids), images=image_stats[0], image_seconds=image_stats[1])
        if self.batcher is not None:
            yield from self.batcher.generate(prompt_ids, media, max_tokens, params, st, logprobs, constraint,
                                             self.should_stop, save_at)
            return
        # a prompt with images decodes op by op: the replayed step's positions assume text-only prompts; logprobs
        # and a grammar read (and mask) every row on the host
        on_host = media or logprobs is not None or constraint is not None
        if self.drafter_factory is not None:
            if not on_host:
                yield from self._speculative(prompt_ids, max_tokens, params, st, save_at)
                return
            self._note_plain("images, logprobs and grammars")
        eos, runner = self._eos(), (None if on_host else self.decode_runner())
        if runner:  # logits stay on the device; the backend samples them and replays its decode step
            runner.reset()
            cache, sample, host = runner.cache, runner.sampler(params), False
        else:
            cache, sample, host = self.model.new_cache(self.context_size), make_sampler(params), True
        seen = list(prompt_ids)
        prefix = self.prefix_cache if not media else None  # image tokens are placeholders: never reused
        snap, split = prefix.lookup(prompt_ids) if prefix is not None else (None, 0)

        def next_token(logits) -> int:
            if runner:
                return sample(logits[-1], seen)
            row = np.asarray(logits[-1], dtype=np.float32)  # the row the sampler reads: checking it costs ~0.1 ms
            check_logits(row, st.generated_tokens + 1, self.config.model_path)
            tok, lp = pick_token(row, sample, seen, logprobs, constraint)
            if lp is not None:
                st.token_logprobs.append(lp)
            return tok

        t0 = time.perf_counter()
        if media:
            logits = self.model.forward(list(prompt_ids), cache, host=host, images=media)
        else:
            n = st.cached_tokens = prefix.restore(snap, cache) if snap is not None else 0
            # a prefix shared with an earlier prompt, where a chat's history ends: saved on the way for later prompts
            for point in save_points(n, len(prompt_ids), split, save_at) if prefix is not None else ():
                self.model.forward(list(prompt_ids[n:point]), cache, host=host)
                prefix.store(prompt_ids[:point], cache)
                n = point
            logits = self.model.forward(list(prompt_ids[n:]), cache, host=host)
            if prefix is not None:
                prefix.store(prompt_ids, cache)
        if runner:  # the device samples: bring the prefill's last row over once to check it (decode steps: not)
            backend = self.backends[("output-layer", None)]
            check_logits(np.asarray(backend.to_host(logits[-1]), dtype=np.float32), 1, self.config.model_path)
        tok = next_token(logits)  # waits for the device
        st.prefill_seconds = time.perf_counter() - t0
        t1 = time.perf_counter()
        st.finish_reason = "length"
        chain = None  # the runner's pipelined greedy steps, when it offers them
        if runner and params.temperature == 0 and params.repetition_penalty == 1.0:
            chain = runner.greedy_tokens(tok)
        try:
            while True:
                st.generated_tokens += 1
                if tok in eos:
                    st.finish_reason = "stop"
                    break
                yield tok
                seen.append(tok)
                fed = len(prompt_ids) + st.generated_tokens - 1  # tokens in the cache before tok (= cache.pos)
                if fed >= self.context_size or st.generated_tokens >= max_tokens:
                    st.finish_reason = "length"
                    break
                if self.should_stop is not None and self.should_stop():
                    st.finish_reason = "cancelled"
                    break
                if chain is not None:
                    tok = next(chain)
                else:
                    tok = next_token(runner.step(tok) if runner else self.model.forward([tok], cache))
        finally:
            if chain is not None:
                chain.close()
            elif prefix is not None and cache.pos <= len(seen):  # the prompt and the reply as the cache holds them
                prefix.store(seen[:cache.pos], cache)  # (a pipelined chain may have run ahead: not saved)
        st.decode_seconds = time.perf_counter() - t1

    def _note_plain(self, why: str) -> None:
        if not self._spec_noted:
            self._spec_noted = True
            print(f"lumen: note: speculative decoding is off for generations with {why}: they decode token by "
                  "token", file=sys.stderr)

    def _speculative(self, prompt_ids: list[int], max_tokens: int, params: SamplingParams, st: Stats,
                     save_at: int | None = None):
        """``generate_tokens`` with a drafter (lumen_core.speculative): the drafter proposes up to
        ``draft_tokens`` tokens, one main forward over them and the newest token verifies them all, and the cache
        is rewound to what was kept. Greedy: the tokens of plain greedy decoding; sampling: the rejection rule
        (the same distribution as plain sampling, not the same draws). Where plain decoding is faster (timed round
        by round, ``speculative.Fallback``; off with draft.fallback false) it runs plain rounds instead: the main
        model forwards the newest token alone and the drafter is told (``skip``)."""
        model, eos = self.model, self._eos()
        drafter = self.drafter_factory(self.context_size)
        records = getattr(model, "records_states", False)
        hidden = {"hidden": True} if drafter.needs_hidden else {}
        rng = np.random.Generator(np.random.PCG64(params.seed))
        greedy = params.temperature == 0
        spec = st.speculative = SpecStats()
        memory = self._spec_memory.setdefault((self.drafter_factory, self.draft_tokens), {})
        # a drafter that cannot be told about plain rounds (no skip of its own) is never skipped; a seeded sampled
        # generation keeps to speculation: which rounds are plain depends on timings, and plain and speculative
        # rounds consume the seed's draws differently, so switching would make the seed's output vary run to run
        fallback = (self.draft_fallback and type(drafter).skip is not Drafter.skip
                    and (greedy or params.seed is None))
        policy, clock = Fallback(memory, fallback), self.spec_clock
        # a backend that replays its decode step (CUDA graphs) verifies in a graph captured per size on its cache
        runner = self.decode_runner()
        verify = runner if runner and hasattr(runner, "verify_graph") else None
        if verify is not None:
            full = verify.verify_graph(self.draft_tokens + 1, drafter.needs_hidden)  # made once (resets the cache)
            # a plain round replays the decode step; one that must give the MTP head its hidden row, a verify of 1
            one = verify.verify_graph(1, True) if drafter.needs_hidden and fallback else None
            if full is None and not self._spec_noted:
                self._spec_noted = True
                print(f"lumen: note: the speculative verify runs op by op: "
                      f"{verify.verify_note(self.draft_tokens + 1, drafter.needs_hidden)}", file=sys.stderr)
            runner.reset()
            cache = runner.cache
        else:
            cache, full, one = model.new_cache(self.context_size), None, None
        prefix = self.prefix_cache
        snap, split = prefix.lookup(prompt_ids) if prefix is not None else (None, 0)
        seen = list(prompt_ids)

        def pick(row, seen) -> int:
            row = np.asarray(row, dtype=np.float32)
            check_logits(row, st.generated_tokens + 1, self.config.model_path)
            return greedy_token(row, params, seen) if greedy else draw(target_probs(row, params, seen), rng)

        def plain_round(last: int, tell: bool = True) -> int:
            """The next token from the main model alone (``last`` forwarded), as plain decoding computes it: its
            replayed step where it has one. The drafter is told (``skip``; not for the generation's last token):
            it catches up when it drafts again."""
            if verify is not None and not drafter.needs_hidden:
                logits, rows, on_device = runner.step(last), None, True
            elif one is not None:
                logits, rows, _ = one.run([last])
                on_device = True
            else:
                out = model.forward([last], cache, **hidden)
                (logits, rows), on_device = (out if hidden else (out, None)), False
            if on_device and greedy and params.repetition_penalty == 1.0:
                tok = verify.argmax_rows(logits)[-1]  # one integer back, as the verify's greedy acceptance reads
            else:
                tok = pick(host_rows(logits)[-1], seen)
            if tell:
                drafter.skip([last], rows)
            return tok

        t0 = time.perf_counter()
        n = st.cached_tokens = prefix.restore(snap, cache) if snap is not None else 0
        for point in save_points(n, len(prompt_ids), split, save_at) if prefix is not None else ():
            model.forward(list(prompt_ids[n:point]), cache)
            prefix.store(prompt_ids[:point], cache)
            n = point
        out = model.forward(list(prompt_ids[n:]), cache, **hidden)  # hidden: every row; logits: the last
        logits, rows = out if hidden else (out, None)
        if prefix is not None:
            prefix.store(prompt_ids, cache)
        pending = [pick(logits[-1], seen)]
        drafter.start(list(prompt_ids), len(prompt_ids) - n, rows)
        st.prefill_seconds = time.perf_counter() - t0
        t1 = time.perf_counter()
        st.finish_reason = "length"
        try:
            while True:
                for tok in pending:
                    st.generated_tokens += 1
                    if tok in eos:
                        st.finish_reason = "stop"
                        return
                    yield tok
                    seen.append(tok)
                    fed = len(prompt_ids) + st.generated_tokens - 1  # tokens in the cache before tok, if fed plainly
                    if fed >= self.context_size or st.generated_tokens >= max_tokens:
                        st.finish_reason = "length"
                        return
                    if self.should_stop is not None and self.should_stop():
                        st.finish_reason = "cancelled"
                        return
                last = pending[-1]  # the only token of pending not in the cache yet
                k = min(self.draft_tokens, self.context_size - cache.pos - 1, max_tokens - st.generated_tokens - 1)
                if k < 1:  # the last token the limits allow: no room to draft
                    pending = [plain_round(last, tell=False)]
                    continue
                start = clock()
                if not policy.speculate():  # plain decoding has been faster lately (or is being timed)
                    pending = [plain_round(last)]
                    spec.plain_rounds += 1
                    policy.record(False, 1, clock() - start)
                    continue
                td = time.perf_counter()
                drafts, dists = drafter.propose(last, k, params, seen, rng)
                tv = time.perf_counter()
                fed_ids = [last] + drafts
                graph = full if verify is not None and k == self.draft_tokens else None  # shorter: op by op
                checkpoint = Checkpoint(cache, k + 1, records or graph is not None)
                if graph is not None:
                    logits, rows, trail = graph.run(fed_ids)
                else:
                    with recording() as trail:
                        out = model.forward(fed_ids, cache, all_logits=True, **hidden)
                    logits, rows = out if hidden else (out, None)
                if graph is not None and greedy and params.repetition_penalty == 1.0:
                    targets = verify.argmax_rows(logits)  # k + 1 integers back, not the rows
                    a = accept_greedy(targets, drafts)
                    nxt = targets[a]
                elif greedy:
                    logits = host_rows(logits)
                    check_logits(logits[0], st.generated_tokens + 1, self.config.model_path)
                    targets = [greedy_token(logits[i], params, seen + drafts[:i]) for i in range(k + 1)]
                    a = accept_greedy(targets, drafts)
                    nxt = targets[a]
                else:
                    logits = host_rows(logits)
                    check_logits(logits[0], st.generated_tokens + 1, self.config.model_path)
                    a, nxt = accept_sampled(_rows_of(logits, params, seen, drafts), dists, drafts, rng)
                rerun = checkpoint.rewind(a + 1, trail)
                if rerun:
                    model.forward(fed_ids[:rerun], cache)
                drafter.accept(fed_ids, a + 1, rows)
                spec.verifies += 1
                spec.drafted += k
                spec.accepted += a
                spec.draft_seconds += tv - td
                spec.verify_seconds += time.perf_counter() - tv
                pending = drafts[:a] + [nxt]
                policy.record(True, a + 1, clock() - start)
        finally:
            st.decode_seconds = time.perf_counter() - t1
            if prefix is not None and cache.pos <= len(seen):
                prefix.store(seen[:cache.pos], cache)

    def start_batching(self, sequences: int | None = None):
        """Run generations in shared batched steps from now on (``lumen_core.batching.Batcher``): up to
        ``sequences`` at once (default: the config's ``kv-cache.sequences``, which the plan counted). Idempotent;
        ``stop_batching`` ends it."""
        from .batching import Batcher

        if self.batcher is None:
            self.batcher = Batcher(self, sequences or self.config.kv_cache().sequences)
            if self.drafter_factory is not None:
                print("lumen: note: speculative decoding is off while generations run batched (kv-cache.sequences "
                      "> 1): a batched step shares the weight reads among sequences instead", file=sys.stderr)
        return self.batcher

    def exclusive(self, fn):
        """``fn()`` with the model to itself: on the batcher's thread between two steps while batching runs, else
        here (the vision tower, scoring a prompt)."""
        return self.batcher.call(fn) if self.batcher is not None else fn()

    def close(self) -> None:
        """Stop batching and release what the backends hold for this engine (device memory, pinned host memory);
        the engine cannot run after."""
        self.stop_batching()
        if self.draft_engine is not None:
            self.draft_engine.close()
        for backend in {id(b): b for b in self.backends.values()}.values():
            close = getattr(backend, "close", None)
            if close is not None:
                close()
        self._runner = None

    def stop_batching(self) -> None:
        if self.batcher is not None:
            self.batcher.close()
            self.batcher = None

    def decode_runner(self):
        """The backend's replayable decode step (a CUDA graph), when every component sits on one backend that
        has one, or every other component is a layer's routed experts on a backend it names in ``graph_guests``
        (their calls become part of the step); prepared once. A backend that declines says why (stderr note)
        and decoding runs op by op."""
        if self._runner is None:
            self._runner = False
            backend = self.backends.get(("output-layer", None))
            guests = [(comp, b) for comp, b in self.backends.items() if b is not backend]
            if backend is not None and all(comp[0] == "experts" and b.name in backend.graph_guests
                                           for comp, b in guests):
                try:
                    self._runner = backend.decode_runner(self.model, self.context_size) or False
                except NotImplementedError as exc:
                    print(f"lumen: note: {backend.device}: decode runs op by op: {exc}", file=sys.stderr)
        return self._runner

    def generate(self, prompt: str | list[int], max_tokens: int | None = None, stop: list[str] | None = None,
                 images: list | None = None, logprobs: int | None = None, constraint=None,
                 **sampling) -> Iterator[str]:
        """Stream the newly generated text. ``sampling``: temperature, top_k, top_p, min_p, seed, ...
        ``images``: one per image placeholder the prompt holds (Qwen: ``<|vision_start|><|image_pad|><|vision_end|>``),
        as paths, bytes, PIL images or data URIs; needs the config's ``vision`` block."""
        defaults = self.config.sampling_defaults()
        max_tokens = defaults.get("max_tokens", 256) if max_tokens is None else max_tokens
        stop = stop if stop is not None else defaults.get("stop", [])
        params = sampling_params(defaults, sampling)
        if images and isinstance(prompt, str):
            prompt = self.arch.image_text(prompt)  # what the family's processor writes around an image
        ids = self.encode(prompt) if isinstance(prompt, str) else list(prompt)
        decoder, matcher = StreamDecoder(self.tokenizer), StopMatcher(stop)
        # text-only calls keep generate_tokens' text-only signature
        extra = _extras(images=images, logprobs=logprobs, constraint=constraint)
        for tok in self.generate_tokens(ids, max_tokens, params, **extra):
            text, stopped = matcher.push(decoder.push(tok))
            if text:
                yield text
            if stopped:
                self.stats.finish_reason = "stop"
                return
        text, stopped = matcher.push(decoder.flush())
        tail = text + ("" if stopped else matcher.flush())
        if tail:
            yield tail

    # -- chat --------------------------------------------------------------------------------------------
    def chat_format(self):
        """The model family's chat format (reasoning and tool-call syntax; plain when none is registered)."""
        return format_for(get_registry(), self.arch.model_type or self.arch.config.get("model_type"))

    def chat(self, messages: list[dict], tools: list[dict] | None = None, think: bool | None = None,
             max_tokens: int | None = None, stop: list[str] | None = None, call_ids=None,
             force_tool: bool | str = False, logprobs: int | None = None, constraint=None, **sampling):
        """Answer a conversation, streamed as chat events: ``Reasoning``, ``Content`` and whole ``ToolCall``
        events (lumen_core.chat), parsed with the model family's chat format. ``think`` switches the template's
        thinking (an error on a template without the switch); the tags reach the parser because the reply is
        decoded with its special tokens, and the format's own stop texts end the reply. ``force_tool``: True
        makes the reply start with a tool call (``tool_choice`` required), a name with a call to that function:
        the format's call opener is written after the prompt (closing an open reasoning block first)."""
        prompt, fmt, parser, first = self.chat_prompt_and_parser(messages, tools, think, call_ids, force_tool)
        yield from first
        defaults = self.config.sampling_defaults()
        max_tokens = defaults.get("max_tokens", 256) if max_tokens is None else max_tokens
        stops = list(defaults.get("stop", []) if stop is None else stop)
        decoder = StreamDecoder(self.tokenizer, skip_special_tokens=False)
        matcher = StopMatcher(stops + list(fmt.stop))
        images = images_of(messages)
        if images:
            prompt = self.arch.image_text(prompt)
        ids = self.encode(prompt, add_special_tokens=False)
        # text-only calls keep generate_tokens' text-only signature
        extra = _extras(images=images, logprobs=logprobs, constraint=constraint,
                        save_at=self._history_end(messages, tools, think, ids) if not images else None)
        for tok in self.generate_tokens(ids, max_tokens, sampling_params(defaults, sampling), **extra):
            text, stopped = matcher.push(decoder.push(tok))
            yield from parser.push(text)
            if stopped:
                self.stats.finish_reason = "stop"
                break
        else:
            text, stopped = matcher.push(decoder.flush())
            yield from parser.push(text + ("" if stopped else matcher.flush()))
        yield from parser.flush()

    def _history_end(self, messages, tools, think, ids) -> int | None:
        """Where the conversation so far ends in the prompt ``ids`` (its tokens without the generation prompt), for
        the prefix cache: a template may render the reply differently in the next turn (Qwen 3.5 drops the
        reasoning), but the next turn starts with this. None without a prefix cache, or when it is no prefix."""
        if self.prefix_cache is None:
            return None
        fmt = self.chat_format()
        kwargs = {} if think is None else {fmt.thinking_kwarg: think}
        try:
            text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=False, tools=tools, **kwargs)
        except Exception:  # noqa: BLE001 - a template that needs the generation prompt: no anchor, no harm
            return None
        head = self.encode(text, add_special_tokens=False)
        return len(head) if 0 < len(head) < len(ids) and ids[:len(head)] == head else None

    def _template(self):
        if self.tokenizer is None:
            raise InputError(f"{self.config.model_path} has no tokenizer, so it cannot chat")
        return self.tokenizer.chat_template

    def chat_prompt_and_parser(self, messages: list[dict], tools: list[dict] | None = None,
                               think: bool | None = None, call_ids=None, force_tool: bool | str = False):
        """(prompt text, chat format, a parser primed for the reply, events already due): what ``chat`` generates
        from. A forced tool call's opener is part of the prompt and already pushed into the parser."""
        from .chat import ChatStreamParser, prompt_ends_in_reasoning

        fmt = self.chat_format()
        check_chat(self._template(), fmt, think, self.config.model_path, tools)
        kwargs = {} if think is None else {fmt.thinking_kwarg: think}
        if not self._template_noted and self.tokenizer.chat_template_origin != "checkpoint":
            self._template_noted = True  # said once per engine, when the template is first used
            print(f"lumen: note: chat template: {self.tokenizer.chat_template_origin}", file=sys.stderr)
        prompt = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tools=tools, **kwargs)
        in_reasoning = prompt_ends_in_reasoning(prompt, fmt)
        parser = ChatStreamParser(fmt, tools, in_reasoning, call_ids)
        if force_tool:
            if fmt.tool_calls is None or not hasattr(fmt.tool_calls, "opener"):
                raise InputError(f"a required tool call: the {fmt.name!r} chat format has no tool-call syntax")
            if not tools:
                raise InputError("a required tool call needs tools")
            prefix = (fmt.reasoning.end + "\n\n" if in_reasoning else "") + fmt.tool_calls.opener(
                force_tool if isinstance(force_tool, str) else None)
            prompt += prefix
            return prompt, fmt, parser, parser.push(prefix)  # (empty: the reasoning closes empty, the call is open)
        return prompt, fmt, parser, []

    # -- scoring -----------------------------------------------------------------------------------------
    def perplexity(self, text: str | list[int]) -> dict:
        """Mean negative log-likelihood (nats) of each token given the ones before it."""
        ids = self.encode(text) if isinstance(text, str) else list(text)
        if len(ids) < 2:
            raise InputError(f"perplexity needs at least 2 tokens; the text has {len(ids)}")
        self.check_length(len(ids))
        cache = self.model.new_cache(self.context_size)
        t0, total = time.perf_counter(), 0.0
        for s in range(0, len(ids) - 1, PREFILL_CHUNK):
            chunk = ids[s:min(s + PREFILL_CHUNK, len(ids) - 1)]
            logits = np.asarray(self.model.forward(chunk, cache, all_logits=True), dtype=np.float64)
            targets = np.asarray(ids[s + 1:s + 1 + len(chunk)])
            with np.errstate(invalid="ignore", over="ignore"):  # non-finite logits: reported just below
                lse = _logsumexp(logits)
            picked = logits[np.arange(len(chunk)), targets]
            finite = np.isfinite(lse) & np.isfinite(picked)  # a NaN or +inf logit in a row makes its logsumexp so
            first = int(np.argmin(finite)) if not finite.all() else len(chunk) - 1
            check_logits(logits[first], s + first + 1, self.config.model_path, "scoring")
            total += float(np.sum(lse - picked))
        n = len(ids) - 1
        self.stats = Stats(prompt_tokens=n, prefill_seconds=time.perf_counter() - t0, finish_reason="scored")
        return {"tokens": n, "nll": total / n, "perplexity": math.exp(total / n)}

    def _eos(self) -> set[int]:
        return set(self.tokenizer.eos_ids) if self.tokenizer else set()


def _rows_of(logits, params: SamplingParams, seen: list[int], drafts: list[int]):
    """``i -> p_i``: the distribution plain sampling draws from at verify row ``i`` (after the drafts before it)."""
    return lambda i: target_probs(logits[i], params, seen + drafts[:i])


def _extras(**options) -> dict:
    """The options of a generation that are given (images: non-empty), to pass on by name."""
    return {k: v for k, v in options.items() if v is not None and (k != "images" or v)}


IMAGE_PARTS = ("image", "image_url", "input_image")


def images_of(messages: list[dict]) -> list:
    """The images of a conversation, in order: the content parts ``{"type": "image", "image": source}`` (source: a
    path, bytes, a PIL image or a data URI) and OpenAI's ``{"type": "image_url", "image_url": {"url": ...}}``,
    which the chat template renders as the family's image placeholder."""
    out = []
    for message in messages:
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(content, list):
            continue
        for part in content:
            if not isinstance(part, dict) or part.get("type") not in IMAGE_PARTS:
                continue
            source = part.get("image", part.get("image_url", part.get("url")))
            if isinstance(source, dict):
                source = source.get("url")
            if source is None:
                raise InputError(f"an image part of a {message.get('role', '?')} message has no image: give "
                                 '{"type": "image", "image": PATH_OR_BYTES_OR_DATA_URI}')
            out.append(source)
    return out


def prepare(source):
    """Config, checkpoint header, architecture and plan: everything before the first weight is read."""
    config = source if isinstance(source, Config) else config_from_path_or_model(source)
    registry = get_registry()
    ckpt = open_checkpoint(config.model_path, registry)
    arch = registry.architecture_class(ckpt.config.get("model_type", "<missing>")).from_checkpoint(ckpt)
    plan, resolved = make_plan(config, arch, ckpt, registry)
    return config, ckpt, arch, plan, resolved


def check_logits(row: np.ndarray, n: int, model_path, doing: str = "generating") -> None:
    """Stop where a healthy model cannot be: a logit that is NaN or infinite (a corrupt weight poisons every logit)
    or one value for every token (a zeroed output layer: the sampler would draw token 0 forever). ``row``: one
    row of logits on the host; ``n``: which token it predicts (1 = the first after the prompt)."""
    finite = np.isfinite(row)
    if finite.all():
        if row.size > 1 and row.min() == row.max():
            raise CheckpointError(
                f"the model produced the same logit ({float(row[0]):g}) for all {row.size} tokens at token {n} "
                f"({doing}): the checkpoint looks corrupt (zeroed weights); {_check_hint(model_path)}"
            )
        return
    bad = row.size - int(np.count_nonzero(finite))
    raise CheckpointError(
        f"the model produced non-finite logits at token {n} ({doing}; {bad} of {row.size} are NaN or infinite): the "
        f"checkpoint looks corrupt; {_check_hint(model_path)}"
    )


def pick_token(row: np.ndarray, sample, seen, logprobs: int | None = None, constraint=None):
    """(token, its TokenLogprob or None): ``sample`` draws from the host row of logits, after ``constraint``'s
    mask; the logprob is of the raw row (what the model gives the token, as ``lumen perplexity`` scores it); the
    constraint then advances past the token."""
    from .logprobs import token_logprob

    tok = sample(row if constraint is None else constraint.mask(row), seen)
    lp = None if logprobs is None else token_logprob(row, tok, logprobs)
    if constraint is not None:
        constraint.advance(tok)
    return tok, lp


def _check_hint(model_path) -> str:
    files = f"{model_path}/*.safetensors" if os.path.isdir(os.path.expanduser(str(model_path))) else str(model_path)
    return f"check it with `sha256sum {files}` against the published checksums, or download it again"


def _logsumexp(x):
    m = x.max(axis=-1)
    return m + np.log(np.exp(x - m[:, None]).sum(axis=-1))


def sampling_params(defaults: dict, overrides: dict) -> SamplingParams:
    """The config's sampling defaults with a request's options on top (None = not given); unknown names raise."""
    names = ("temperature", "top_k", "top_p", "min_p", "seed", "repetition_penalty")
    unknown = set(overrides) - set(names)
    if unknown:
        raise InputError(f"unknown sampling option(s) {sorted(unknown)}; known: {', '.join(names)}")
    merged = {k: defaults[k] for k in names if k in defaults}
    merged.update({k: v for k, v in overrides.items() if v is not None})
    return SamplingParams(**merged)


def _backends(placements: dict, registry) -> dict:
    """One backend instance per device, shared by every component placed there."""
    by_device, out = {}, {}
    for comp, p in placements.items():
        if p.device not in by_device:
            by_device[p.device] = registry.backend_class(p.backend)(p.device, registry)
        out[comp] = by_device[p.device]
    return out


def _configure_cpu(config, backends: dict) -> None:
    """The config's cpu block to the CPU backend, before any weight is read (the int8 repack already runs on the
    pool, and marks the weights whose GEMVs quantize x)."""
    cpus = {id(b): b for b in backends.values() if b.name == "cpu"}
    threads, quant = config.cpu_threads(), config.cpu_compute_quantization()
    for key, value, unset in (("threads", threads, None), ("compute-quantization", quant, "none")):
        if value != unset and not cpus:
            print(f"lumen: note: cpu.{key} ({value}) has no effect: no component computes on the CPU",
                  file=sys.stderr)
    for b in cpus.values():
        if threads is not None:
            b.configure_threads(threads)
        b.configure_compute_quantization(quant)


def _configure_cuda(config, backends: dict) -> None:
    """cuda.compute-quantization to every cuda backend, before any weight is read (each weight it makes is marked:
    ``Weight.activations``); where no component computes on cuda, a note says it has no effect."""
    quant = config.cuda_compute_quantization()
    cudas = {id(b): b for b in backends.values() if b.name == "cuda"}
    if quant != "none" and not cudas:
        print(f"lumen: note: cuda.compute-quantization ({quant}) has no effect: no component computes on cuda",
              file=sys.stderr)
    for b in cudas.values():
        b.configure_compute_quantization(quant)


def _configure_attention(config, backends: dict) -> None:
    """model.attention.compute-quantization fp8 to every backend that computes a layer's token mixer (the plan has
    checked that each has it), before the model makes its KV caches."""
    quant = config.attention_compute_quantization()
    if quant == "none":
        return
    chosen = {id(backends[comp]): backends[comp] for comp in mixer_components(backends)}
    for b in chosen.values():
        b.configure_attention_quantization(quant)


def _note_unused_quantization(config, backends: dict) -> None:
    """cpu.compute-quantization int8 or bf16 where the CPU holds no weight it applies to (int8: GGUF blocks held in
    RAM, NVFP4 experts with the C kernels built; bf16: NVFP4 experts on a CPU with AMX-BF16): say so rather than
    ignore it."""
    cpus = [b for b in backends.values() if b.name == "cpu"]
    if not cpus or any(b.compute_quantization_applies() for b in cpus):
        return
    if config.cpu_compute_quantization() == "bf16":
        print("lumen: note: cpu.compute-quantization (bf16) has no effect: it runs the several-token products of NVFP4 "
              "routed experts in AMX bf16 tiles, and this plan puts no NVFP4 weight on the CPU or this CPU (or its "
              "OS) does not offer AMX-BF16 (LUMEN_CPU_ISA may also cap it below amx)", file=sys.stderr)
        return
    print("lumen: note: cpu.compute-quantization (int8) has no effect: it quantizes the activations of weights in "
          "the CPU's int8 layout (GGUF Q4_0/Q5_0/Q8_0/Q4_K/Q5_K/Q6_K blocks with store ram) and of NVFP4 routed "
          "experts (with lumen-cpu's C kernels built), and this plan puts none on the CPU", file=sys.stderr)


def load(source, progress: bool | Progress | None = None, chat_template: str | os.PathLike | None = None,
         chat: bool = False, think: bool | None = None) -> Engine:
    """Validate, plan and load a config (path, dict, an HF checkpoint directory or a .gguf file) into an Engine.

    ``progress``: report the long phases on stderr (default: on a terminal only). ``chat_template``: a Jinja
    file to chat with instead of the checkpoint's template (default: the config's ``model.chat-template``, else
    the checkpoint's, else the model family's). ``chat=True`` refuses, before any weight is read, a model that
    cannot chat, and a ``think`` its template cannot honour.
    """
    if progress is None:
        progress = sys.stderr.isatty()
    return Engine.load(source, progress=progress, chat_template=chat_template, chat=chat, think=think)


# --- the chat template ---------------------------------------------------------------------------------------


def choose_chat_template(ckpt, fmt: ChatFormat, override,
                         json_path: str | None = None) -> tuple[str | dict | None, str]:
    """(template, where it came from): ``override`` (a file), else the checkpoint's, else the model family's
    (``fmt.template``), as llama.cpp does for a GGUF without one. Reads no tensor and builds no tokenizer.
    ``json_path``: the config key that named ``override`` (its errors are then ConfigErrors naming it)."""
    if override is not None:
        path = os.path.expanduser(os.fspath(override))
        try:
            template = open(path, encoding="utf-8").read()
        except (OSError, UnicodeDecodeError) as exc:
            _template_error(json_path, f"cannot read the chat template file {path}: {getattr(exc, 'strerror', exc)}",
                            "name a UTF-8 Jinja file")
        problem = _jinja_problem(template)
        if problem:
            _template_error(json_path, f"the chat template file {path} is not a valid Jinja template: {problem}",
                            "fix the template or name another file")
        return template, f"from the file {path}"
    template = ckpt.chat_template()
    if template or not fmt.template:
        return template, "checkpoint"
    return fmt.template, (f"{ckpt.path} has none; using the {fmt.name} family's template (set model.chat-template "
                          "or --chat-template FILE to use another)")


def _template_error(json_path: str | None, message: str, fix: str):
    if json_path:
        raise ConfigError(json_path, message, fix)
    raise InputError(f"{message}; {fix}")


def check_chat(template, fmt: ChatFormat, think: bool | None, model_path, tools: list[dict] | None = None) -> None:
    """Refuse a chat the model cannot have: no template at all, a ``think`` switch its template lacks, tools its
    family has no syntax for (their calls could not be read back)."""
    if not template:
        raise InputError(f"{model_path} has no chat template and its chat format ({fmt.name}) supplies none: "
                         "name a Jinja template file (model.chat-template in the config)")
    if think is not None and not (fmt.thinking_kwarg and fmt.thinking_kwarg in str(template)):
        raise InputError(f"thinking on/off: the chat template of {model_path} has no thinking switch "
                         f"({fmt.thinking_kwarg or 'its chat format names none'}); leave thinking unset")
    if tools and fmt.tool_calls is None:
        raise InputError(f"tools: the {fmt.name} chat format has no tool-call syntax, so this model cannot "
                         "call tools; send the request without tools")


def _jinja_problem(source: str) -> str | None:
    """Why ``source`` does not compile as a chat template (None: it does)."""
    import jinja2

    from .tokenizer import compile_template

    try:
        compile_template(source)
    except jinja2.TemplateError as exc:
        return str(exc)
    return None


def _plan_bytes_note(plan: Plan) -> str:
    total = sum(e.nbytes for e in plan.entries if e.kind == "weights")
    return f"{total / 1e6:.0f} MB"
