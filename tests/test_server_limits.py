"""Issue 15, the server's faults, each reproduced against a real uvicorn server over the tiny Qwen 3.5 checkpoint:

1. API keys: an empty or blank key (``--api-key ""``, ``server-parameters.api-keys``, ``create_app``) is refused at
   startup, never taken as "no authentication".
2. A non-streamed request whose client gives up is cancelled within a few tokens (OpenAI chat and completions,
   Anthropic messages): the worker is free for the next request.
3. Limits: a full queue is a 429 with Retry-After; a generation past the request timeout ends as "length"; a
   max_tokens past the context left is OpenAI's 400 "max_tokens is too large"; a body past the size limit is a 413
   before it is parsed; HEAD /health is a 200.
4. Values the engine cannot honour (a temperature of 1e-310, a repetition penalty of 1e-320, a lone surrogate,
   ``max_tokens: true``) are 400s naming the field, where they were 500s.

Generation is scripted where timing matters (``server_util.slow``: one token every few milliseconds, counted as the
worker computes it); the sampler cases run the real model.
"""

from __future__ import annotations

import json
import threading
import time

import httpx
import openai
import pytest
from server_util import Server, load_tiny, script, slow

from lumen_core.cli import main
from lumen_core.config import load_config
from lumen_core.errors import ConfigError
from lumen_core.server.app import create_app
from lumen_core.server.settings import Limits

CONTEXT = 2048
HI = [{"role": "user", "content": "Hello there"}]
ROUTES = {  # route -> a body asking for far more tokens than a client waits for
    "/v1/completions": {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 1900},
    "/v1/chat/completions": {"model": "tiny", "messages": HI, "max_tokens": 1900},
    "/v1/messages": {"model": "tiny", "messages": HI, "max_tokens": 1900},
}


@pytest.fixture(scope="module")
def engine(tiny_checkpoint):
    return load_tiny(tiny_checkpoint("qwen3_5"), context=CONTEXT)


@pytest.fixture(scope="module")
def server(engine):
    srv = Server(engine)
    yield srv
    srv.stop()


def post(server, route: str, body, **kw) -> httpx.Response:
    """A raw POST; ``body`` a dict (written with json.dumps, so NaN and escaped surrogates go as JSON allows) or
    bytes."""
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {"content-type": "application/json", **kw.pop("headers", {})}
    return httpx.post(server.url + route, content=content, headers=headers, timeout=kw.pop("timeout", 60), **kw)


def openai_error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"], err
    return err


def anthropic_error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    body = r.json()
    assert body["type"] == "error" and set(body["error"]) == {"type", "message"}, body
    return body["error"]


def wait_idle(server, seconds: float = 5.0) -> float:
    """Seconds until the queue is empty (fails past ``seconds``)."""
    t0 = time.perf_counter()
    while server.app.state.service.queue_depth:
        assert time.perf_counter() - t0 < seconds, "the worker is still busy"
        time.sleep(0.01)
    return time.perf_counter() - t0


# --- 1. API keys -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("keys", [[""], ["   "], ["good", ""], [" padded "], ["two\nlines"]])
def test_an_empty_or_blank_api_key_is_a_startup_error_naming_api_key(capsys, keys, tmp_path):
    """Before: `--api-key ""` switched authentication off while printing "(API keys required)". Refused before
    anything loads (the model path does not even exist)."""
    argv = ["serve", "--config", str(tmp_path / "nothing-here.gguf")]
    for key in keys:
        argv += ["--api-key", key]
    with pytest.raises(SystemExit) as info:
        main(argv)
    err = capsys.readouterr().err
    assert info.value.code == 2 and "--api-key" in err and "API key" in err, err
    assert "Traceback" not in err


@pytest.mark.parametrize("key", ["", "  ", "\t", " k ", "k\n"])
def test_a_blank_config_api_key_is_a_config_error_naming_its_path(key, capsys, tmp_path):
    raw = {"model": {"path": str(tmp_path / "missing.gguf")}, "server-parameters": {"api-keys": ["ok", key]}}
    with pytest.raises(ConfigError) as info:  # every command: load_config checks the server block too
        load_config(raw)
    assert info.value.path == "server-parameters.api-keys[1]", info.value
    # `lumen serve` stops there too, with status 2, before the (missing) checkpoint is looked at
    path = tmp_path / "serve.json"
    path.write_text(json.dumps(raw))
    with pytest.raises(SystemExit) as info:
        main(["serve", "--config", str(path)])
    err = capsys.readouterr().err
    assert info.value.code == 2 and "server-parameters.api-keys[1]" in err and "missing.gguf" not in err, err


def test_create_app_refuses_a_blank_key_and_a_real_key_still_works(engine):
    with pytest.raises(ValueError, match=r"api_keys\[1\]"):
        create_app(engine, ["k1", " "])
    srv = Server(engine, api_keys=["k1"])
    try:
        assert httpx.get(srv.url + "/v1/models", headers={"Authorization": "Bearer k1"}).status_code == 200
        for headers in ({"Authorization": "Bearer"}, {"x-api-key": ""}, {}):  # an empty key never gets in
            assert openai_error(httpx.get(srv.url + "/v1/models", headers=headers), 401)["type"] == \
                "authentication_error"
    finally:
        srv.stop()


def test_serve_takes_its_limits_from_the_config_and_the_command_line(capsys, monkeypatch, tiny_checkpoint, tmp_path):
    import uvicorn

    seen = {}
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: seen.update(app=app, **kw))
    raw = {"model": {"path": str(tiny_checkpoint("qwen3_5")), "hidden-layers": {"kv-cache": {"context-size": 512}}},
           "server-parameters": {"api-keys": ["k"], "max-queue": 3, "request-timeout": 5, "max-body-bytes": 4096,
                                 "max-tokens-limit": 7}}
    path = tmp_path / "serve.json"
    path.write_text(json.dumps(raw))
    main(["serve", "--config", str(path), "--max-queue", "9", "--port", "8123"])
    app = seen["app"]
    try:
        assert app.state.limits == Limits(max_queue=9, request_timeout=5, max_body_bytes=4096, max_tokens=7)
        assert seen["port"] == 8123
        err = capsys.readouterr().err
        assert "API keys required; queue 9, timeout 5 s, body 4096 bytes" in err, err
    finally:
        app.state.service.close()


@pytest.mark.parametrize(("key", "value"), [("max-queue", -1), ("request-timeout", -0.5), ("max-body-bytes", 10),
                                            ("max-tokens-limit", 0), ("max-queue", True), ("request-timeout", "1")])
def test_a_bad_limit_in_the_config_is_a_config_error_naming_it(key, value):
    with pytest.raises(ConfigError) as info:
        load_config({"model": {"path": "x.gguf"}, "server-parameters": {key: value}})
    assert info.value.path == f"server-parameters.{key}"


# --- 2. a client that gives up on a whole (non-streamed) reply ---------------------------------------------------

@pytest.mark.parametrize("route", list(ROUTES))
def test_a_client_that_times_out_on_a_whole_reply_frees_the_worker(server, engine, monkeypatch, route):
    """Before: a 1900-token request whose client gave up after 0.5 s generated all 1900 tokens (7.6 s here) for
    nobody while the queue waited. Now the disconnect cancels it within a few tokens."""
    produced: list = []
    slow(engine, monkeypatch, 0.004, produced)
    with pytest.raises(httpx.ReadTimeout):
        post(server, route, ROUTES[route], timeout=0.5)
    wait_idle(server, 3.0)
    assert 0 < len(produced) < 400, len(produced)  # ~125 in the 0.5 s, a few after; never the 1900
    deadline = time.time() + 2  # /metrics counts the request as 499 (client closed request), not as a 200
    while f'route="{route}",status="499"' not in httpx.get(server.url + "/metrics").text:
        assert time.time() < deadline, "no 499 counted"
        time.sleep(0.02)
    # the worker is free: the next request is served at once
    script(engine, monkeypatch, "Hi.")
    t0 = time.perf_counter()
    r = post(server, route, {**ROUTES[route], "max_tokens": 8}, timeout=10)
    assert r.status_code == 200 and time.perf_counter() - t0 < 2.0, r.text


def test_a_client_that_leaves_while_queued_is_skipped(server, engine, monkeypatch):
    """A whole-reply request that gives up while another generation holds the worker never runs at all."""
    produced, start = [], threading.Event()
    slow(engine, monkeypatch, 0.001, produced, start)
    holder = threading.Thread(target=post, args=(server, "/v1/completions", {**ROUTES["/v1/completions"],
                                                                              "max_tokens": 20}))
    holder.start()
    deadline = time.time() + 5
    while server.app.state.service.queue_depth < 1:
        assert time.time() < deadline
        time.sleep(0.01)
    with pytest.raises(httpx.ReadTimeout):
        post(server, "/v1/completions", ROUTES["/v1/completions"], timeout=0.3)
    time.sleep(0.2)  # the server notices the disconnect and marks the waiting job cancelled
    start.set()
    holder.join(10)
    wait_idle(server, 3.0)
    assert len(produced) == 20  # the holder's 20, none of the 1900 of the one that left


def test_a_client_that_leaves_during_a_long_tool_call_stops_it_within_tokens(server, engine, monkeypatch):
    """A tool call being written makes no event until it closes, so the worker's check between events never runs:
    the engine's per-token `should_stop` ends it (before: all 1900 tokens, ~9.5 s here, for nobody)."""
    produced = []
    slow(engine, monkeypatch, 0.005, produced, first="<tool_call>")
    with pytest.raises(httpx.ReadTimeout):
        post(server, "/v1/chat/completions", ROUTES["/v1/chat/completions"], timeout=0.5)
    wait_idle(server, 3.0)
    assert len(produced) < 1000 and engine.should_stop is None  # the hook is the running job's only


def test_the_engine_checks_should_stop_after_every_token(engine):
    """The real generation loop: `should_stop` is asked after each token; True ends it as "cancelled"."""
    asked = []
    engine.should_stop = lambda: asked.append(1) or len(asked) >= 3
    try:
        tokens = list(engine.generate_tokens(engine.encode("Once upon a time"), max_tokens=50,
                                             params=None))
    finally:
        engine.should_stop = None
    assert len(tokens) == 3 and engine.stats.finish_reason == "cancelled"


# --- 3. limits ---------------------------------------------------------------------------------------------------

def test_a_full_queue_is_a_429_with_retry_after(engine, monkeypatch):
    srv = Server(engine, limits=Limits(max_queue=1))
    produced, start = [], threading.Event()
    slow(engine, monkeypatch, 0.001, produced, start)
    body = {**ROUTES["/v1/completions"], "max_tokens": 5}
    threads = [threading.Thread(target=post, args=(srv, "/v1/completions", body)) for _ in range(2)]
    try:
        for t in threads:  # one runs (held by `start`), one waits: the queue is full
            t.start()
            deadline = time.time() + 5
            while srv.app.state.service.queue_depth < threads.index(t) + 1:
                assert time.time() < deadline
                time.sleep(0.01)
        r = post(srv, "/v1/completions", body)
        err = openai_error(r, 429)
        assert int(r.headers["retry-after"]) >= 1 and "busy" in err["message"] and err["code"] == "queue_full"
        r = post(srv, "/v1/messages", {**ROUTES["/v1/messages"], "max_tokens": 5})
        assert anthropic_error(r, 429)["type"] == "rate_limit_error" and "retry-after" in r.headers
        with pytest.raises(openai.RateLimitError):  # what the SDK raises (no retries here)
            openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0).completions.create(
                model="tiny", prompt="Hi", max_tokens=5)
        start.set()
        for t in threads:
            t.join(10)
        assert post(srv, "/v1/completions", body).status_code == 200  # room again
        assert 'route="/v1/completions",status="429"} 2' in httpx.get(srv.url + "/metrics").text
    finally:
        start.set()
        srv.stop()


def test_a_generation_past_the_request_timeout_ends_as_length(engine, monkeypatch):
    srv = Server(engine, limits=Limits(request_timeout=0.3))
    produced: list = []
    slow(engine, monkeypatch, 0.004, produced)
    try:
        t0 = time.perf_counter()
        r = post(srv, "/v1/completions", ROUTES["/v1/completions"])
        took = time.perf_counter() - t0
        assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length", r.text
        assert took < 3.0 and r.json()["usage"]["completion_tokens"] == len(produced) < 400
        assert r.json()["choices"][0]["text"] == engine.tokenizer.decode(produced)  # what was generated so far
        r = post(srv, "/v1/chat/completions", ROUTES["/v1/chat/completions"])
        assert r.json()["choices"][0]["finish_reason"] == "length"
        r = post(srv, "/v1/messages", ROUTES["/v1/messages"])
        assert r.json()["stop_reason"] == "max_tokens" and r.json()["usage"]["output_tokens"] < 400
        with httpx.stream("POST", srv.url + "/v1/chat/completions", json={**ROUTES["/v1/chat/completions"],
                                                                         "stream": True}, timeout=10) as s:
            chunks = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        assert "lumen_request_timeouts_total 4" in httpx.get(srv.url + "/metrics").text
    finally:
        srv.stop()


def test_max_tokens_past_the_context_left_is_openais_400(server, engine, monkeypatch):
    script(engine, monkeypatch, "Hi.")
    n = len(engine.encode("Once upon a time"))
    room = CONTEXT - n
    r = post(server, "/v1/completions", {"model": "tiny", "prompt": "Once upon a time", "max_tokens": room + 1})
    err = openai_error(r, 400)
    assert err["param"] == "max_tokens" and err["message"].startswith(f"max_tokens is too large: {room + 1}.")
    assert f"at most {room} can be generated" in err["message"]
    assert post(server, "/v1/completions", {"model": "tiny", "prompt": "Once upon a time",
                                            "max_tokens": room}).status_code == 200
    r = post(server, "/v1/chat/completions", {"model": "tiny", "messages": HI, "max_completion_tokens": 10**9})
    assert openai_error(r, 400)["param"] == "max_completion_tokens"
    r = post(server, "/v1/messages", {"model": "tiny", "messages": HI, "max_tokens": CONTEXT})
    assert "max_tokens is too large" in anthropic_error(r, 400)["message"]
    with pytest.raises(openai.BadRequestError, match="max_tokens is too large"):  # streamed: before the stream
        openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0).completions.create(
            model="tiny", prompt="Hi", max_tokens=CONTEXT, stream=True)


def test_the_max_tokens_limit(engine, monkeypatch):
    srv = Server(engine, limits=Limits(max_tokens=10))
    script(engine, monkeypatch, "Hi.")
    try:
        err = openai_error(post(srv, "/v1/completions", {"prompt": "Hi", "max_tokens": 11}), 400)
        assert err["param"] == "max_tokens" and "at most 10 tokens per request" in err["message"]
        assert post(srv, "/v1/completions", {"prompt": "Hi", "max_tokens": 10}).status_code == 200
        assert post(srv, "/v1/completions", {"prompt": "Hi"}).status_code == 200  # left out: the default
    finally:
        srv.stop()


def test_a_20_mb_body_is_a_413_in_milliseconds_before_it_is_tokenized(server, engine, monkeypatch):
    """Before: 47 s of tokenizing, then a 400. Now the body is refused before anything parses it."""
    encoded = []
    monkeypatch.setattr(engine, "encode", lambda *a, **k: encoded.append(a) or [1])
    big = json.dumps({"model": "tiny", "prompt": "hello " * (20 * 1024 * 1024 // 6)}).encode()
    assert len(big) > 20_000_000
    t0 = time.perf_counter()
    r = post(server, "/v1/completions", big)
    took = time.perf_counter() - t0
    print(f"\n20 MB body: {r.status_code} in {took * 1000:.0f} ms")
    err = openai_error(r, 413)
    assert "4194304 bytes" in err["message"] and err["code"] == "request_too_large"
    assert took < 2.0 and not encoded, took  # sending 20 MB over loopback included
    # sent in chunks without a Content-Length: counted while read, refused the same
    chunked = httpx.post(server.url + "/v1/messages", content=iter([big[i:i + 65536]
                                                                    for i in range(0, len(big), 65536)]),
                         headers={"content-type": "application/json"}, timeout=30)
    assert anthropic_error(chunked, 413)["type"] == "request_too_large" and not encoded
    # the connection was drained, not reset: the server answers the next request
    assert httpx.get(server.url + "/health").status_code == 200


def test_a_small_body_limit_and_head_health(engine, monkeypatch):
    srv = Server(engine, api_keys=["k1"], limits=Limits(max_body_bytes=2048))
    script(engine, monkeypatch, "Hi.")
    try:
        auth = {"Authorization": "Bearer k1"}
        r = post(srv, "/v1/completions", {"prompt": "x" * 3000}, headers=auth)
        assert openai_error(r, 413)["code"] == "request_too_large"
        assert post(srv, "/v1/completions", {"prompt": "x" * 1000, "max_tokens": 4}, headers=auth).status_code == 200
        r = httpx.head(srv.url + "/health")  # no key needed, as GET
        assert r.status_code == 200 and r.content == b""
        assert httpx.head(srv.url + "/v1/models").status_code == 401  # keys still guard the rest
    finally:
        srv.stop()


def test_head_health_on_an_open_server(server):
    assert httpx.head(server.url + "/health").status_code == 200


# --- 4. values the engine cannot honour: 400s naming the field, never 500s ---------------------------------------

@pytest.mark.parametrize(("field", "value"), [
    ("temperature", 1e-310), ("repetition_penalty", 1e-320), ("temperature", float("nan")),
    ("temperature", float("inf")), ("top_p", float("nan")), ("min_p", float("inf")), ("seed", -1),
    ("repetition_penalty", 1e300),
])
def test_sampling_values_that_cannot_be_honoured_are_400s_naming_the_field(server, field, value):
    for route in ("/v1/completions", "/v1/chat/completions"):
        for stream in (False, True):
            body = {**ROUTES[route], "max_tokens": 4, field: value, "stream": stream}
            err = openai_error(post(server, route, body), 400)
            assert err["param"] == field and err["message"].startswith(f"{field} must be"), err
    if field in ("temperature", "top_p"):  # the Anthropic fields
        for stream in (False, True):
            r = post(server, "/v1/messages", {**ROUTES["/v1/messages"], "max_tokens": 4, field: value,
                                              "stream": stream})
            assert field in anthropic_error(r, 400)["message"]


def test_the_smallest_accepted_temperature_samples_the_real_model(server):
    """1e-5 (MIN_TEMPERATURE) runs the real sampler on the real logits: a reply, not an IndexError."""
    r = post(server, "/v1/completions", {"prompt": "Once upon a time", "max_tokens": 4, "temperature": 1e-5,
                                         "repetition_penalty": 1e-5, "seed": 1})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1, r.text


@pytest.mark.parametrize(("route", "body", "named"), [
    ("/v1/completions", {"prompt": "a \ud800 b"}, "prompt"),
    ("/v1/completions", {"prompt": ["\udc00"]}, "prompt[0]"),
    ("/v1/completions", {"prompt": "ok", "stop": ["\ud800"]}, "stop[0]"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "\ud800"}]}, "messages[0].content"),
    ("/v1/chat/completions", {"messages": HI, "model": "\udfff"}, "model"),
    ("/v1/messages", {"model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "\ud800x"}]}]}, "messages[0].content[0].text"),
    ("/v1/messages", {"model": "tiny", "max_tokens": 4, "system": "\ud800", "messages": HI}, "system"),
])
def test_a_lone_surrogate_is_a_400_naming_the_field(server, route, body, named):
    """Before: a TypeError from the tokenizer, a 500. A surrogate pair (an emoji escaped by json.dumps) is fine."""
    r = post(server, route, body)
    assert r.status_code == 400, r.text
    message = r.json()["error"]["message"]
    assert f"{named} holds a lone UTF-16 surrogate" in message, message


def test_a_surrogate_pair_is_text(server, engine, monkeypatch):
    script(engine, monkeypatch, "Hi.")
    r = post(server, "/v1/completions", {"prompt": "smile \U0001F600", "max_tokens": 4})  # sent as \\ud83d\\ude00
    assert r.status_code == 200, r.text


@pytest.mark.parametrize(("route", "field", "value"), [
    ("/v1/completions", "max_tokens", True), ("/v1/completions", "max_tokens", 4.0),
    ("/v1/completions", "seed", True), ("/v1/completions", "temperature", True), ("/v1/completions", "stream", "yes"),
    ("/v1/chat/completions", "max_completion_tokens", False), ("/v1/chat/completions", "top_k", "5"),
    ("/v1/messages", "max_tokens", True), ("/v1/messages", "stream", 1), ("/v1/messages", "temperature", "0"),
])
def test_a_json_value_of_the_wrong_type_is_a_400_naming_the_field(server, route, field, value):
    """``true`` is not the integer 1 and "yes" is not a boolean: refused, not converted."""
    r = post(server, route, {**ROUTES[route], "max_tokens": 4, field: value})
    assert r.status_code == 400, r.text
    body = r.json()
    message = body["error"]["message"]
    assert field in message, message


def test_image_limits_come_from_the_config_and_the_options():
    from lumen_core.config import load_config
    from lumen_core.server.settings import Limits

    config = load_config({"model": {"path": "m"}, "server-parameters": {"fetch-timeout": 2.5, "fetch-max-bytes": 1000,
                                                                        "max-images": 3}})
    limits = Limits.from_parameters(config.server_parameters())
    assert (limits.fetch_timeout, limits.fetch_max_bytes, limits.max_images) == (2.5, 1000, 3)
    assert Limits.from_parameters(config.server_parameters(), max_images=0, fetch_timeout=None).max_images == 0
    from lumen_core.errors import ConfigError

    with pytest.raises(ConfigError) as info:
        load_config({"model": {"path": "m"}, "server-parameters": {"fetch-timeout": 0}})
    assert info.value.path == "server-parameters.fetch-timeout"
