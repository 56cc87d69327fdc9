"""Routed experts streamed from host RAM to the GPU (``experts: {compute: cuda:0, store: ram}``, lumen_cuda.stream):
the same logits and greedy tokens as the all-VRAM run of the same checkpoint, the plan's expert cache entry, the
work moving with the config (host-to-device copies, cache hits), and the errors.

Tolerance: the streamed run uses the same device kernels (reading experts from VRAM slots or host memory); a prefill
that needs more experts than the cache holds runs in passes whose outputs are added, so sums differ in order:
<= 1e-4 x max(1, max |logit|), tokens equal.
GPU tests carry the ``gpu`` marker and skip without CuPy or a CUDA device.
"""

from __future__ import annotations

import numpy as np
import pytest
from gpu_util import close, greedy_run

import lumen_core as lumen
from lumen_core.sampling import SamplingParams

pytest.importorskip("lumen_cuda")

CONTEXT = 128
STEPS = 8
MOE_GEMMA = {"enable_moe_block": True, "num_experts": 4, "top_k_experts": 2, "moe_intermediate_size": 32}
KINDS = {"qwen3_5_moe": ("qwen3_5_moe", {}), "gemma4-moe": ("gemma4", MOE_GEMMA)}


def load(path, **experts):
    hidden = {"kv-cache": {"context-size": CONTEXT}}
    if experts:
        hidden["experts"] = experts
    return lumen.load({"model": {"path": str(path), "compute": "cuda:0", "store": "vram", "hidden-layers": hidden}},
                      progress=False)


def run(model, ids):
    return greedy_run(model, ids, CONTEXT, STEPS)


def expert_stats(engine) -> dict:
    """The expert cache statistics of the backend the engine streams its routed experts through (each engine's
    CUDABackend has a cache of its own)."""
    backend = next(b for comp, b in engine.backends.items() if comp[0] == "experts")
    return backend.expert_stats()


def quantize(tiny_checkpoint, tmp_path_factory, fmt):
    from lumen_core.cli import main

    out = tmp_path_factory.mktemp(f"moe-{fmt}") / "q"
    try:
        rc = main(["quantize", "--input", str(tiny_checkpoint("qwen3_5_moe")), "--output", str(out), "--format",
                   fmt, "--block", "32"])
    except SystemExit as exc:
        rc = exc.code
    assert not rc
    return out


@pytest.fixture(scope="module", params=["qwen3_5_moe", "gemma4-moe", "qwen3_5_moe-fp8", "qwen3_5_moe-nvfp4"])
def checkpoint(request, tiny_checkpoint, tmp_path_factory, cp):
    name = request.param
    if name.endswith(("-fp8", "-nvfp4")):
        return name, quantize(tiny_checkpoint, tmp_path_factory, name.rsplit("-", 1)[1])
    kind, overrides = KINDS[name]
    return name, tiny_checkpoint(kind, **overrides)


@pytest.mark.gpu
@pytest.mark.parametrize("cache", [1, 64])  # 1: every prefill in passes, decode reads from host; 64: all resident
def test_streamed_experts_equal_the_vram_run(checkpoint, cache):
    name, path = checkpoint
    ref = load(path)
    ids = np.random.RandomState(0).randint(3, ref.model.vocab_size, 40).tolist()
    want = run(ref.model, ids)
    streamed = load(path, compute="cuda:0", store="ram", cache=cache)
    stores = {e.component: e.store for e in streamed.plan.entries}
    experts = [c for c in stores if c.endswith(".experts")]
    assert experts and all(stores[c] == "ram" for c in experts)
    entry = next(e for e in streamed.plan.entries if e.component == f"expert cache ({cache} experts)")
    assert entry.device == "cuda:0" and entry.store == "vram" and entry.nbytes > 0
    got = run(streamed.model, ids)
    errs = close(got[0], want[0], 1e-4), close(got[2], want[2], 1e-4)
    assert got[1] == want[1]
    assert np.isclose(streamed.perplexity(ids)["nll"], ref.perplexity(ids)["nll"], rtol=1e-4)
    st = expert_stats(streamed)
    assert st["copied_bytes"] > 0 and st["misses"] > 0
    if cache == 1:  # at most one expert resident: decode reads the others from host memory
        assert st["host_read_bytes"] > 0
    else:  # everything fits: a second run of the same prompt copies nothing and hits
        assert run(streamed.model, ids)[1] == want[1]
        st2 = expert_stats(streamed)
        assert st2["copied_bytes"] == st["copied_bytes"] and st2["hits"] > st["hits"]
    print(f"{name} cache {cache}: max |dlogit| prefill {errs[0]:.2e} decode {errs[1]:.2e}; {st}")


@pytest.mark.gpu
@pytest.mark.parametrize("cache", [2, 64])
def test_streamed_experts_decode_through_the_graph_and_generate_the_same_text(checkpoint, cache, monkeypatch):
    """Decode reads non-resident experts from host memory, so the step is captured as a CUDA graph as the all-VRAM
    one is; with the cache refreshed every step (REFRESH = 1) experts are swapped in while generating, and the
    tokens stay those of the all-VRAM engine."""
    from lumen_cuda import stream

    _, path = checkpoint
    monkeypatch.setattr(stream, "REFRESH", 1)
    ref = load(path)
    streamed = load(path, compute="cuda:0", store="ram", cache=cache)
    prompt = list(range(5, 30))
    got, want = list(streamed.generate_tokens(prompt, 24)), list(ref.generate_tokens(prompt, 24))
    # the tiny NVFP4 checkpoint has matrices too narrow for the NVFP4 GEMV, whose cuBLAS fallback is not
    # capturable: then neither engine has a graph
    assert bool(streamed.decode_runner()) == bool(ref.decode_runner())
    if "nvfp4" not in str(path):
        assert streamed.decode_runner()
    if cache == 2 and streamed.decode_runner():
        assert expert_stats(streamed)["swaps"] > 0
    if got != want:  # allowed only where the reference's two best logits tie to within the tolerance
        i = next(j for j, (a, b) in enumerate(zip(got, want, strict=False)) if a != b)
        logits = np.asarray(ref.model.forward(prompt + want[:i], ref.model.new_cache(CONTEXT))[-1], np.float64)
        top = np.argsort(logits)[-2:]
        gap = logits[top[1]] - logits[top[0]]
        assert got[i] in top.tolist() and gap <= 1e-4 * max(1.0, np.abs(logits).max()), (
            f"token {i} differs ({got[i]} vs {want[i]}) with a margin of {gap:.3g} between the two best logits")


@pytest.mark.gpu
def test_store_mmap_on_cuda_is_read_as_ram_with_a_note(tiny_checkpoint, cp):
    """A GPU reads weights from VRAM or page-locked RAM; LumenLLM's meaning of mmap under a GPU is ram ("mmap currently
    behaves like ram on the CUDA backend"): the plan reads it so, says so in a note, and decodes as store ram does."""
    path = tiny_checkpoint("qwen3_5_moe")
    mapped = lumen.load({"model": {"path": str(path), "compute": "cuda:0", "store": "mmap"}}, progress=False)
    assert {e.store for e in mapped.plan.entries if e.kind != "cache"} == {"ram"}
    assert any("store mmap under a GPU compute device is read as ram" in n and n.startswith("model:")
               for n in mapped.plan.notes)
    ram = lumen.load({"model": {"path": str(path), "compute": "cuda:0", "store": "ram"}}, progress=False)
    params = SamplingParams(temperature=0.0)
    assert list(mapped.generate_tokens([1, 2, 3], 6, params)) == list(ram.generate_tokens([1, 2, 3], 6, params))


@pytest.mark.gpu
def test_experts_on_the_cpu_with_the_rest_on_the_gpu_equal_the_cpu(checkpoint):
    """experts: {compute: cpu, store: ram} under a cuda:0 model: the hidden states cross to the CPU backend and
    back each MoE layer; logits as the all-CPU run of the same checkpoint (<= 1e-3, the cuda-vs-cpu tolerance of
    test_cuda.py), the same greedy tokens."""
    name, path = checkpoint
    cpu = lumen.load({"model": {"path": str(path), "compute": "cpu", "store": "ram",
                                "hidden-layers": {"kv-cache": {"context-size": CONTEXT}}}}, progress=False)
    mixed = load(path, compute="cpu", store="ram")
    backends = {e.component: e.backend for e in mixed.plan.entries if e.kind == "weights"}
    assert {b for c, b in backends.items() if c.endswith(".experts")} == {"cpu"}
    assert {b for c, b in backends.items() if not c.endswith(".experts")} == {"cuda"}
    ids = np.random.RandomState(2).randint(3, cpu.model.vocab_size, 40).tolist()
    want, got = run(cpu.model, ids), run(mixed.model, ids)
    errs = close(got[0], want[0], 1e-3), close(got[2], want[2], 1e-3)
    assert got[1] == want[1]
    assert np.isclose(mixed.perplexity(ids)["nll"], cpu.perplexity(ids)["nll"], rtol=1e-3)
    # decode through the engine: one CUDA graph, the CPU experts as its host nodes (lumen_cuda.hostcall)
    runner = mixed.decode_runner()
    if "nvfp4" not in str(path):  # the tiny NVFP4 checkpoint's narrow matrices fall back to cuBLAS: no graph
        assert runner and len(runner.inputs.host_calls) == sum(c.endswith(".experts") for c in backends)
        # each replay first lets the CPU backend free this thread's idle OpenMP pool (Backend.release_threads)
        assert {type(hc.target).__name__ for hc in runner.inputs.host_calls} == {"CPUBackend"}
        released = []
        target = runner.inputs.host_calls[0].target
        target.release_threads = lambda: released.append(1)
    assert list(mixed.generate_tokens(ids, STEPS)) == list(cpu.generate_tokens(ids, STEPS))  # pipelined greedy
    if "nvfp4" not in str(path):
        assert STEPS - 1 <= len(released) <= STEPS + 2, released  # once a replay (one backend), not a host call
        del target.release_threads
    sampled = {"temperature": 0.8, "top_k": 5, "seed": 3}  # runner.step per token, sampled on the device
    assert 1 <= len(list(mixed.generate_tokens(ids, STEPS, SamplingParams(**sampled)))) <= STEPS
    print(f"{name}: max |dlogit| prefill {errs[0]:.2e} decode {errs[1]:.2e}")


@pytest.mark.gpu
def test_a_dropped_cpu_experts_engine_lets_its_queued_steps_finish(checkpoint, capfd):
    """Pipelined greedy decoding keeps two steps queued; an engine dropped right after the consumer stops must
    wait for them, else their host nodes run after the host calls are freed (hostcall's trampoline says so)."""
    import gc

    _, path = checkpoint
    if "nvfp4" in str(path):
        pytest.skip("the tiny NVFP4 checkpoint's narrow matrices fall back to cuBLAS, which a graph cannot hold")
    mixed = load(path, compute="cpu", store="ram")
    assert mixed.decode_runner()
    tokens = mixed.generate_tokens([5, 6, 7], 8)
    next(tokens)
    tokens.close()
    del mixed, tokens
    gc.collect()
    assert "ran after its decode step was freed" not in capfd.readouterr().err


@pytest.mark.gpu
def test_an_error_in_a_cpu_expert_host_node_is_raised_not_swallowed(checkpoint, monkeypatch):
    """A host node cannot stop the graph; what it raised comes out of the next step the engine waits for."""
    _, path = checkpoint
    if "nvfp4" in str(path):
        pytest.skip("the tiny NVFP4 checkpoint's narrow matrices fall back to cuBLAS, which a graph cannot hold")
    monkeypatch.setenv("LUMEN_HOSTCALL", "python")  # under native (the default) fp8 experts have no Python fn
    mixed = load(path, compute="cpu", store="ram")
    runner = mixed.decode_runner()
    assert runner

    def broken(*args):
        raise ValueError("expert kernel failed")

    runner.inputs.host_calls[0].fn = broken
    with pytest.raises(RuntimeError, match="expert kernel failed"):
        list(mixed.generate_tokens([5, 6, 7], 4))


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["qwen3.5-35b-a3b-gpu-streamed-experts.json", "qwen3.5-35b-a3b-gpu-cpu-experts.json"])
def test_gpu_placement_examples_run(name, tiny_checkpoint, write_config, cp):
    """The examples/ recipes for a big MoE on one GPU, pointed at the tiny MoE checkpoint: they plan, load and
    generate, and place the experts as they say."""
    import json
    from pathlib import Path

    raw = json.loads((Path(__file__).resolve().parents[1] / "examples" / name).read_text())
    raw["model"]["path"] = str(tiny_checkpoint("qwen3_5_moe"))
    raw["model"]["hidden-layers"]["kv-cache"]["context-size"] = 256
    engine = lumen.load(str(write_config(raw)), progress=False)
    experts = raw["model"]["hidden-layers"]["experts"]
    placed = {(e.backend, e.store) for e in engine.plan.entries if e.component.endswith(".experts")}
    assert placed == {(experts["compute"].split(":")[0], experts["store"])}
    ids = list(engine.generate_tokens(engine.encode("Hello"), max_tokens=4))
    assert len(ids) <= 4 and engine.stats.generated_tokens >= 1


@pytest.mark.gpu
@pytest.mark.parametrize("placement", ["vram", "stream"])
def test_memory_allocated_is_within_ten_percent_of_the_plan(placement, tiny_checkpoint, cp):
    """The plan is the truth: after loading and generating, the VRAM Lumen holds (CuPy's default pool plus the
    decode graph's private pool: weights, KV cache, expert cache, scratch) and the pinned host memory it took (the
    streamed experts) are each within 10% of the plan's pools. A checkpoint big enough (~1.7 GB f32) that the
    figures are not noise. CUDA's own context, cuBLAS workspaces and loaded kernels are not Lumen's allocations
    and not in the plan."""
    import gc

    path = tiny_checkpoint("qwen3_5_moe", hidden_size=1024, num_experts=32, num_experts_per_tok=4,
                           moe_intermediate_size=1024, shared_expert_intermediate_size=1024)
    gc.collect()
    pool = cp.get_default_memory_pool()
    used0 = pool.used_bytes()
    experts = {"compute": "cuda:0", "store": "ram", "cache": 16} if placement == "stream" else {}
    engine = lumen.load({"model": {"path": str(path), "compute": "cuda:0", "store": "vram", "hidden-layers": {
        "kv-cache": {"context-size": 1024}, **({"experts": experts} if experts else {})}}}, progress=False)
    list(engine.generate_tokens(list(range(5, 40)), 4))
    runner = engine.decode_runner()
    vram = pool.used_bytes() - used0 + (runner.pool.used_bytes() if runner else 0)
    pinned = engine.backends[("output-layer", None)].arena.allocated  # the engine's own arena
    pools = engine.plan.pools()
    want_vram, want_ram = pools.get("cuda:0 VRAM", 0), pools.get("host RAM", 0)
    print(f"{placement}: VRAM {vram / 1e6:.1f} MB (plan {want_vram / 1e6:.1f}), pinned {pinned / 1e6:.1f} MB "
          f"(plan host RAM {want_ram / 1e6:.1f})")
    assert abs(vram - want_vram) <= 0.1 * want_vram, (vram, want_vram)
    if placement == "stream":
        assert want_ram > 0.5 * (want_vram + want_ram)  # most of the model is in host memory, as configured
        assert abs(pinned - want_ram) <= 0.1 * want_ram, (pinned, want_ram)
    del engine, runner
    gc.collect()


@pytest.mark.gpu
def test_a_dropped_engine_gives_its_vram_back(tiny_checkpoint, cp):
    """Loading, generating (the decode graph, fused projections, MoE pointer tables) and dropping an engine leaves
    CuPy's pool where it was: what an engine derives (graphs, fused weights, tables) is its own, so a second model
    fits where the first was (a notebook that reloads with another config must not run out of VRAM).
    tests/test_cuda_engines.py checks the same with ``Engine.close`` and streamed experts, and the pinned memory."""
    import gc

    path = tiny_checkpoint("qwen3_5_moe", hidden_size=1024, num_experts=32, num_experts_per_tok=4,
                           moe_intermediate_size=1024, shared_expert_intermediate_size=1024)
    gc.collect()
    pool = cp.get_default_memory_pool()
    before = pool.used_bytes()
    engine = lumen.load({"model": {"path": str(path), "compute": "cuda:0", "store": "vram",
                                   "hidden-layers": {"kv-cache": {"context-size": 256}}}}, progress=False)
    list(engine.generate_tokens(list(range(5, 40)), 4))
    loaded = pool.used_bytes() - before
    assert engine.decode_runner()
    del engine
    gc.collect()
    left = pool.used_bytes() - before
    print(f"VRAM held: {loaded / 1e6:.1f} MB loaded, {left / 1e6:.1f} MB after the engine is dropped")
    assert left <= 0.02 * loaded, (left, loaded)


def graph_logits(engine, ids, steps):
    """The decode graph's logits for ``steps`` greedy tokens after an eager prefill of ``ids`` into its cache."""
    import cupy

    runner = engine.decode_runner()
    assert runner
    runner.reset()
    logits, out = engine.model.forward(ids, runner.cache)[-1], []
    for _ in range(steps):
        logits = cupy.asnumpy(runner.step(int(np.argmax(logits))))[-1]
        out.append(logits)
    return runner, np.stack(out)


@pytest.fixture(scope="module")
def fp8_checkpoint(tiny_checkpoint, tmp_path_factory, cp):
    return quantize(tiny_checkpoint, tmp_path_factory, "fp8")


@pytest.mark.gpu
def test_native_crossings_equal_python_host_nodes_bit_for_bit(fp8_checkpoint, monkeypatch):
    """LUMEN_HOSTCALL native (kernels polling a mailbox that the CPU server answers), node (the server asked from a
    host node's C function) and python (a Python host node): the same C worker and sums, so the same logits to the
    bit, step after step."""
    from lumen_cuda.hostcall import HostCall, NativeCall

    ids = [5, 9, 2, 7, 11]
    got = {}
    for how in ("native", "node", "python"):
        monkeypatch.setenv("LUMEN_HOSTCALL", how)
        mixed = load(fp8_checkpoint, compute="cpu", store="ram")
        runner, got[how] = graph_logits(mixed, ids, STEPS)
        kinds = {type(hc) for hc in runner.inputs.host_calls}
        assert kinds == ({HostCall} if how == "python" else {NativeCall}), (how, kinds)
        assert all(hc.how == how for hc in runner.inputs.host_calls if isinstance(hc, NativeCall))
        mixed.close()
    assert np.isfinite(got["python"]).all()
    assert np.array_equal(got["native"], got["python"])
    assert np.array_equal(got["node"], got["python"])


@pytest.mark.gpu
def test_a_native_crossing_nobody_answers_times_out_and_raises(fp8_checkpoint, monkeypatch):
    """A stopped server: each wait gives up after LUMEN_HOSTCALL_TIMEOUT and the next step raises with the fix."""
    from lumen_cuda.hostcall import NativeCall

    monkeypatch.setenv("LUMEN_HOSTCALL", "native")
    monkeypatch.setenv("LUMEN_HOSTCALL_TIMEOUT", "0.2")
    mixed = load(fp8_checkpoint, compute="cpu", store="ram")
    runner = mixed.decode_runner()
    assert runner and isinstance(runner.inputs.host_calls[0], NativeCall)
    runner.inputs.host_calls[0].server.close()
    with pytest.raises(RuntimeError, match="did not answer .* LUMEN_HOSTCALL_TIMEOUT"):
        list(mixed.generate_tokens([5, 6, 7], 4))


@pytest.mark.gpu
def test_a_native_server_error_is_raised_after_the_step(fp8_checkpoint, monkeypatch):
    """The server's error word (an unknown job number: lumen_serve's answer) comes out of the next step."""
    monkeypatch.setenv("LUMEN_HOSTCALL", "native")
    mixed = load(fp8_checkpoint, compute="cpu", store="ram")
    runner = mixed.decode_runner()
    assert runner
    runner.inputs.host_calls[0].box.words[9] = 5
    with pytest.raises(RuntimeError, match="unknown job"):
        list(mixed.generate_tokens([5, 6, 7], 4))


@pytest.mark.gpu
@pytest.mark.parametrize("var,value,message", [("LUMEN_HOSTCALL", "fast", "'fast'.*native, node, python"),
                                               ("LUMEN_HOSTCALL_TIMEOUT", "-1", "'-1'.*seconds > 0")])
def test_a_bad_hostcall_setting_is_named(fp8_checkpoint, monkeypatch, var, value, message):
    from lumen_core.errors import LumenError

    monkeypatch.setenv(var, value)
    mixed = load(fp8_checkpoint, compute="cpu", store="ram")
    with pytest.raises(LumenError, match=f"{var}={message}"):
        mixed.decode_runner()
