"""Images on wgpu (issue 19): a tiny multimodal checkpoint of each family with its vision tower and its text model
on wgpu:0, against the same on the CPU with the same images: the tower's embeddings and the prefill logits within
1e-3 x max(1, max |x|) (f32 weights; the towers' GELU and softmax use the driver's exp/tanh and the GEMMs sum in
another order: Gemma 4's logits differ by ~1e-4 on lavapipe), and the same 8 greedy tokens. A prompt with images
decodes op by op (the replayed step has text positions only)."""

from __future__ import annotations

import numpy as np
import pytest
from gpu_util import close

import lumen_core as lumen
from lumen_core.sampling import SamplingParams

pytest.importorskip("lumen_wgpu")

CASES = {"qwen3_5_vl": ("qwen3_5_vl", "<|vision_start|><|image_pad|><|vision_end|>"),
         "gemma4_mm": ("gemma4_mm", "<|image|>"),
         "gemma3_vl": ("gemma3_vl", "<start_of_image>")}


def images():
    from PIL import Image

    rng = np.random.RandomState(0)
    return [Image.fromarray((rng.rand(h, w, 3) * 255).astype("uint8")) for h, w in ((64, 96), (80, 48))]


def engine(path, device: str):
    store = "ram" if device == "cpu" else "vram"
    return lumen.load({"model": {"path": str(path), "compute": device, "store": store,
                                 "hidden-layers": {"kv-cache": {"context-size": 2048}}},
                       "vision": {"compute": device, "store": store}}, progress=False)


@pytest.mark.wgpu
@pytest.mark.parametrize("name", sorted(CASES))
def test_images_on_wgpu_equal_the_cpu(name, tiny_checkpoint, wgpu_pair):
    kind, placeholder = CASES[name]
    path = tiny_checkpoint(kind)
    cpu, gpu = engine(path, "cpu"), engine(path, "wgpu:0")
    assert {e.device for e in gpu.plan.entries if e.component == "vision"} == {"wgpu:0"}
    pics = images()
    prompt = f"{placeholder}Describe the first. {placeholder}And the second?"
    ids_c, media_c = cpu.with_images(cpu.encode(prompt), pics)
    ids_g, media_g = gpu.with_images(gpu.encode(prompt), pics)
    assert ids_c == ids_g
    for (_, c), (_, g) in zip(media_c, media_g, strict=True):
        close(gpu.backends[("vision", None)].to_host(g), c, 1e-3)
    want = cpu.model.forward(ids_c, cpu.model.new_cache(2048), all_logits=True, images=media_c)
    got = gpu.model.forward(ids_g, gpu.model.new_cache(2048), all_logits=True, images=media_g)
    close(got, want, 1e-3)
    params = SamplingParams(temperature=0.0)
    tokens = list(gpu.generate_tokens(gpu.encode(prompt), 8, params, images=pics))
    assert tokens == list(cpu.generate_tokens(cpu.encode(prompt), 8, params, images=pics))
