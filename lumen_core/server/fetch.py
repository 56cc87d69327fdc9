"""Image URLs fetched for the chat routes (OpenAI ``image_url`` parts, Anthropic ``url`` image sources).

``fetch_image(url, timeout, max_bytes)`` returns the body's bytes or raises ``FetchError`` whose message names the
URL and the reason, which the routes answer as a 400. It blocks: the routes call it off the event loop
(``run_in_threadpool``), several URLs of one request at once.

* Only ``http://`` and ``https://`` URLs with a host, also as redirect targets (``file:``, ``ftp:`` ... are refused
  before anything is opened, so a client cannot make the server read its own files).
* ``timeout`` bounds the whole fetch, the DNS lookup included: the work runs on a daemon thread that the caller
  waits for at most ``timeout`` seconds. A socket's own timeout covers each connect and read but not
  ``getaddrinfo``, which on a machine without a working resolver can block far longer; such a thread is left to
  finish on its own, the client has its 400 at the deadline. No fetch can hang a request.
* The body is read in 64 KiB chunks and the fetch stops at the first chunk past ``max_bytes`` (a declared
  ``Content-Length`` over it is refused before reading).
* At most ``MAX_REDIRECTS`` redirects are followed.
* Any failure is a ``FetchError``: a bad URL, DNS, a refused or unreachable connection, TLS, the timeout, an HTTP
  status of 400 or more, a body over the limit, an empty body, or a ``text/*`` / JSON body (an error page, not an
  image). Whether the bytes are an image is the image loader's question (``lumen_core.images.load_image``), asked by
  the routes with the URL in the message.

The environment's proxy settings (``http_proxy``, ``https_proxy``, ``no_proxy``) apply, as for any ``urllib``
client. The server fetches whatever http(s) URL a client sends, addresses on its own network included: serve it
where the clients are trusted, or behind a proxy that filters.
"""

from __future__ import annotations

import http.client
import socket
import ssl
import threading
import time
import urllib.error
import urllib.parse
import urllib.request

from .settings import DEFAULT_FETCH_MAX_BYTES, DEFAULT_FETCH_TIMEOUT

MAX_REDIRECTS = 5
CHUNK = 64 * 1024
USER_AGENT = "lumen-serve (image fetch)"
_NOT_IMAGES = ("text/", "application/json", "application/problem+json")


class FetchError(Exception):
    """An image URL that could not be fetched: ``url`` and ``reason``; the message says both."""

    def __init__(self, url: str, reason: str):
        super().__init__(f"could not fetch {url}: {reason}")
        self.url, self.reason = url, reason


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n} bytes"


def check_url(url: str) -> str:
    """``url`` when it is an http(s) URL with a host, else FetchError (nothing is opened)."""
    try:
        parts = urllib.parse.urlsplit(url)
    except ValueError as exc:
        raise FetchError(url, f"not a valid URL ({exc})") from None
    scheme = parts.scheme.lower()
    if scheme not in ("http", "https"):
        shown = f"a {scheme}: URL" if scheme else "a URL without a scheme"
        raise FetchError(url, f"{shown}; only http:// and https:// image URLs are fetched (or send the image "
                              "inline as base64 data)")
    if not parts.hostname:
        raise FetchError(url, "the URL has no host")
    if any(c.isspace() or ord(c) < 32 for c in url):
        raise FetchError(url, "the URL holds whitespace or control characters")
    return url


class _Redirects(urllib.request.HTTPRedirectHandler):
    """Follows at most MAX_REDIRECTS redirects, to http(s) URLs only."""

    max_redirections = MAX_REDIRECTS + 1  # ours below says it first, in our words

    def __init__(self, origin: str):
        super().__init__()
        self.origin, self.count = origin, 0

    def http_error_302(self, req, fp, code, msg, headers):
        target = headers.get("location") or headers.get("uri")
        if target:
            newurl = urllib.parse.urljoin(req.full_url, target)
            self.count += 1
            if self.count > MAX_REDIRECTS:
                raise FetchError(self.origin, f"more than {MAX_REDIRECTS} redirects (the last to {newurl})")
            scheme = urllib.parse.urlsplit(newurl).scheme.lower()
            if scheme not in ("http", "https"):
                raise FetchError(self.origin, f"redirected to {newurl}; only http(s) redirects are followed")
        return super().http_error_302(req, fp, code, msg, headers)

    http_error_301 = http_error_303 = http_error_307 = http_error_308 = http_error_302


def _reason(exc: BaseException, timeout: float) -> str:
    """A failure in words a client understands."""
    if isinstance(exc, urllib.error.HTTPError):
        return f"the server answered HTTP {exc.code} {exc.reason}".rstrip()
    if isinstance(exc, urllib.error.URLError) and isinstance(exc.reason, BaseException):
        exc = exc.reason
    elif isinstance(exc, urllib.error.URLError):
        return str(exc.reason)
    if isinstance(exc, socket.gaierror):
        return f"cannot resolve the host name ({exc.strerror or exc})"
    if isinstance(exc, (TimeoutError, socket.timeout)):
        return f"no answer within the {timeout:g} s fetch timeout"
    if isinstance(exc, ConnectionRefusedError):
        return "the connection was refused"
    if isinstance(exc, ssl.SSLError):
        return f"TLS error ({exc.reason or exc})"
    if isinstance(exc, OSError):
        return f"network error ({exc.strerror or exc})"
    if isinstance(exc, http.client.HTTPException):
        return f"a bad HTTP answer ({type(exc).__name__}: {exc})"
    return f"{type(exc).__name__}: {exc}"


def _fetch(url: str, timeout: float, max_bytes: int, deadline: float) -> bytes:
    redirects = _Redirects(url)
    opener = urllib.request.build_opener(redirects)
    request = urllib.request.Request(url, headers={"User-Agent": USER_AGENT, "Accept": "image/*"})
    try:
        with opener.open(request, timeout=timeout) as response:
            kind = (response.headers.get("Content-Type") or "").split(";")[0].strip().lower()
            if kind.startswith(_NOT_IMAGES):
                raise FetchError(url, f"the server answered {kind}, not an image")
            declared = response.headers.get("Content-Length")
            if declared and declared.strip().isdigit() and int(declared) > max_bytes:
                raise FetchError(url, f"the image is {_mib(int(declared))}, over the {_mib(max_bytes)} limit")
            chunks, size = [], 0
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError
                sock = getattr(getattr(response.fp, "raw", None), "_sock", None)  # http.client's socket
                if sock is not None:
                    sock.settimeout(left)  # each read waits no longer than the time left
                chunk = response.read1(CHUNK)  # what one receive gives: a slow sender cannot stretch a read
                if not chunk:
                    break
                size += len(chunk)
                if size > max_bytes:
                    raise FetchError(url, f"the image is over the {_mib(max_bytes)} limit (stopped reading past "
                                          "it)")
                chunks.append(chunk)
    except FetchError:
        raise
    except Exception as exc:  # urllib, socket, ssl, http.client: all are the URL's failure
        raise FetchError(url, _reason(exc, timeout)) from None
    if not size:
        raise FetchError(url, "the server answered an empty body")
    return b"".join(chunks)


def fetch_image(url: str, timeout: float = DEFAULT_FETCH_TIMEOUT,
                max_bytes: int = DEFAULT_FETCH_MAX_BYTES) -> bytes:
    """The body of ``url`` (http or https), within ``timeout`` seconds in all and ``max_bytes``; FetchError
    otherwise. Blocks (at most ``timeout`` and a little): call it off the event loop."""
    check_url(url)
    deadline = time.monotonic() + timeout
    result: dict = {}

    def work():
        try:
            result["body"] = _fetch(url, timeout, max_bytes, deadline)
        except BaseException as exc:  # handed to the caller
            result["error"] = exc

    thread = threading.Thread(target=work, name="lumen-image-fetch", daemon=True)
    thread.start()
    thread.join(timeout + 0.05)
    if thread.is_alive():  # DNS, most likely: getaddrinfo has no timeout of its own
        raise FetchError(url, f"no answer within the {timeout:g} s fetch timeout")
    if "error" in result:
        error = result["error"]
        if isinstance(error, FetchError):
            raise error
        raise FetchError(url, _reason(error, timeout))
    return result["body"]
