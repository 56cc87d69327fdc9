"""One loaded engine shared by every request: a FIFO queue served by one worker thread.

The engine (its weights, its decode graph) is not re-entrant, so requests run one at a time in arrival order;
each gets its own cache (the engine makes one per generation), so a request's output never depends on the
others: N concurrent greedy clients get exactly what each would get alone. Events travel from the worker to the
request's asyncio task through ``loop.call_soon_threadsafe``. A request whose client went away is cancelled: the
worker checks between tokens and closes the generation.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field


@dataclass
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    finish_reason: str = "stop"  # stop | length | tool_calls (set by the API layer) | cancelled


@dataclass
class Job:
    run: Callable[[], Iterator]  # called on the worker thread: yields events (chat events or text pieces)
    loop: asyncio.AbstractEventLoop
    out: asyncio.Queue
    cancelled: threading.Event = field(default_factory=threading.Event)
    usage: Usage = field(default_factory=Usage)


_DONE = object()


@dataclass
class Metrics:
    requests: dict = field(default_factory=dict)  # (route, status) -> count
    prompt_tokens: int = 0
    completion_tokens: int = 0
    latency_sum: float = 0.0
    latency_count: int = 0

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
                  "# HELP lumen_queue_depth Generations waiting or running.", "# TYPE lumen_queue_depth gauge",
                  f"lumen_queue_depth {queue_depth}"]
        return "\n".join(lines) + "\n"


class Service:
    def __init__(self, engine):
        self.engine = engine
        self.metrics = Metrics()
        self.routes: set[str] = set()  # the app's route paths (metrics label values)
        self._jobs: queue.Queue[Job | None] = queue.Queue()
        self._depth = 0
        self._lock = threading.Lock()
        self._worker = threading.Thread(target=self._serve, name="lumen-engine", daemon=True)
        self._worker.start()

    @property
    def queue_depth(self) -> int:
        return self._depth

    def close(self) -> None:
        self._jobs.put(None)

    async def stream(self, run: Callable[[], Iterator], usage: Usage | None = None) -> AsyncIterator:
        """Queue ``run`` (a generator function of the engine) and yield its events here as they come. Leaving the
        iteration early (a disconnected client) cancels the generation. Errors raised by ``run`` re-raise here."""
        loop = asyncio.get_running_loop()
        job = Job(run, loop, asyncio.Queue(), usage=usage or Usage())
        with self._lock:
            self._depth += 1
        self._jobs.put(job)
        t0 = time.perf_counter()
        try:
            while True:
                item = await job.out.get()
                if item is _DONE:
                    break
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            job.cancelled.set()  # no-op when it finished; stops the worker when the client left early
            self.metrics.latency_sum += time.perf_counter() - t0
            self.metrics.latency_count += 1

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
        gen = job.run()
        try:
            for event in gen:
                if job.cancelled.is_set():
                    job.usage.finish_reason = "cancelled"
                    break
                job.loop.call_soon_threadsafe(job.out.put_nowait, event)
        finally:
            gen.close()
            stats = self.engine.stats
            job.usage.prompt_tokens = stats.prompt_tokens
            job.usage.completion_tokens = stats.generated_tokens
            if job.usage.finish_reason != "cancelled":
                job.usage.finish_reason = "length" if stats.finish_reason == "length" else "stop"
            self.metrics.prompt_tokens += stats.prompt_tokens
            self.metrics.completion_tokens += stats.generated_tokens
