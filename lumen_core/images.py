"""Images in: the family-neutral part of vision (issue 17).

An image travels as ``ImageInput``: what the model family's preprocessor (in its plugin, from the checkpoint's
``preprocessor_config.json``) made of one picture, ready for the family's vision tower, with the number of prompt
tokens it becomes. ``load_image`` turns what a user hands over (a path, bytes, a PIL image, a ``data:`` URI) into a
decoded PIL image in the mode the file has, refusing bad input by name; ``images_from`` does it for a list, naming
each image by its place in it.

The mode is left as decoded because the family preprocessors convert it themselves, as transformers' image
processors do (``to_rgb``: transparency composited onto white, everything else through Pillow's ``convert("RGB")``).
The helpers below (``to_rgb``, ``resize``, ``rescale_normalize``) are the steps transformers' PIL image processors
share, written so that a preprocessor built on them gives the same float32 values.
"""

from __future__ import annotations

import base64
import binascii
import io
import os
import re
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from lumen_core.errors import InputError

MAX_IMAGE_BYTES = 20 * 1024 * 1024
"""The largest encoded image (file, bytes, or a data URI's decoded payload) ``load_image`` takes: 20 MiB."""


@dataclass
class ImageInput:
    """One image, preprocessed for one model family.

    - ``pixels``: float32, the family's tower input (its layout is the family preprocessor's to document; Qwen 3.5:
      the flattened patches ``(t*h*w, C*T*P*P)`` as transformers' processor gives ``pixel_values``).
    - ``grid``: the family's patch grid (Qwen 3.5: ``(t, h, w)`` in patches before merging, ``image_grid_thw``;
      Gemma 4: its patch grid; Gemma 3: ``()``, a fixed square input).
    - ``num_tokens``: how many placeholder tokens the image becomes in the prompt.
    - ``extra``: anything else the family's tower needs (e.g. Gemma 4's patch positions), by name.
    """

    pixels: np.ndarray
    grid: tuple[int, ...]
    num_tokens: int
    extra: dict[str, Any] = field(default_factory=dict)


# -- loading ------------------------------------------------------------------------------------------------------

_DATA_URI = re.compile(r"data:(?P<type>[^;,]*)(?P<params>(?:;[^;,]*)*),(?P<data>.*)", re.DOTALL)

# Formats Pillow does not read, told apart from garbage by their first bytes (offset, signature, name).
_KNOWN_UNSUPPORTED = (
    (0, b"%PDF", "PDF"),
    (0, b"<svg", "SVG"),
    (0, b"<?xml", "SVG/XML"),
    (4, b"ftypheic", "HEIC"),
    (4, b"ftypheix", "HEIC"),
    (4, b"ftypmif1", "HEIF"),
    (4, b"ftypjxl", "JPEG XL"),
    (0, b"\xff\x0a", "JPEG XL"),
    (0, b"\x00\x00\x00\x0cJXL ", "JPEG XL"),
)


def _pil():
    try:
        from PIL import Image
    except ImportError as e:  # a dependency of lumen-core; only a broken install lacks it
        raise InputError("images need Pillow: pip install 'pillow>=10'") from e
    return Image


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def _read_path(path, label: str, max_bytes: int) -> bytes:
    try:
        size = os.stat(path).st_size
    except FileNotFoundError:
        raise InputError(f"{label}: no such file") from None
    except OSError as e:
        raise InputError(f"{label}: cannot read the file ({e.strerror or e})") from None
    if os.path.isdir(path):
        raise InputError(f"{label}: is a directory, not an image file")
    if size > max_bytes:
        raise InputError(f"{label}: the file is {_mib(size)}, over the {_mib(max_bytes)} limit on one image")
    try:
        with open(path, "rb") as f:
            return f.read(max_bytes + 1)
    except OSError as e:
        raise InputError(f"{label}: cannot read the file ({e.strerror or e})") from None


def _decode_data_uri(uri: str, label: str, max_bytes: int) -> bytes:
    m = _DATA_URI.fullmatch(uri.strip())
    if m is None:
        raise InputError(f"{label}: a bad data URI (no ',' before the data); expected data:image/<type>;base64,<data>")
    media = m["type"].strip().lower()
    params = [p.strip().lower() for p in m["params"].split(";") if p.strip()]
    if not media.startswith("image/"):
        raise InputError(f"{label}: a data URI of type {media or '(none)'!r}, not an image; expected "
                         "data:image/<type>;base64,<data>")
    if "base64" not in params:
        raise InputError(f"{label}: a data URI without ';base64'; only base64-encoded image data URIs are taken")
    data = re.sub(r"\s+", "", m["data"])
    if len(data) // 4 * 3 > max_bytes + 3:
        raise InputError(f"{label}: the data URI holds about {_mib(len(data) // 4 * 3)}, over the "
                         f"{_mib(max_bytes)} limit on one image")
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError) as e:
        raise InputError(f"{label}: the data URI's base64 data is bad ({e})") from None
    if not raw:
        raise InputError(f"{label}: the data URI holds no data")
    return raw


# Formats Pillow reads, by their first bytes: data that starts so but does not open is cut short or damaged.
_KNOWN_SUPPORTED = (
    (0, b"\x89PNG\r\n\x1a\n", "PNG"),
    (0, b"\xff\xd8\xff", "JPEG"),
    (0, b"GIF8", "GIF"),
    (8, b"WEBP", "WebP"),
    (0, b"BM", "BMP"),
    (0, b"II*\x00", "TIFF"),
    (0, b"MM\x00*", "TIFF"),
)


def _format_of(data: bytes) -> str | None:
    for offset, sig, name in _KNOWN_SUPPORTED:
        if data[offset:offset + len(sig)] == sig:
            return name
    return None


def _broken(label: str, e: Exception, fmt: str | None) -> InputError:
    what = "truncated" if "truncated" in str(e).lower() or isinstance(e, EOFError) else "corrupt"
    return InputError(f"{label}: {what} {fmt + ' ' if fmt else ''}image data ({e})")


def _unrecognised(data: bytes, label: str) -> InputError:
    name = _format_of(data)
    if name is not None:
        return InputError(f"{label}: truncated or corrupt {name} data ({len(data)} bytes; Pillow cannot read "
                          "its header)")
    for offset, sig, name in _KNOWN_UNSUPPORTED:
        if data[offset:offset + len(sig)].lower() == sig.lower():
            return InputError(f"{label}: {name} images are not supported (Pillow cannot decode them); "
                              "convert it to PNG, JPEG or WebP")
    return InputError(f"{label}: not an image, or an image format Pillow cannot decode")


def _bomb(label: str, pixels: int | None, limit) -> InputError:
    size = f" ({pixels:,} pixels)" if pixels else ""
    return InputError(f"{label}: the image is too large to decode{size}: over the limit of {limit:,} pixels "
                      "(PIL.Image.MAX_IMAGE_PIXELS), a possible decompression bomb")


def _decode(data: bytes, label: str, max_bytes: int):
    Image = _pil()
    if len(data) > max_bytes:
        raise InputError(f"{label}: the image is {_mib(len(data))}, over the {_mib(max_bytes)} limit on one image")
    if not data:
        raise InputError(f"{label}: empty (0 bytes)")
    limit = Image.MAX_IMAGE_PIXELS
    with warnings.catch_warnings():
        warnings.simplefilter("error", Image.DecompressionBombWarning)
        try:
            img = Image.open(io.BytesIO(data))
        except (Image.DecompressionBombError, Image.DecompressionBombWarning):
            raise _bomb(label, None, limit) from None
        except Image.UnidentifiedImageError:
            raise _unrecognised(data, label) from None
        except (OSError, SyntaxError, ValueError, EOFError) as e:
            raise _broken(label, e, _format_of(data)) from None
        w, h = img.size
        if limit and w * h > limit:
            raise _bomb(label, w * h, limit)
        if w < 1 or h < 1:
            raise InputError(f"{label}: the image is {w}x{h} pixels, empty")
        try:
            img.load()
        except (Image.DecompressionBombError, Image.DecompressionBombWarning):
            raise _bomb(label, w * h, limit) from None
        except (OSError, SyntaxError, ValueError, EOFError) as e:
            raise _broken(label, e, img.format or _format_of(data)) from None
        try:
            from PIL import ImageOps

            img = ImageOps.exif_transpose(img)  # upright, as transformers' load_image and browsers show it
        except Exception:  # a broken EXIF block: keep the pixels as stored
            pass
    return img


def load_image(source, label: str | None = None, max_bytes: int = MAX_IMAGE_BYTES):
    """Decode one image: ``source`` is a path (``str`` / ``os.PathLike``), encoded ``bytes``, a ``PIL.Image.Image``
    (returned as it is) or a ``data:image/<type>;base64,<data>`` URI. Returns the decoded PIL image in its own
    mode (RGBA, L, P, CMYK, I;16... stay so: the family preprocessor converts), turned upright by its EXIF
    orientation as transformers' ``load_image`` does. URLs are not fetched.

    Bad input raises ``InputError`` naming the source (``label``, else the path / "image bytes" / "data URI") and
    the reason: a missing or unreadable file, empty, truncated or non-image data, a format Pillow cannot decode,
    more than ``max_bytes`` encoded (``MAX_IMAGE_BYTES``, 20 MiB), more pixels than ``PIL.Image.MAX_IMAGE_PIXELS``
    (a decompression bomb; Pillow's warning band below twice the limit is refused too), a bad data URI."""
    Image = _pil()
    if isinstance(source, Image.Image):
        return source
    if isinstance(source, (bytes, bytearray, memoryview)):
        return _decode(bytes(source), label or "image bytes", max_bytes)
    if isinstance(source, str) and source.lstrip()[:5].lower() == "data:":
        label = label or "data URI"
        return _decode(_decode_data_uri(source, label, max_bytes), label, max_bytes)
    if isinstance(source, str) and re.match(r"(?i)https?://", source):
        raise InputError(f"{label or source}: image URLs are not fetched; download the image and pass its path")
    if isinstance(source, (str, os.PathLike)):
        path = os.fspath(source)
        if isinstance(path, bytes):
            path = os.fsdecode(path)
        label = label or path
        if not path:
            raise InputError(f"{label or 'image'}: an empty path")
        return _decode(_read_path(path, label, max_bytes), label, max_bytes)
    raise InputError(f"{label or 'image'}: a value of type {type(source).__name__}, not an image; give a path, "
                     "bytes, a PIL image or a data:image/...;base64 URI")


def images_from(sources: Sequence, max_bytes: int = MAX_IMAGE_BYTES) -> list:
    """``load_image`` for each of ``sources``; an error names the image by its place, counted from 1 ("image 2",
    with its path when it is one: "image 2 (cat.png)")."""
    if isinstance(sources, (str, bytes, os.PathLike)) or not isinstance(sources, Sequence):
        raise InputError(f"images: a list of images is expected, got a value of type {type(sources).__name__}")
    out = []
    for i, source in enumerate(sources, 1):
        label = f"image {i}"
        if isinstance(source, (str, os.PathLike)) and not (isinstance(source, str) and
                                                           source.lstrip()[:5].lower() == "data:"):
            label += f" ({os.fspath(source)!s})"
        out.append(load_image(source, label=label, max_bytes=max_bytes))
    return out


# -- the steps transformers' PIL image processors share --------------------------------------------------------------


def to_rgb(img, label: str = "image", convert: bool = True) -> np.ndarray:
    """``img`` as a uint8 ``(H, W, 3)`` array, as transformers' ``convert_to_rgb`` makes it: an image with an alpha
    band or a ``transparency`` entry (P / L / RGB with tRNS) is composited onto opaque white through RGBA; any
    other mode (L, 1, P, CMYK, I;16 — clipped at 255 by Pillow, as there —, YCbCr...) goes through Pillow's
    ``convert("RGB")``. With ``convert=False`` (a config's ``do_convert_rgb: false``) the image is taken as it is
    and must already be 8-bit RGB."""
    Image = _pil()
    if not convert:
        arr = np.asarray(img)
        if arr.dtype != np.uint8 or arr.ndim != 3 or arr.shape[2] != 3:
            raise InputError(f"{label}: a {img.mode} image, but the preprocessor config turns off the RGB "
                             "conversion (do_convert_rgb: false); give an 8-bit RGB image")
        return arr
    try:
        if "A" in img.getbands() or img.info.get("transparency") is not None:
            rgba = img.convert("RGBA")
            white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
            rgb = Image.alpha_composite(white, rgba).convert("RGB")
        else:
            rgb = img.convert("RGB")
    except (ValueError, OSError) as e:
        raise InputError(f"{label}: a {img.mode} image cannot be converted to RGB ({e})") from None
    return np.asarray(rgb, dtype=np.uint8)


RESAMPLE_NAMES = {0: "nearest", 1: "lanczos", 2: "bilinear", 3: "bicubic", 4: "box", 5: "hamming"}


def resample_filter(value, default: int, key: str = "resample") -> int:
    """A preprocessor config's ``resample`` (Pillow's filter number, 0-5; None: ``default``)."""
    from lumen_core.errors import CheckpointError

    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or value not in RESAMPLE_NAMES:
        raise CheckpointError(f"preprocessor_config.json: {key} is {value!r}; expected a Pillow filter number 0-5")
    return int(value)


def resize(rgb: np.ndarray, height: int, width: int, resample: int) -> np.ndarray:
    """Pillow's resize of a uint8 ``(H, W, 3)`` array to ``(height, width, 3)``, as transformers' PIL backend
    resizes (no reducing gap)."""
    Image = _pil()
    return np.asarray(Image.fromarray(rgb).resize((width, height), resample=resample), dtype=np.uint8)


def rescale_normalize(rgb: np.ndarray, rescale: float | None, mean=None, std=None) -> np.ndarray:
    """A uint8 ``(H, W, C)`` array as float32 ``(C, H, W)``: times ``rescale`` (in float64, then rounded to
    float32, as transformers rescales; None: no rescale), then ``(x - mean) / std`` per channel in float32 when
    ``mean`` is given."""
    channels = rgb.shape[2]
    m = np.broadcast_to(np.asarray(mean if mean is not None else 0.0, dtype=np.float32), (channels,))
    s = np.broadcast_to(np.asarray(std if mean is not None else 1.0, dtype=np.float32), (channels,))
    x = np.empty((channels, *rgb.shape[:2]), dtype=np.float32)
    for c in range(channels):  # a channel at a time: the float64 step stays one plane
        plane = rgb[:, :, c]
        x[c] = (plane.astype(np.float64) * rescale).astype(np.float32) if rescale is not None else plane
        if mean is not None:
            x[c] -= m[c]
            x[c] /= s[c]
    return x


# -- reading preprocessor_config.json ------------------------------------------------------------------------------


class PreprocessorConfig:
    """Typed reads of a checkpoint's ``preprocessor_config.json`` (a dict; None: empty). A key that is absent or
    null takes the fallback given (the vision config's value, else transformers' class default), as transformers'
    image processors treat null; a value of the wrong type is a ``CheckpointError`` naming the key."""

    FILE = "preprocessor_config.json"

    def __init__(self, config: dict | None):
        from lumen_core.errors import CheckpointError

        if config is not None and not isinstance(config, dict):
            raise CheckpointError(f"{self.FILE}: expected a JSON object, got a {type(config).__name__}")
        self.config = dict(config or {})

    def pixel_steps(self, resample: int, mean, std, normalize: bool = True) -> dict:
        """The steps every family's processor shares, as attributes: ``do_convert_rgb``, ``do_resize``,
        ``resample``, ``do_rescale``, ``rescale_factor``, ``do_normalize``, ``image_mean``, ``image_std``; the
        arguments are the family's defaults (transformers' class defaults)."""
        return {"do_convert_rgb": self.flag("do_convert_rgb", True), "do_resize": self.flag("do_resize", True),
                "resample": self.resample(resample), "do_rescale": self.flag("do_rescale", True),
                "rescale_factor": self.number("rescale_factor", 1 / 255),
                "do_normalize": self.flag("do_normalize", normalize),
                "image_mean": self.channels("image_mean", mean), "image_std": self.channels("image_std", std)}

    def error(self, key: str, problem: str):
        from lumen_core.errors import CheckpointError

        return CheckpointError(f"{self.FILE}: {key} {problem}")

    def get(self, key: str, *fallbacks):
        value = self.config.get(key)
        for f in (value, *fallbacks):
            if f is not None:
                return f
        return None

    def flag(self, key: str, default: bool) -> bool:
        value = self.get(key, default)
        if not isinstance(value, bool):
            raise self.error(key, f"is {value!r}; expected true or false")
        return value

    def integer(self, key: str, *fallbacks, minimum: int = 1) -> int:
        value = self.get(key, *fallbacks)
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise self.error(key, f"is {value!r}; expected an integer >= {minimum}")
        return value

    def number(self, key: str, default: float) -> float:
        value = self.get(key, default)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not np.isfinite(value) or value <= 0:
            raise self.error(key, f"is {value!r}; expected a positive number")
        return float(value)

    def channels(self, key: str, default, channels: int = 3) -> list[float]:
        """``image_mean`` / ``image_std``: one number per channel, or one for all (as transformers repeats it)."""
        value = self.get(key, default)
        values = [value] * channels if isinstance(value, (int, float)) and not isinstance(value, bool) else value
        if (not isinstance(values, (list, tuple)) or len(values) != channels
                or not all(isinstance(v, (int, float)) and not isinstance(v, bool) and np.isfinite(v)
                           for v in values)):
            raise self.error(key, f"is {value!r}; expected {channels} numbers (one per RGB channel)")
        if key.endswith("std") and any(v == 0 for v in values):
            raise self.error(key, f"is {value!r}; a standard deviation of 0 divides by zero")
        return [float(v) for v in values]

    def resample(self, default: int) -> int:
        return resample_filter(self.config.get("resample"), default)
