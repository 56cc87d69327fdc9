"""GGUF checkpoints on CUDA (issue 16, part 2): no CUDA kernel reads GGUF blocks yet, so block formats (q8_0, q4_k,
q6_k, q5_0, ...) are dequantized to bf16 when a weight is uploaded (``CUDABackend.stored_format``), and F32 / F16
tensors stay as stored. The plan counts the converted bytes and says so in a note.

Proofs, against the CPU backend:
- one weight: the uploaded bf16 bits are the round-to-nearest-even of ``gguf.quants.dequantize`` (VRAM and host RAM);
- every tiny fixture of tests/data/gguf on cuda:0 against the CPU computing from the same weights: for F32 / F16
  files the CPU reads them as stored, for block-quantized files it is given the same bf16 rounding of the
  dequantized blocks (``bf16_cpu``). Within the cuda-vs-cpu tolerance of the other GPU tests (1e-3 x max(1, max
  |logit|)), the same greedy tokens. How far the bf16 rounding itself moves the logits from the CPU's exact run
  of the blocks is printed, not asserted: on these tiny random models it reaches 0.04-0.5 (a near-tied MoE
  router choice flips), so a real model's GGUF on CUDA is the bf16 model of its dequantized weights, no closer.
GPU tests carry the ``gpu`` marker and skip without CuPy or a CUDA device.
"""

from __future__ import annotations

from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from gpu_util import close, greedy_run, host

import lumen_core as lumen

pytest.importorskip("lumen_cuda")

DATA = Path(__file__).parent / "data" / "gguf"
FILES = sorted(DATA.glob("*/*.gguf"))
CONTEXT = 64


def test_every_fixture_is_found():
    assert len(FILES) >= 20, FILES  # 5 architectures x F32, F16, Q8_0, Q4_K_M


@pytest.mark.gpu
@pytest.mark.parametrize("store", ["vram", "ram"])
@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q5_0"])
def test_block_weights_upload_as_the_bf16_rounding_of_the_reference(qtype, store, cp):
    from gguf.quants import GGMLQuantizationType, dequantize, quantize
    from lumen_cuda.backend import CUDABackend

    from lumen_core.plugins import get_registry

    backend = CUDABackend("cuda:0", get_registry())
    x = np.random.RandomState(0).standard_normal((8, 96)).astype(np.float32)
    t = GGMLQuantizationType[qtype]
    blocks = quantize(x, t)
    w = backend.weight(blocks, qtype.lower(), store, shape=x.shape)
    assert w.format == "bf16" and tuple(w.shape) == x.shape
    want = dequantize(blocks, t).astype(ml_dtypes.bfloat16).view(np.uint16)
    got = np.asarray(host(w.data)).view(np.uint16).reshape(x.shape)
    np.testing.assert_array_equal(got, want)
    out = backend.ops.linear(backend.tensor(x[:2]), w)
    close(out, x[:2] @ want.view(ml_dtypes.bfloat16).astype(np.float32).T, 1e-4)


def load(path, compute: str):
    return lumen.load({"model": {"path": str(path), "compute": compute, "store": "vram" if compute != "cpu" else "ram",
                                 "hidden-layers": {"kv-cache": {"context-size": CONTEXT}}}}, progress=False)


@pytest.fixture
def bf16_cpu(monkeypatch):
    """The CPU backend given GGUF block weights as the CUDA backend stores them: the bf16 rounding of their
    dequantization (``lumen_cuda.backend.dequantized_bf16``), as bf16 weights."""
    from lumen_cpu.backend import CPUBackend
    from lumen_cuda.backend import dequantized_bf16, is_gguf_block

    plain = CPUBackend.weight

    def weight(self, array, fmt, store, scale=None, shape=None):
        if is_gguf_block(fmt):
            bits = dequantized_bf16(array, fmt, shape)
            return plain(self, bits.view(ml_dtypes.bfloat16), "bf16", store, None, bits.shape)
        return plain(self, array, fmt, store, scale, shape)

    def load_bf16(path):
        with monkeypatch.context() as m:
            m.setattr(CPUBackend, "weight", weight)
            return load(path, "cpu")

    return load_bf16


@pytest.mark.gpu
@pytest.mark.parametrize("path", FILES, ids=[p.name for p in FILES])
def test_gguf_on_cuda_equals_the_cpu_on_the_same_weights(path, bf16_cpu, cp):
    gpu = load(path, "cuda:0")
    quantized = not path.stem.endswith(("-f32", "-f16"))
    notes = [n for n in gpu.plan.notes if "converted on load" in n]
    assert bool(notes) == quantized, gpu.plan.notes
    if quantized:
        assert all(set(e.format.split("+")) <= {"bf16", "f16", "f32"} for e in gpu.plan.entries if e.kind == "weights")
    cpu = bf16_cpu(path) if quantized else load(path, "cpu")
    ids = np.random.RandomState(1).randint(3, cpu.model.vocab_size, 24).tolist()
    want, got = greedy_run(cpu.model, ids, CONTEXT, 4), greedy_run(gpu.model, ids, CONTEXT, 4)
    errs = close(got[0], want[0], 1e-3), close(got[2], want[2], 1e-3)
    assert got[1] == want[1]
    assert np.isclose(gpu.perplexity(ids)["nll"], cpu.perplexity(ids)["nll"], rtol=1e-3)
    exact = greedy_run(load(path, "cpu").model, ids, CONTEXT, 4)[0] if quantized else want[0]
    print(f"{path.name}: max |dlogit| prefill {errs[0]:.2e} decode {errs[1]:.2e}; the bf16 rounding of the weights "
          f"moves prefill logits by {np.abs(exact - want[0]).max():.2e} from the CPU's exact run of the blocks")
