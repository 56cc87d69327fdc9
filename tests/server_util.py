"""A real `lumen serve` app on loopback for tests: uvicorn in a thread on a free port."""

from __future__ import annotations

import socket
import threading
import time

import lumen_core as lumen
from lumen_core.engine import Stats


def load_tiny(path, context: int = 512):
    return lumen.load({"model": {"path": str(path), "hidden-layers": {"kv-cache": {"context-size": context}}}},
                      progress=False)


class Server:
    """``Server(engine, api_keys)`` starts; ``.url`` is ``http://127.0.0.1:PORT``; ``.stop()`` stops. ``server_api``:
    ``openai`` or ``anthropic`` serves only that API (None: both)."""

    def __init__(self, engine, api_keys=None, model_name: str = "tiny", limits=None, server_api=None):
        import uvicorn

        from lumen_core.server.app import create_app

        self.app = create_app(engine, api_keys, model_name, limits, server_api)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(self.app, host="127.0.0.1", port=self.port, log_level="warning")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.time() + 20
        while not self.server.started:
            if time.time() > deadline:
                raise RuntimeError("the test server did not start")
            time.sleep(0.02)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.app.state.service.close()


def script(engine, monkeypatch, reply: str, prompts: list | None = None):
    """Make ``engine`` 'generate' exactly the tokens of ``reply`` (then an end-of-turn token when ``max_tokens``
    leaves room), keeping ``engine.stats`` as the real loop does; each prompt is appended to ``prompts`` as text.
    Servers run generation on a worker thread, which calls this same engine object."""
    ids = engine.tokenizer.backend.encode(reply, add_special_tokens=False).ids

    def fake(prompt_ids, max_tokens=256, params=None, **_):  # a constraint (forced calls) is not applied
        if prompts is not None:
            prompts.append(engine.tokenizer.decode(list(prompt_ids), skip_special_tokens=False))
        engine.stats = st = Stats(prompt_tokens=len(prompt_ids), finish_reason="length")
        for tok in ids[:max_tokens]:
            st.generated_tokens += 1
            yield tok
        if len(ids) < max_tokens:
            st.generated_tokens += 1  # the end-of-turn token
            st.finish_reason = "stop"

    monkeypatch.setattr(engine, "generate_tokens", fake)


def slow(engine, monkeypatch, delay: float, produced: list, start: threading.Event | None = None,
         first: str | None = None):
    """Make ``engine`` 'generate' the token of " word" every ``delay`` seconds until ``max_tokens`` (no end-of-turn
    token), appending each to ``produced``: what the worker computed, whether or not anyone read it. ``start``:
    wait for it before the first token (a generation that holds the worker until the test lets it go). ``first``:
    a text whose tokens come first (e.g. a tool-call opener, after which the reply makes no event). Like the real
    `Engine.generate_tokens`, it ends early when ``engine.should_stop()`` says so after a token."""
    tok = engine.tokenizer.backend.encode(" word", add_special_tokens=False).ids[0]
    head = engine.tokenizer.backend.encode(first, add_special_tokens=False).ids if first else []

    def fake(prompt_ids, max_tokens=256, params=None, **_):  # a constraint (forced calls) is not applied
        engine.stats = st = Stats(prompt_tokens=len(prompt_ids), finish_reason="length")
        if start is not None:
            start.wait(30)
        for i in range(max_tokens):
            time.sleep(delay)
            st.generated_tokens += 1
            produced.append(head[i] if i < len(head) else tok)
            yield produced[-1]
            if engine.should_stop is not None and engine.should_stop():
                st.finish_reason = "cancelled"
                return

    monkeypatch.setattr(engine, "generate_tokens", fake)
