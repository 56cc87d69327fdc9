"""Images through both APIs of `lumen serve` (issue 17): the real `openai` and `anthropic` SDKs against real
servers on loopback.

* A text-only engine (tiny Qwen 3.5, no vision block): an image is a 400 in each API's shape with the engine's
  "no vision tower loaded ... add a vision block" message, before anything is queued.
* A tiny Qwen 3.5 checkpoint with a vision tower, loaded with ``"vision": {"compute": "cpu"}``: URL fetch failures
  (refused port, unroutable address, HTTP errors, an HTML page, too big, a slow sender, bad schemes and redirects)
  are 400s naming the URL and the reason, within a bounded time; malformed parts and bad images are 400s naming
  the field.
* ``fetch_image`` on its own against a local ``http.server`` thread (the success path and the failures).
* The conversion of each API's request into the engine's messages: image parts in place among the text parts.
"""

from __future__ import annotations

import base64
import http.server
import io
import socket
import struct
import threading
import time
import zlib

import anthropic
import openai
import pytest
from PIL import Image
from server_util import Server, load_tiny, script

import lumen_core as lumen
from lumen_core.server.anthropic_api import MessageParam, to_openai_messages
from lumen_core.server.fetch import FetchError, fetch_image
from lumen_core.server.openai_api import ChatRequest, _messages
from lumen_core.server.settings import Limits

FETCH_TIMEOUT = 1.5
FETCH_MAX = 256 * 1024


def png(width: int = 40, height: int = 30, color=(200, 40, 30)) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (width, height), color).save(out, "PNG")
    return out.getvalue()


PNG = png()
PNG_B64 = base64.b64encode(PNG).decode()
DATA_URI = "data:image/png;base64," + PNG_B64


def bomb_png(width: int = 30000, height: int = 30000) -> bytes:
    """A PNG whose header claims width x height pixels (past PIL's decompression-bomb limit) and holds no data."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0))
            + chunk(b"IEND", b""))


def user(*parts) -> list[dict]:
    return [{"role": "user", "content": list(parts)}]


def oa_image(url: str, **extra) -> dict:
    return {"type": "image_url", "image_url": {"url": url, **extra}}


def an_image(data: str = PNG_B64, media_type: str = "image/png") -> dict:
    return {"type": "image", "source": {"type": "base64", "media_type": media_type, "data": data}}


def an_url(url: str) -> dict:
    return {"type": "image", "source": {"type": "url", "url": url}}


TEXT = {"type": "text", "text": "What is in the picture?"}


# --- a local HTTP server for the fetches ---------------------------------------------------------------------


class _Handler(http.server.BaseHTTPRequestHandler):
    def log_message(self, *args):  # quiet
        pass

    def _send(self, status: int, body: bytes, kind: str = "image/png", headers: dict | None = None):
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):  # noqa: N802 (http.server's name)
        path = self.path
        if path == "/cat.png":
            self._send(200, PNG)
        elif path == "/page":
            self._send(200, b"<html>not here</html>", "text/html; charset=utf-8")
        elif path == "/missing.png":
            self._send(404, b"no", "text/plain")
        elif path == "/broken.png":
            self._send(500, b"oops", "text/plain")
        elif path == "/big.png":
            self._send(200, b"\x89PNG" + b"\0" * (FETCH_MAX * 2), "image/png")
        elif path == "/big-undeclared.png":  # no Content-Length: read until the limit, then stop
            self.send_response(200)
            self.send_header("Content-Type", "image/png")
            self.end_headers()
            try:
                for _ in range(64):
                    self.wfile.write(b"\0" * 65536)
            except OSError:
                pass
            self.close_connection = True
        elif path == "/garbage.bin":
            self._send(200, b"this is no image at all" * 10, "application/octet-stream")
        elif path == "/truncated.png":
            self._send(200, PNG[:60])
        elif path == "/bomb.png":
            self._send(200, bomb_png())
        elif path == "/slow.png":  # a byte every 0.3 s for a minute
            self.send_response(200)
            self.send_header("Content-Type", "image/png")
            self.send_header("Content-Length", "200")
            self.end_headers()
            try:
                for _ in range(200):
                    self.wfile.write(b"\0")
                    self.wfile.flush()
                    time.sleep(0.3)
            except OSError:
                pass
        elif path == "/loop":
            self._send(302, b"", "text/plain", {"Location": "/loop2"})
        elif path == "/loop2":
            self._send(302, b"", "text/plain", {"Location": "/loop"})
        elif path.startswith("/chain/"):
            n = int(path.rsplit("/", 1)[1])
            target = "/cat.png" if n == 0 else f"/chain/{n - 1}"
            self._send(302, b"", "text/plain", {"Location": target})
        elif path == "/to-file":
            self._send(302, b"", "text/plain", {"Location": "file:///etc/passwd"})
        else:
            self._send(404, b"?", "text/plain")


@pytest.fixture(scope="module")
def files():
    """``http://127.0.0.1:PORT`` of a threaded http.server serving the routes above."""
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    httpd.daemon_threads = True
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


@pytest.fixture(scope="module")
def refused_url():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}/cat.png"  # nothing listens there now


UNROUTABLE = "http://10.255.255.1/cat.png"  # a private address nobody answers: a connect that times out


# --- fetch_image on its own ---------------------------------------------------------------------------------


def test_fetch_image_gets_the_bytes_and_follows_redirects(files):
    assert fetch_image(files + "/cat.png", timeout=5) == PNG
    assert fetch_image(files + "/chain/3", timeout=5) == PNG


@pytest.mark.parametrize(("path", "reason"), [
    ("/missing.png", "HTTP 404"), ("/broken.png", "HTTP 500"), ("/page", "text/html, not an image"),
    ("/big.png", "over the 256.0 KiB limit"), ("/big-undeclared.png", "stopped reading past it"),
    ("/loop", "redirect"), ("/chain/9", "more than 5 redirects"), ("/to-file", "only http(s) redirects"),
])
def test_fetch_image_failures_name_the_url_and_the_reason(files, path, reason):
    with pytest.raises(FetchError) as info:
        fetch_image(files + path, timeout=5, max_bytes=FETCH_MAX)
    reason = reason.replace("256.0 KiB", "262144 bytes")
    assert files + path in str(info.value) and reason in str(info.value)


def test_fetch_image_is_bounded_in_time(files, refused_url):
    for url, reason in ((refused_url, "refused"), (UNROUTABLE, ""), (files + "/slow.png", "timeout"),
                        ("http://lumen-test-host.invalid/x.png", "")):
        t0 = time.monotonic()
        with pytest.raises(FetchError) as info:
            fetch_image(url, timeout=1.0)
        elapsed = time.monotonic() - t0
        assert elapsed < 2.0, (url, elapsed)
        assert url in str(info.value) and reason in str(info.value)


@pytest.mark.parametrize("url", ["file:///etc/passwd", "ftp://example.com/a.png", "gopher://x/", "/etc/passwd",
                                 "http:///nohost.png"])
def test_fetch_image_refuses_other_schemes_before_opening_anything(url):
    t0 = time.monotonic()
    with pytest.raises(FetchError, match="only http:// and https://|no host"):
        fetch_image(url)
    assert time.monotonic() - t0 < 0.5


# --- the conversion of each API's messages --------------------------------------------------------------------


def test_openai_parts_become_the_engines_in_place():
    req = ChatRequest.model_validate({"messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "First"}, {"type": "text", "text": "second"},
                                     oa_image(DATA_URI, detail="low"), {"type": "text", "text": "between"},
                                     oa_image("https://example.com/b.png"), {"type": "text", "text": "last"}]},
        {"role": "assistant", "content": "Seen."},
        {"role": "user", "content": [oa_image(DATA_URI)]},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]})
    refs = []
    out = _messages(req.messages, refs)
    assert out[0] == {"role": "system", "content": "Be brief."}
    assert out[1]["content"] == [{"type": "text", "text": "First\nsecond"}, {"type": "image", "image": DATA_URI},
                                 {"type": "text", "text": "between"},
                                 {"type": "image", "image": "https://example.com/b.png"},
                                 {"type": "text", "text": "last"}]
    assert out[3]["content"] == [{"type": "image", "image": DATA_URI}]
    assert out[4]["content"] == "a\nb"  # text-only lists: joined as before
    assert [(r.field, r.url) for r in refs] == [("messages[1].content[2].image_url.url", None),
                                                ("messages[1].content[4].image_url.url", "https://example.com/b.png"),
                                                ("messages[3].content[0].image_url.url", None)]
    assert refs[1].part is out[1]["content"][3]  # a fetch replaces the URL in the message itself


def test_anthropic_blocks_become_the_engines_in_place():
    messages = [MessageParam.model_validate(m) for m in [
        {"role": "user", "content": [an_image(), {"type": "text", "text": "What is it?"},
                                     {"type": "text", "text": "Briefly."}, an_url("https://example.com/c.png")]},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "look", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1",
                                      "content": [{"type": "text", "text": "here"}, an_image()]},
                                     {"type": "text", "text": "And this?"}, an_image()]}]]
    refs = []
    out = to_openai_messages(messages, "Be brief.", refs)
    assert out[0] == {"role": "system", "content": "Be brief."}
    assert out[1] == {"role": "user", "content": [
        {"type": "image", "image": PNG}, {"type": "text", "text": "What is it?\nBriefly."},
        {"type": "image", "image": "https://example.com/c.png"}]}
    assert out[3] == {"role": "tool", "tool_call_id": "t1",
                      "content": [{"type": "text", "text": "here"}, {"type": "image", "image": PNG}]}
    assert out[4] == {"role": "user", "content": [{"type": "text", "text": "And this?"},
                                                  {"type": "image", "image": PNG}]}
    assert [r.field for r in refs] == ["messages[0].content[0].source.data", "messages[0].content[3].source.url",
                                       "messages[2].content[0].content[1].source.data",
                                       "messages[2].content[2].source.data"]


def test_the_engine_reads_the_images_in_prompt_order():
    from lumen_core.engine import images_of

    req = ChatRequest.model_validate({"messages": [
        {"role": "user", "content": [oa_image("data:image/png;base64,AAAA"), TEXT, oa_image(DATA_URI)]}]})
    assert images_of(_messages(req.messages)) == ["data:image/png;base64,AAAA", DATA_URI]


# --- a text-only engine ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def text_engine(tiny_checkpoint):
    return load_tiny(tiny_checkpoint("qwen3_5"), context=2048)


@pytest.fixture(scope="module")
def text_server(text_engine):
    srv = Server(text_engine)
    yield srv
    srv.stop()


def _clients(server):
    return (openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=30),
            anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=30))


def test_a_text_only_engine_answers_images_with_how_to_load_a_tower(text_server, text_engine, monkeypatch, files):
    prompts: list = []
    script(text_engine, monkeypatch, "never", prompts)
    oa, an = _clients(text_server)
    for stream in (False, True):
        for url in (DATA_URI, files + "/cat.png"):
            with pytest.raises(openai.BadRequestError) as info:
                oa.chat.completions.create(model="tiny", messages=user(TEXT, oa_image(url)), max_tokens=4,
                                           stream=stream)
            error = info.value.body
            assert "no vision tower loaded" in error["message"] and "vision block" in error["message"]
            assert error["type"] == "invalid_request_error"
        for image in (an_image(), an_url(files + "/cat.png")):
            with pytest.raises(anthropic.BadRequestError) as info:
                an.messages.create(model="tiny", max_tokens=4, messages=user(image, TEXT), stream=stream)
            assert info.value.body["type"] == "error"
            assert info.value.body["error"]["type"] == "invalid_request_error"
            assert "no vision tower loaded" in info.value.body["error"]["message"]
    with pytest.raises(anthropic.BadRequestError, match="no vision tower loaded"):
        an.messages.count_tokens(model="tiny", messages=user(an_image(), TEXT))
    assert prompts == []  # refused before the queue: nothing generated
    oa.chat.completions.create(model="tiny", messages=user(TEXT), max_tokens=2)  # text still goes through
    assert len(prompts) == 1 and "<|image_pad|>" not in prompts[0]


# --- an engine with a vision tower ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def vl_engine(tiny_checkpoint):
    return lumen.load({"model": {"path": str(tiny_checkpoint("qwen3_5_vl")),
                                 "hidden-layers": {"kv-cache": {"context-size": 2048}}},
                       "vision": {"compute": "cpu"}}, progress=False)


@pytest.fixture(scope="module")
def vl_server(vl_engine):
    srv = Server(vl_engine, limits=Limits(fetch_timeout=FETCH_TIMEOUT, fetch_max_bytes=FETCH_MAX, max_images=4))
    yield srv
    srv.stop()


def _oa_error(oa, *parts) -> str:
    t0 = time.monotonic()
    with pytest.raises(openai.BadRequestError) as info:
        oa.chat.completions.create(model="tiny", messages=user(*parts), max_tokens=4)
    assert time.monotonic() - t0 < FETCH_TIMEOUT + 1.5
    return info.value.body["message"]


def _an_error(an, *blocks, count: bool = False) -> str:
    t0 = time.monotonic()
    with pytest.raises(anthropic.BadRequestError) as info:
        if count:
            an.messages.count_tokens(model="tiny", messages=user(*blocks))
        else:
            an.messages.create(model="tiny", max_tokens=4, messages=user(*blocks))
    assert time.monotonic() - t0 < FETCH_TIMEOUT + 1.5
    return info.value.body["error"]["message"]


def test_url_fetch_failures_are_quick_400s_naming_the_url(vl_server, vl_engine, monkeypatch, files, refused_url):
    prompts: list = []
    script(vl_engine, monkeypatch, "never", prompts)
    oa, an = _clients(vl_server)
    cases = [(refused_url, "refused"), (UNROUTABLE, ""), (files + "/slow.png", "timeout"),
             (files + "/missing.png", "HTTP 404"), (files + "/page", "not an image"),
             (files + "/big.png", "limit"), (files + "/chain/9", "more than 5 redirects"),
             (files + "/to-file", "only http(s) redirects")]
    for url, reason in cases:
        message = _oa_error(oa, TEXT, oa_image(url))
        assert message.startswith("messages[0].content[1].image_url.url: could not fetch " + url), message
        assert reason in message
        message = _an_error(an, an_url(url), TEXT)
        assert message.startswith("messages[0].content[0].source.url: could not fetch " + url), message
        assert reason in message
    assert "source.url: could not fetch" in _an_error(an, an_url(refused_url), count=True)
    assert prompts == []


@pytest.mark.parametrize("url", ["file:///etc/passwd", "ftp://example.com/a.png", "example.com/a.png"])
def test_other_schemes_are_400s_without_a_fetch(vl_server, url):
    oa, an = _clients(vl_server)
    assert "only http:// and https://" in _oa_error(oa, oa_image(url), TEXT)
    assert "only http:// and https://" in _an_error(an, an_url(url), TEXT)


def test_malformed_parts_name_the_field(vl_server):
    oa, an = _clients(vl_server)
    assert _oa_error(oa, TEXT, {"type": "image_url", "image_url": {}}).startswith(
        "messages[0].content[1].image_url.url: a string is required")
    assert _oa_error(oa, {"type": "image_url"}).startswith("messages[0].content[0].image_url must be an object")
    assert _oa_error(oa, oa_image(DATA_URI, detail="huge")).startswith(
        "messages[0].content[0].image_url.detail: 'huge'")
    assert _oa_error(oa, oa_image("data:image/png;base64,@@@not base64@@@")).startswith(
        "messages[0].content[0].image_url.url: the data URI's base64 data is bad")
    assert "'text/plain', not an image" in _oa_error(oa, oa_image("data:text/plain;base64,aGVsbG8="))
    assert _an_error(an, {"type": "image", "source": {"type": "base64", "media_type": "image/png"}}).startswith(
        "messages[0].content[0].source.data: the image's base64 data")
    assert _an_error(an, an_image("@@@not base64@@@")).startswith(
        "messages[0].content[0].source.data: not valid base64")
    assert _an_error(an, TEXT, an_image(media_type="application/pdf")).startswith(
        "messages[0].content[1].source.media_type: 'application/pdf' is not an image type")
    assert _an_error(an, {"type": "image"}).startswith("messages[0].content[0].source: an image block needs")
    assert _an_error(an, {"type": "image", "source": {"type": "file", "file_id": "f"}}).startswith(
        "messages[0].content[0].source: file sources")
    assert _an_error(an, {"type": "image", "source": {"type": "url"}}).startswith(
        "messages[0].content[0].source.url: an http(s) URL")
    # images where the APIs take none
    with pytest.raises(openai.BadRequestError, match=r"messages\[0\].content\[0\]: image_url parts are taken in "
                                                     "user messages only"):
        oa.chat.completions.create(model="tiny", max_tokens=4, messages=[
            {"role": "system", "content": [oa_image(DATA_URI)]}, {"role": "user", "content": "Hi"}])
    with pytest.raises(anthropic.BadRequestError, match=r"system\[0\]: image blocks are taken in user messages"):
        an.messages.create(model="tiny", max_tokens=4, system=[an_image()], messages=user(TEXT))
    with pytest.raises(anthropic.BadRequestError, match=r"messages\[1\].content\[0\]: image blocks are taken"):
        an.messages.create(model="tiny", max_tokens=4, messages=[
            {"role": "user", "content": "Hi"}, {"role": "assistant", "content": [an_image()]},
            {"role": "user", "content": "Hi"}])


def test_bad_images_are_400s_with_the_loaders_message(vl_server, files):
    oa, an = _clients(vl_server)
    garbage = base64.b64encode(b"this is no image at all" * 10).decode()
    truncated = base64.b64encode(PNG[:60]).decode()
    bomb = base64.b64encode(bomb_png()).decode()
    for data, reason in ((garbage, "not an image"), (truncated, "truncated PNG"),
                         (bomb, "decompression bomb")):
        message = _oa_error(oa, oa_image("data:image/png;base64," + data))
        assert message.startswith("messages[0].content[0].image_url.url: ") and reason in message, message
        message = _an_error(an, TEXT, an_image(data))
        assert message.startswith("messages[0].content[1].source.data: ") and reason in message, message
    for path, reason in (("/garbage.bin", "not an image"), ("/truncated.png", "truncated PNG"),
                         ("/bomb.png", "decompression bomb")):
        message = _oa_error(oa, oa_image(files + path))
        assert message.startswith(f"messages[0].content[0].image_url.url ({files + path}): ") and reason in message
    assert "at most 4 per request" in _oa_error(oa, *[oa_image(DATA_URI)] * 5)


# --- end to end: the tiny Qwen 3.5 with its vision tower ------------------------------------------------------------

RED, BLUE = png(40, 30, (200, 40, 30)), png(56, 28, (20, 60, 220))


def _direct(engine, messages, think=None):
    """(content, reasoning, prompt tokens) of Engine.chat itself, greedy, 8 tokens."""
    from lumen_core.chat import collect

    content, reasoning, _ = collect(list(engine.chat(messages, think=think, max_tokens=8, temperature=0)))
    return content, reasoning, engine.stats.prompt_tokens


def test_openai_image_replies_equal_the_engines(vl_server, vl_engine, files):
    oa, _ = _clients(vl_server)
    b64 = base64.b64encode(BLUE).decode()
    parts = [{"type": "text", "text": "Compare"}, oa_image(files + "/cat.png", detail="high"),
             {"type": "text", "text": "with"}, oa_image("data:image/png;base64," + b64)]
    reply = oa.chat.completions.create(model="tiny", messages=[{"role": "user", "content": parts}], max_tokens=8,
                                       temperature=0)
    content, reasoning, n = _direct(vl_engine, [{"role": "user", "content": [
        {"type": "text", "text": "Compare"}, {"type": "image", "image": PNG}, {"type": "text", "text": "with"},
        {"type": "image", "image": BLUE}]}])
    message = reply.choices[0].message
    assert (message.content or "", getattr(message, "reasoning_content", None) or "") == (content, reasoning)
    assert reply.usage.prompt_tokens == n > 60  # the images' tokens counted (the text alone is ~20)
    # the images in the other order: another prompt, the same count; streamed = whole
    swapped = [parts[0], parts[3], parts[2], parts[1]]
    chunks = list(oa.chat.completions.create(model="tiny", messages=[{"role": "user", "content": swapped}],
                                             max_tokens=8, temperature=0, stream=True,
                                             stream_options={"include_usage": True}))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    content, _, n2 = _direct(vl_engine, [{"role": "user", "content": [
        {"type": "text", "text": "Compare"}, {"type": "image", "image": BLUE}, {"type": "text", "text": "with"},
        {"type": "image", "image": PNG}]}])
    assert streamed == content and chunks[-1].usage.prompt_tokens == n2 == n


def test_anthropic_image_replies_equal_the_engines(vl_server, vl_engine, files):
    _, an = _clients(vl_server)
    blocks = [an_url(files + "/cat.png"), {"type": "text", "text": "What is it?"}]
    msg = an.messages.create(model="tiny", max_tokens=8, messages=user(*blocks), extra_body={"temperature": 0})
    content, reasoning, n = _direct(vl_engine, [{"role": "user", "content": [
        {"type": "image", "image": PNG}, {"type": "text", "text": "What is it?"}]}], think=False)
    assert "".join(b.text for b in msg.content if b.type == "text") == content
    assert msg.usage.input_tokens == n
    assert an.messages.count_tokens(model="tiny", messages=user(*blocks)).input_tokens == n
    # base64, and an image inside a tool result
    tool_turns = [{"role": "user", "content": "Look at the picture"},
                  {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "camera", "input": {}}]},
                  {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1",
                                                "content": [{"type": "text", "text": "snap"},
                                                            an_image(base64.b64encode(BLUE).decode())]}]}]
    tools = [{"name": "camera", "description": "Takes a picture", "input_schema": {"type": "object",
                                                                                   "properties": {}}}]
    msg = an.messages.create(model="tiny", max_tokens=8, messages=tool_turns, tools=tools,
                             extra_body={"temperature": 0})
    from lumen_core.chat import collect

    events = list(vl_engine.chat([
        {"role": "user", "content": "Look at the picture"},
        {"role": "assistant", "content": "", "tool_calls": [{"id": "t1", "type": "function",
                                                             "function": {"name": "camera", "arguments": {}}}]},
        {"role": "tool", "tool_call_id": "t1", "content": [{"type": "text", "text": "snap"},
                                                           {"type": "image", "image": BLUE}]}],
        tools=[{"type": "function", "function": {"name": "camera",  # the server's key order, as the template dumps it
                                                 "parameters": {"type": "object", "properties": {}},
                                                 "description": "Takes a picture"}}],
        think=False, max_tokens=8, temperature=0))
    assert "".join(b.text for b in msg.content if b.type == "text") == collect(events)[0]
    assert msg.usage.input_tokens == vl_engine.stats.prompt_tokens


def test_with_url_fetching_off_an_image_url_is_a_400_and_nothing_is_fetched(vl_engine, monkeypatch, files):
    """server-parameters.fetch-image-urls false (lumen serve --no-fetch-image-urls): an image URL is refused before
    anything is opened (the local file server below would have answered); inline images still work."""
    import lumen_core.server.vision as server_vision

    opened: list = []
    monkeypatch.setattr(server_vision, "fetch_image", lambda *a, **k: opened.append(a) or b"")
    srv = Server(vl_engine, limits=Limits(fetch_urls=False))
    try:
        oa, an = _clients(srv)
        message = _oa_error(oa, TEXT, oa_image(files + "/ok.png"))
        assert message.startswith("messages[0].content[1].image_url.url: this server does not fetch image URLs")
        assert "fetch-image-urls is false" in message and "inline" in message
        assert "does not fetch image URLs" in _an_error(an, an_url(files + "/ok.png"), TEXT)
        assert opened == []
    finally:
        srv.stop()
    from lumen_core.config import load_config

    config = load_config({"model": {"path": "m"}, "server-parameters": {"fetch-image-urls": False}})
    assert Limits.from_parameters(config.server_parameters()).fetch_urls is False
    assert Limits.from_parameters(config.server_parameters(), fetch_urls=True).fetch_urls is True
