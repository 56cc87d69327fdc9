"""CUDA-graph decode (lumen_cuda.graph) and bf16 parity with transformers on the GPU.

- The captured step replays exactly what the op-by-op step computes: same logits (≤ 1e-4, both f32 compute over
  the same weights; the rotary tables are computed on the device in the graph, on the host op by op) and the same
  greedy tokens, over two sequences (the runner's reset really empties the cache).
- bf16 checkpoints (tiny random models saved by transformers, cast to bf16): Lumen's cuda backend keeps the bf16
  weights and computes in f32, so its reference is transformers in f32 over the same bf16 values: prefill logits
  ≤ 1e-3 and 32 greedy tokens equal. Against transformers computing in bf16 itself: max |Δlogit| ≤ 3e-2 of the
  logit range (prefill, all rows), or, where transformers' own f32 and bf16 runs differ by more than that (they
  do on these random models), no farther than transformers-f32 is.
- The engine uses the graph by itself (same text as with LUMEN_CUDA_GRAPH=0, greedy and seeded sampling); with
  LUMEN_CUDA_GRAPH=0 it decodes op by op and says so.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

import lumen_core as lumen
from lumen_core.sampling import SamplingParams

pytest.importorskip("lumen_cuda")
torch = pytest.importorskip("torch")

CONTEXT = 256
STEPS = 32
MOE = {"enable_moe_block": True, "num_experts": 4, "top_k_experts": 2, "moe_intermediate_size": 32}
E2B = {"hidden_size_per_layer_input": 8, "num_kv_shared_layers": 2, "use_double_wide_mlp": True}
MODELS = {  # name: (kind, overrides, prompt length); Gemma's sliding windows (8) make ring caches
    "qwen3_5": ("qwen3_5", {}, 80),
    "qwen3_5_moe": ("qwen3_5_moe", {}, 80),
    # the shared expert as wide as the routed ones: one more slot of their kernels (ops.moe_shared)
    "qwen3_5_moe-shared-slot": ("qwen3_5_moe", {"shared_expert_intermediate_size": 32}, 80),
    "gemma3": ("gemma3", {}, 48),
    "gemma4": ("gemma4", {}, 48),
    "gemma4-full-caches": ("gemma4", {"sliding_window": 512}, 48),
    "gemma4-moe": ("gemma4", MOE, 48),
    "gemma4-e2b": ("gemma4", E2B, 48),  # per-layer inputs, KV-shared layers reading a ring
}


def bf16_copy(src, dst):
    """The checkpoint at src with every floating tensor cast to bf16 (as a bf16 release is saved)."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    for f in dst.glob("*.safetensors"):
        tensors = load_file(f)
        save_file({k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in tensors.items()}, f,
                  metadata={"format": "pt"})
    cfg = json.loads((dst / "config.json").read_text())
    cfg["torch_dtype"] = cfg["dtype"] = "bfloat16"
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def load(path, compute="cuda:0", store="vram"):
    model = {"path": str(path), "compute": compute, "store": store,
             "hidden-layers": {"kv-cache": {"context-size": CONTEXT}}}
    return lumen.load({"model": model}, progress=False)


def prompt(engine, n, seed=0):
    return np.random.RandomState(seed).randint(3, engine.model.vocab_size, n).tolist()


@pytest.fixture(scope="module", params=list(MODELS))
def bf16_model(request, tiny_checkpoint, tmp_path_factory, cp):
    kind, overrides, n = MODELS[request.param]
    path = bf16_copy(tiny_checkpoint(kind, **overrides), tmp_path_factory.mktemp("bf16") / request.param)
    return request.param, path, n


def eager_run(model, ids, tokens=None, steps=STEPS):
    """Prefill + steps op by op; greedy unless ``tokens`` forces the inputs. -> (logits (steps, V), tokens)."""
    cache = model.new_cache(CONTEXT)
    logits = model.forward(ids, cache)
    out, toks = [], []
    for i in range(steps):
        toks.append(int(np.argmax(logits[-1])) if tokens is None else tokens[i])
        logits = model.forward([toks[-1]], cache)
        out.append(logits[-1])
    return np.stack(out), toks


def graph_run(cp, engine, ids, tokens=None, steps=STEPS):
    runner = engine.decode_runner()
    assert runner, "the decode step was not captured"
    runner.reset()
    logits = engine.model.forward(ids, runner.cache, host=False)
    out, toks = [], []
    for i in range(steps):
        toks.append(int(cp.argmax(logits[-1])) if tokens is None else tokens[i])
        logits = runner.step(toks[-1])
        out.append(cp.asnumpy(logits[-1]))
    return np.stack(out), toks


@pytest.mark.gpu
def test_graph_replay_equals_op_by_op_decode(cp, bf16_model):
    name, path, n = bf16_model
    engine = load(path)
    ids = prompt(engine, n)
    want, tokens = eager_run(engine.model, ids)
    for seq in range(2):  # the second sequence starts from runner.reset()
        got, got_tokens = graph_run(cp, engine, ids, tokens)
        err = np.abs(got - want).max()
        assert err <= 1e-4 * max(1.0, np.abs(want).max()), f"{name} sequence {seq}: max |Δ| {err:.3g}"
        assert got_tokens == tokens
    assert engine.decode_runner().cache.pos == n + STEPS


@pytest.mark.gpu
@pytest.mark.parametrize("pdl", ["1", "noprefetch", "late"])
def test_graph_with_programmatic_dependent_launch_equals_without(cp, bf16_model, monkeypatch, pdl):
    """LUMEN_CUDA_PDL (each mode): the step's hand-written kernels captured with programmatic dependent launch (each
    waits for the kernel before it in pdl_begin); the replay gives the bits of the graph captured without it, over
    two sequences. Both with the fused decode ops (LUMEN_CUDA_DECODE_FUSION=1), whose kernels PDL launches too."""
    monkeypatch.setenv("LUMEN_CUDA_DECODE_FUSION", "1")
    name, path, n = bf16_model
    engine = load(path)
    ids = prompt(engine, n)
    want, tokens = graph_run(cp, engine, ids)
    monkeypatch.setenv("LUMEN_CUDA_PDL", pdl)
    with_pdl = load(path)
    for seq in range(2):
        got, got_tokens = graph_run(cp, with_pdl, ids, tokens)
        np.testing.assert_array_equal(got, want, err_msg=f"{name} sequence {seq}")
        assert got_tokens == tokens


@pytest.mark.gpu
def test_graph_with_the_fused_decode_ops_matches_without(cp, bf16_model, monkeypatch):
    """LUMEN_CUDA_DECODE_FUSION=1 (the shared expert as a routed slot, the fused norms, the gates in the delta step):
    the same greedy tokens as the unfused graph, logits within 1e-4 of the scale (the MoE sum takes the shared expert
    in slot order: another f32 order; the rest is bit-exact by construction)."""
    name, path, n = bf16_model
    monkeypatch.setenv("LUMEN_CUDA_DECODE_FUSION", "0")
    engine = load(path)
    ids = prompt(engine, n)
    want, tokens = graph_run(cp, engine, ids)
    monkeypatch.setenv("LUMEN_CUDA_DECODE_FUSION", "1")
    got, got_tokens = graph_run(cp, load(path), ids, tokens)
    err = np.abs(got - want).max()
    assert err <= 1e-4 * max(1.0, np.abs(want).max()), f"{name}: max |Δ| {err:.3g}"
    assert got_tokens == tokens


def hf(path, dtype, device="cpu"):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()


@pytest.mark.gpu
def test_bf16_weights_match_transformers(cp, bf16_model):
    name, path, n = bf16_model
    engine = load(path)
    ids = prompt(engine, n, seed=1)
    ref = hf(path, torch.float32)  # f32 compute over the same bf16 values: what Lumen computes
    with torch.no_grad():
        theirs = ref(input_ids=torch.tensor([ids])).logits[0].numpy()
        gen = ref.generate(torch.tensor([ids]), max_new_tokens=STEPS, do_sample=False, eos_token_id=None,
                           pad_token_id=0)
    ours = engine.model.forward(ids, engine.model.new_cache(CONTEXT), all_logits=True)
    err = np.abs(ours - theirs).max()
    assert err <= 1e-3, f"{name}: prefill max |Δ| {err:.3g} against transformers f32 on the bf16 weights"
    _, tokens = graph_run(cp, engine, ids)
    assert tokens == gen[0, len(ids):].tolist()
    # transformers computing in bf16 (on the GPU when torch sees it). On these random tiny models bf16 compute
    # is far from f32 compute (Lumen, equal to transformers-f32 within 1e-3, differed from transformers-bf16 by
    # 3-24% of the logit range on the H200), so "3e-2 of the range" cannot hold for any f32-accurate engine; what
    # can: Lumen is no farther from transformers-bf16 than transformers-f32 is.
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with torch.no_grad():
        low = hf(path, torch.bfloat16, device)(input_ids=torch.tensor([ids], device=device)).logits[0]
    low = low.float().cpu().numpy()
    rng = float(low.max() - low.min())
    err, own = np.abs(ours - low).max(), np.abs(theirs - low).max()
    assert err <= max(3e-2 * rng, 1.02 * own + 1e-3), (
        f"{name}: max |Δ| {err:.3g} to transformers-bf16 (logit range {rng:.3g}); transformers-f32 is {own:.3g}")


@pytest.mark.gpu
@pytest.mark.parametrize("sampling", [{"temperature": 0.0}, {"temperature": 0.8, "top_k": 20, "top_p": 0.9,
                                                              "seed": 7}])
def test_engine_generates_the_same_with_and_without_the_graph(cp, tiny_checkpoint, tmp_path_factory,
                                                              monkeypatch, sampling):
    path = bf16_copy(tiny_checkpoint("qwen3_5"), tmp_path_factory.mktemp("bf16") / "engine")
    ids = list(range(5, 40))
    graph = load(path)
    with_graph = list(graph.generate_tokens(ids, 24, SamplingParams(**sampling)))
    assert graph.decode_runner()
    monkeypatch.setenv("LUMEN_CUDA_GRAPH", "0")
    eager = load(path)
    without = list(eager.generate_tokens(ids, 24, SamplingParams(**sampling)))
    assert eager.decode_runner() is False
    assert with_graph == without


@pytest.mark.gpu
def test_without_graphs_the_engine_says_so(cp, tiny_checkpoint, capsys, monkeypatch):
    monkeypatch.setenv("LUMEN_CUDA_GRAPH", "0")
    engine = load(tiny_checkpoint("gemma3"))
    out = list(engine.generate_tokens(list(range(5, 30)), 8))
    assert len(out) >= 1
    assert engine.decode_runner() is False
    assert "decode runs op by op: CUDA graphs are off (LUMEN_CUDA_GRAPH=0)" in capsys.readouterr().err


# -- quantized checkpoints: the same dequantized weights on both backends ----------------------------------------
SHARED_SLOT = {"shared_expert_intermediate_size": 32}  # = moe_intermediate_size: ops.moe_shared's fused path
QUANT = {"qwen3_5-fp8": ("qwen3_5", {}, "fp8"), "qwen3_5_moe-fp8": ("qwen3_5_moe", {}, "fp8"),
         "qwen3_5-nvfp4": ("qwen3_5", {}, "nvfp4"), "gemma4-moe-fp8": ("gemma4", MOE, "fp8"),
         "qwen3_5_moe-fp8-shared-slot": ("qwen3_5_moe", SHARED_SLOT, "fp8"),
         "qwen3_5_moe-nvfp4-shared-slot": ("qwen3_5_moe", SHARED_SLOT, "nvfp4")}


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(QUANT))
def test_quantized_checkpoints_match_the_cpu(cp, tiny_checkpoint, tmp_path_factory, name, monkeypatch):
    """fp8 (32x32 block scales) and NVFP4 checkpoints written by ``lumen quantize``: cuda against the CPU backend
    over the same dequantized weights: prefill logits <= 1e-3 of max(1, |logit|), 24 greedy tokens equal (through
    the decode graph where the step was captured)."""
    from lumen_core.quantize import quantize_checkpoint

    kind, overrides, fmt = QUANT[name]
    if "shared-slot" in name:  # the fused decode ops (the shared expert in the routed experts' kernels among them)
        monkeypatch.setenv("LUMEN_CUDA_DECODE_FUSION", "1")
    src = tiny_checkpoint(kind, **overrides)
    dst = tmp_path_factory.mktemp("quant") / name
    quantize_checkpoint(src, dst, fmt, block=32, progress=False)
    on_cpu, on_gpu = load(dst, "cpu", "ram"), load(dst)
    ids = prompt(on_cpu, 48, seed=2)
    want = on_cpu.model.forward(ids, on_cpu.model.new_cache(CONTEXT), all_logits=True)
    got = on_gpu.model.forward(ids, on_gpu.model.new_cache(CONTEXT), all_logits=True)
    err = np.abs(got - want).max()
    assert err <= 1e-3 * max(1.0, np.abs(want).max()), f"{name}: prefill max |Δ| {err:.3g}"
    greedy = SamplingParams(temperature=0.0)
    assert list(on_gpu.generate_tokens(ids, 24, greedy)) == list(on_cpu.generate_tokens(ids, 24, greedy))
    if "shared-slot" in name:  # the shared expert ran in the routed experts' table (E + 1 entries)
        from lumen_cuda import moe
        from lumen_cuda.state import derived

        mlp = on_gpu.model.layers[0].mlp
        assert mlp.fused and ("moe_table_pairs", len(mlp.gate_up) + 1) in derived(mlp.gate_up[0][0])  # built by use
        assert moe.fits_one_table(mlp.gate_up_shared, mlp.down_shared)
    print(f"{name}: prefill max |Δ| {err:.2g}; decode graph: {bool(on_gpu.decode_runner())}")
