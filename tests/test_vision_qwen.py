"""The Qwen 3.5 vision tower and images in the Qwen forward pass (issue 17), on the CPU, against transformers.

Images are built from transformers' own processor output (``pixel_values``, ``image_grid_thw``), so these tests
hold the tower and the forward pass to transformers independently of Lumen's preprocessor. Tolerance: f32 weights
and f32 compute on both sides, max |Δ| ≤ 1e-4.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

import lumen_core as lumen
from lumen_core.errors import InputError
from lumen_core.images import ImageInput
from lumen_core.plugins import get_registry

TOL = 1e-4
DECODE_STEPS = 8
CONTEXT = 512
# two blocks, and a 4x4 learned position grid that every test image's grid differs from (resampled)
VISION = {"depth": 2}
KINDS = {"dense": "qwen3_5_vl", "moe": "qwen3_5_moe_vl"}
# (height, width) in pixels; patch 4, merge 2: multiples of 8 keep the processor from resizing much
SIZES = {"tall": (40, 24), "wide": (16, 32), "square": (32, 32)}


# -- ops the tower added to the contract -----------------------------------------------------------------
def cpu(op):
    return get_registry().op(op, "cpu", None)


def test_vision_ops_match_torch():
    rng = np.random.default_rng(0)
    x = (rng.normal(size=(7, 33)) * 3).astype(np.float32)
    w, b = rng.normal(size=33).astype(np.float32), rng.normal(size=33).astype(np.float32)
    t = torch.from_numpy
    F = torch.nn.functional
    assert np.abs(cpu("layer_norm")(x, w, b, 1e-6) - F.layer_norm(t(x), (33,), t(w), t(b), 1e-6).numpy()).max() < 1e-5
    assert np.abs(cpu("gelu")(x) - F.gelu(t(x)).numpy()).max() < 1e-5
    assert np.abs(cpu("gelu_tanh")(x) - F.gelu(t(x), approximate="tanh").numpy()).max() < 1e-5
    T, S, H, Hkv, D = 50, 40, 4, 2, 8
    q = rng.normal(size=(T, H, D)).astype(np.float32)
    k, v = rng.normal(size=(S, Hkv, D)).astype(np.float32), rng.normal(size=(S, Hkv, 6)).astype(np.float32)
    ref = F.scaled_dot_product_attention(t(q).transpose(0, 1), t(k).transpose(0, 1).repeat_interleave(2, 0),
                                         t(v).transpose(0, 1).repeat_interleave(2, 0), scale=0.3)
    got = cpu("bidirectional_attention")(q, k, v, 0.3)
    assert got.shape == (T, H, 6)
    assert np.abs(got - ref.transpose(0, 1).numpy()).max() < 1e-5
    assert np.array_equal(cpu("concat")([x[:3], x[3:]]), x)


# -- fixtures ------------------------------------------------------------------------------------------------
def build(path):
    """The model with its tower on the CPU, built as the engine does but without the config's ``vision`` block:
    ``arch.vision`` set by hand, every component on one CPU backend."""
    from lumen_core.checkpoint import open_checkpoint
    from lumen_core.loader import load_component

    registry = get_registry()
    ckpt = open_checkpoint(path, registry)
    arch = registry.architecture_class(ckpt.config["model_type"]).from_checkpoint(ckpt)
    assert arch.has_vision()
    arch.vision = True
    layout = arch.layout(ckpt.tensors)
    assert ("vision", None) in layout.needs and not layout.skipped
    backend = registry.backend_class("cpu")("cpu", registry)
    shared: dict = {}
    weights = {c: load_component(ckpt, arch, backend, "ram", names, shared) for c, names in layout.needs.items()}
    backends = {c: backend for c in arch.components()}
    return arch, arch.build(weights, backends, SimpleNamespace(type_k="f32", type_v="f32"))


@pytest.fixture(scope="module", params=list(KINDS))
def setup(request, tiny_checkpoint):
    from transformers import AutoModelForImageTextToText

    path = tiny_checkpoint(KINDS[request.param], vision_config=VISION)
    ref = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    arch, model = build(path)
    return SimpleNamespace(path=path, ref=ref, arch=arch, model=model, cfg=ref.config)


def processor():
    from transformers import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil(patch_size=4, temporal_patch_size=2, merge_size=2,
                                    size={"shortest_edge": 64, "longest_edge": 64 * 64})


def pictures(names, seed=0):
    from PIL import Image

    rng = np.random.RandomState(seed)
    return [Image.fromarray((rng.rand(*SIZES[n], 3) * 255).astype(np.uint8)) for n in names]


def processed(names, seed=0):
    """transformers' processor output for the named pictures, and the ImageInputs Lumen takes from it."""
    out = processor()(images=pictures(names, seed), return_tensors="pt")
    pixels, grid = out["pixel_values"], out["image_grid_thw"]
    inputs, at = [], 0
    for t, h, w in grid.tolist():
        n = t * h * w
        inputs.append(ImageInput(pixels[at:at + n].numpy().astype(np.float32), (t, h, w), n // 4))
        at += n
    return pixels, grid, inputs


def prompt(cfg, n_images, between: bool = True):
    """Text ids around ``n_images`` placeholders ``<|vision_start|><|image_pad|><|vision_end|>``, with text
    between them or not."""
    s, pad, e = cfg.vision_start_token_id, cfg.image_token_id, cfg.vision_end_token_id
    rng = np.random.RandomState(n_images)
    text = [rng.randint(3, 800, size=k).tolist() for k in (40, 9, 25, 6)]  # one-image prompt > 64 tokens (a GDN chunk)
    ids = text[0]
    for i in range(n_images):
        ids += [s, pad, e] + (text[i + 1] if between or i == n_images - 1 else [])
    return ids


def reference_logits(ref, ids, pixels, grid):
    t = torch.tensor([ids])
    with torch.no_grad():
        return ref(input_ids=t, pixel_values=pixels, image_grid_thw=grid,
                   mm_token_type_ids=(t == ref.config.image_token_id).int()).logits[0].numpy()


# -- the tower -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("names", [["tall"], ["tall", "wide", "square"]])
def test_tower_matches_transformers(setup, names):
    pixels, grid, inputs = processed(names)
    with torch.no_grad():
        theirs = setup.ref.model.visual(pixels, grid_thw=grid).pooler_output.numpy()
    ours = setup.model.encode_images(inputs)
    assert [o.shape for o in ours] == [(i.num_tokens, setup.arch.args.hidden_size) for i in inputs]
    assert np.abs(np.concatenate(ours) - theirs).max() <= TOL


def test_tower_layout_and_ops(setup):
    arch = setup.arch
    assert arch.components()[0] == ("vision", None)
    assert {"layer_norm", "bidirectional_attention", "gelu", "linear"} <= arch.required_ops(("vision", None))
    names = arch.layout(__import__("safetensors").safe_open(str(setup.path / "model.safetensors"), "np").keys())
    tower = names.needs[("vision", None)]
    assert len(tower) == 9 + 12 * VISION["depth"] and all(n.startswith("model.visual.") for n in tower)
    assert arch.is_matrix("model.visual.blocks.0.attn.qkv.weight")
    assert not arch.is_matrix("model.visual.blocks.0.norm1.weight")
    assert not arch.is_matrix("model.visual.patch_embed.proj.weight")  # 5-D: the tower flattens it
    from lumen_core.checkpoint import open_checkpoint

    arch.check_checkpoint(open_checkpoint(setup.path, get_registry()))  # the tower's shapes as its config says


def test_tower_shape_check_names_the_vision_key(tiny_checkpoint):
    from lumen_core.checkpoint import open_checkpoint
    from lumen_core.errors import CheckpointError

    path = tiny_checkpoint(KINDS["dense"], vision_config=VISION)
    registry = get_registry()
    ckpt = open_checkpoint(path, registry)
    arch = registry.architecture_class("qwen3_5").from_checkpoint(ckpt)
    arch.vision = True
    arch.vision_args.intermediate_size += 1
    with pytest.raises(CheckpointError, match="vision_config.intermediate_size"):
        arch.check_checkpoint(ckpt)
    from lumen_core.loader import load_component

    backend = registry.backend_class("cpu")("cpu", registry)
    layout = arch.layout(ckpt.tensors)
    weights = {c: load_component(ckpt, arch, backend, "ram", names, {}) for c, names in layout.needs.items()}
    with pytest.raises(CheckpointError, match="vision_config.intermediate_size"):  # and when the tower is built
        arch.build(weights, {c: backend for c in arch.components()}, SimpleNamespace(type_k="f32", type_v="f32"))


def test_tower_on_bf16_weights(tiny_checkpoint, tmp_path):
    """A bf16 checkpoint (as Qwen ships): the linears stay bf16, the 5-D patch kernel and the norms are read as f32;
    the tower equals transformers' on the same weights widened to f32."""
    import shutil

    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForImageTextToText

    src = tiny_checkpoint(KINDS["dense"], vision_config=VISION)
    for f in src.iterdir():
        if f.name != "model.safetensors":
            shutil.copy(f, tmp_path / f.name)
    tensors = {k: v.to(torch.bfloat16) for k, v in load_file(src / "model.safetensors").items()}
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    ref = AutoModelForImageTextToText.from_pretrained(tmp_path, dtype=torch.float32).eval()
    _, model = build(tmp_path)
    assert model.tower.blocks[0].qkv.format == "bf16"
    pixels, grid, inputs = processed(["tall", "square"])
    with torch.no_grad():
        theirs = ref.model.visual(pixels, grid_thw=grid).pooler_output.numpy()
    assert np.abs(np.concatenate(model.encode_images(inputs)) - theirs).max() <= TOL


# -- images in the forward pass ------------------------------------------------------------------------------
CASES = {  # pictures, text between the images
    "one image": (["tall"], True),
    "two images of different sizes": (["tall", "wide"], False),
    "image, text, image": (["wide", "square"], True),
}


def run_case(setup, names, ids):
    pixels, grid, inputs = processed(names)
    ids = setup.arch.expand_image_tokens(ids, inputs)
    media = list(zip(inputs, setup.model.encode_images(inputs), strict=True))
    return ids, pixels, grid, media


@pytest.mark.parametrize("case", list(CASES))
def test_prefill_and_greedy_decode_match_transformers(setup, case):
    names, between = CASES[case]
    ids, pixels, grid, media = run_case(setup, names, prompt(setup.cfg, len(names), between))
    theirs = reference_logits(setup.ref, ids, pixels, grid)
    cache = setup.model.new_cache(CONTEXT)
    ours = setup.model.forward(ids, cache, all_logits=True, images=media)
    assert ours.shape == theirs.shape
    assert np.abs(ours - theirs).max() <= TOL
    assert cache.rope_offset < 0  # an image's tokens take fewer rope positions than cache positions

    t = torch.tensor([ids])
    with torch.no_grad():
        out = setup.ref.generate(input_ids=t, pixel_values=pixels, image_grid_thw=grid,
                                 mm_token_type_ids=(t == setup.cfg.image_token_id).int(),
                                 max_new_tokens=DECODE_STEPS, do_sample=False, output_logits=True,
                                 return_dict_in_generate=True, eos_token_id=None, pad_token_id=0)
    expected = out.sequences[0, len(ids):].tolist()
    got, row = [], ours[-1]
    for step in range(DECODE_STEPS):
        assert np.abs(row - out.logits[step][0].numpy()).max() <= TOL, f"step {step}"
        got.append(int(np.argmax(row)))
        row = setup.model.forward([got[-1]], cache)[-1]
    assert got == expected


def test_image_prompt_in_chunks_equals_one_pass(setup):
    """A forward holds whole images: text, then [image + text], then text, continues the rope positions."""
    names = ["tall", "wide"]
    ids, _, _, media = run_case(setup, names, prompt(setup.cfg, 2))
    whole = setup.model.forward(ids, setup.model.new_cache(CONTEXT), all_logits=True, images=media)
    pad = setup.cfg.image_token_id
    first = ids.index(pad)
    second = ids.index(pad, first + media[0][0].num_tokens)
    cuts = [0, first - 1, second - 1, len(ids)]
    cache, parts = setup.model.new_cache(CONTEXT), []
    for a, b in zip(cuts, cuts[1:], strict=False):
        held = [m for m, at in zip(media, (first, second), strict=True) if a <= at < b]
        parts.append(setup.model.forward(ids[a:b], cache, all_logits=True, images=held or None))
    assert np.abs(whole - np.concatenate(parts)).max() <= TOL


def test_text_only_after_an_image_sequence_starts_fresh(setup):
    """A forward at position 0 starts a new sequence: the rope offset an image left in a reused cache is dropped,
    so text-only logits equal a fresh cache's."""
    ids, _, _, media = run_case(setup, ["square"], prompt(setup.cfg, 1))
    cache = setup.model.new_cache(CONTEXT)
    setup.model.forward(ids, cache, images=media)
    assert cache.rope_offset != 0
    text = list(range(3, 40))
    fresh = setup.model.forward(text, setup.model.new_cache(CONTEXT), all_logits=True)
    reused = setup.model.new_cache(CONTEXT)
    reused.rope_offset = -7
    assert np.array_equal(setup.model.forward(text, reused, all_logits=True), fresh)
    assert reused.rope_offset == 0


def test_expand_image_tokens_and_mismatches(setup):
    arch, cfg = setup.arch, setup.cfg
    _, _, inputs = processed(["tall", "wide"])
    ids = prompt(cfg, 2)
    expanded = arch.expand_image_tokens(ids, inputs)
    assert expanded.count(cfg.image_token_id) == sum(i.num_tokens for i in inputs)
    assert len(expanded) == len(ids) - 2 + sum(i.num_tokens for i in inputs)
    with pytest.raises(InputError, match="2 image placeholder"):
        arch.expand_image_tokens(ids, inputs[:1])
    with pytest.raises(InputError, match="1 image placeholder"):
        arch.expand_image_tokens(prompt(cfg, 1), inputs)
    media = list(zip(inputs, setup.model.encode_images(inputs), strict=True))
    with pytest.raises(InputError, match="image pads"):  # not expanded: one pad per image
        setup.model.forward(ids, setup.model.new_cache(CONTEXT), images=media)
    bad = ImageInput(inputs[0].pixels[:-4], inputs[0].grid, inputs[0].num_tokens)
    with pytest.raises(InputError, match="image 1"):
        setup.model.encode_images([bad])


# -- through lumen.load ----------------------------------------------------------------------------------------
def test_load_with_a_vision_block_places_the_tower(tiny_checkpoint):
    """``"vision": {"compute": "cpu"}`` loads the tower as the component ("vision", None); its logits on an image
    prompt are the hand-built model's, and without the block the tower's tensors stay skipped."""
    path = tiny_checkpoint(KINDS["dense"], vision_config=VISION)
    model = {"path": str(path), "compute": "cpu", "store": "ram",
             "hidden-layers": {"kv-cache": {"context-size": CONTEXT}}}
    engine = lumen.load({"model": model, "vision": {"compute": "cpu"}}, progress=False)
    assert ("vision", None) in engine.weights and not engine.report.skipped and not engine.report.unused
    text_only = lumen.load({"model": model}, progress=False)
    assert ("vision", None) not in text_only.weights
    assert text_only.report.skipped and all(n.startswith("model.visual.") for n in text_only.report.skipped)
    _, built = build(path)
    _, _, inputs = processed(["tall", "wide"])
    ids = engine.arch.expand_image_tokens(prompt(_cfg(path), 2), inputs)
    logits = [m.forward(ids, m.new_cache(CONTEXT), all_logits=True,
                        images=list(zip(inputs, m.encode_images(inputs), strict=True)))
              for m in (engine.model, built)]
    assert np.array_equal(*logits)


def _cfg(path):
    import json

    c = json.loads((path / "config.json").read_text())
    return SimpleNamespace(**{k: c[k] for k in ("vision_start_token_id", "image_token_id", "vision_end_token_id")})


@pytest.mark.parametrize("kind", list(KINDS))
def test_engine_generates_with_images_as_transformers(kind, tiny_checkpoint, tmp_path):
    """The whole path: lumen.load with a vision block and the checkpoint's preprocessor_config.json, Lumen's own
    preprocessor, the placeholders expanded, the tower, the prefill and greedy decode: transformers' tokens."""
    import json
    import shutil

    from transformers import AutoModelForImageTextToText

    from lumen_core.sampling import SamplingParams

    path = tmp_path / kind
    shutil.copytree(tiny_checkpoint(KINDS[kind], vision_config=VISION), path)
    (path / "preprocessor_config.json").write_text(json.dumps(
        {"patch_size": 4, "temporal_patch_size": 2, "merge_size": 2,
         "size": {"shortest_edge": 64, "longest_edge": 64 * 64}}))
    engine = lumen.load({"model": {"path": str(path), "compute": "cpu", "store": "ram",
                                   "hidden-layers": {"kv-cache": {"context-size": CONTEXT}}},
                         "vision": {"compute": "cpu"}}, progress=False)
    cfg = _cfg(path)
    ids = prompt(cfg, 2)
    got = list(engine.generate_tokens(ids, DECODE_STEPS, SamplingParams(temperature=0.0),
                                      images=pictures(["tall", "wide"], seed=3)))
    pixels, grid, inputs = processed(["tall", "wide"], seed=3)
    ids = engine.arch.expand_image_tokens(ids, inputs)
    ref = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    t = torch.tensor([ids])
    with torch.no_grad():
        out = ref.generate(input_ids=t, pixel_values=pixels, image_grid_thw=grid,
                           mm_token_type_ids=(t == cfg.image_token_id).int(), max_new_tokens=DECODE_STEPS,
                           do_sample=False, eos_token_id=None, pad_token_id=0)
    assert got == out[0, len(ids):].tolist()
    assert engine.stats.images == 2 and engine.stats.prompt_tokens == len(ids)


def test_image_prompts_in_a_batch_equal_their_solo_runs(tiny_checkpoint, tmp_path):
    """Continuous batching with images: an image prompt prefills alone (its tower embeddings), then decodes in the
    batch beside a text-only prompt at M-RoPE positions shifted by its rope offset; both equal their solo tokens."""
    import json
    import shutil
    import threading

    from lumen_core.sampling import SamplingParams

    path = tmp_path / "batched"
    shutil.copytree(tiny_checkpoint(KINDS["dense"], vision_config=VISION), path)
    (path / "preprocessor_config.json").write_text(json.dumps(
        {"patch_size": 4, "temporal_patch_size": 2, "merge_size": 2,
         "size": {"shortest_edge": 64, "longest_edge": 64 * 64}}))
    engine = lumen.load({"model": {"path": str(path), "compute": "cpu", "store": "ram",
                                   "hidden-layers": {"kv-cache": {"context-size": CONTEXT, "sequences": 3}}},
                         "vision": {"compute": "cpu"}}, progress=False)
    cfg = _cfg(path)
    greedy = SamplingParams(temperature=0.0)
    jobs = [(prompt(cfg, 2), pictures(["tall", "wide"], seed=3)), (prompt(cfg, 0), None),
            (prompt(cfg, 1), pictures(["square"], seed=4))]

    def gen(ids, images):
        return list(engine.generate_tokens(ids, DECODE_STEPS, greedy, **({"images": images} if images else {})))

    alone = [gen(*job) for job in jobs]
    engine.start_batching()
    out = [None] * len(jobs)
    try:
        threads = [threading.Thread(target=lambda i=i: out.__setitem__(i, gen(*jobs[i]))) for i in range(len(jobs))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
    finally:
        engine.close()
    assert out == alone
