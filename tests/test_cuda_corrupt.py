"""A corrupt checkpoint on the GPU. The CUDA decode graph samples on the device, so the engine brings the prefill's
last row of logits to the host once and checks it there (`lumen_core.engine.check_logits`); the GPU backend has no
load warm-up, so this is where a NaN weight is caught."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import lumen_core as lumen
from lumen_core.errors import CheckpointError

pytestmark = pytest.mark.gpu


def test_a_nan_weight_on_the_gpu_is_refused_at_the_first_token(cp, tiny_checkpoint, tmp_path):
    path = tmp_path / "nan"
    shutil.copytree(tiny_checkpoint("qwen3_5"), path)
    tensors = load_file(str(path / "model.safetensors"))
    victim = "model.layers.1.mlp.down_proj.weight"
    tensors[victim] = tensors[victim].copy()
    tensors[victim][3, 5] = np.nan
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    engine = lumen.load({"model": {"path": str(path), "compute": "cuda:0", "store": "vram",
                                   "hidden-layers": {"kv-cache": {"context-size": 64}}}}, progress=False)
    assert engine.decode_runner(), "the all-GPU model decodes through the CUDA graph"
    with pytest.raises(CheckpointError, match=r"non-finite logits at token 1 \(generating"):
        list(engine.generate_tokens([5, 6, 7], max_tokens=4))


def test_a_healthy_checkpoint_on_the_gpu_passes_the_check(cp, tiny_checkpoint):
    engine = lumen.load({"model": {"path": str(tiny_checkpoint("qwen3_5")), "compute": "cuda:0", "store": "vram",
                                   "hidden-layers": {"kv-cache": {"context-size": 64}}}}, progress=False)
    assert len(list(engine.generate_tokens([5, 6, 7], max_tokens=4))) >= 1
