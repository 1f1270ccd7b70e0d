"""Diffusion (image-generation) models trained through diffusers: which pipeline (``config.py``), its family
(``qwen_image.py``, ``family.py``), the trained transformer (``transformer.py``) and the flow-matching targets
(``flow_matching.py``); the export of the result is ``checkpoint/diffusion_export.py``. diffusers is imported only by
the functions that use it."""

from lightning_moe.models.diffusion.config import DiffusionModelConfig
from lightning_moe.models.diffusion.family import load_family
from lightning_moe.models.diffusion.flow_matching import FlowMatchingConfig

__all__ = ["DiffusionModelConfig", "FlowMatchingConfig", "load_family"]
