"""Images in: the family-neutral part of vision (issue 17).

An image travels as ``ImageInput``: what the model family's preprocessor (in its plugin, from the checkpoint's
``preprocessor_config.json``) made of one picture, ready for the family's vision tower, with the number of prompt
tokens it becomes. ``load_image`` turns what a user hands over (a path, bytes, a PIL image, a ``data:`` URI) into an
RGB PIL image, refusing bad input by name.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np


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
