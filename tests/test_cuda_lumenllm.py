"""LumenLLM's three published examples (tests/data/lumenllm/) run as written on cuda:0 with tiny checkpoints of their
architectures (issue 16): the Qwen3.6-35B one keeps every token mixer in VRAM and streams the rest of each layer and
its routed experts from host RAM (``hidden-layers.store: ram`` + ``attention.store: vram``). Against the all-VRAM run
of the same checkpoint with the example's KV cache types: decode runs the same kernels on the same bytes (host
weights unfused), prefill the same GEMMs on VRAM copies, so the tolerance is <= 1e-4 x max(1, max |logit|) with an
f32 KV cache (as for tests/test_cuda_hostweights.py) and 1e-3 with the examples' f16 one; the greedy tokens are
equal. GPU tests carry the ``gpu`` marker and skip without CuPy or a CUDA device.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from gpu_util import close, greedy_run
from test_attention_placement import CONTEXT, MOE_GEMMA, greedy, rows, whole

import lumen_core as lumen

pytest.importorskip("lumen_cuda")

DATA = Path(__file__).parent / "data" / "lumenllm"
EXAMPLES = {"parameters.qwen35-9b.json": ("qwen3_5", {}),
            "parameters.qwen36-35b.json": ("qwen3_5_moe", {}),
            "parameters.gemma4-26b-vision-draft.json": ("gemma4", MOE_GEMMA)}


def as_written(name: str, path) -> dict:
    """The example with its checkpoint path pointed at a tiny checkpoint and a context the tiny model was made for;
    the gemma4 example's vision and draft blocks are left out (their checkpoints are not built here: the draft's
    plan is tested in tests/test_lumenllm_configs.py, speculative decoding on CUDA in tests/test_cuda_speculative.py).
    Every placement is as written."""
    raw = json.loads((DATA / name).read_text(encoding="utf-8"))
    raw.pop("vision", None)
    raw.pop("draft", None)
    raw["model"]["path"] = str(path)
    raw["model"]["hidden-layers"]["kv-cache"]["context-size"] = CONTEXT
    return raw


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_lumenllm_examples_run_as_written_on_the_gpu(name, tiny_checkpoint, cp):
    kind, overrides = EXAMPLES[name]
    path = tiny_checkpoint(kind, **overrides)
    theirs = lumen.load(as_written(name, path), progress=False)
    reference = whole(path, "cuda:0", "vram")  # everything in VRAM, with the example's own KV cache types
    kv = json.loads((DATA / name).read_text())["model"]["hidden-layers"]["kv-cache"]
    reference["model"]["hidden-layers"]["kv-cache"].update({k: kv[k] for k in ("type-k", "type-v")})
    ref = lumen.load(reference, progress=False)
    got_rows = rows(theirs)
    layers_store = json.loads((DATA / name).read_text())["model"]["hidden-layers"]["store"]
    for i in range(theirs.arch.num_layers):
        assert got_rows[f"layers.{i}"][:2] == ("cuda:0", layers_store)
        if layers_store != "vram":  # LumenLLM: attention in VRAM, the rest of the layer streamed from host RAM
            assert got_rows[f"layers.{i}.attention"][:2] == ("cuda:0", "vram")
    ids = np.random.RandomState(5).randint(3, ref.model.vocab_size, 30).tolist()
    want, got = greedy_run(ref.model, ids, CONTEXT, 6), greedy_run(theirs.model, ids, CONTEXT, 6)
    # f16 KV (all three examples): the two runs' keys and values differ in the last f32 bits (unfused host-weight
    # GEMVs vs fused VRAM ones), which rounding to f16 can turn into one f16 ulp (~5e-4 relative): 1e-3 then
    tol = 1e-4 if kv["type-k"] == kv["type-v"] == "f32" else 1e-3
    errs = close(got[0], want[0], tol), close(got[2], want[2], tol)
    assert got[1] == want[1]
    assert bool(theirs.decode_runner()) == bool(ref.decode_runner())
    assert greedy(theirs, ids) == greedy(ref, ids)
    print(f"{name}: max |dlogit| prefill {errs[0]:.2e} decode {errs[1]:.2e}; graph {bool(theirs.decode_runner())}")


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["qwen3_5", "qwen3_5_moe"])
@pytest.mark.parametrize("layers, attention", [("cpu", "cuda:0"), ("cuda:0", "cpu")])
def test_token_mixers_computed_apart_from_their_layers_equal_the_cpu(kind, layers, attention, tiny_checkpoint, cp):
    """model.attention.compute apart from the layers' device (Qwen 3.5): the mixers, their KV caches and recurrent
    states on one device, the rest of each layer on the other; against everything on the CPU within the cuda-vs-cpu
    tolerance of the other GPU tests (1e-3 x max(1, max |logit|)), the same greedy tokens."""
    path = tiny_checkpoint(kind)
    store = {"cpu": "ram", "cuda:0": "vram"}
    raw = {"model": {"path": str(path), "compute": layers, "store": store[layers],
                     "attention": {"compute": attention, "store": store[attention]},
                     "hidden-layers": {"kv-cache": {"context-size": CONTEXT}}}}
    apart, cpu = lumen.load(raw, progress=False), lumen.load(whole(path), progress=False)
    assert {e.device for e in apart.plan.entries if e.component.startswith("cache.")} == {attention}
    ids = np.random.RandomState(6).randint(3, cpu.model.vocab_size, 30).tolist()
    want, got = greedy_run(cpu.model, ids, CONTEXT, 6), greedy_run(apart.model, ids, CONTEXT, 6)
    errs = close(got[0], want[0], 1e-3), close(got[2], want[2], 1e-3)
    assert got[1] == want[1]
    assert greedy(apart, ids) == greedy(cpu, ids)
    print(f"{kind} layers {layers} attention {attention}: max |dlogit| prefill {errs[0]:.2e} decode {errs[1]:.2e}")
