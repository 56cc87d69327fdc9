"""The FastAPI application: auth, errors in each API's own shape, health, metrics, models and the names a request's
``model`` may give (others are a 404); the OpenAI routes (``openai_api.py``) and the Anthropic routes
(``anthropic_api.py``) are mounted here."""

from __future__ import annotations

import hmac
import json

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from .service import Service

ANTHROPIC_PREFIX = "/v1/messages"


class APIError(Exception):
    """An error to return as JSON in the calling API's shape: ``status``, a message, an OpenAI/Anthropic type,
    OpenAI's ``param`` and ``code``; ``anthropic_message`` replaces the message in Anthropic's shape."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, anthropic_message: str | None = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.param = status, message, kind, param
        self.code, self.anthropic_message = code, anthropic_message


def error_response(request: Request, status: int, message: str, kind: str = "invalid_request_error",
                   param: str | None = None, code: str | None = None,
                   anthropic_message: str | None = None) -> JSONResponse:
    """OpenAI: {"error": {message, type, param, code}}; Anthropic (its routes, or a request from its SDK, which
    sends ``anthropic-version``): {"type": "error", "error": {type, message}}."""
    if request.url.path.startswith(ANTHROPIC_PREFIX) or request.headers.get("anthropic-version"):
        anthropic_kind = {401: "authentication_error", 404: "not_found_error", 413: "request_too_large",
                          429: "rate_limit_error", 500: "api_error", 503: "overloaded_error"}.get(status, kind)
        body = {"type": "error", "error": {"type": anthropic_kind, "message": anthropic_message or message}}
    else:
        body = {"error": {"message": message, "type": kind, "param": param, "code": code}}
    return JSONResponse(body, status_code=status)


def model_names(engine, model_name: str | None) -> tuple[str, ...]:
    """The names a request's ``model`` may give, the served id first: ``model_name`` (``--model-name``, else the
    checkpoint's directory or file name), the checkpoint's name, and the model path as the config writes it (a
    Hugging Face id such as ``google/gemma-3-270m``, or a path)."""
    path = str(engine.config.model_path).rstrip("/")
    written = str(((getattr(engine.config, "raw", None) or {}).get("model") or {}).get("path") or "").rstrip("/")
    checkpoint = path.split("/")[-1]
    names = [model_name or checkpoint, checkpoint, written]
    return tuple(dict.fromkeys(n for n in names if n))


def check_model(app: FastAPI, name: str | None) -> None:
    """A request's ``model``: left out (OpenAI routes) or one of ``app.state.model_names``; any other name is a
    404 as OpenAI words it (``model_not_found``), or Anthropic's ``not_found_error``."""
    if name is None or name in app.state.model_names:
        return
    raise APIError(404, f"The model `{name}` does not exist or you do not have access to it.",
                   param="model", code="model_not_found",
                   anthropic_message=f"model: {name} is not served here; this server serves "
                                     f"{app.state.model_name}")


def create_app(engine, api_keys: list[str] | None = None, model_name: str | None = None) -> FastAPI:
    """The app over a loaded Engine. ``api_keys``: when non-empty, every route but /health needs one of them as
    ``Authorization: Bearer KEY`` or ``x-api-key: KEY`` (401 otherwise)."""
    app = FastAPI(title="Lumen", description="OpenAI- and Anthropic-compatible API over one local model.")
    service = Service(engine)
    app.state.service = service
    app.state.engine = engine
    app.state.model_names = model_names(engine, model_name)
    app.state.model_name = app.state.model_names[0]  # the served id: what /v1/models lists and replies report
    keys = [k.encode() for k in (api_keys or [])]

    @app.middleware("http")
    async def auth_and_count(request: Request, call_next):
        path = request.url.path
        if keys and path != "/health":
            given = request.headers.get("x-api-key") or ""
            bearer = request.headers.get("authorization", "")
            if bearer.lower().startswith("bearer "):
                given = given or bearer[7:].strip()
            if not any(hmac.compare_digest(given.encode(), k) for k in keys):
                response = error_response(request, 401, "invalid or missing API key (Authorization: Bearer KEY or "
                                          "x-api-key: KEY)", "authentication_error")
                _count(service, path, 401)
                return response
        response = await call_next(request)
        _count(service, path, response.status_code)
        return response

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError):
        return error_response(request, exc.status, exc.message, exc.kind, exc.param, exc.code,
                              exc.anthropic_message)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError):
        parts = []
        for err in exc.errors():
            loc = ".".join(str(p) for p in err.get("loc", ()) if p != "body")
            parts.append(f"{loc or 'body'}: {err.get('msg')}")
        return error_response(request, 400, "invalid request: " + "; ".join(parts))

    @app.exception_handler(json.JSONDecodeError)
    async def bad_json(request: Request, exc: json.JSONDecodeError):
        return error_response(request, 400, f"the body is not valid JSON: {exc}")

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return error_response(request, exc.status_code, str(exc.detail), kind)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception):  # never a bare 500 page
        return error_response(request, 500, f"internal error: {type(exc).__name__}: {exc}", "api_error")

    @app.get("/health")
    async def health():
        return {"status": "ok", "model": app.state.model_name, "queue_depth": service.queue_depth}

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(service.metrics.prometheus(service.queue_depth),
                                 media_type="text/plain; version=0.0.4")

    def model_card(request: Request) -> dict:
        if request.headers.get("anthropic-version"):  # the anthropic SDK's shape
            return {"type": "model", "id": app.state.model_name, "display_name": app.state.model_name,
                    "created_at": "1970-01-01T00:00:00Z"}
        return {"id": app.state.model_name, "object": "model", "created": 0, "owned_by": "lumen"}

    @app.get("/v1/models")
    async def models(request: Request):
        card = model_card(request)
        if "type" in card:
            return {"data": [card], "has_more": False, "first_id": card["id"], "last_id": card["id"]}
        return {"object": "list", "data": [card]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str, request: Request):
        check_model(app, model_id)  # the served id or an alias; the card names the served id
        return model_card(request)

    from . import anthropic_api, openai_api

    openai_api.mount(app)
    anthropic_api.mount(app)
    service.routes = {getattr(r, "path", None) for r in app.routes} - {None}
    return app


def _count(service: Service, path: str, status: int) -> None:
    """Requests by route and status; paths that are no route count as "other" (bounded label values)."""
    if path not in service.routes:
        path = "other"
    key = (path, status)
    service.metrics.requests[key] = service.metrics.requests.get(key, 0) + 1
