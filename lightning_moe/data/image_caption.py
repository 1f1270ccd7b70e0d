"""Image + caption rows (``lambdalabs/naruto-blip-captions`` schema: ``image``, ``text``) as model inputs.

Every row's image is decoded, resized so its shorter side is ``resolution`` and centre-cropped to a square, then
scaled to [-1, 1] (what the VAE of a diffusion pipeline takes). A row whose image is missing or cannot be decoded,
or whose caption is not a non-empty string, is a :class:`~lightning_moe.data.formats.RowError` that callers report
with the source and row number.
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import Any

import numpy as np

from lightning_moe.data.formats import RowError
from lightning_moe.data.vision_text import ImageError, decode_image

log = logging.getLogger(__name__)


def square_pixels(image: Any, resolution: int) -> np.ndarray:
    """``[3, resolution, resolution]`` float32 in [-1, 1]: shorter side resized (bilinear) to ``resolution``,
    centre crop (as diffusers' text-to-image training scripts do)."""
    from PIL import Image

    width, height = image.size
    scale = resolution / min(width, height)
    size = (max(resolution, round(width * scale)), max(resolution, round(height * scale)))
    image = image.resize(size, Image.BILINEAR)
    left, top = (size[0] - resolution) // 2, (size[1] - resolution) // 2
    image = image.crop((left, top, left + resolution, top + resolution))
    pixels = np.asarray(image, dtype=np.float32).transpose(2, 0, 1)
    return pixels / 127.5 - 1.0


class ImageCaptionRows:
    """The rows of one source: ``pixels(i)`` and ``caption(i)`` raise :class:`RowError` for a bad row.

    Args:
        source: a loaded :class:`~lightning_moe.data.sources.Source`.
        base_dir: folder that relative image paths are read from (the data file's folder).
    """

    def __init__(self, source: Any, resolution: int, image_column: str = "image", caption_column: str = "text",
                 base_dir: str | None = None) -> None:
        from datasets import Image

        ds = source.dataset
        for column in (image_column, caption_column):
            if column not in ds.column_names:
                raise ValueError(f"{source.name}: column '{column}' missing (found: {', '.join(ds.column_names)})")
        if isinstance(ds.features.get(image_column), Image):  # undecoded, so a bad image is one bad row
            ds = ds.cast_column(image_column, Image(decode=False))
        if resolution < 16 or resolution % 16:
            raise ValueError(f"resolution={resolution} must be a positive multiple of 16 (VAE 8x, 2x2 patches)")
        self.dataset, self.name, self.resolution = ds, source.name, resolution
        self.image_column, self.caption_column, self.base_dir = image_column, caption_column, base_dir

    def __len__(self) -> int:
        return len(self.dataset)

    def caption(self, index: int) -> str:
        value = self.dataset[index][self.caption_column]
        if not isinstance(value, str) or not value.strip():
            raise RowError(f"column '{self.caption_column}' must be a non-empty caption string, got {value!r:.40}")
        return value

    def pixels(self, index: int) -> np.ndarray:
        image = decode_image(self.dataset[index][self.image_column], self.base_dir, self.image_column)
        return square_pixels(image, self.resolution)

    def check(self, bad_rows: str = "error") -> list[int]:
        """The usable row numbers. ``bad_rows``: ``error`` stops at the first bad row, naming it; ``skip`` leaves
        bad rows out and logs how many and why."""
        kept, skipped, first = [], Counter(), None
        for i in range(len(self)):
            try:
                self.caption(i)
                decode_image(self.dataset[i][self.image_column], self.base_dir, self.image_column)
            except RowError as err:
                if bad_rows == "error":
                    raise ValueError(f"{self.name} row {i}: {err} (set bad_rows: skip to leave such rows out)") from None
                skipped["missing or undecodable image" if isinstance(err, ImageError) else "missing caption"] += 1
                first = first or f"row {i}: {err}"
                continue
            kept.append(i)
        if skipped:
            log.warning("%s: skipped %d of %d rows (%s); first bad row: %s", self.name, sum(skipped.values()), len(self),
                        ", ".join(f"{n} {k}" for k, n in skipped.items()), first)
        if not kept:
            raise ValueError(f"{self.name}: no usable rows ({dict(skipped)}; first: {first})")
        return kept
