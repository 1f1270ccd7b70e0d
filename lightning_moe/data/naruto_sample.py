"""Synthetic rows in the schema of ``lambdalabs/naruto-blip-captions`` (train, 1,221 rows): ``image`` (a
``datasets`` ``Image`` feature: ``{bytes, path}`` structs holding PNG bytes in parquet) and ``text`` (a BLIP
caption, lower case, no final stop).

Each picture is a flat-colour "character": a background, a round head with a fringe of coloured hair, eyes and a
headband, on canvases of a few sizes and aspect ratios (so resizing and centre cropping are exercised); the
caption names what is drawn. The repository's ``data/naruto_sample/train.parquet`` is
``write_naruto_sample(folder)``.
"""

from __future__ import annotations

import io
import random
from pathlib import Path

import numpy as np

HAIR = {"blonde": (235, 200, 60), "pink": (240, 140, 180), "black": (30, 30, 40), "white": (235, 235, 235),
        "red": (200, 40, 40), "blue": (60, 90, 200)}
BACKGROUND = {"green": (80, 160, 90), "orange": (240, 150, 50), "grey": (150, 150, 150), "purple": (120, 80, 160)}
SIZES = ((64, 64), (80, 64), (64, 96), (96, 96))  # (width, height)
WHO = ("a man", "a girl", "a boy", "a woman", "a ninja")


def _drawing(rng: np.random.Generator, width: int, height: int, hair: tuple, background: tuple,
             headband: bool) -> np.ndarray:
    yy, xx = np.mgrid[0:height, 0:width]
    image = np.empty((height, width, 3), dtype=np.float64)
    image[:] = background
    cy, cx, r = height * 0.55, width * 0.5, min(width, height) * 0.3
    head = (yy - cy) ** 2 + (xx - cx) ** 2 <= r**2
    image[head] = (250, 215, 180)
    fringe = head & (yy < cy - 0.35 * r)
    image[fringe] = hair
    for ex in (cx - 0.4 * r, cx + 0.4 * r):
        image[(yy - cy) ** 2 + (xx - ex) ** 2 <= (0.12 * r) ** 2] = (20, 20, 20)
    if headband:
        image[head & (np.abs(yy - (cy - 0.3 * r)) < 0.08 * r)] = (90, 100, 120)
    image += rng.normal(0, 4, image.shape)  # a little texture, so PNG sizes differ
    return np.clip(image, 0, 255).astype(np.uint8)


def naruto_rows(num_rows: int = 24, seed: int = 0) -> list[dict]:
    """``{"image": PNG bytes, "text": caption}`` rows."""
    from PIL import Image

    rng, pick = np.random.default_rng(seed), random.Random(seed)
    rows = []
    for i in range(num_rows):
        hair, background = pick.choice(sorted(HAIR)), pick.choice(sorted(BACKGROUND))
        width, height = SIZES[i % len(SIZES)]
        headband = i % 3 != 0
        pixels = _drawing(rng, width, height, HAIR[hair], BACKGROUND[background], headband)
        buffer = io.BytesIO()
        Image.fromarray(pixels).save(buffer, format="PNG")
        caption = f"{pick.choice(WHO)} with {hair} hair" + (" and a headband" if headband else "")
        rows.append({"image": buffer.getvalue(), "text": f"{caption} on a {background} background"})
    return rows


def write_naruto_sample(output_dir: str | Path, num_rows: int = 24, seed: int = 0) -> Path:
    """``train.parquet`` under ``output_dir``, written by ``datasets`` with the hub dataset's features."""
    import datasets

    rows = naruto_rows(num_rows, seed)
    features = datasets.Features({"image": datasets.Image(), "text": datasets.Value("string")})
    ds = datasets.Dataset.from_dict(
        {"image": [{"bytes": r["image"], "path": None} for r in rows], "text": [r["text"] for r in rows]},
        features=features,
    )
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    ds.to_parquet(str(out / "train.parquet"))
    return out / "train.parquet"
