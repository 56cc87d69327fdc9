"""One loaded engine shared by every request: a FIFO queue served by worker threads.

With ``kv-cache.sequences`` 1 (the default) one worker runs the requests one at a time in arrival order (on CUDA
through the captured decode graph). With ``sequences`` N > 1 the engine batches (``lumen_core.batching``): N
workers each run one request's generation, and the engine's batcher computes the running generations' tokens in
shared steps; requests join and leave the batch between decode steps. Either way each request has its own cache,
so a request's output never depends on the others: N concurrent greedy clients get exactly what each would get
alone. Events travel from a worker to the request's asyncio task through ``loop.call_soon_threadsafe``.

A route ``submit``s its generation (refused with ``QueueFull`` when ``Limits.max_queue`` generations already wait
behind the running ones: before any response has started) and then reads it with ``events`` (a streamed reply) or
``collect`` (a whole one). A generation is cancelled when the request is done with it: a streamed reply's client
went away, or a whole reply's client disconnected while it waited (``collect`` watches for that). The worker
checks between events, and the engine after every token, and closes the generation (it leaves the batch at the
next step); one cancelled while still queued is skipped. A generation that runs past ``Limits.request_timeout`` is
stopped the same way and reported as cut short (``finish_reason`` "length").
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import math
import queue
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field

from .settings import Limits

# Set by whoever runs the app in process (the replicas of ``lumen serve --replicas``, scale_out.call_asgi): called
# on the request's event loop when a worker takes the request's generation. Until then nothing of it has run, so a
# replica that dies before may have it retried elsewhere.
ON_START: contextvars.ContextVar[Callable[[], None] | None] = contextvars.ContextVar("lumen_on_start", default=None)


@dataclass
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens the prefix cache supplied (OpenAI cached_tokens, Anthropic cache_read)
    token_logprobs: list = field(default_factory=list)  # lumen_core.logprobs.TokenLogprob per generated token
    finish_reason: str = "stop"  # stop | length | cancelled (the API layer adds tool_calls)
    timed_out: bool = False  # stopped by the request timeout (finish_reason is then "length")


@dataclass
class Job:
    run: Callable[[], Iterator]  # called on the worker thread: yields events (chat events or text pieces)
    loop: asyncio.AbstractEventLoop
    out: asyncio.Queue
    cancelled: threading.Event = field(default_factory=threading.Event)
    usage: Usage = field(default_factory=Usage)
    queued_at: float = field(default_factory=time.perf_counter)
    started: float = 0.0  # when a worker took it
    on_start: Callable[[], None] | None = None  # ON_START of the request that submitted it

    def cancel(self) -> None:
        """Stop the generation before its next event (a no-op once it finished)."""
        self.cancelled.set()


class QueueFull(Exception):
    """``max_queue`` generations wait already; ``retry_after``: whole seconds a client should wait."""

    def __init__(self, waiting: int, retry_after: int):
        super().__init__(f"the server is busy: {waiting} requests are waiting for the model; retry in "
                         f"{retry_after} s")
        self.retry_after = retry_after


class ClientGone(Exception):
    """The client of a whole reply disconnected before it was ready (the app answers 499, which no one reads)."""


_DONE = object()


# Histogram bucket bounds (seconds): time to first token spans a cached short prompt to a long prefill; the gap
# between tokens a fast GPU step to a CPU one.
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0)


@dataclass
class Histogram:
    bounds: tuple
    counts: list = field(default_factory=list)  # per bound: observations <= it (cumulative at output)
    total: float = 0.0
    n: int = 0

    def __post_init__(self):
        self.counts = [0] * len(self.bounds)

    def observe(self, value: float, times: int = 1) -> None:
        for i, bound in enumerate(self.bounds):
            if value <= bound:
                self.counts[i] += times
                break
        self.total += value * times
        self.n += times

    def lines(self, name: str, help_text: str) -> list[str]:
        out = [f"# HELP {name} {help_text}", f"# TYPE {name} histogram"]
        running = 0
        for bound, count in zip(self.bounds, self.counts, strict=True):
            running += count
            out.append(f'{name}_bucket{{le="{bound:g}"}} {running}')
        out += [f'{name}_bucket{{le="+Inf"}} {self.n}', f"{name}_sum {self.total:.6f}", f"{name}_count {self.n}"]
        return out


@dataclass
class Metrics:
    requests: dict = field(default_factory=dict)  # (route, status) -> count
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens the prefix cache supplied
    spec_verifies: int = 0  # speculative decoding: verify steps, drafted and accepted tokens
    spec_drafted: int = 0
    spec_accepted: int = 0
    spec_plain: int = 0  # tokens decoded plainly by the fallback while drafting was on (SpecStats.plain_rounds)
    latency_sum: float = 0.0
    latency_count: int = 0
    timeouts: int = 0
    queue_wait_sum: float = 0.0  # seconds generations waited for a worker
    queue_wait_count: int = 0
    ttft: Histogram = field(default_factory=lambda: Histogram(TTFT_BUCKETS))
    itl: Histogram = field(default_factory=lambda: Histogram(ITL_BUCKETS))
    engine: object = None  # the engine (its batcher and prefix cache report themselves)

    def prometheus(self, queue_depth: int) -> str:
        lines = ["# HELP lumen_requests_total HTTP requests by route and status.",
                 "# TYPE lumen_requests_total counter"]
        for (route, status), n in sorted(self.requests.items()):
            lines.append(f'lumen_requests_total{{route="{route}",status="{status}"}} {n}')
        lines += ["# HELP lumen_prompt_tokens_total Prompt tokens processed.",
                  "# TYPE lumen_prompt_tokens_total counter", f"lumen_prompt_tokens_total {self.prompt_tokens}",
                  "# HELP lumen_completion_tokens_total Tokens generated.",
                  "# TYPE lumen_completion_tokens_total counter",
                  f"lumen_completion_tokens_total {self.completion_tokens}",
                  "# HELP lumen_request_latency_seconds Time from queueing to the last token.",
                  "# TYPE lumen_request_latency_seconds summary",
                  f"lumen_request_latency_seconds_sum {self.latency_sum:.6f}",
                  f"lumen_request_latency_seconds_count {self.latency_count}",
                  "# HELP lumen_request_timeouts_total Generations stopped by the request timeout.",
                  "# TYPE lumen_request_timeouts_total counter", f"lumen_request_timeouts_total {self.timeouts}",
                  "# HELP lumen_queue_depth Generations waiting or running.", "# TYPE lumen_queue_depth gauge",
                  f"lumen_queue_depth {queue_depth}",
                  "# HELP lumen_queue_wait_seconds Time a generation waited for a free place (summary).",
                  "# TYPE lumen_queue_wait_seconds summary",
                  f"lumen_queue_wait_seconds_sum {self.queue_wait_sum:.6f}",
                  f"lumen_queue_wait_seconds_count {self.queue_wait_count}",
                  "# HELP lumen_cached_prompt_tokens_total Prompt tokens taken from the prefix cache, not prefilled.",
                  "# TYPE lumen_cached_prompt_tokens_total counter",
                  f"lumen_cached_prompt_tokens_total {self.cached_tokens}"]
        if self.spec_verifies or self.spec_plain:
            lines += ["# HELP lumen_speculative_verifies_total Speculative verify steps (one main forward each).",
                      "# TYPE lumen_speculative_verifies_total counter",
                      f"lumen_speculative_verifies_total {self.spec_verifies}",
                      "# HELP lumen_speculative_drafted_tokens_total Tokens the drafter proposed.",
                      "# TYPE lumen_speculative_drafted_tokens_total counter",
                      f"lumen_speculative_drafted_tokens_total {self.spec_drafted}",
                      "# HELP lumen_speculative_accepted_tokens_total Drafted tokens the main model kept "
                      "(/ drafted = acceptance rate; (accepted + verifies) / verifies = tokens per verify).",
                      "# TYPE lumen_speculative_accepted_tokens_total counter",
                      f"lumen_speculative_accepted_tokens_total {self.spec_accepted}",
                      "# HELP lumen_speculative_plain_rounds_total Rounds decoded without drafts (one token each) "
                      "because plain decoding was measured faster, probes included (draft.fallback).",
                      "# TYPE lumen_speculative_plain_rounds_total counter",
                      f"lumen_speculative_plain_rounds_total {self.spec_plain}"]
        lines += self.ttft.lines("lumen_time_to_first_token_seconds",
                                 "From queueing to the first generated token (queue wait, prefill).")
        lines += self.itl.lines("lumen_inter_token_latency_seconds",
                                "Time between two generated tokens (each request's mean, once per token).")
        batcher = getattr(self.engine, "batcher", None)
        if batcher is not None:
            lines += ["# HELP lumen_batch_size Generations in the running batch now.", "# TYPE lumen_batch_size gauge",
                      f"lumen_batch_size {batcher.running}",
                      "# HELP lumen_batch_steps_total Batched forward steps run.",
                      "# TYPE lumen_batch_steps_total counter", f"lumen_batch_steps_total {batcher.steps}",
                      "# HELP lumen_batch_rows_total Sequences summed over batched steps (/ steps = mean batch size).",
                      "# TYPE lumen_batch_rows_total counter", f"lumen_batch_rows_total {batcher.batch_sizes}"]
        prefix = getattr(self.engine, "prefix_cache", None)
        if prefix is not None:
            lines += prefix.metric_lines()
        return "\n".join(lines) + "\n"


class Service:
    def __init__(self, engine, limits: Limits | None = None):
        self.engine = engine
        self.limits = limits or Limits()
        self.metrics = Metrics()
        self.metrics.engine = engine
        self.routes: set[str] = set()  # the app's route paths (metrics label values)
        self._jobs: queue.Queue[Job | None] = queue.Queue()
        self._depth = 0
        self._lock = threading.Lock()
        kv = getattr(getattr(engine, "config", None), "kv_cache", None)
        self.workers = max(1, kv().sequences) if kv is not None else 1
        if self.workers > 1:  # several generations at once: the engine batches their steps
            engine.start_batching(self.workers)
        self._threads = [threading.Thread(target=self._serve, name=f"lumen-engine-{i}", daemon=True)
                         for i in range(self.workers)]
        for thread in self._threads:
            thread.start()

    @property
    def queue_depth(self) -> int:
        return self._depth

    def close(self) -> None:
        for _ in self._threads:
            self._jobs.put(None)

    def submit(self, run: Callable[[], Iterator], usage: Usage | None = None) -> Job:
        """Queue ``run`` (a generator function of the engine); QueueFull when ``max_queue`` jobs wait behind the
        running one. Call it before the response starts, so a refusal is a 429, and read the job with ``events``
        or ``collect``."""
        with self._lock:
            waiting = max(self._depth - self.workers, 0)  # the ones at the front run
            if self._depth >= self.workers and waiting >= self.limits.max_queue:
                raise QueueFull(waiting, self.retry_after())
            self._depth += 1
        job = Job(run, asyncio.get_running_loop(), asyncio.Queue(), usage=usage or Usage(), on_start=ON_START.get())
        self._jobs.put(job)
        return job

    def retry_after(self) -> int:
        """Seconds until a place is likely free: the mean time of a generation so far (at least 1)."""
        m = self.metrics
        return max(1, math.ceil(m.latency_sum / m.latency_count)) if m.latency_count else 1

    async def events(self, job: Job) -> AsyncIterator:
        """The job's events as they come. Leaving the iteration early (a disconnected client) cancels the
        generation. Errors raised by ``run`` re-raise here."""
        try:
            while True:
                item = await job.out.get()
                if item is _DONE:
                    break
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            job.cancel()  # no-op when it finished; stops the worker when the client left early
            self.metrics.latency_sum += time.perf_counter() - job.queued_at
            self.metrics.latency_count += 1

    async def collect(self, job: Job, gone: Callable[[], Awaitable]) -> list:
        """All events of ``job`` (a whole reply). ``gone()`` returns when the client has disconnected: the
        generation is then cancelled and ClientGone raised (there is no one to answer)."""
        watch = self.watch(job, gone)
        try:
            events = [event async for event in self.events(job)]
        finally:
            watch.cancel()
        if watch.done() and not watch.cancelled():
            raise ClientGone()
        return events

    @staticmethod
    def watch(job: Job, gone: Callable[[], Awaitable]) -> asyncio.Task:
        """A task that cancels ``job`` when ``gone()`` returns; cancel the task once the job is done with."""
        async def cancel_when_gone():
            with contextlib.suppress(Exception):  # a failed receive: no client is left to answer either
                await gone()
            job.cancel()

        return asyncio.ensure_future(cancel_when_gone())

    def _serve(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            try:
                if not job.cancelled.is_set():
                    self._run(job)
            except BaseException as exc:  # handed to the request, which turns it into an HTTP error
                job.loop.call_soon_threadsafe(job.out.put_nowait, exc)
            finally:
                with self._lock:
                    self._depth -= 1
                job.loop.call_soon_threadsafe(job.out.put_nowait, _DONE)

    def _run(self, job: Job) -> None:
        job.started = time.perf_counter()
        if job.on_start is not None:
            job.loop.call_soon_threadsafe(job.on_start)
        with self._lock:  # several workers when the engine batches
            self.metrics.queue_wait_sum += job.started - job.queued_at
            self.metrics.queue_wait_count += 1
        timeout = self.limits.request_timeout
        deadline = time.monotonic() + timeout if timeout else math.inf

        def stop() -> bool:
            if job.cancelled.is_set():
                return True
            if time.monotonic() > deadline:
                job.usage.timed_out = True
                return True
            return False

        # checked by the engine after every token too, so a stretch of tokens that makes no event (a tool call
        # being written) cannot outlive its client or its time limit
        self.engine.should_stop = stop
        gen = job.run()
        try:
            for event in gen:
                if job.cancelled.is_set():
                    break
                # known once the prompt is in: the reply's usage (even a stream's first event) can report it
                job.usage.cached_tokens = getattr(self.engine.stats, "cached_tokens", 0)
                job.loop.call_soon_threadsafe(job.out.put_nowait, event)  # what was made before a time limit is sent
                if stop():
                    break
        finally:
            gen.close()
            self.engine.should_stop = None
            if job.cancelled.is_set():
                job.usage.finish_reason = "cancelled"
            elif job.usage.timed_out:
                self.metrics.timeouts += 1
            self._account(job)

    def _account(self, job: Job) -> None:
        with self._lock:  # workers finish concurrently when the engine batches
            self._account_locked(job)

    def _account_locked(self, job: Job) -> None:
        stats, usage = self.engine.stats, job.usage
        usage.prompt_tokens = stats.prompt_tokens
        usage.completion_tokens = stats.generated_tokens
        usage.cached_tokens = stats.cached_tokens
        usage.token_logprobs = stats.token_logprobs
        if usage.timed_out:
            usage.finish_reason = "length"
        elif usage.finish_reason != "cancelled":
            usage.finish_reason = "length" if stats.finish_reason == "length" else "stop"
        self.metrics.prompt_tokens += stats.prompt_tokens
        self.metrics.completion_tokens += stats.generated_tokens
        self.metrics.cached_tokens += stats.cached_tokens
        spec = getattr(stats, "speculative", None)
        if spec is not None:
            self.metrics.spec_verifies += spec.verifies
            self.metrics.spec_drafted += spec.drafted
            self.metrics.spec_accepted += spec.accepted
            self.metrics.spec_plain += spec.plain_rounds
        if stats.generated_tokens:
            self.metrics.ttft.observe(job.started - job.queued_at + stats.prefill_seconds)
        if stats.generated_tokens > 1 and stats.decode_seconds > 0:
            gaps = stats.generated_tokens - 1
            self.metrics.itl.observe(stats.decode_seconds / gaps, gaps)
