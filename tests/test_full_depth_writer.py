"""benchmarks/full_depth.py writes full-depth random checkpoints directly in fp8 / NVFP4 / bf16 (issue 21's method:
no bf16 copy first). Here the real structures (Qwen 3.5 MoE's per-expert tensors, Gemma 4's layer kinds and
experts) at small sizes: the direct bf16 checkpoint holds the tensors (names, dtypes, shapes) transformers'
``save_pretrained`` writes for that config, the direct fp8 and NVFP4 ones what ``lumen quantize`` writes from that
saved checkpoint (and its quantization_config), and Lumen loads every one on the CPU and generates (a NaN or
infinite logit would raise)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from cuda_models import hf_config  # noqa: E402
from full_depth import _header, write_checkpoint  # noqa: E402

import lumen_core as lumen  # noqa: E402
from lumen_core.quantize import quantize_checkpoint  # noqa: E402

SMALL = dict(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
             global_head_dim=64, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
             linear_value_head_dim=16, moe_intermediate_size=32, shared_expert_intermediate_size=32,
             sliding_window=16, num_experts=8)


def tensors(path: Path) -> dict:
    out = {}
    for f in sorted(path.glob("*.safetensors")):
        out.update({n: (m["dtype"], tuple(m["shape"])) for n, m in _header(f).items()})
    return out


@pytest.mark.parametrize("shape,layers", [("35b-a3b", 8), ("g4-26b-a4b", 6), ("9b", 4)])
def test_direct_checkpoints_are_what_transformers_and_lumen_quantize_write_and_load(tmp_path, shape, layers):
    import torch

    cfg, model_cls = hf_config(shape, layers, 512, SMALL)
    saved = tmp_path / "saved"
    model_cls(cfg).to(torch.bfloat16).save_pretrained(saved)
    bf16 = write_checkpoint(shape, layers, "bf16", tmp_path, vocab=512, progress=False, dims=SMALL)
    assert tensors(bf16) == tensors(saved)
    for fmt in ("fp8", "nvfp4"):
        direct = write_checkpoint(shape, layers, fmt, tmp_path, vocab=512, progress=False, dims=SMALL)
        ref = tmp_path / f"ref-{fmt}"
        quantize_checkpoint(saved, ref, fmt, progress=False)
        assert tensors(direct) == tensors(ref)
        got = json.loads((direct / "config.json").read_text())
        want = json.loads((ref / "config.json").read_text())
        assert got["quantization_config"] == want["quantization_config"]
        assert got["num_hidden_layers"] == layers
    for path in (bf16, *(tmp_path / f"{shape}-l{layers}-{f}-small" for f in ("fp8", "nvfp4"))):
        engine = lumen.load({"model": {"path": str(path), "compute": "cpu", "store": "ram"}}, progress=False)
        assert len(list(engine.generate_tokens([1, 2, 3, 4, 5], 3))) == 3
