"""Synthetic rows in the schema of the MedPix VQA dataset (``mmoukouba/MedPix-VQA``), with small PNG "scans".

Each case is a noisy grey field with an elliptical organ and sometimes a bright lesion, 28 to 84 pixels a side
(so images of several sizes reach the vision tower), asked about with MedPix-style questions. The pictures and
answers are consistent (the answer says where the lesion is), but the point is the schema and the size
spread, not the medicine. The repository's ``data/medpix_sample`` folder is ``write_medpix_sample(folder)``.

Schema (one JSON object per line): ``image_id`` (the image's path relative to the file, as a ``datasets``
``Image`` column stores local files), ``mode`` (imaging modality), ``case_id``, ``question``, ``answer``.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np

MODES = ("CT", "MRI", "X-ray", "Ultrasound")
SIDES = (28, 42, 56, 70, 84)
REGIONS = ("brain", "chest", "abdomen", "pelvis", "knee", "spine")
QUESTIONS = (
    ("What imaging modality was used?", "{mode_long}."),
    ("Is there an abnormality in this image?", "{finding_short}"),
    ("Where is the lesion located?", "{location}"),
    ("Which part of the body is shown?", "The {region}."),
    ("Describe the findings.", "{mode_long} of the {region} showing {finding_long}."),
)
MODE_LONG = {"CT": "Computed tomography", "MRI": "Magnetic resonance imaging", "X-ray": "Plain radiograph",
             "Ultrasound": "Ultrasound"}


def _scan(rng: np.random.Generator, height: int, width: int, lesion: tuple[float, float] | None) -> np.ndarray:
    yy, xx = np.mgrid[0:height, 0:width]
    cy, cx = height / 2, width / 2
    organ = ((yy - cy) / (0.4 * height)) ** 2 + ((xx - cx) / (0.4 * width)) ** 2 <= 1.0
    image = rng.normal(40, 12, (height, width)) + organ * 90
    if lesion is not None:
        ly, lx = lesion[0] * height, lesion[1] * width
        radius = max(2.0, 0.08 * min(height, width))
        image += (((yy - ly) ** 2 + (xx - lx) ** 2) <= radius**2) * 100
    grey = np.clip(image, 0, 255).astype(np.uint8)
    return np.stack([grey] * 3, axis=-1)


def _location(lesion: tuple[float, float]) -> str:
    vertical = "upper" if lesion[0] < 0.5 else "lower"
    horizontal = "left" if lesion[1] < 0.5 else "right"
    return f"In the {vertical} {horizontal} part of the image."


def medpix_rows(num_cases: int = 36, seed: int = 0) -> list[tuple[dict, np.ndarray | None]]:
    """``(row, image pixels)`` pairs; later rows of a case reuse its first image (pixels None)."""
    rng, pick = np.random.default_rng(seed), random.Random(seed)
    rows = []
    for case in range(num_cases):
        mode, region = MODES[case % len(MODES)], pick.choice(REGIONS)
        height, width = pick.choice(SIDES), pick.choice(SIDES)
        lesion = (pick.uniform(0.3, 0.7), pick.uniform(0.3, 0.7)) if case % 3 else None
        pixels = _scan(rng, height, width, lesion)
        values = {
            "mode_long": MODE_LONG[mode], "region": region,
            "finding_short": "Yes, a focal hyperdense lesion." if lesion else "No, the study is normal.",
            "finding_long": "a well-circumscribed focal lesion" if lesion else "no focal abnormality",
            "location": _location(lesion) if lesion else "No lesion is seen.",
        }
        case_id = f"MPX{1000 + case}"
        image = f"images/{case_id}.png"
        asked = pick.sample(range(len(QUESTIONS)), 1 + case % 2)
        for n, index in enumerate(asked):
            question, answer = QUESTIONS[index]
            row = {"image_id": image, "mode": mode, "case_id": case_id, "question": question,
                   "answer": answer.format(**values)}
            rows.append((row, pixels if n == 0 else None))
    return rows


def write_medpix_sample(output_dir: str | Path, num_cases: int = 36, validation_cases: int = 6, seed: int = 0) -> None:
    """``train.jsonl`` and ``validation.jsonl`` (disjoint cases) plus ``images/*.png`` under ``output_dir``."""
    from PIL import Image

    out = Path(output_dir)
    (out / "images").mkdir(parents=True, exist_ok=True)
    rows = medpix_rows(num_cases + validation_cases, seed)
    splits: dict[str, list[str]] = {"train": [], "validation": []}
    for row, pixels in rows:
        if pixels is not None:
            Image.fromarray(pixels).save(out / row["image_id"], optimize=True)
        split = "validation" if int(row["case_id"][3:]) - 1000 >= num_cases else "train"
        splits[split].append(json.dumps(row))
    for split, lines in splits.items():
        (out / f"{split}.jsonl").write_text("\n".join(lines) + "\n")
