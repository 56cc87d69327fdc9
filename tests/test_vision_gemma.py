"""Gemma 3 / Gemma 4 vision (issue 17) against transformers on the tiny multimodal checkpoints: the towers
(``get_image_features``), prefill logits and greedy tokens with one image, two images, and image / text / image,
image tokens' bidirectional attention (Gemma 3 on every layer, Gemma 4 on sliding layers with
``use_bidirectional_attention: "vision"``), Gemma 4's per-layer inputs (E2B) and MoE with images, the layout of the
vision component, ``expand_image_tokens``.

The images are made by transformers' own PIL image processors (``pixel_values`` and the rest become ``ImageInput``
fields), so these tests do not depend on Lumen's preprocessors.

Tolerance: f32 on both sides. Each part is held to 1e-4: the towers (1.4e-6 measured) and the text model's logits
given transformers' own image features (5.4e-5 at most over 15 prompts a variant). End to end (our tower feeding our
text model) Gemma 4's logits are held to 2e-4: the tiny random Gemma 4 text models are ill-conditioned on image rows,
where a relative perturbation of 1e-6 of the image embeddings alone moves the logits by 7e-5 to 1.3e-4 (measured on
g4-mm-bidirectional), so the towers' 1e-6 f32 differences come out at up to 1.4e-4 (15 prompts a variant); Gemma 3's
measure 2e-6 and stay at 1e-4. A wrong mask, scale or position moves logits by 1e-2 or more, and greedy tokens must
be equal.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

import lumen_core as lumen
from lumen_core.errors import InputError
from lumen_core.images import ImageInput

TOL = 1e-4
STEPS = 8
CONTEXT = 256
TEXT_IDS = (3, 850)  # ordinary tokens of the tiny vocabulary (the special tokens sit above)

MOE = {"enable_moe_block": True, "num_experts": 4, "top_k_experts": 2, "moe_intermediate_size": 32}
K_EQ_V = {"attention_k_eq_v": True, "num_global_key_value_heads": 1}
E2B = {"hidden_size_per_layer_input": 8, "num_kv_shared_layers": 2, "use_double_wide_mlp": True}
BIDI = {"use_bidirectional_attention": "vision"}

G4_END_TO_END = 2e-4
VARIANTS = {  # name: (kind, text config overrides, end-to-end logits tolerance)
    "g4-mm": ("gemma4_mm", {}, G4_END_TO_END),
    "g4-mm-bidirectional": ("gemma4_mm", BIDI, G4_END_TO_END),
    "g4-mm-e2b-bidirectional": ("gemma4_mm", {**E2B, **BIDI}, G4_END_TO_END),
    "g4-mm-moe-k-eq-v": ("gemma4_mm", {**MOE, **K_EQ_V}, G4_END_TO_END),
    "g3-vl": ("gemma3_vl", {}, TOL),
}
SIZES = ((40, 56), (64, 32), (48, 48))  # Gemma 4: 63, 55 and 36 soft tokens; Gemma 3 resizes each to 16x16


def pictures(n: int, seed: int = 0) -> list:
    rng = np.random.RandomState(seed)
    return [Image.fromarray(rng.randint(0, 256, (*SIZES[i % len(SIZES)], 3)).astype(np.uint8)) for i in range(n)]


class Case:
    """One tiny checkpoint: transformers' model, Lumen's engine (loaded with a vision block) and how its family's
    processor turns pictures into tower inputs."""

    def __init__(self, path, tol: float = TOL):
        from transformers import AutoModelForImageTextToText

        self.path, self.tol = path, tol
        self.ref = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
        self.engine = lumen.load({"model": {"path": str(path), "compute": "cpu", "store": "ram",
                                            "hidden-layers": {"kv-cache": {"context-size": CONTEXT}}},
                                  "vision": {"compute": "cpu"}}, progress=False)
        self.arch, self.model = self.engine.arch, self.engine.model
        self.gemma4 = self.arch.model_type == "gemma4"

    def process(self, pics):
        """(the ImageInputs, transformers' image kwargs)."""
        if self.gemma4:
            from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil

            out = Gemma4ImageProcessorPil(patch_size=4, max_soft_tokens=70, pooling_kernel_size=2)(
                images=pics, return_tensors="pt")
            inputs = [ImageInput(out["pixel_values"][i].numpy(), (), int(out["num_soft_tokens_per_image"][i]),
                                 {"positions": out["image_position_ids"][i].numpy()}) for i in range(len(pics))]
            return inputs, {"pixel_values": out["pixel_values"], "image_position_ids": out["image_position_ids"]}
        from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

        out = Gemma3ImageProcessorPil(size={"height": 16, "width": 16})(images=pics, return_tensors="pt")
        tokens = self.arch.config["mm_tokens_per_image"]
        return [ImageInput(out["pixel_values"][i].numpy(), (), tokens) for i in range(len(pics))], \
            {"pixel_values": out["pixel_values"]}

    def prompt(self, layout: list, seed: int = 0):
        """``layout``: text lengths (int) and images ("I"), in order -> (ImageInputs, ids with the placeholders
        expanded, transformers' kwargs)."""
        rng = np.random.RandomState(seed)
        n = sum(1 for part in layout if part == "I")
        inputs, kwargs = self.process(pictures(n, seed))
        ids = []
        for part in layout:
            ids += [self.arch.placeholder_id] if part == "I" else rng.randint(*TEXT_IDS, part).tolist()
        ids = self.arch.expand_image_tokens(ids, inputs)
        types = torch.tensor([[int(t == self.arch.image_token_id) for t in ids]])
        kwargs[("mm_token_type_ids" if self.gemma4 else "token_type_ids")] = types
        return inputs, ids, kwargs

    def media(self, inputs):
        return list(zip(inputs, self.model.encode_images(inputs), strict=True))

    def their_media(self, inputs, kwargs):
        """The images with transformers' own tower output (``get_image_features``) as their embeddings."""
        with torch.no_grad():
            extra = (kwargs["image_position_ids"],) if self.gemma4 else ()
            feats = self.ref.model.get_image_features(kwargs["pixel_values"], *extra).pooler_output
        return [(image, f.numpy()) for image, f in zip(inputs, feats, strict=True)]


@pytest.fixture(scope="module", params=list(VARIANTS))
def case(request, tiny_checkpoint):
    kind, overrides, tol = VARIANTS[request.param]
    return Case(tiny_checkpoint(kind, **overrides), tol)


LAYOUTS = {"one image": [10, "I", 6], "two images": [5, "I", "I", 4], "image text image": [4, "I", 12, "I", 3]}


def test_towers_match_transformers(case):
    inputs, kwargs = case.process(pictures(3))
    with torch.no_grad():
        if case.gemma4:
            theirs = case.ref.model.get_image_features(kwargs["pixel_values"], kwargs["image_position_ids"])
        else:
            theirs = case.ref.model.get_image_features(kwargs["pixel_values"])
    theirs = [t.numpy() for t in theirs.pooler_output]
    ours = case.model.encode_images(inputs)
    for image, o, t in zip(inputs, ours, theirs, strict=True):
        assert o.shape == t.shape == (image.num_tokens, case.arch.args.hidden_size)
        assert np.abs(o - t).max() <= TOL


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_prefill_logits_match_transformers(case, layout):
    inputs, ids, kwargs = case.prompt(LAYOUTS[layout])
    with torch.no_grad():
        theirs = case.ref(input_ids=torch.tensor([ids]), **kwargs).logits[0].numpy()
    # the text model alone: transformers' image features in
    text_model = case.model.forward(ids, case.model.new_cache(CONTEXT), all_logits=True,
                                    images=case.their_media(inputs, kwargs))
    assert text_model.shape == theirs.shape
    assert np.abs(text_model - theirs).max() <= TOL
    ours = case.model.forward(ids, case.model.new_cache(CONTEXT), all_logits=True, images=case.media(inputs))
    assert np.abs(ours - theirs).max() <= case.tol


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_greedy_tokens_match_transformers_generate(case, layout):
    inputs, ids, kwargs = case.prompt(LAYOUTS[layout], seed=1)
    with torch.no_grad():
        out = case.ref.generate(torch.tensor([ids]), **kwargs, max_new_tokens=STEPS, do_sample=False,
                                output_logits=True, return_dict_in_generate=True, eos_token_id=None, pad_token_id=0)
    expected = out.sequences[0, len(ids):].tolist()
    cache = case.model.new_cache(CONTEXT)
    logits, got = case.model.forward(ids, cache, images=case.media(inputs)), []
    for step in range(STEPS):
        assert np.abs(logits[-1] - out.logits[step][0].numpy()).max() <= case.tol, f"step {step}"
        got.append(int(np.argmax(logits[-1])))
        logits = case.model.forward([got[-1]], cache)
    assert got == expected


def test_text_before_the_images_in_another_forward(case):
    # The image blocks are positions in the whole sequence: a prefill in two calls (text, then the images) equals
    # one pass.
    inputs, ids, _ = case.prompt(LAYOUTS["image text image"], seed=2)
    media = case.media(inputs)
    whole = case.model.forward(ids, case.model.new_cache(CONTEXT), all_logits=True, images=media)
    cache = case.model.new_cache(CONTEXT)
    first = case.model.forward(ids[:3], cache, all_logits=True)
    rest = case.model.forward(ids[3:], cache, all_logits=True, images=media)
    assert np.abs(whole - np.concatenate([first, rest])).max() <= TOL


def test_a_text_only_prompt_is_unchanged_by_the_vision_tower(case):
    ids = np.random.RandomState(3).randint(*TEXT_IDS, 30).tolist()
    ours = case.model.forward(ids, case.model.new_cache(CONTEXT), all_logits=True)
    with torch.no_grad():
        theirs = case.ref(input_ids=torch.tensor([ids])).logits[0].numpy()
    assert np.abs(ours - theirs).max() <= TOL


def test_layout_puts_the_tower_in_the_vision_component(case):
    arch, report = case.arch, case.engine.report
    assert arch.has_vision() and arch.vision
    assert arch.components()[0] == ("vision", None)
    names = case.engine.weights[("vision", None)]
    assert names and all("vision" in n or "multi_modal_projector" in n for n in names)
    assert "bidirectional_attention" in arch.required_ops(("vision", None))
    assert "concat" in arch.required_ops(("input-layer", None))
    skipped = getattr(report, "skipped", {}) or {}
    if not case.gemma4:  # SigLIP's pooling head: skipped by name, never loaded
        assert not any(".head." in n for n in names)
        heads = [n for n in skipped if ".head." in n]
        assert heads and all("pooling head" in skipped[n] for n in heads)


def test_expand_image_tokens(case):
    arch = case.arch
    inputs, _ = case.process(pictures(2))
    ids = [5, arch.placeholder_id, 6, arch.placeholder_id]
    out = arch.expand_image_tokens(ids, inputs)
    c = arch.config
    if case.gemma4:
        boi, eoi = c["boi_token_id"], c["eoi_token_id"]
    else:
        boi, eoi = c["boi_token_index"], c["eoi_token_index"]
    runs = [[boi] + [arch.image_token_id] * image.num_tokens + [eoi] for image in inputs]
    assert out == [5, *runs[0], 6, *runs[1]]
    with pytest.raises(InputError, match="2 image placeholder"):
        arch.expand_image_tokens(ids, inputs[:1])


def test_images_that_do_not_fit_their_runs_are_refused(case):
    inputs, ids, _ = case.prompt(LAYOUTS["two images"])
    media = case.media(inputs)
    with pytest.raises(InputError, match="run"):
        case.model.forward(ids, case.model.new_cache(CONTEXT), images=media[:1])
    if case.gemma4:  # different token counts: the first run does not fit the second image
        with pytest.raises(InputError, match="image 1"):
            case.model.forward(ids, case.model.new_cache(CONTEXT), images=media[::-1])


PREPROCESSOR = {"gemma4_mm": {"patch_size": 4, "max_soft_tokens": 70, "pooling_kernel_size": 2},
                "gemma3_vl": {"size": {"height": 16, "width": 16}}}


@pytest.mark.parametrize("kind", list(PREPROCESSOR))
def test_engine_generates_with_images_as_transformers(kind, tiny_checkpoint, tmp_path):
    # The whole path: lumen.load with a vision block, the checkpoint's preprocessor_config.json, Lumen's own
    # preprocessor, the placeholders expanded, the tower, the prefill and greedy decode.
    import json
    import shutil

    from lumen_core.sampling import SamplingParams

    path = tmp_path / kind
    shutil.copytree(tiny_checkpoint(kind), path)
    (path / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR[kind]))
    case = Case(path)
    pics = pictures(2, seed=5)
    rng = np.random.RandomState(5)
    text = [rng.randint(*TEXT_IDS, n).tolist() for n in (4, 7, 3)]
    ph = case.arch.placeholder_id
    prompt = text[0] + [ph] + text[1] + [ph] + text[2]
    got = list(case.engine.generate_tokens(prompt, STEPS, SamplingParams(temperature=0.0), images=pics))
    inputs, kwargs = case.process(pics)
    ids = case.arch.expand_image_tokens(prompt, inputs)
    kwargs[("mm_token_type_ids" if case.gemma4 else "token_type_ids")] = \
        torch.tensor([[int(t == case.arch.image_token_id) for t in ids]])
    with torch.no_grad():
        out = case.ref.generate(torch.tensor([ids]), **kwargs, max_new_tokens=STEPS, do_sample=False,
                                eos_token_id=None, pad_token_id=0)
    assert got == out[0, len(ids):].tolist()
    assert case.engine.stats.images == 2 and case.engine.stats.prompt_tokens == len(ids)


def test_gemma4_tower_with_gqa_clipped_linears_and_standardize(make_tiny, tmp_path):
    # What the tiny checkpoint leaves at its defaults: one KV head for two query heads, two layers, clipped linears
    # (the clip ranges set to ±0.3-0.4, so they bite) and the standardization after the pooler.
    import shutil

    import transformers

    base = make_tiny.make("gemma4_mm", tmp_path / "base", vision_config={"use_clipped_linears": True,
                                                                         "standardize": True})
    cfg = transformers.AutoConfig.from_pretrained(base)
    cfg.vision_config.num_key_value_heads, cfg.vision_config.num_hidden_layers = 1, 2
    model = transformers.Gemma4ForConditionalGeneration(cfg).float().eval()
    make_tiny.randomise(model, 0)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, buf in model.model.vision_tower.named_buffers():
            if name.endswith(("input_min", "output_min", "input_max", "output_max")):
                sign = -1.0 if name.endswith("min") else 1.0
                buf.fill_(sign * (0.3 + 0.1 * torch.rand((), generator=gen).item()))
            elif name.endswith("std_bias"):
                buf.copy_(0.1 * torch.randn(buf.shape, generator=gen))
            elif name.endswith("std_scale"):
                buf.copy_(1 + 0.1 * torch.randn(buf.shape, generator=gen))
    path = tmp_path / "model"
    shutil.copytree(base, path)
    model.save_pretrained(path)
    case = Case(path)
    assert "clamp" in case.arch.required_ops(("vision", None))
    inputs, kwargs = case.process(pictures(3))
    with torch.no_grad():
        theirs = case.ref.model.get_image_features(kwargs["pixel_values"], kwargs["image_position_ids"]).pooler_output
    for ours, t in zip(case.model.encode_images(inputs), theirs, strict=True):
        assert np.abs(ours - t.numpy()).max() <= TOL


@pytest.mark.parametrize("kind", ["gemma4_mm", "gemma3_vl"])
def test_a_vision_config_that_does_not_match_the_tower_is_refused_by_key(kind, tiny_checkpoint, tmp_path):
    import json
    import shutil

    from lumen_core.errors import CheckpointError, LumenError

    path = tmp_path / kind
    shutil.copytree(tiny_checkpoint(kind), path)
    config = json.loads((path / "config.json").read_text())
    config["vision_config"]["intermediate_size"] = 65
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"mlp\..*has shape .*vision_config.intermediate_size"):
        lumen.load({"model": {"path": str(path), "compute": "cpu"}, "vision": {"compute": "cpu"}}, progress=False)
    config["vision_config"]["intermediate_size"] = 64
    config["vision_config"]["num_hidden_layers"] = 2  # the file has one layer: layer 1's tensors are missing
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(LumenError, match=r"encoder\.layers\.1\."):
        lumen.load({"model": {"path": str(path), "compute": "cpu"}, "vision": {"compute": "cpu"}}, progress=False)
    lumen.load({"model": {"path": str(path), "compute": "cpu"}}, progress=False)  # text alone needs no tower


@pytest.mark.parametrize("kind", ["gemma4_mm", "gemma3_vl"])
def test_towers_on_bf16_weights_mapped_from_the_file(kind, tiny_checkpoint, tmp_path):
    # Released checkpoints are bf16: the kernels stay bf16 (SigLIP's patch kernel reshaped, the projector
    # transposed on load), here read through store mmap, against transformers in f32 over the same rounded values.
    import shutil

    from transformers import AutoModelForImageTextToText

    path = tmp_path / kind
    shutil.copytree(tiny_checkpoint(kind), path)
    AutoModelForImageTextToText.from_pretrained(path, dtype=torch.bfloat16).save_pretrained(path)
    case = Case.__new__(Case)
    case.ref = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    case.engine = lumen.load({"model": {"path": str(path), "compute": "cpu", "store": "mmap"},
                              "vision": {"compute": "cpu", "store": "mmap"}}, progress=False)
    case.arch, case.model, case.gemma4 = case.engine.arch, case.engine.model, kind == "gemma4_mm"
    assert {w.format for w in case.engine.weights[("vision", None)].values() if hasattr(w, "format")} == {"bf16"}
    inputs, kwargs = case.process(pictures(2))
    with torch.no_grad():
        extra = (kwargs["image_position_ids"],) if case.gemma4 else ()
        theirs = case.ref.model.get_image_features(kwargs["pixel_values"], *extra).pooler_output
    for ours, t in zip(case.model.encode_images(inputs), theirs, strict=True):
        assert np.abs(ours - t.numpy()).max() <= TOL


@pytest.mark.parametrize("kind", ["gemma4_mm", "gemma3_vl"])
def test_a_multimodal_config_without_the_tower_tensors_has_no_vision(kind, tiny_checkpoint, tmp_path):
    import shutil

    from lumen_models_gemma.vision import vision_key
    from safetensors.numpy import load_file, save_file

    from lumen_core.errors import LumenError

    path = tmp_path / kind
    shutil.copytree(tiny_checkpoint(kind), path)
    tensors = load_file(path / "model.safetensors")
    save_file({n: t for n, t in tensors.items() if vision_key(n) is None}, path / "model.safetensors",
              metadata={"format": "pt"})
    with pytest.raises(LumenError, match="no vision tower"):
        lumen.load({"model": {"path": str(path), "compute": "cpu"}, "vision": {"compute": "cpu"}}, progress=False)
    engine = lumen.load({"model": {"path": str(path), "compute": "cpu"}}, progress=False)
    assert not engine.arch.has_vision()


def test_a_released_config_saying_rope_type_default_is_the_axial_rope(tiny_checkpoint, tmp_path):
    """Gemma 4's published vision_config says rope_parameters {"rope_type": "default", "rope_theta": 100.0}; that is
    the tower's axial 2-D RoPE (transformers rewrites it so): the same embeddings as the checkpoint saved by
    transformers (which writes "axial")."""
    import json
    import shutil

    import numpy as np

    import lumen_core as lumen

    src = tiny_checkpoint("gemma4_mm")
    dst = tmp_path / "released"
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg["vision_config"]["rope_parameters"] = {"rope_type": "default", "rope_theta": 100.0}
    (dst / "config.json").write_text(json.dumps(cfg))
    from PIL import Image

    image = Image.fromarray((np.random.RandomState(0).rand(40, 56, 3) * 255).astype("uint8"))
    got = [lumen.load({"model": {"path": str(p)}, "vision": {"compute": "cpu"}}, progress=False)
           for p in (src, dst)]
    a, b = (e.model.encode_images(e.images_in([image]))[0] for e in got)
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_gemma3_prompt_ids_with_an_image_are_what_its_processor_tokenizes(tiny_checkpoint):
    """transformers' Gemma3Processor replaces each <start_of_image> of the text with "\\n\\n<start_of_image>" + the
    soft tokens + "<end_of_image>\\n\\n" and then tokenizes the whole text (the blank lines merge with the newlines
    around them). Lumen writes the blank lines into the text (Gemma3.image_text) and expands the tokens between:
    the same ids as the HF tokenizer gives that processor text."""
    import numpy as np
    from PIL import Image
    from transformers import AutoTokenizer

    import lumen_core as lumen

    path = tiny_checkpoint("gemma3_vl")
    engine = lumen.load({"model": {"path": str(path)}, "vision": {"compute": "cpu"}}, progress=False)
    image = Image.fromarray((np.random.RandomState(0).rand(40, 56, 3) * 255).astype("uint8"))
    n = engine.arch.config["mm_tokens_per_image"]
    tok = AutoTokenizer.from_pretrained(path)
    for text in ("Look:\n<start_of_image>\nWhat is it?", "<start_of_image>Describe.", "A\n\n<start_of_image>\n\nB"):
        full = text.replace("<start_of_image>",
                            "\n\n<start_of_image>" + "<image_soft_token>" * n + "<end_of_image>\n\n")
        want = tok(full)["input_ids"]
        got, _ = engine.with_images(engine.encode(engine.arch.image_text(text)), [image])
        assert got == want, text
    # generate() applies it: the prompt it runs is that one
    list(engine.generate("Look:\n<start_of_image>\nWhat is it?", images=[image], max_tokens=1, temperature=0.0))
    assert engine.stats.prompt_tokens == len(tok("Look:\n" + "\n\n<start_of_image>" + "<image_soft_token>" * n
                                                 + "<end_of_image>\n\n" + "\nWhat is it?")["input_ids"])
