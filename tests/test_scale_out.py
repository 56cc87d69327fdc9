"""``lumen serve --replicas N`` on Ray Serve (lumen_core.server.scale_out, ray_app): the routing key, the replica
choice, resources from the placement, merged metrics; then a local Ray cluster with 2 CPU replicas of a tiny
checkpoint behind one endpoint: greedy replies equal one engine's, concurrent clients spread over both replicas, a
conversation's second turn lands on the replica that cached its first (its cached-token count says so), API keys /
health / metrics / streaming through the proxy, and a killed replica loses no request that had not started (the
ones it was running end with an error, never a hang; Ray Serve starts a new replica)."""

from __future__ import annotations

import asyncio
import json
import socket
import time

import httpx
import pytest

from lumen_core.server import scale_out
from lumen_core.server.ray_app import REPORT_S
from lumen_core.server.scale_out import (
    metrics_by_replica,
    rendezvous,
    renumbered,
    replica_resources,
    routing_key,
)

KEY = "sk-test"


# -- no Ray needed -------------------------------------------------------------------------------------------------
def chat(*messages, system=None):
    return json.dumps({"messages": ([{"role": "system", "content": system}] if system else []) + list(messages)})


def test_every_turn_of_a_conversation_has_the_first_turns_key():
    u1, a1, u2 = ({"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
                  {"role": "user", "content": "more"})
    for system in (None, "be brief"):
        first = routing_key("/v1/chat/completions", chat(u1, system=system).encode())
        assert first is not None
        assert routing_key("/v1/chat/completions", chat(u1, a1, u2, system=system).encode()) == first
    assert routing_key("/v1/chat/completions", chat(u1).encode()) != routing_key(
        "/v1/chat/completions", chat(u1, system="be brief").encode())
    assert routing_key("/v1/chat/completions", chat({"role": "user", "content": "other"}).encode()) != \
        routing_key("/v1/chat/completions", chat(u1).encode())
    anthropic = {"system": "s", "messages": [u1], "max_tokens": 4}
    key = routing_key("/v1/messages", json.dumps(anthropic).encode())
    anthropic["messages"] = [u1, a1, u2]
    assert routing_key("/v1/messages", json.dumps(anthropic).encode()) == key
    prompt = "x" * 300
    assert routing_key("/v1/completions", json.dumps({"prompt": prompt}).encode()) == \
        routing_key("/v1/completions", json.dumps({"prompt": prompt + " and more"}).encode())
    # no affinity: other routes, bodies that are not such JSON
    for path, body in (("/v1/models", b""), ("/v1/chat/completions", b"{not json"),
                       ("/v1/chat/completions", b"[1, 2]"), ("/v1/chat/completions", b'{"messages": 3}')):
        assert routing_key(path, body) is None


def test_rendezvous_keeps_keys_in_place_when_a_replica_leaves():
    ids = ["a", "b", "c"]
    keys = [f"k{i}" for i in range(300)]
    first = {k: rendezvous(k, ids)[0] for k in keys}
    assert set(first.values()) == set(ids)  # every replica gets some keys
    after = {k: rendezvous(k, ["a", "c"])[0] for k in keys}
    assert all(after[k] == first[k] for k in keys if first[k] != "b")  # only b's keys move
    assert rendezvous("k1", ids) == rendezvous("k1", list(reversed(ids)))


def test_resources_and_device_numbers_come_from_the_placement():
    raw = {"model": {"path": "m", "compute": "cuda:1", "hidden-layers": {"ranges": [
        {"layers": "0-3", "experts": {"compute": "cpu"}}, {"layers": "4-7", "compute": "cuda:3"}]}},
           "cpu": {"threads": 4}}
    assert replica_resources(raw) == {"num_gpus": 2, "num_cpus": 4.0}
    out = renumbered(raw)
    assert out["model"]["compute"] == "cuda:0" and out["model"]["hidden-layers"]["ranges"][1]["compute"] == "cuda:1"
    assert raw["model"]["compute"] == "cuda:1"  # a copy
    assert replica_resources({"model": {"path": "m"}}) == {"num_gpus": 0, "num_cpus": 1.0}
    assert replica_resources({"model": {"path": "m", "compute": "wgpu:0"}})["num_gpus"] == 0


def test_metrics_of_replicas_are_labelled_and_grouped_by_family():
    a = "# HELP x X\n# TYPE x counter\nx 1\n# HELP h H\n# TYPE h histogram\nh_bucket{le=\"1\"} 2\nh_sum 3\n"
    text = metrics_by_replica({"r1": a, "r2": a.replace("x 1", "x 5")})
    lines = text.splitlines()
    assert "lumen_replicas 2" in lines
    assert lines.count("# TYPE x counter") == 1 and lines.count("# HELP h H") == 1
    i = lines.index("# TYPE x counter")
    assert lines[i + 1:i + 3] == ['x{replica="r1"} 1', 'x{replica="r2"} 5']
    assert 'h_bucket{replica="r2",le="1"} 2' in lines


def test_the_serve_command_names_what_it_needs(tmp_path, monkeypatch, capsys):
    from lumen_core.cli import main

    config = tmp_path / "c.json"
    config.write_text(json.dumps({"model": {"path": str(tmp_path)}}))

    def run(*argv):
        with pytest.raises(SystemExit) as exc:
            main(["serve", "--config", str(config), *argv])
        return exc.value.code, capsys.readouterr().err

    code, err = run("--ray-address", "ray://x:10001")
    assert code == 2 and "--ray-address needs --replicas" in err
    code, err = run("--replicas", "0")
    assert code == 2 and "--replicas" in err
    code, err = run("--replicas", "2", "--ray-address", "127.0.0.1:9")  # nothing listens there
    assert code == 2 and "could not connect to the Ray cluster at 127.0.0.1:9" in err and "ray start --head" in err
    assert "Traceback" not in err
    code, err = run("--replicas", "2", "--ray-address", "no-port")
    assert code == 2 and "give HOST:PORT" in err
    monkeypatch.setitem(__import__("sys").modules, "ray", None)  # Ray not installed
    code, err = run("--replicas", "2")
    assert code == 2 and "pip install 'ray[serve]'" in err


def test_scale_out_in_the_config_is_checked():
    from lumen_core.config import load_config
    from lumen_core.errors import ConfigError

    cfg = load_config({"model": {"path": "m"}, "server-parameters": {"scale-out": {"replicas": 2,
                                                                                    "ray-address": "auto"}}})
    assert cfg.server_parameters()["scale_out"] == {"replicas": 2, "ray-address": "auto"}
    for bad in ({"replicas": 0}, {"replicas": "2"}, {"replica": 2}, {"ray-address": ""}):
        with pytest.raises(ConfigError, match="scale-out"):
            load_config({"model": {"path": "m"}, "server-parameters": {"scale-out": bad}})


# -- the KubeRay example -----------------------------------------------------------------------------------------
EXAMPLES = __import__("pathlib").Path(__file__).resolve().parents[1] / "examples"


def test_the_kuberay_example_names_the_image_the_builder_and_the_resources(tmp_path, monkeypatch):
    """examples/kuberay-rayservice.yaml (schema level: no Kubernetes here): it parses; its Lumen config passes the
    config schema; every container runs the image that examples/kuberay.Dockerfile builds, on the Ray version of
    rayVersion; the Serve application imports Lumen's builder with arguments it takes, and builds (Ray Serve's own
    path, without a cluster); the GPU workers hold what the replicas ask Ray for; API keys come from the Secret."""
    import re

    import yaml
    from ray.serve.schema import ServeDeploySchema

    from lumen_core.config import load_config
    from lumen_core.errors import ConfigError
    from lumen_core.server import ray_app

    docs = {d["kind"]: d for d in yaml.safe_load_all((EXAMPLES / "kuberay-rayservice.yaml").read_text())}
    assert set(docs) == {"ConfigMap", "RayService"}
    raw = json.loads(docs["ConfigMap"]["data"]["config.json"])
    load_config(raw)  # the schema
    need = replica_resources(raw)
    assert need == {"num_gpus": 1, "num_cpus": 4.0}

    dockerfile = (EXAMPLES / "kuberay.Dockerfile").read_text()
    tag = re.search(r"docker build -f examples/kuberay.Dockerfile -t (\S+) \.", dockerfile).group(1)
    base = re.search(r"^FROM rayproject/ray:([0-9.]+)-py311", dockerfile, re.M).group(1)
    assert "[scale-out]" in dockerfile and "plugins/models-qwen" in dockerfile and "plugins/lumen-cuda" in dockerfile

    spec = docs["RayService"]["spec"]
    cluster = spec["rayClusterConfig"]
    assert cluster["rayVersion"] == base
    assert int(base.split(".")[0]) == 2  # the ray[serve] major of pyproject's scale-out extra
    groups = [cluster["headGroupSpec"]] + cluster["workerGroupSpecs"]
    for group in groups:
        for container in group["template"]["spec"]["containers"]:
            assert container["image"] == tag
            env = {e["name"]: e for e in container.get("env", [])}
            assert env["LUMEN_API_KEYS"]["valueFrom"]["secretKeyRef"]["name"] == "lumen-api-keys"
            mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
            assert mounts["/etc/lumen"] == "lumen-config"

    serve_config = ServeDeploySchema(**yaml.safe_load(spec["serveConfigV2"]))  # Ray Serve's own check
    (app,) = serve_config.applications
    assert app.import_path == "lumen_core.server.ray_app:build" and app.route_prefix == "/"
    assert set(app.args) <= set(ray_app.BUILD_ARGS) and app.args["config"] == "/etc/lumen/config.json"
    replicas = app.args["replicas"]
    workers = [g for g in cluster["workerGroupSpecs"] if int(g["rayStartParams"].get("num-gpus", "0")) > 0]
    gpus = sum(g["replicas"] * int(g["rayStartParams"]["num-gpus"]) for g in workers)
    assert gpus >= replicas * need["num_gpus"]
    for g in workers:  # each worker fits a replica: the GPUs and CPUs Ray sees, and what Kubernetes gives the pod
        limits = g["template"]["spec"]["containers"][0]["resources"]["limits"]
        assert int(limits["nvidia.com/gpu"]) == int(g["rayStartParams"]["num-gpus"]) >= need["num_gpus"]
        assert float(limits["cpu"]) >= float(g["rayStartParams"]["num-cpus"]) >= need["num_cpus"]
    models = [m for g in workers for m in g["template"]["spec"]["containers"][0]["volumeMounts"]
              if m["mountPath"] == "/models"]
    assert models and raw["model"]["path"].startswith("/models/")

    config = tmp_path / "config.json"  # the builder, given the ConfigMap's file where the pod mounts it
    config.write_text(json.dumps(raw))
    monkeypatch.setenv("LUMEN_API_KEYS", "sk-a,sk-b")
    built = ray_app.build({**app.args, "config": str(config)})
    assert type(built).__name__ == "Application"
    assert type(ray_app.build({"config": str(config), "replicas": "3"})).__name__ == "Application"  # serve run's
    with pytest.raises(ConfigError, match="args.replicas"):
        ray_app.build({"config": str(config), "replicas": "two"})
    with pytest.raises(scale_out.ScaleOutError, match="unknown argument.*bogus"):
        ray_app.build({"config": str(config), "bogus": 1})
    with pytest.raises(scale_out.ScaleOutError, match="args.config"):
        ray_app.build({"replicas": 2})
    with pytest.raises(scale_out.ScaleOutError, match="LUMEN_NO_SUCH_VAR"):
        scale_out.keys_from_env("LUMEN_NO_SUCH_VAR")
    assert scale_out.keys_from_env("LUMEN_API_KEYS") == ["sk-a", "sk-b"]


# -- a local Ray cluster ---------------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def cluster(tiny_checkpoint):
    """(base URL, raw config, the port) of 2 replicas behind one endpoint on a local Ray cluster."""
    import ray  # the test extra installs ray[serve]: a missing Ray fails here, never skips
    from ray import serve

    from lumen_core.config import load_config

    path = tiny_checkpoint("qwen3_5")
    raw = {"model": {"path": str(path), "hidden-layers": {"kv-cache": {"context-size": 256, "prefix-cache-mb": 16}}},
           "cpu": {"threads": 1}}
    cfg = load_config(raw)
    port = free_port()
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    try:
        options = {"api_keys": [KEY], "model_name": "tiny", "name": "tiny", "limits": {"max_queue": MAX_QUEUE},
                   "server_api": None, "chat_template": None}
        scale_out.serve_replicas(cfg, 2, None, "127.0.0.1", port, options, block=False,
                                 echo=lambda line: None)
        yield f"http://127.0.0.1:{port}", raw
    finally:
        scale_out.shutdown()
        serve.shutdown()
        ray.shutdown()


AUTH = {"Authorization": f"Bearer {KEY}"}
MAX_QUEUE = 16  # each replica's app: 1 generation running, 16 waiting, past which its 429


def complete(client, prompt: str, tokens: int = 8):
    r = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": tokens, "temperature": 0},
                    headers=AUTH)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"], r.headers[scale_out.REPLICA_HEADER]


def test_greedy_replies_equal_one_engines(cluster):
    from fastapi.testclient import TestClient

    from lumen_core.engine import load
    from lumen_core.server.app import create_app

    url, raw = cluster
    prompts = ["Hello there", "The capital of France is", "1 2 3 4", "Once upon a time"]
    with httpx.Client(base_url=url, timeout=120) as client:
        got = [complete(client, p)[0] for p in prompts]
    local = TestClient(create_app(load(raw, progress=False), model_name="tiny"))
    want = [local.post("/v1/completions", json={"prompt": p, "max_tokens": 8, "temperature": 0}).json()
            ["choices"][0]["text"] for p in prompts]
    assert got == want


def test_concurrent_clients_spread_over_both_replicas(cluster):
    url, _ = cluster

    async def run():
        async with httpx.AsyncClient(base_url=url, timeout=120) as client:
            replies = await asyncio.gather(*[client.post(
                "/v1/chat/completions", headers=AUTH,
                json={"messages": [{"role": "user", "content": f"question {i}"}], "max_tokens": 6,
                      "temperature": 0}) for i in range(8)])
        return replies

    replies = asyncio.run(run())
    assert all(r.status_code == 200 for r in replies), [r.text for r in replies]
    assert len({r.headers[scale_out.REPLICA_HEADER] for r in replies}) == 2


def test_a_conversations_second_turn_lands_on_its_replica_and_uses_its_cache(cluster):
    url, _ = cluster
    with httpx.Client(base_url=url, timeout=120) as client:
        for n in range(3):  # three conversations: each one's turns stay on one replica
            messages = [{"role": "system", "content": "You answer in one line."},
                        {"role": "user", "content": f"conversation {n}: tell me about the sea and the sky"}]
            first = client.post("/v1/chat/completions", headers=AUTH,
                                json={"messages": messages, "max_tokens": 6, "temperature": 0})
            assert first.status_code == 200, first.text
            reply = first.json()["choices"][0]["message"]
            messages += [{"role": "assistant", "content": reply["content"] or "ok"},
                         {"role": "user", "content": "and then?"}]
            second = client.post("/v1/chat/completions", headers=AUTH,
                                 json={"messages": messages, "max_tokens": 6, "temperature": 0})
            assert second.status_code == 200, second.text
            assert second.headers[scale_out.REPLICA_HEADER] == first.headers[scale_out.REPLICA_HEADER]
            usage = second.json()["usage"]
            assert usage["prompt_tokens_details"]["cached_tokens"] >= first.json()["usage"]["prompt_tokens"] // 2


def test_keys_health_metrics_and_streams_behave_as_with_one_engine(cluster):
    url, _ = cluster
    with httpx.Client(base_url=url, timeout=120) as client:
        refused = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert refused.status_code == 401 and refused.json()["error"]["type"] == "authentication_error"
        refused = client.post("/v1/messages", json={"model": "tiny", "max_tokens": 2,
                                                    "messages": [{"role": "user", "content": "hi"}]})
        assert refused.status_code == 401 and refused.json()["type"] == "error"
        bad = client.post("/v1/completions", headers=AUTH, json={"prompt": "hi", "max_tokens": 2, "bogus": 1})
        assert bad.status_code == 400 and "bogus" in bad.json()["error"]["message"]
        health = client.get("/health").json()  # no key needed
        assert health["status"] == "ok" and health["replicas"] == 2 and health["model"] == "tiny"
        time.sleep(1.0)  # replicas report their metrics every 0.5 s (ray_app.REPORT_S)
        assert client.get("/v1/models", headers=AUTH).json()["data"][0]["id"] == "tiny"
        with client.stream("POST", "/v1/chat/completions", headers=AUTH,
                           json={"messages": [{"role": "user", "content": "stream"}], "max_tokens": 5,
                                 "stream": True}) as s:
            assert s.status_code == 200 and s.headers["content-type"].startswith("text/event-stream")
            lines = [line for line in s.iter_lines() if line.startswith("data: ")]
        assert lines[-1] == "data: [DONE]" and len(lines) >= 3
        metrics = client.get("/metrics", headers=AUTH).text
        assert "lumen_replicas 2" in metrics
        served = [line for line in metrics.splitlines() if line.startswith("lumen_completion_tokens_total{")]
        assert len(served) == 2 and all('replica="' in line for line in served)


def completion_tokens(client) -> float:
    time.sleep(2 * REPORT_S + 0.2)  # the replicas' latest reports
    lines = client.get("/metrics", headers=AUTH).text.splitlines()
    return sum(float(line.split()[-1]) for line in lines if line.startswith("lumen_completion_tokens_total{"))


def test_a_client_that_leaves_a_stream_stops_its_generation_through_the_proxy(cluster):
    url, _ = cluster
    with httpx.Client(base_url=url, timeout=120) as client:
        before = completion_tokens(client)
        with client.stream("POST", "/v1/completions", headers=AUTH,
                           json={"prompt": "a long one", "max_tokens": 240, "temperature": 0, "stream": True}) as s:
            assert s.status_code == 200
            for line in s.iter_lines():
                if line.startswith("data: "):
                    break  # the first token came: leave
        spent = completion_tokens(client) - before
    # the replica's app saw the disconnect and stopped within a few tokens (240 would run ~1 s here)
    assert 1 <= spent < 120, spent


def test_a_killed_replica_loses_no_request_that_had_not_started(cluster):
    import ray

    url, _ = cluster
    replicas = [n for n in ray.util.list_named_actors(all_namespaces=True)
                if "SERVE_REPLICA" in n["name"] and "Replica" in n["name"].split("#")[1]]
    assert len(replicas) == 2
    actors = {n["name"].split("#")[-1]: n for n in replicas}  # replica id -> its named actor
    with httpx.Client(base_url=url, timeout=60) as client:
        assert set(actors) <= set(client.get("/health").json()["replica_ids"])

    def depths(metrics) -> dict[str, float]:  # each replica's waiting requests, as /metrics reports them
        out = {}
        for line in metrics.text.splitlines():
            if line.startswith('lumen_queue_depth{replica="'):
                out[line.split('"')[1]] = float(line.split()[-1])
        return out

    async def run():
        async with httpx.AsyncClient(base_url=url, timeout=180) as client:
            tasks = [asyncio.ensure_future(client.post(
                "/v1/completions", headers=AUTH,
                json={"prompt": f"request {i} " * 4, "max_tokens": 200, "temperature": 0})) for i in range(16)]
            # the victim: whichever replica first reports 4 waiting (the routing decides how the 16 split; one of
            # the two holds at least 8, 7 of them waiting, while it runs one at a time)
            deadline = time.monotonic() + 10
            while True:
                held = {k: v for k, v in depths(await client.get("/metrics", headers=AUTH)).items() if k in actors}
                victim_id = max(held, key=held.get) if held else None
                if victim_id is not None and held[victim_id] >= 4:
                    break
                assert time.monotonic() < deadline, f"no replica held 4 waiting requests: {held}"
                await asyncio.sleep(0.05)
            ray.kill(ray.get_actor(actors[victim_id]["name"], namespace=actors[victim_id]["namespace"]))
            return victim_id, await asyncio.wait_for(asyncio.gather(*tasks), 170)  # never a hang

    t0 = time.monotonic()
    victim_id, replies = asyncio.run(run())
    failed = [r for r in replies if r.status_code != 200]
    for r in failed:  # the one the killed replica was running: an error in the API's shape
        assert r.status_code == 503 and r.json()["error"]["code"] == "replica_failed", r.text
    # it runs one generation at a time (kv-cache.sequences 1): at most that one is lost; the ones waiting in its
    # queue were sent again, to the other replica (which can hold all 16: a retry meets its queue limit as any
    # request does, and would be a 429 past it)
    assert len(failed) <= 1, [r.status_code for r in replies]
    retried = [r for r in replies if r.status_code == 200 and r.headers["x-lumen-attempts"] != "1"]
    seen = [(r.status_code, r.headers.get("x-lumen-attempts"), r.headers.get(scale_out.REPLICA_HEADER)) for r in
            replies]
    assert retried and all(r.headers[scale_out.REPLICA_HEADER] != victim_id for r in retried), (victim_id, seen)
    assert time.monotonic() - t0 < 170
    with httpx.Client(base_url=url, timeout=120) as client:  # new requests go to a live replica
        assert complete(client, "after the kill")[0]
        deadline = time.monotonic() + 120
        while True:  # Ray Serve starts a new replica in its place
            ids = client.get("/health").json().get("replica_ids", [])
            if len(ids) == 2 and victim_id not in ids:
                break
            assert time.monotonic() < deadline, f"the killed replica was not replaced: {ids}"
            time.sleep(1)
    print(f"killed replica {victim_id}: {len(failed)} of {len(replies)} requests failed (503), {len(retried)} sent "
          f"again, all in {time.monotonic() - t0:.1f} s")


def test_past_the_queue_limit_a_429_in_the_apis_shape(cluster):
    """Last: redeploys the application with max-queue 1 (Serve replaces the replicas)."""
    url, raw = cluster
    from lumen_core.config import load_config

    options = {"api_keys": [KEY], "model_name": "tiny", "name": "tiny", "limits": {"max_queue": 1},
               "server_api": None, "chat_template": None}
    with httpx.Client(base_url=url, timeout=60) as client:
        old = set(client.get("/health").json()["replica_ids"])
        scale_out.serve_replicas(load_config(raw), 2, None, "127.0.0.1", int(url.rsplit(":", 1)[1]), options,
                                 block=False, echo=lambda line: None)
        deadline = time.monotonic() + 120
        while True:  # the new replicas report, the old ones are gone
            ids = set(client.get("/health").json().get("replica_ids", []))
            if len(ids) == 2 and not ids & old:
                break
            assert time.monotonic() < deadline, (old, ids)
            time.sleep(0.5)

    async def run():
        async with httpx.AsyncClient(base_url=url, timeout=180) as client:
            return await asyncio.gather(*[client.post(
                "/v1/chat/completions", headers=AUTH,
                json={"messages": [{"role": "user", "content": f"burst {i}"}], "max_tokens": 200, "temperature": 0})
                for i in range(20)])

    replies = asyncio.run(run())
    codes = [r.status_code for r in replies]
    # each replica's app holds 1 running + 1 waiting, as one engine with max-queue 1 would (one more may wait to be
    # routed); what arrives while they are full is refused at once, each a 429 in the API's shape
    assert set(codes) <= {200, 429} and codes.count(200) >= 4 and codes.count(429) >= 4, \
        [(r.status_code, r.text[:300]) for r in replies if r.status_code != 200]
    for refused in (r for r in replies if r.status_code == 429):
        assert refused.json()["error"]["code"] == "queue_full" and int(refused.headers["retry-after"]) >= 1
