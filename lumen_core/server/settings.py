"""What ``lumen serve`` is configured with beside host and port: the API keys and the limits. No FastAPI here, so
the config (``Config.server_parameters``) checks API keys with the same rule as the command line and the app.

Limits (``server-parameters`` keys / ``lumen serve`` options; docs/server.md says why each default):

* ``max-queue`` (64): generations waiting behind the running one. A request past it is refused at once with a 429
  and a ``Retry-After`` header (seconds: the mean time of a generation so far, at least 1), not queued for minutes.
* ``request-timeout`` (600 s): how long one generation may run once the worker starts it (queue time not counted).
  Past it the reply ends as if ``max_tokens`` had been reached (``finish_reason: "length"``, Anthropic
  ``stop_reason: "max_tokens"``) with what was generated so far; 0 turns the limit off.
* ``max-body-bytes`` (4 MiB): a larger request body is a 413 before it is parsed or tokenized.
* ``max-tokens-limit`` (none): the most tokens one request may ask for. Whatever it says, ``max_tokens`` may not
  exceed the context left after the prompt (OpenAI's 400 "max_tokens is too large").

Images (issue 17; ``server-parameters`` keys ``fetch-timeout``, ``fetch-max-bytes``, ``max-images``; ``lumen serve``
options ``--fetch-timeout``, ``--max-images``):

* ``fetch_timeout`` (10 s): the most one image URL's fetch may take, from the DNS lookup to the last byte; past it
  the request is a 400 naming the URL.
* ``fetch_max_bytes`` (20 MiB, the image loader's own limit on one image): a URL whose body is larger is a 400; the
  body is read in chunks and the fetch stops at the first byte past the limit.
* ``fetch-image-urls`` (true): false makes every image URL a 400 (images inline only, data URIs / base64), so no
  request can make the server open a connection (a server that takes requests from untrusted clients).
* ``max_images`` (32): images in one request (URLs and inline data together); more is a 400. With the fetch limit
  it bounds what one request may make the server hold (32 x 20 MiB) and encode.

Which API (``server-parameters.server-api`` / ``--server-api``, ``ServerAPI``): ``openai`` or ``anthropic`` serves only
that API's routes, the other API's answer 404 in their own API's error shape, saying why and how to serve both;
absent, both APIs. /health, /metrics and /v1/models are always served (both APIs have /v1/models).
"""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_MAX_QUEUE = 64
DEFAULT_REQUEST_TIMEOUT = 600.0
DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024
MIN_BODY_BYTES = 1024  # below this not even a short request fits
DEFAULT_FETCH_TIMEOUT = 10.0
DEFAULT_FETCH_MAX_BYTES = 20 * 1024 * 1024  # lumen_core.images.MAX_IMAGE_BYTES: the loader takes no more
DEFAULT_MAX_IMAGES = 32


@dataclass(frozen=True)
class Limits:
    max_queue: int = DEFAULT_MAX_QUEUE
    request_timeout: float = DEFAULT_REQUEST_TIMEOUT  # seconds; 0 = no limit
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    max_tokens: int | None = None  # None: only the context left after the prompt
    fetch_timeout: float = DEFAULT_FETCH_TIMEOUT  # seconds one image URL may take to fetch, all of it
    fetch_max_bytes: int = DEFAULT_FETCH_MAX_BYTES  # the largest image a URL may give
    max_images: int = DEFAULT_MAX_IMAGES  # images in one request
    fetch_urls: bool = True  # False: an image URL is a 400 (images inline only): no request makes the server fetch

    def __post_init__(self):
        _need(_is_int(self.max_queue) and self.max_queue >= 0, "max_queue", self.max_queue, "an integer >= 0")
        _need(isinstance(self.request_timeout, int | float) and not isinstance(self.request_timeout, bool)
              and 0 <= self.request_timeout < float("inf"), "request_timeout", self.request_timeout,
              "a number of seconds >= 0 (0 = no limit)")
        _need(_is_int(self.max_body_bytes) and self.max_body_bytes >= MIN_BODY_BYTES, "max_body_bytes",
              self.max_body_bytes, f"an integer >= {MIN_BODY_BYTES}")
        _need(self.max_tokens is None or (_is_int(self.max_tokens) and self.max_tokens >= 1), "max_tokens",
              self.max_tokens, "an integer >= 1, or None")
        _need(isinstance(self.fetch_timeout, int | float) and not isinstance(self.fetch_timeout, bool)
              and 0 < self.fetch_timeout < float("inf"), "fetch_timeout", self.fetch_timeout,
              "a number of seconds > 0")
        _need(_is_int(self.fetch_max_bytes) and self.fetch_max_bytes >= 1, "fetch_max_bytes", self.fetch_max_bytes,
              "an integer >= 1")
        _need(_is_int(self.max_images) and self.max_images >= 0, "max_images", self.max_images, "an integer >= 0")
        _need(isinstance(self.fetch_urls, bool), "fetch_urls", self.fetch_urls, "true or false")

    @classmethod
    def from_parameters(cls, params: dict, **given) -> Limits:
        """``Config.server_parameters()`` with the options given on the command line (None: not given) on top."""
        names = ("max_queue", "request_timeout", "max_body_bytes", "max_tokens", "fetch_timeout", "fetch_max_bytes",
                 "max_images", "fetch_urls")
        values = {name: params[name] for name in names if name in params}
        values.update({name: value for name, value in given.items() if value is not None})
        return cls(**values)


SERVER_APIS = ("openai", "anthropic")  # LumenLLM's server-parameters.server-api values
API_TITLES = {"openai": "OpenAI", "anthropic": "Anthropic"}
API_ROUTES = {"openai": ("/v1/chat/completions", "/v1/completions"),
              "anthropic": ("/v1/messages", "/v1/messages/count_tokens")}


@dataclass(frozen=True)
class ServerAPI:
    """Which API the server serves: ``only`` None = both (the default), else ``openai`` or ``anthropic`` (LumenLLM's
    ``server-parameters.server-api``). ``source``: where the choice came from, ``config`` or ``option``
    (``lumen serve --server-api``), so that the 404 of a route that is off says what to change."""

    only: str | None = None
    source: str = "config"

    def __post_init__(self):
        _need(self.only is None or self.only in SERVER_APIS, "server_api", self.only,
              f"one of {', '.join(SERVER_APIS)}, or None for both")
        _need(self.source in ("config", "option"), "server_api source", self.source, "config or option")

    @classmethod
    def from_parameters(cls, params: dict, given: str | None = None) -> ServerAPI:
        """``Config.server_parameters()``'s ``server_api`` with ``--server-api`` (None: not given; ``both``: both
        APIs whatever the config says) on top."""
        if given is not None:
            return cls(None if given == "both" else given, "option")
        return cls(params.get("server_api"), "config")

    def serves(self, api: str) -> bool:
        return self.only is None or self.only == api

    def describe(self) -> str:
        """For the startup line: ``OpenAI + Anthropic APIs``, or ``Anthropic API only, by --server-api``."""
        if self.only is None:
            return "OpenAI + Anthropic APIs"
        by = "server-parameters.server-api" if self.source == "config" else "--server-api"
        return f"{API_TITLES[self.only]} API only, by {by}"

    def off_message(self, path: str) -> str:
        """Why ``path`` (a route of the API that is not served) is a 404, and how to serve both APIs."""
        api = next(name for name, routes in API_ROUTES.items() if path in routes)
        if self.source == "config":
            why = f"server-parameters.server-api is {self.only}"
            fix = "remove server-parameters.server-api from the server's config (absent, both APIs are served)"
        else:
            why = f"the server was started with --server-api {self.only}"
            fix = ("restart it with --server-api both, or without --server-api and without "
                   "server-parameters.server-api in its config")
        served = ", ".join(API_ROUTES[self.only] + ("/v1/models",))
        return (f"{path} is off: this server serves only the {API_TITLES[self.only]} API ({served}) because {why}, "
                f"not the {API_TITLES[api]} API. To serve both APIs, {fix}.")


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _need(ok: bool, name: str, value, allowed: str) -> None:
    if not ok:
        raise ValueError(f"server limit {name} must be {allowed}, got {value!r}")


def api_key_problem(key) -> str | None:
    """Why ``key`` cannot be an API key, or None. An empty or blank key would be taken as "no keys" by a check
    that tests the list's truth, and one with whitespace around it can never be sent: HTTP strips a header
    value's surrounding whitespace (and ``Bearer KEY`` is split on it)."""
    if not isinstance(key, str):
        return f"an API key must be a string, got {type(key).__name__}"
    if not key.strip():
        return f"an API key must not be empty or blank (got {key!r}): it would not protect anything"
    if key != key.strip():
        return f"an API key must not start or end with whitespace (got {key!r}): no client could send it"
    if any(ord(c) < 32 or ord(c) == 127 for c in key):
        return "an API key must not hold control characters (a newline, a tab): no client could send it"
    return None
