"""Images in (issue 17): ``lumen_core.images.load_image`` / ``images_from`` (decoding, and every bad input refused by
name) and the family preprocessors, compared with transformers 5.23's PIL image processors (the reference: the
pixel values within 1e-6, the grids and the token counts equal) on generated images of many sizes, aspects and
modes.

The tiny checkpoints (scripts/make_tiny_checkpoint.py) write no ``preprocessor_config.json``, so the configs here
are the released families' own, transcribed: Qwen 3.5's (Qwen3-VL's: patch 16, [0.5] mean/std, 64Ki..16Mi pixels),
Gemma 3's (896 x 896 SigLIP, with its nulls), Gemma 4's (280 soft tokens), plus transformers' class defaults
(``None``) and variants (min/max pixels, other soft-token budgets).
"""

from __future__ import annotations

import base64
import copy
import io
import json

import numpy as np
import pytest
from PIL import Image

from lumen_core.errors import CheckpointError, InputError
from lumen_core.images import MAX_IMAGE_BYTES, ImageInput, images_from, load_image

transformers = pytest.importorskip("transformers")
from lumen_models_gemma.vision_preprocess import (  # noqa: E402
    Gemma3ImageProcessor,
    Gemma4ImageProcessor,
    pad_to_max_patches,
)
from lumen_models_qwen.vision_preprocess import ImageProcessor as QwenImageProcessor  # noqa: E402
from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil  # noqa: E402
from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil  # noqa: E402
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil  # noqa: E402

TOL = 1e-6

QWEN3_5 = {  # Qwen 3.5's preprocessor_config.json (as Qwen3-VL's)
    "size": {"longest_edge": 16777216, "shortest_edge": 65536},
    "patch_size": 16, "temporal_patch_size": 2, "merge_size": 2,
    "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
    "processor_class": "Qwen3VLProcessor", "image_processor_type": "Qwen2VLImageProcessorFast",
}
QWEN_CONFIGS = {
    "defaults": None,  # transformers' Qwen2VLImageProcessor class defaults (patch 14, CLIP mean/std)
    "qwen3.5": QWEN3_5,
    "min-max-pixels": {**QWEN3_5, "min_pixels": 128 * 32 * 32, "max_pixels": 256 * 32 * 32},  # top-level wins
    "size-small": {**QWEN3_5, "size": {"shortest_edge": 4 * 32 * 32, "longest_edge": 64 * 32 * 32}},
}
GEMMA3 = {  # Gemma 3's preprocessor_config.json (4B/12B/27B)
    "do_convert_rgb": None, "do_normalize": True, "do_pan_and_scan": None, "do_rescale": True, "do_resize": True,
    "image_mean": [0.5, 0.5, 0.5], "image_processor_type": "Gemma3ImageProcessor", "image_seq_length": 256,
    "image_std": [0.5, 0.5, 0.5], "pan_and_scan_max_num_crops": None, "pan_and_scan_min_crop_size": None,
    "pan_and_scan_min_ratio_to_activate": None, "processor_class": "Gemma3Processor", "resample": 2,
    "rescale_factor": 0.00392156862745098, "size": {"height": 896, "width": 896},
}
GEMMA3_CONFIGS = {"gemma3": GEMMA3, "defaults": None}
GEMMA4 = {  # Gemma 4's preprocessor_config.json
    "image_processor_type": "Gemma4ImageProcessor", "do_convert_rgb": True, "do_resize": True, "resample": 3,
    "do_rescale": True, "rescale_factor": 0.00392156862745098, "do_normalize": False,
    "image_mean": [0.0, 0.0, 0.0], "image_std": [1.0, 1.0, 1.0],
    "patch_size": 16, "pooling_kernel_size": 3, "max_soft_tokens": 280,
}
GEMMA4_CONFIGS = {"gemma4": GEMMA4, "defaults": None, "70-tokens": {**GEMMA4, "max_soft_tokens": 70},
                  "1120-tokens": {**GEMMA4, "max_soft_tokens": 1120}}


# -- generated images -------------------------------------------------------------------------------------------


def _rgb(width: int, height: int, seed: int) -> np.ndarray:
    """Smooth colour gradients under noise: resizing has edges and flats to get right."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    base = np.stack([x / max(width - 1, 1), y / max(height - 1, 1), (x + y) / max(width + height - 2, 1)], -1)
    noise = rng.normal(0, 0.15, (height, width, 3)).astype(np.float32)
    return (np.clip(base + noise, 0, 1) * 255).round().astype(np.uint8)


def _roundtrip(img: Image.Image, fmt: str, **kw) -> Image.Image:
    buf = io.BytesIO()
    img.save(buf, fmt, **kw)
    return load_image(buf.getvalue())


def _images() -> dict[str, Image.Image]:
    rgb = Image.fromarray(_rgb(320, 240, 1))
    alpha = Image.fromarray(np.random.default_rng(2).integers(0, 256, (240, 320), dtype=np.uint8))
    rgba = rgb.copy()
    rgba.putalpha(alpha)
    p_transparent = rgb.quantize(64)
    p_transparent.info["transparency"] = 3
    i16 = (np.arange(180 * 250, dtype=np.uint32).reshape(180, 250) * 7 % 65536).astype(np.uint16)
    rgb_trns = _roundtrip(Image.fromarray(_rgb(97, 61, 3)), "PNG", transparency=(255, 255, 255))
    images = {
        "rgb-320x240": rgb,
        "rgba": rgba,
        "l": Image.fromarray(_rgb(333, 222, 4)).convert("L"),
        "la": rgba.convert("LA"),
        "p": Image.fromarray(_rgb(257, 300, 5)).quantize(200),
        "p-transparency": p_transparent,
        "pa": rgba.convert("PA"),
        "cmyk": Image.fromarray(_rgb(410, 307, 6)).convert("CMYK"),
        "i16-png": _roundtrip(Image.fromarray(i16), "PNG"),
        "1-bit": Image.fromarray(_rgb(123, 77, 7)).convert("1"),
        "ycbcr": Image.fromarray(_rgb(64, 64, 8)).convert("YCbCr"),
        "rgb-trns-png": rgb_trns,
        "1x1": Image.fromarray(_rgb(1, 1, 9)),
        "1x1-rgba": Image.fromarray(np.array([[[10, 200, 30, 77]]], dtype=np.uint8)),
        "6000x200": Image.fromarray(_rgb(6000, 200, 10)),
        "200x6000": Image.fromarray(_rgb(200, 6000, 11)),
        "3000x2000": Image.fromarray(_rgb(3000, 2000, 12)),
        "17x1000": Image.fromarray(_rgb(17, 1000, 13)),
        "jpeg": _roundtrip(Image.fromarray(_rgb(640, 480, 14)), "JPEG", quality=85),
        "jpeg-gray": _roundtrip(Image.fromarray(_rgb(300, 500, 15)).convert("L"), "JPEG"),
        "jpeg-cmyk": _roundtrip(Image.fromarray(_rgb(200, 150, 16)).convert("CMYK"), "JPEG"),
        "png-rgba": _roundtrip(rgba, "PNG"),
        "png-p": _roundtrip(Image.fromarray(_rgb(150, 100, 17)).quantize(16), "PNG"),
        "webp": _roundtrip(Image.fromarray(_rgb(500, 281, 18)), "WEBP", quality=80),
        "webp-lossless-rgba": _roundtrip(rgba, "WEBP", lossless=True),
        "square-896": Image.fromarray(_rgb(896, 896, 19)),
        "exact-grid-448x224": Image.fromarray(_rgb(448, 224, 20)),
    }
    return images


@pytest.fixture(scope="module")
def images() -> dict[str, Image.Image]:
    return _images()


IMAGE_NAMES = ["rgb-320x240", "rgba", "l", "la", "p", "p-transparency", "pa", "cmyk", "i16-png", "1-bit", "ycbcr",
               "rgb-trns-png", "1x1", "1x1-rgba", "6000x200", "200x6000", "3000x2000", "17x1000", "jpeg", "jpeg-gray",
               "jpeg-cmyk", "png-rgba", "png-p", "webp", "webp-lossless-rgba", "square-896", "exact-grid-448x224"]


def test_generated_images_cover_the_modes(images):
    assert sorted(images) == sorted(IMAGE_NAMES)
    modes = {img.mode for img in images.values()}
    assert {"RGB", "RGBA", "L", "LA", "P", "PA", "CMYK", "I;16", "1", "YCbCr"} <= modes, modes
    assert images["i16-png"].mode == "I;16" and images["png-rgba"].mode == "RGBA" and images["png-p"].mode == "P"
    assert images["webp-lossless-rgba"].mode == "RGBA" and images["jpeg-cmyk"].mode == "CMYK"
    assert images["rgb-trns-png"].info.get("transparency") is not None


def _reference(cls, config: dict | None):
    # transformers 5.23 keeps an explicit null as None (Gemma 3's do_convert_rgb: null turns the RGB conversion
    # off, so its processor fails on any non-RGB image); Lumen reads null as the class default. Compared with
    # the nulls dropped; test_gemma3_released_config_verbatim checks RGB images with them kept.
    # (deep-copied: Qwen2VLImageProcessor's __init__ writes min/max pixels into the size dict it is given)
    return cls.from_dict(copy.deepcopy({k: v for k, v in (config or {}).items() if v is not None}))


def _close(ours: np.ndarray, theirs, what: str) -> float:
    theirs = np.asarray(theirs)
    assert ours.dtype == np.float32, what
    assert ours.shape == theirs.shape, f"{what}: shape {ours.shape} vs transformers' {theirs.shape}"
    err = float(np.abs(ours - theirs).max()) if ours.size else 0.0
    assert err <= TOL, f"{what}: max |diff| {err}"
    return err


# -- Qwen 3.5 ---------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def qwen_pairs():
    return {name: (QwenImageProcessor(cfg), _reference(Qwen2VLImageProcessorPil, cfg))
            for name, cfg in QWEN_CONFIGS.items()}


@pytest.mark.parametrize("config", list(QWEN_CONFIGS))
@pytest.mark.parametrize("name", IMAGE_NAMES)
def test_qwen_matches_transformers(images, qwen_pairs, config, name):
    ours, ref = qwen_pairs[config]
    img = images[name]
    out = ours.preprocess(img)
    theirs = ref(img)
    assert isinstance(out, ImageInput)
    _close(out.pixels, theirs["pixel_values"], f"qwen {config} {name}")
    grid = tuple(int(v) for v in np.asarray(theirs["image_grid_thw"])[0])
    assert out.grid == grid
    t, h, w = grid
    assert out.num_tokens == t * h * w // ours.merge_size**2 == ours.num_tokens(img.height, img.width)
    # transformers' own count of the <|image_pad|> tokens (what its processor expands the placeholder to)
    assert out.num_tokens == ref.get_number_of_image_patches(img.height, img.width) // ours.merge_size**2


def test_qwen_config_values():
    p = QwenImageProcessor(QWEN_CONFIGS["min-max-pixels"])
    assert (p.min_pixels, p.max_pixels, p.patch_size, p.merge_size, p.temporal_patch_size) == (
        128 * 32 * 32, 256 * 32 * 32, 16, 2, 2)
    d = QwenImageProcessor(None)
    assert (d.min_pixels, d.max_pixels, d.patch_size) == (56 * 56, 28 * 28 * 1280, 14)
    # the min/max pixels bound the token count
    small = Image.fromarray(_rgb(40, 30, 0))
    big = Image.fromarray(_rgb(3000, 2000, 0))
    assert p.preprocess(small).num_tokens >= 128 // 4 * 1 and p.preprocess(big).num_tokens <= 256 // 4 * 4
    # old configs: size {"min_pixels", "max_pixels"}
    old = QwenImageProcessor({"size": {"min_pixels": 1000, "max_pixels": 50000}})
    assert (old.min_pixels, old.max_pixels) == (1000, 50000)
    # the vision config fills what the preprocessor config leaves out
    v = QwenImageProcessor(None, {"patch_size": 16, "spatial_merge_size": 2, "temporal_patch_size": 2})
    assert v.patch_size == 16 and v.factor == 32


def test_qwen_refusals():
    with pytest.raises(InputError, match="aspect ratio"):
        QwenImageProcessor(QWEN3_5).preprocess(Image.new("RGB", (4020, 20)), label="image 3")
    with pytest.raises(CheckpointError, match="patch_size"):
        QwenImageProcessor({"patch_size": 0})
    with pytest.raises(CheckpointError, match="image_mean"):
        QwenImageProcessor({"image_mean": [0.5, 0.5]})
    with pytest.raises(CheckpointError, match="size.longest_edge"):
        QwenImageProcessor({"size": {"shortest_edge": 100}})
    with pytest.raises(InputError, match="do_convert_rgb"):
        QwenImageProcessor({"do_convert_rgb": False}).preprocess(Image.new("RGBA", (64, 64)))


# -- Gemma 3 ----------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def gemma3_pairs():
    return {name: (Gemma3ImageProcessor(cfg), _reference(Gemma3ImageProcessorPil, cfg))
            for name, cfg in GEMMA3_CONFIGS.items()}


@pytest.mark.parametrize("config", list(GEMMA3_CONFIGS))
@pytest.mark.parametrize("name", IMAGE_NAMES)
def test_gemma3_matches_transformers(images, gemma3_pairs, config, name):
    ours, ref = gemma3_pairs[config]
    out = ours.preprocess(images[name])
    theirs = ref(images[name])
    _close(out.pixels, np.asarray(theirs["pixel_values"])[0], f"gemma3 {config} {name}")
    assert out.grid == () and list(theirs["num_crops"]) == [0]
    assert out.num_tokens == 256  # image_seq_length / mm_tokens_per_image
    assert out.pixels.shape == ((3, 896, 896) if config == "gemma3" else (3, 224, 224))


def test_gemma3_released_config_verbatim(images):
    """With its nulls kept, transformers' processor gives the same values on RGB images."""
    ours, ref = Gemma3ImageProcessor(GEMMA3), Gemma3ImageProcessorPil.from_dict(copy.deepcopy(GEMMA3))
    for name in ("rgb-320x240", "jpeg", "webp", "6000x200"):
        _close(ours.preprocess(images[name]).pixels, np.asarray(ref(images[name])["pixel_values"])[0], name)


def test_gemma3_tokens_and_pan_and_scan():
    img = Image.fromarray(_rgb(50, 40, 0))
    assert Gemma3ImageProcessor(GEMMA3, mm_tokens_per_image=4).preprocess(img).num_tokens == 4
    assert Gemma3ImageProcessor({**GEMMA3, "image_seq_length": 64}).preprocess(img).num_tokens == 64
    tiny = Gemma3ImageProcessor(None, {"image_size": 16})
    assert tiny.preprocess(img).pixels.shape == (3, 16, 16)
    pas = Gemma3ImageProcessor({**GEMMA3, "do_pan_and_scan": True})  # built fine: refused when an image comes
    with pytest.raises(InputError, match="image 2: .*pan-and-scan.*not implement"):
        pas.preprocess(img, label="image 2")
    with pytest.raises(CheckpointError, match="size"):
        Gemma3ImageProcessor({"size": {"shortest_edge": 896}})


# -- Gemma 4 ----------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def gemma4_pairs():
    return {name: (Gemma4ImageProcessor(cfg), _reference(Gemma4ImageProcessorPil, cfg))
            for name, cfg in GEMMA4_CONFIGS.items()}


@pytest.mark.parametrize("config", list(GEMMA4_CONFIGS))
@pytest.mark.parametrize("name", IMAGE_NAMES)
def test_gemma4_matches_transformers(images, gemma4_pairs, config, name):
    ours, ref = gemma4_pairs[config]
    out = ours.preprocess(images[name])
    theirs = ref(images[name])
    n = out.pixels.shape[0]
    h, w = out.grid
    assert n == h * w and out.extra["positions"].shape == (n, 2) and out.extra["positions"].dtype == np.int64
    assert out.num_tokens == int(theirs["num_soft_tokens_per_image"][0]) == n // ours.pooling_kernel_size**2
    assert out.num_tokens <= ours.max_soft_tokens
    # the real patches equal transformers' first n; padded as transformers pads, the whole batch row equals
    _close(out.pixels, np.asarray(theirs["pixel_values"])[0][:n], f"gemma4 {config} {name}")
    pixels, positions = pad_to_max_patches(out)
    _close(pixels, np.asarray(theirs["pixel_values"])[0], f"gemma4 {config} {name} padded")
    assert np.array_equal(positions, np.asarray(theirs["image_position_ids"])[0])


def test_gemma4_config():
    with pytest.raises(CheckpointError, match="max_soft_tokens"):
        Gemma4ImageProcessor({"max_soft_tokens": 100})
    tiny = Gemma4ImageProcessor(None, {"patch_size": 4, "pooling_kernel_size": 2})
    out = tiny.preprocess(Image.fromarray(_rgb(100, 60, 0)))
    assert out.pixels.shape[1] == 4 * 4 * 3 and out.grid[0] % 2 == 0 and out.grid[1] % 2 == 0
    # the preprocessor config wins over the vision config
    assert Gemma4ImageProcessor(GEMMA4, {"patch_size": 4}).patch_size == 16


# -- the architectures' hooks -----------------------------------------------------------------------------------


@pytest.mark.parametrize("kind, cls_name, processor", [
    ("qwen3_5_vl", "Qwen3_5", QwenImageProcessor), ("qwen3_5", "Qwen3_5", None),
    ("gemma3_vl", "Gemma3", Gemma3ImageProcessor), ("gemma3", "Gemma3", None),
    ("gemma4_mm", "Gemma4", Gemma4ImageProcessor), ("gemma4", "Gemma4", None),
])
def test_architecture_image_processor(tiny_checkpoint, kind, cls_name, processor):
    import lumen_models_gemma.gemma3
    import lumen_models_gemma.gemma4
    import lumen_models_qwen.qwen3_5

    module = {"Qwen3_5": lumen_models_qwen.qwen3_5, "Gemma3": lumen_models_gemma.gemma3,
              "Gemma4": lumen_models_gemma.gemma4}[cls_name]
    path = tiny_checkpoint(kind)
    config = json.loads((path / "config.json").read_text())
    arch = getattr(module, cls_name)(config)
    got = arch.image_processor(None)
    if processor is None:
        assert got is None
        return
    assert isinstance(got, processor)
    vision = config["vision_config"]
    out = got.preprocess(Image.fromarray(_rgb(90, 70, 0)))
    if kind == "qwen3_5_vl":  # patch sizes from the vision config
        assert (got.patch_size, got.merge_size) == (vision["patch_size"], vision["spatial_merge_size"])
        assert out.pixels.shape[1] == 3 * vision["temporal_patch_size"] * vision["patch_size"] ** 2
        assert isinstance(arch.image_processor(QWEN3_5), processor)
    elif kind == "gemma3_vl":  # the tower's image size, mm_tokens_per_image tokens
        assert out.pixels.shape == (3, vision["image_size"], vision["image_size"])
        assert out.num_tokens == config["mm_tokens_per_image"]
    else:
        assert (got.patch_size, got.pooling_kernel_size) == (vision["patch_size"], vision["pooling_kernel_size"])
        assert out.pixels.shape[1] == 3 * vision["patch_size"] ** 2


# -- load_image and its refusals --------------------------------------------------------------------------------


def _png(img: Image.Image | None = None) -> bytes:
    buf = io.BytesIO()
    (img or Image.fromarray(_rgb(40, 30, 0))).save(buf, "PNG")
    return buf.getvalue()


def test_load_image_sources(tmp_path, images):
    data = _png(images["rgba"])
    path = tmp_path / "a.png"
    path.write_bytes(data)
    uri = "data:image/png;base64," + base64.b64encode(data).decode()
    for source in (str(path), path, data, bytearray(data), uri, images["rgba"]):
        img = load_image(source)
        assert img.mode == "RGBA" and img.size == (320, 240)  # the mode is kept: the preprocessors convert
        assert np.array_equal(np.asarray(img), np.asarray(images["rgba"]))
    assert load_image(images["cmyk"]) is images["cmyk"]
    loaded = images_from([str(path), data, uri])
    assert [im.size for im in loaded] == [(320, 240)] * 3


def test_load_image_exif_orientation():
    img = Image.fromarray(_rgb(60, 20, 0))
    exif = Image.Exif()
    exif[0x0112] = 6  # rotated 90° clockwise: shown 20 wide, 60 high
    buf = io.BytesIO()
    img.save(buf, "JPEG", exif=exif)
    assert load_image(buf.getvalue()).size == (20, 60)


@pytest.mark.parametrize("source, reason", [
    ("missing", "no such file"),
    ("dir", "is a directory"),
    ("empty", "empty"),
    ("text", "not an image"),
    ("truncated-header", "truncated (or corrupt )?PNG"),
    ("truncated-png", "truncated"),
    ("truncated-jpeg", "truncated"),
    ("pdf", "PDF images are not supported"),
    ("svg", "SVG images are not supported"),
    ("too-big", "over the 20.0 MiB limit"),
    ("uri-not-image", "not an image"),
    ("uri-not-base64", "without ';base64'"),
    ("uri-bad-base64", "base64 data is bad"),
    ("uri-no-comma", "bad data URI"),
    ("uri-garbage", "not an image"),
    ("url", "URLs are not fetched"),
    ("number", "not an image"),
])
def test_load_image_refusals(tmp_path, source, reason):
    big = _rgb(400, 300, 1)
    png = _png(Image.fromarray(big))
    jpeg = io.BytesIO()
    Image.fromarray(big).save(jpeg, "JPEG")
    files = {
        "missing": None, "dir": None,
        "empty": b"", "text": b"hello, this is not an image\n", "truncated-header": png[:20],
        "truncated-png": png[: len(png) // 2], "truncated-jpeg": jpeg.getvalue()[: len(jpeg.getvalue()) // 2],
        "pdf": b"%PDF-1.4\n%...\n", "svg": b"<svg xmlns='http://www.w3.org/2000/svg'/>",
        "too-big": png + b"\0" * (MAX_IMAGE_BYTES + 1 - len(png)),
    }
    uris = {
        "uri-not-image": "data:text/plain;base64," + base64.b64encode(b"hi").decode(),
        "uri-not-base64": "data:image/png," + "abc",
        "uri-bad-base64": "data:image/png;base64,@@@not base64@@@",
        "uri-no-comma": "data:image/png;base64",
        "uri-garbage": "data:image/png;base64," + base64.b64encode(b"not a png at all").decode(),
    }
    if source in files:
        path = tmp_path / f"{source}.png"
        if source == "dir":
            path.mkdir()
        elif files[source] is not None:
            path.write_bytes(files[source])
        arg, label = str(path), str(path)
    elif source in uris:
        arg, label = uris[source], "data URI"
    elif source == "url":
        arg, label = "https://example.com/cat.png", "https://example.com/cat.png"
    else:
        arg, label = 42, "image"
    with pytest.raises(InputError, match=reason) as e:
        load_image(arg)
    assert str(e.value).startswith(label + ":"), str(e.value)
    # in a list, the image is named by its place (and its path)
    with pytest.raises(InputError, match=reason) as e:
        images_from([png, arg])
    assert str(e.value).startswith("image 2"), str(e.value)
    if source in files:
        assert str(e.value).startswith(f"image 2 ({path}):")
    # and as bytes, where it is bytes
    if source in files and files[source] is not None and source != "too-big":
        with pytest.raises(InputError, match=reason):
            load_image(files[source])


def test_load_image_byte_limit():
    png = _png()
    assert load_image(png, max_bytes=len(png)).size == (40, 30)
    with pytest.raises(InputError, match="image bytes: .*over the"):
        load_image(png, max_bytes=len(png) - 1)
    uri = "data:image/png;base64," + base64.b64encode(png).decode()
    with pytest.raises(InputError, match="data URI: .*over the"):
        load_image(uri, max_bytes=len(png) // 2)


@pytest.mark.parametrize("pixels", [1999, 3001])  # Pillow warns over the limit and raises over twice it
def test_load_image_decompression_bomb(monkeypatch, tmp_path, pixels):
    png = _png(Image.fromarray(_rgb(100, 40, 0)))  # 4000 pixels
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", pixels)
    path = tmp_path / "bomb.png"
    path.write_bytes(png)
    with pytest.raises(InputError, match="decompression bomb") as e:
        load_image(str(path))
    assert str(e.value).startswith(f"{path}:") and "MAX_IMAGE_PIXELS" in str(e.value)
    with pytest.raises(InputError, match="image 1: .*decompression bomb"):
        images_from([png])
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 4000)  # at the limit: fine
    assert load_image(png).size == (100, 40)


def test_images_from_wants_a_list():
    with pytest.raises(InputError, match="a list of images"):
        images_from("cat.png")


def test_importable_without_torch():
    """The preprocessors and images.py import neither torch nor transformers."""
    import subprocess
    import sys

    code = ("import sys; sys.modules['torch'] = None; sys.modules['transformers'] = None\n"
            "import lumen_core.images, lumen_models_qwen.vision_preprocess, lumen_models_gemma.vision_preprocess\n")
    subprocess.run([sys.executable, "-c", code], check=True)
