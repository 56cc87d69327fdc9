"""Gemma's image preprocessing (issue 17), in numpy + Pillow (no torch), equal to transformers' PIL processors.

**Gemma 3** (``Gemma3ImageProcessor``, SigLIP): RGB (transparency onto white), a plain resize to ``size`` (896 x 896
in the released checkpoints; bilinear), ``x * rescale_factor``, ``(x - 0.5) / 0.5``. ``ImageInput.pixels`` is
``(3, H, W)`` float32, ``grid`` is ``()``, ``num_tokens`` is ``mm_tokens_per_image`` (256): the image soft tokens
between ``<start_of_image>`` and ``<end_of_image>``. Pan-and-scan (extra crops) is not implemented: a config that
turns it on is refused when an image comes.

**Gemma 4** (``Gemma4ImageProcessor``, variable resolution): RGB, a resize keeping the aspect ratio to the largest
size whose sides are multiples of ``pooling_kernel_size * patch_size`` within ``max_soft_tokens *
pooling_kernel_size**2`` patches (bicubic; none when the size is already that), ``x * rescale_factor`` (no
normalization by default: the tower takes [0, 1]), then patches row-major, each flattened as ``(P, P, C)``.
``ImageInput.pixels`` is ``(n, P*P*3)`` float32 for the ``n = h*w`` real patches (transformers pads the batch to
``max_patches`` with zero patches at position ``(-1, -1)``; the tower masks those, so they are left out here),
``grid`` is ``(h, w)`` in patches, ``extra["positions"]`` is ``(n, 2)`` int64 ``(x, y)`` = (column, row) per patch
(``image_position_ids``), ``extra["max_patches"]`` the padded length, and ``num_tokens = n /
pooling_kernel_size**2`` (``num_soft_tokens_per_image``: the ``<|image|>`` tokens between ``<|image>`` and
``<image|>``).
"""

from __future__ import annotations

import math

import numpy as np

from lumen_core.errors import InputError
from lumen_core.images import ImageInput, PreprocessorConfig, rescale_normalize, resize, to_rgb

BILINEAR, BICUBIC = 2, 3
IMAGENET_STANDARD_MEAN = (0.5, 0.5, 0.5)
IMAGENET_STANDARD_STD = (0.5, 0.5, 0.5)
GEMMA3_SIZE = 224  # transformers' class default; the released checkpoints' configs say 896
GEMMA3_TOKENS = 256
GEMMA4_SOFT_TOKENS = (70, 140, 280, 560, 1120)  # the budgets transformers' Gemma 4 processor takes


def _int(value):
    return value if isinstance(value, int) and not isinstance(value, bool) else None


class Gemma3ImageProcessor:
    """Gemma 3's preprocessor from a ``preprocessor_config.json`` dict (None: transformers' defaults).
    ``vision_config`` gives the square ``size`` (its ``image_size``) where the preprocessor config has none;
    ``mm_tokens_per_image`` (the model config's) is ``num_tokens``, else the config's ``image_seq_length``, else
    256."""

    def __init__(self, preprocessor_config: dict | None = None, vision_config: dict | None = None,
                 mm_tokens_per_image: int | None = None):
        cfg = PreprocessorConfig(preprocessor_config)
        vision = vision_config or {}
        vars(self).update(cfg.pixel_steps(BILINEAR, IMAGENET_STANDARD_MEAN, IMAGENET_STANDARD_STD))
        self.do_pan_and_scan = cfg.flag("do_pan_and_scan", False)
        size = cfg.config.get("size")
        if size is None:
            size = _int(vision.get("image_size")) or GEMMA3_SIZE
        if isinstance(size, int) and not isinstance(size, bool):
            size = {"height": size, "width": size}  # transformers' get_size_dict, square by default
        if (not isinstance(size, dict) or set(size) != {"height", "width"}
                or not all(_int(v) and v > 0 for v in size.values())):
            raise cfg.error("size", f"is {size!r}; Gemma 3 takes {{\"height\": H, \"width\": W}} (896 x 896)")
        self.height, self.width = size["height"], size["width"]
        self.patch_size = _int(vision.get("patch_size")) or 14  # SigLIP's: for the plan's activation estimate
        if mm_tokens_per_image is not None:
            if not _int(mm_tokens_per_image) or mm_tokens_per_image < 1:
                raise InputError(f"mm_tokens_per_image is {mm_tokens_per_image!r}; expected a positive integer")
            self.num_image_tokens = mm_tokens_per_image
        else:
            self.num_image_tokens = cfg.integer("image_seq_length", GEMMA3_TOKENS)

    @property
    def max_patches(self) -> int:
        """Patches the tower sees for one image (every image: the input is a fixed square)."""
        return (self.height // self.patch_size) * (self.width // self.patch_size)

    def preprocess(self, image, label: str = "image") -> ImageInput:
        """One decoded PIL image as an ``ImageInput`` for Gemma 3's SigLIP tower: ``(3, H, W)`` float32."""
        if self.do_pan_and_scan:
            raise InputError(f"{label}: the checkpoint's preprocessor config turns on Gemma 3's pan-and-scan "
                             "(do_pan_and_scan), which Lumen does not implement yet; set it to false in "
                             "preprocessor_config.json to use one 896x896 view of each image")
        rgb = to_rgb(image, label, self.do_convert_rgb)
        if self.do_resize:
            rgb = resize(rgb, self.height, self.width, self.resample)
        x = rescale_normalize(rgb, self.rescale_factor if self.do_rescale else None,
                              self.image_mean if self.do_normalize else None, self.image_std)
        return ImageInput(pixels=x, grid=(), num_tokens=self.num_image_tokens)


def gemma4_size(height: int, width: int, patch_size: int, max_patches: int, pooling: int) -> tuple[int, int]:
    """The ``(height, width)`` Gemma 4 resizes an image to: the aspect ratio kept, both sides multiples of
    ``pooling * patch_size``, at most ``max_patches`` patches (a side that would round to 0 gets one block and the
    other side grows with the aspect ratio, capped)."""
    block = pooling * patch_size
    scale = math.sqrt(max_patches * patch_size**2 / (height * width))
    h = int(math.floor(scale * height / block)) * block
    w = int(math.floor(scale * width / block)) * block
    if h == 0 and w == 0:
        raise InputError(f"the image ({width}x{height}) would resize to 0x0")
    longest = (max_patches // pooling**2) * block
    if h == 0:
        h, w = block, min(int(math.floor(width / height)) * block, longest)
    elif w == 0:
        h, w = min(int(math.floor(height / width)) * block, longest), block
    if h * w > max_patches * patch_size**2:
        raise InputError(f"the image is {width}x{height} pixels, too elongated for Gemma 4's budget of "
                         f"{max_patches} patches (it would resize to {w}x{h})")
    return h, w


class Gemma4ImageProcessor:
    """Gemma 4's preprocessor from a ``preprocessor_config.json`` dict (None: transformers' defaults: patch 16,
    pooling 3, 280 soft tokens). ``vision_config`` gives ``patch_size`` and ``pooling_kernel_size`` where the
    preprocessor config has none."""

    def __init__(self, preprocessor_config: dict | None = None, vision_config: dict | None = None):
        cfg = PreprocessorConfig(preprocessor_config)
        vision = vision_config or {}
        vars(self).update(cfg.pixel_steps(BICUBIC, (0.0, 0.0, 0.0), (1.0, 1.0, 1.0), normalize=False))
        self.patch_size = cfg.integer("patch_size", _int(vision.get("patch_size")), 16)
        self.pooling_kernel_size = cfg.integer("pooling_kernel_size", _int(vision.get("pooling_kernel_size")), 3)
        self.max_soft_tokens = cfg.integer("max_soft_tokens", 280)
        if self.max_soft_tokens not in GEMMA4_SOFT_TOKENS:
            raise cfg.error("max_soft_tokens", f"is {self.max_soft_tokens}; Gemma 4 takes one of "
                            f"{', '.join(map(str, GEMMA4_SOFT_TOKENS))}")

    @property
    def max_patches(self) -> int:
        return self.max_soft_tokens * self.pooling_kernel_size**2

    def preprocess(self, image, label: str = "image") -> ImageInput:
        """One decoded PIL image as an ``ImageInput`` for Gemma 4's tower (see the module's docstring)."""
        rgb = to_rgb(image, label, self.do_convert_rgb)
        height, width = rgb.shape[:2]
        p = self.patch_size
        if self.do_resize:
            try:
                h, w = gemma4_size(height, width, p, self.max_patches, self.pooling_kernel_size)
            except InputError as e:
                raise InputError(f"{label}: {e}") from None
            if (h, w) != (height, width):
                rgb = resize(rgb, h, w, self.resample)
        x = rescale_normalize(rgb, self.rescale_factor if self.do_rescale else None,
                              self.image_mean if self.do_normalize else None, self.image_std)
        gh, gw = x.shape[1] // p, x.shape[2] // p
        if gh * gw > self.max_patches:
            raise InputError(f"{label}: {gh * gw} patches, over Gemma 4's {self.max_patches} (resizing is off)")
        # (C, H, W) -> (gh, gw, P, P, C): patches row-major, pixels row-major inside, channels last. A side that is
        # not a multiple of P loses its remainder, as in transformers.
        c = x.shape[0]
        patches = x[:, :gh * p, :gw * p].reshape(c, gh, p, gw, p).transpose(1, 3, 2, 4, 0)
        pixels = np.ascontiguousarray(patches.reshape(gh * gw, p * p * c), dtype=np.float32)
        cols, rows = np.meshgrid(np.arange(gw, dtype=np.int64), np.arange(gh, dtype=np.int64), indexing="xy")
        positions = np.stack([cols.ravel(), rows.ravel()], axis=1)
        return ImageInput(pixels=pixels, grid=(gh, gw), num_tokens=gh * gw // self.pooling_kernel_size**2,
                          extra={"positions": positions, "max_patches": self.max_patches})


def pad_to_max_patches(image: ImageInput) -> tuple[np.ndarray, np.ndarray]:
    """A Gemma 4 ``ImageInput``'s patches and positions padded to ``max_patches`` as transformers batches them:
    zero patches at position ``(-1, -1)``."""
    n, total = image.pixels.shape[0], image.extra["max_patches"]
    pixels = np.zeros((total, image.pixels.shape[1]), dtype=np.float32)
    pixels[:n] = image.pixels
    positions = np.full((total, 2), -1, dtype=np.int64)
    positions[:n] = image.extra["positions"]
    return pixels, positions
