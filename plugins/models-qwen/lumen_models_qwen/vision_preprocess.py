"""Qwen 3.5's image preprocessing (issue 17): what transformers' ``Qwen2VLImageProcessor`` (the class a Qwen 3.5 /
3.6 checkpoint's ``preprocessor_config.json`` names, also for Qwen3-VL) makes of one still image, in numpy + Pillow
(no torch).

1. RGB: transparency composited onto white, other modes through Pillow (``lumen_core.images.to_rgb``).
2. ``smart_resize``: each side a multiple of ``patch_size * merge_size``, the area within ``[min_pixels,
   max_pixels]`` (``size.shortest_edge`` / ``size.longest_edge``; top-level ``min_pixels`` / ``max_pixels`` win), the
   aspect ratio kept as near as rounding allows; Pillow bicubic by default.
3. ``x * rescale_factor``, then ``(x - image_mean) / image_std`` per channel, float32.
4. Patches: a still image is one temporal patch (``grid t = 1``) whose ``temporal_patch_size`` frames are the same
   picture; patches run merge-window by merge-window (row-major over the ``(h/m, w/m)`` windows, row-major inside
   each ``m x m`` window), each flattened as ``(C, T, P, P)``.

``ImageInput.pixels`` is ``(t*h*w, C*T*P*P)`` float32 (transformers' ``pixel_values``), ``grid`` is ``(t, h, w)`` in
patches (``image_grid_thw``), ``num_tokens = t*h*w / merge_size**2`` (the ``<|image_pad|>`` tokens of the image).
"""

from __future__ import annotations

import math

import numpy as np

from lumen_core.errors import InputError
from lumen_core.images import ImageInput, PreprocessorConfig, rescale_normalize, resize, to_rgb

# transformers' Qwen2VLImageProcessor class defaults, used for what the config leaves out.
OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
MIN_PIXELS = 56 * 56
MAX_PIXELS = 28 * 28 * 1280
BICUBIC = 3
MAX_ASPECT = 200


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """The size Qwen's processor resizes a ``height x width`` image to: both sides multiples of ``factor``, the
    area within ``[min_pixels, max_pixels]``, the aspect ratio nearly kept (Python's round-half-even, as there)."""
    if max(height, width) / min(height, width) > MAX_ASPECT:
        raise InputError(f"the image is {width}x{height} pixels: Qwen's processor takes an aspect ratio of at "
                         f"most {MAX_ASPECT}:1")
    h = round(height / factor) * factor
    w = round(width / factor) * factor
    if h * w > max_pixels:
        scale = math.sqrt(height * width / max_pixels)
        h = max(factor, math.floor(height / scale / factor) * factor)
        w = max(factor, math.floor(width / scale / factor) * factor)
    elif h * w < min_pixels:
        scale = math.sqrt(min_pixels / (height * width))
        h = math.ceil(height * scale / factor) * factor
        w = math.ceil(width * scale / factor) * factor
    return h, w


class ImageProcessor:
    """Qwen 3.5's preprocessor from a ``preprocessor_config.json`` dict (None: transformers' defaults).
    ``vision_config`` (the model config's) fills ``patch_size``, ``temporal_patch_size`` and ``merge_size``
    (its ``spatial_merge_size``) where the preprocessor config leaves them out, so a checkpoint without the file
    still gets patches its tower takes."""

    def __init__(self, preprocessor_config: dict | None = None, vision_config: dict | None = None):
        cfg = PreprocessorConfig(preprocessor_config)
        vision = vision_config or {}
        vars(self).update(cfg.pixel_steps(BICUBIC, OPENAI_CLIP_MEAN, OPENAI_CLIP_STD))
        self.patch_size = cfg.integer("patch_size", _int(vision.get("patch_size")), 14)
        self.temporal_patch_size = cfg.integer("temporal_patch_size", _int(vision.get("temporal_patch_size")), 2)
        self.merge_size = cfg.integer("merge_size", _int(vision.get("spatial_merge_size")), 2)
        # size: {"shortest_edge": min_pixels, "longest_edge": max_pixels}; top-level min_pixels / max_pixels win
        # (transformers' __init__ does the same). Old configs' size {"min_pixels", "max_pixels"} is read too.
        size = cfg.config.get("size")
        if size is None:
            size = {"shortest_edge": MIN_PIXELS, "longest_edge": MAX_PIXELS}
        if not isinstance(size, dict):
            raise cfg.error("size", f"is {size!r}; expected {{\"shortest_edge\": min_pixels, \"longest_edge\": "
                            "max_pixels}")
        self.min_pixels = _pixels(cfg, "min_pixels", "shortest_edge", size)
        self.max_pixels = _pixels(cfg, "max_pixels", "longest_edge", size)

    @property
    def factor(self) -> int:
        return self.patch_size * self.merge_size

    def target_size(self, height: int, width: int) -> tuple[int, int]:
        """The ``(height, width)`` an image of that size is resized to (itself when resizing is off)."""
        if not self.do_resize:
            return height, width
        return smart_resize(height, width, self.factor, self.min_pixels, self.max_pixels)

    @property
    def max_patches(self) -> int:
        """Patches the tower sees for the largest image (``max_pixels``; a still image is one temporal patch)."""
        return self.max_pixels // self.patch_size**2

    def num_tokens(self, height: int, width: int) -> int:
        """How many ``<|image_pad|>`` tokens an image of ``height x width`` pixels becomes."""
        h, w = self.target_size(height, width)
        return (h // self.patch_size) * (w // self.patch_size) // self.merge_size**2

    def preprocess(self, image, label: str = "image") -> ImageInput:
        """One decoded PIL image (``lumen_core.images.load_image``) as an ``ImageInput`` for Qwen 3.5's tower."""
        rgb = to_rgb(image, label, self.do_convert_rgb)
        height, width = rgb.shape[:2]
        try:
            h, w = self.target_size(height, width)
        except InputError as e:
            raise InputError(f"{label}: {e}") from None
        if h % self.factor or w % self.factor:
            raise InputError(f"{label}: the image is {width}x{height} pixels and the preprocessor config turns "
                             f"resizing off; both sides must then be multiples of {self.factor}")
        if self.do_resize:
            rgb = resize(rgb, h, w, self.resample)
        x = rescale_normalize(rgb, self.rescale_factor if self.do_rescale else None,
                              self.image_mean if self.do_normalize else None, self.image_std)
        pixels, gh, gw = self.patchify(x)
        return ImageInput(pixels=pixels, grid=(1, gh, gw), num_tokens=gh * gw // self.merge_size**2)

    def patchify(self, x: np.ndarray) -> tuple[np.ndarray, int, int]:
        """``(C, H, W)`` float32 -> ``(gh*gw, C*T*P*P)`` in the tower's order, with ``gh``, ``gw``."""
        c, height, width = x.shape
        p, m, t = self.patch_size, self.merge_size, self.temporal_patch_size
        gh, gw = height // p, width // p
        # (C, H, W) -> (C, gh/m, m, P, gw/m, m, P): each side is windows x window x patch pixels.
        blocks = x.reshape(c, gh // m, m, p, gw // m, m, p)
        # window row, window col, row in window, col in window | channel, pixel row, pixel col
        blocks = blocks.transpose(1, 4, 2, 5, 0, 3, 6)
        # one temporal patch of T identical frames, between the channel and the pixel axes
        frames = np.repeat(blocks[:, :, :, :, :, None], t, axis=5)
        return np.ascontiguousarray(frames.reshape(gh * gw, c * t * p * p), dtype=np.float32), gh, gw


def _int(value):
    """A vision-config integer, or None (a list-valued ``patch_size`` is not a fallback)."""
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _pixels(cfg: PreprocessorConfig, key: str, edge: str, size: dict) -> int:
    """``min_pixels`` / ``max_pixels``: the top-level key, else ``size[edge]`` (old configs: ``size[key]``)."""
    value, where = cfg.config.get(key), key
    if value is None:
        value, where = size.get(edge, size.get(key)), f"size.{edge}"
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise cfg.error(where, f"is {value!r}; expected a positive number of pixels")
    return value
