"""benchmarks/vision.py keeps working: the whole script on the CPU, both models, at a tiny size.

The published shapes in the script's MODELS table are swapped for tiny ones of the same families (the script's
checkpoint builder, preprocessors, Lumen and transformers paths and report all run as in a real run); both engines
must produce the same first token on the same random checkpoint.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"

TINY = {
    "qwen3.5-9b": {
        "vision": dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, in_channels=3, patch_size=16,
                       spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=64, num_position_embeddings=16,
                       hidden_act="gelu_pytorch_tanh", deepstack_visual_indexes=[]),
        "text": dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                     linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
                     tie_word_embeddings=False,
                     rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.25,
                                      "mrope_section": [1, 1, 0], "mrope_interleaved": True}),
    },
    "gemma4-26b": {
        "vision": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                       num_key_value_heads=2, head_dim=16, patch_size=16, pooling_kernel_size=3,
                       position_embedding_size=64, standardize=True, use_clipped_linears=False),
        "text": dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                     global_head_dim=32, num_global_key_value_heads=1, attention_k_eq_v=True, sliding_window=8,
                     enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=32,
                     hidden_size_per_layer_input=0, tie_word_embeddings=True, final_logit_softcapping=30.0),
        "preprocessor": {"max_soft_tokens": 70},
    },
}


@pytest.fixture
def bench(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    spec = importlib.util.spec_from_file_location("bench_vision", BENCH / "vision.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    for name, tiny in TINY.items():
        entry = dict(module.MODELS[name], vision=tiny["vision"], text=tiny["text"])
        entry["preprocessor"] = {**entry["preprocessor"], **tiny.get("preprocessor", {})}
        monkeypatch.setitem(module.MODELS, name, entry)
    yield module
    sys.modules.pop("bench_vision", None)


@pytest.mark.slow
def test_vision_benchmark_runs_on_cpu(bench, tmp_path, capsys):
    out = tmp_path / "vision.json"
    info = bench.main(["--device", "cpu", "--image-size", "64", "--text-layers", "2", "--vocab", "6000",
                       "--repeat", "1", "--threads", "1", "--workdir", str(tmp_path / "ckpt"), "--json", str(out)])
    printed = capsys.readouterr().out
    saved = json.loads(out.read_text())
    assert set(saved["results"]) == {"qwen3.5-9b", "gemma4-26b"}
    for name, row in info["results"].items():
        lumen, hf = row["lumen"], row["transformers"]
        assert "error" not in hf, hf.get("error")
        for key in ("a", "b", "c"):
            assert len(lumen[key]) == len(hf[key]) == 1 and lumen[key][0] > 0 and hf[key][0] > 0
        assert lumen["first_token"] == hf["first_token"], name  # same checkpoint, image and ids: same greedy token
        assert lumen["image_tokens"] > 0 and row["text_layers"] == 2 and row["vocab"] == 6000
        for label in ("(a) preprocess", "(b) tower", "(c) TTFT"):
            assert f"| {name} | cpu | {label} |" in printed


def test_unknown_model_is_refused(bench):
    with pytest.raises(SystemExit, match="unknown model"):
        bench.main(["--models", "nope"])
