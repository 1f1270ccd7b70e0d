"""The diffusion tests import their helpers from here and the shared harness from ``tests/``; one tiny Qwen-Image
pipeline folder and one latent cache of the shipped Naruto sample serve the whole session."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

for folder in (Path(__file__).parent, Path(__file__).parents[1]):
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))


@pytest.fixture(scope="session")
def tiny_pipeline(tmp_path_factory) -> Path:
    from tiny_qwen_image import save_tiny_qwen_image

    return save_tiny_qwen_image(tmp_path_factory.mktemp("qwen_image") / "pipeline")


@pytest.fixture(scope="session")
def tiny_cache(tiny_pipeline, tmp_path_factory) -> Path:
    from tiny_qwen_image import RESOLUTION, SAMPLE

    from lightning_moe.data.commands import main

    out = tmp_path_factory.mktemp("cache") / "naruto_latents"
    assert main(["cache-latents", "--dataset", str(SAMPLE), "--model", str(tiny_pipeline), "--output", str(out),
                 "--resolution", str(RESOLUTION), "--encoder-dtype", "float32", "--batch-size", "5"]) == 0
    return out
