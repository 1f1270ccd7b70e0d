"""The family object of a ``DiffusionModelConfig``: its pipeline folder resolved, the family detected."""

from __future__ import annotations

from lightning_moe.models.diffusion.config import (
    DiffusionModelConfig,
    detect_family,
    refuse_unimplemented,
    resolve_pipeline_dir,
)
from lightning_moe.models.diffusion.qwen_image import QwenImageFamily


def load_family(cfg: DiffusionModelConfig):
    """The family object of ``cfg`` (its folder resolved)."""
    directory = resolve_pipeline_dir(cfg)
    family = detect_family(directory) if cfg.family == "auto" else cfg.family
    refuse_unimplemented(family)
    return QwenImageFamily(directory, cfg)
