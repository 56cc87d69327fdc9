"""``server-parameters.server-api`` (LumenLLM's choice of API) and ``lumen serve --server-api``: ``openai`` serves only
the OpenAI routes, ``anthropic`` only the Anthropic ones; the other API's routes answer 404 in their own API's error
shape (so that API's SDK reads it), saying that server-api turned them off and how to serve both. Absent: both APIs.
/health, /metrics and /v1/models (both APIs have it; in the served API's shape) are always there. A real uvicorn
server over the tiny Qwen 3.5 checkpoint, generation scripted (``server_util.script``)."""

from __future__ import annotations

import json

import anthropic
import httpx
import openai
import pytest
from server_util import Server, load_tiny, script

from lumen_core.cli import main
from lumen_core.config import load_config
from lumen_core.server.app import create_app
from lumen_core.server.settings import ServerAPI

HI = [{"role": "user", "content": "Hello there"}]
OPENAI_BODIES = {"/v1/chat/completions": {"model": "tiny", "messages": HI, "max_tokens": 4},
                 "/v1/completions": {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 4}}
ANTHROPIC_BODIES = {"/v1/messages": {"model": "tiny", "messages": HI, "max_tokens": 4},
                    "/v1/messages/count_tokens": {"model": "tiny", "messages": HI}}


@pytest.fixture(scope="module")
def engine(tiny_checkpoint):
    return load_tiny(tiny_checkpoint("qwen3_5"), context=1024)


@pytest.fixture
def serve(engine, monkeypatch):
    """serve(server_api, api_keys=None) -> a started Server (stopped after the test), replies scripted."""
    script(engine, monkeypatch, "Hi there")
    started = []

    def start(server_api, api_keys=None):
        started.append(Server(engine, api_keys=api_keys, server_api=server_api))
        return started[-1]

    yield start
    for srv in started:
        srv.stop()


def post(srv, route: str, body: dict, **headers) -> httpx.Response:
    return httpx.post(srv.url + route, json=body, headers=headers, timeout=60)


def openai_404(r: httpx.Response) -> str:
    assert r.status_code == 404, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert err["type"] == "invalid_request_error" and err["code"] == "api_not_served" and err["param"] is None
    return err["message"]


def anthropic_404(r: httpx.Response) -> str:
    assert r.status_code == 404, r.text
    body = r.json()
    assert body["type"] == "error" and set(body["error"]) == {"type", "message"}, body
    assert body["error"]["type"] == "not_found_error"
    return body["error"]["message"]


def test_openai_only_serves_openai_and_turns_the_anthropic_routes_off(serve):
    srv = serve("openai")
    for route, body in OPENAI_BODIES.items():
        assert post(srv, route, body).status_code == 200, route
    for route, body in ANTHROPIC_BODIES.items():
        message = anthropic_404(post(srv, route, body, **{"anthropic-version": "2023-06-01"}))
        assert message == (f"{route} is off: this server serves only the OpenAI API (/v1/chat/completions, "
                           "/v1/completions, /v1/models) because server-parameters.server-api is openai, not the "
                           "Anthropic API. To serve both APIs, remove server-parameters.server-api from the server's "
                           "config (absent, both APIs are served).")
    # the anthropic SDK reads the 404 as NotFoundError with that message
    client = anthropic.Anthropic(base_url=srv.url, api_key="unused", max_retries=0, timeout=30)
    with pytest.raises(anthropic.NotFoundError, match="server-parameters.server-api is openai"):
        client.messages.create(model="tiny", max_tokens=4, messages=HI)
    # /v1/models in OpenAI's shape, whatever the request's headers; /health and /metrics as ever
    models = httpx.get(srv.url + "/v1/models", headers={"anthropic-version": "2023-06-01"}).json()
    assert models["object"] == "list" and models["data"][0]["object"] == "model"
    assert httpx.get(srv.url + "/health").json()["status"] == "ok"
    metrics = httpx.get(srv.url + "/metrics").text
    assert 'route="/v1/messages",status="404"' in metrics, metrics


def test_anthropic_only_serves_anthropic_and_turns_the_openai_routes_off(serve):
    srv = serve("anthropic")
    for route, body in ANTHROPIC_BODIES.items():
        assert post(srv, route, body).status_code == 200, route
    for route, body in OPENAI_BODIES.items():
        for headers in ({}, {"anthropic-version": "2023-06-01"}):  # OpenAI's shape on its own routes, always
            message = openai_404(post(srv, route, body, **headers))
            assert message.startswith(f"{route} is off: this server serves only the Anthropic API (/v1/messages, "
                                      "/v1/messages/count_tokens, /v1/models) because server-parameters.server-api "
                                      "is anthropic, not the OpenAI API. To serve both APIs, remove "
                                      "server-parameters.server-api"), message
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=30)
    with pytest.raises(openai.NotFoundError, match="server-parameters.server-api is anthropic") as info:
        client.chat.completions.create(model="tiny", messages=HI, max_tokens=4)
    assert info.value.code == "api_not_served"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="tiny", prompt="Hi", max_tokens=4)
    # /v1/models in Anthropic's shape (its SDK's models.list works), /health and /metrics as ever
    models = httpx.get(srv.url + "/v1/models").json()
    assert models["data"][0]["type"] == "model" and models["first_id"] == "tiny"
    card = anthropic.Anthropic(base_url=srv.url, api_key="unused", max_retries=0).models.retrieve("tiny")
    assert card.id == "tiny"
    assert httpx.get(srv.url + "/health").status_code == 200
    assert httpx.get(srv.url + "/metrics").status_code == 200
    # other errors come in the served API's shape too (an unknown path; a 404 for an unknown model id)
    assert anthropic_404(httpx.get(srv.url + "/v1/nothing")) == "Not Found"
    assert "not served here" in anthropic_404(httpx.get(srv.url + "/v1/models/other"))


def test_absent_serves_both_apis(serve):
    srv = serve(None)
    for route, body in {**OPENAI_BODIES, **ANTHROPIC_BODIES}.items():
        assert post(srv, route, body).status_code == 200, route
    assert srv.app.state.server_api == ServerAPI(None)


def test_an_off_route_still_needs_the_api_key(serve):
    srv = serve("openai", api_keys=["k"])
    assert post(srv, "/v1/messages", ANTHROPIC_BODIES["/v1/messages"]).status_code == 401
    assert "server-api is openai" in anthropic_404(post(srv, "/v1/messages", ANTHROPIC_BODIES["/v1/messages"],
                                                        **{"x-api-key": "k"}))


def test_the_off_routes_are_not_in_the_openapi_schema(serve):
    paths = httpx.get(serve("anthropic").url + "/openapi.json").json()["paths"]
    assert "/v1/messages" in paths and "/v1/chat/completions" not in paths and "/v1/completions" not in paths


def test_a_bad_choice_is_refused(engine):
    with pytest.raises(ValueError, match="server_api must be one of openai, anthropic"):
        create_app(engine, server_api="grpc")
    with pytest.raises(ValueError, match="server_api must be"):
        ServerAPI("both")  # "both" is --server-api's word for None


@pytest.mark.parametrize(("config_api", "option", "only", "line"), [
    (None, None, None, "(OpenAI + Anthropic APIs; no authentication; queue 64"),
    ("anthropic", None, "anthropic", "(Anthropic API only, by server-parameters.server-api; no authentication"),
    ("anthropic", "both", None, "(OpenAI + Anthropic APIs; no authentication"),
    ("anthropic", "openai", "openai", "(OpenAI API only, by --server-api; no authentication"),
    (None, "anthropic", "anthropic", "(Anthropic API only, by --server-api; no authentication"),
])
def test_lumen_serve_takes_server_api_from_the_config_and_the_option(config_api, option, only, line, capsys,
                                                                      monkeypatch, tiny_checkpoint, tmp_path):
    import uvicorn

    seen = {}
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: seen.update(app=app, **kw))
    raw = {"model": {"path": str(tiny_checkpoint("qwen3_5")), "hidden-layers": {"kv-cache": {"context-size": 512}}}}
    if config_api:
        raw["server-parameters"] = {"server-api": config_api}
    path = tmp_path / "serve.json"
    path.write_text(json.dumps(raw))
    main(["serve", "--config", str(path)] + (["--server-api", option] if option else []))
    app = seen["app"]
    try:
        assert app.state.server_api.only == only
        assert line in capsys.readouterr().err
        if option and only:  # the 404 says what to change: the option this server was started with
            message = ServerAPI.from_parameters({}, option).off_message(
                "/v1/messages" if only == "openai" else "/v1/completions")
            assert f"started with --server-api {only}" in message and "--server-api both" in message
    finally:
        app.state.service.close()


def test_server_api_in_the_config_reaches_serve():
    config = load_config({"model": {"path": "m"}, "server-parameters": {"server-api": "anthropic"}})
    assert ServerAPI.from_parameters(config.server_parameters()) == ServerAPI("anthropic", "config")


def test_lumen_serve_refuses_an_unknown_server_api(capsys, tmp_path):
    with pytest.raises(SystemExit) as info:
        main(["serve", "--config", str(tmp_path / "x.gguf"), "--server-api", "grpc"])
    assert info.value.code == 2 and "grpc" in capsys.readouterr().err
