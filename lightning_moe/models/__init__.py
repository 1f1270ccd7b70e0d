"""Model configuration, the generic decoder and the per-family Hugging Face translations."""

from lightning_moe.models import blocks  # noqa: F401  (its records register the checks of a config's patterns)
from lightning_moe.models.config import (
    AttentionConfig,
    MambaConfig,
    MLPConfig,
    ModelConfig,
    MoEConfig,
    MTPConfig,
    RopeConfig,
)

__all__ = ["AttentionConfig", "MLPConfig", "MTPConfig", "MambaConfig", "ModelConfig", "MoEConfig", "RopeConfig"]
