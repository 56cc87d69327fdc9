"""GPU components whose weights stay in host RAM (``compute: cuda:0, store: ram`` for layers and the input/output
layers; lumen_cuda.hostweights): decode reads them over PCIe through zero-copy views, a prefill copies each matrix
into VRAM for its GEMM. Against the all-VRAM run of the same checkpoint: the same logits and greedy tokens, and
the memory as planned (host RAM page-locked, VRAM holding only the caches).

Tolerance: decode runs the same GEMV kernels on the same bytes (unfused: a fused projection would sit in VRAM),
prefill the same GEMMs on VRAM copies: <= 1e-4 x max(1, max |logit|), tokens equal.

They first passed on the H200 on 2026-11-30; the cuda backend has declared the store since.
GPU tests carry the ``gpu`` marker and skip without CuPy or a CUDA device.
"""

from __future__ import annotations

import numpy as np
import pytest
from gpu_util import close, greedy_run

import lumen_core as lumen

pytest.importorskip("lumen_cuda")

CONTEXT = 128
STEPS = 6
MOE_GEMMA = {"enable_moe_block": True, "num_experts": 4, "top_k_experts": 2, "moe_intermediate_size": 32}
KINDS = {"qwen3_5": ("qwen3_5", {}), "qwen3_5_moe": ("qwen3_5_moe", {}), "gemma4": ("gemma4", {}),
         "gemma4-moe": ("gemma4", MOE_GEMMA)}


def load(path, store: str):
    return lumen.load({"model": {"path": str(path), "compute": "cuda:0", "store": store,
                                 "hidden-layers": {"kv-cache": {"context-size": CONTEXT}}}}, progress=False)


def run(model, ids):
    return greedy_run(model, ids, CONTEXT, STEPS)


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(KINDS))
def test_weights_in_host_ram_equal_the_vram_run(name, tiny_checkpoint, cp):
    kind, overrides = KINDS[name]
    path = tiny_checkpoint(kind, **overrides)
    ref, host = load(path, "vram"), load(path, "ram")
    stores = {(e.component, e.store) for e in host.plan.entries if e.kind == "weights"}
    assert {s for _, s in stores} == {"ram"}
    assert {e.store for e in host.plan.entries if e.component.startswith("cache.")} == {"vram"}
    ids = np.random.RandomState(4).randint(3, ref.model.vocab_size, 30).tolist()
    want, got = run(ref.model, ids), run(host.model, ids)
    errs = close(got[0], want[0], 1e-4), close(got[2], want[2], 1e-4)
    assert got[1] == want[1]
    runner = host.decode_runner()  # decode through the graph: the zero-copy reads are captured like any read
    assert bool(runner) == bool(ref.decode_runner())
    assert list(host.generate_tokens(ids, STEPS)) == list(ref.generate_tokens(ids, STEPS))
    assert np.isclose(host.perplexity(ids)["nll"], ref.perplexity(ids)["nll"], rtol=1e-4)
    print(f"{name}: max |dlogit| prefill {errs[0]:.2e} decode {errs[1]:.2e}; graph {bool(runner)}")


@pytest.mark.gpu
def test_weights_in_host_ram_take_pinned_memory_not_vram_as_planned(tiny_checkpoint, cp):
    """The plan is the truth: a ~270 MB f32 Qwen 3.5 with every weight in host RAM takes page-locked memory within
    10% of the plan's host-RAM pool, and its VRAM (caches, decode scratch, transient prefill copies freed) stays far
    below the all-VRAM figure."""
    import gc

    path = tiny_checkpoint("qwen3_5", hidden_size=1024, intermediate_size=4096, num_hidden_layers=4,
                           num_attention_heads=8, num_key_value_heads=2, head_dim=128, linear_num_key_heads=4,
                           linear_num_value_heads=8, linear_key_head_dim=128, linear_value_head_dim=128)
    gc.collect()
    pool = cp.get_default_memory_pool()
    used0 = pool.used_bytes()
    engine = lumen.load({"model": {"path": str(path), "compute": "cuda:0", "store": "ram",
                                   "hidden-layers": {"kv-cache": {"context-size": 1024}}}}, progress=False)
    list(engine.generate_tokens(list(range(5, 40)), 4))
    runner = engine.decode_runner()
    vram = pool.used_bytes() - used0 + (runner.pool.used_bytes() if runner else 0)
    pinned = engine.backends[("output-layer", None)].arena.allocated  # the engine's own arena (pinned.py)
    pools = engine.plan.pools()
    want_ram, want_vram = pools["host RAM"], pools.get("cuda:0 VRAM", 0)
    print(f"host weights: VRAM {vram / 1e6:.1f} MB (plan {want_vram / 1e6:.1f}), pinned {pinned / 1e6:.1f} MB "
          f"(plan {want_ram / 1e6:.1f})")
    assert abs(pinned - want_ram) <= 0.1 * want_ram, (pinned, want_ram)
    assert vram < 0.25 * want_ram  # the weights are not in VRAM
    del engine, runner
    gc.collect()
