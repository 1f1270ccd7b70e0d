"""LightningModules: ``CausalLM`` (pretraining, SFT, LoRA), ``VisionLM`` (vision-language fine-tuning),
``DiffusionModule`` (text-to-image flow-matching fine-tuning)."""

from lightning_moe.modules.causal_lm import CausalLM
from lightning_moe.modules.diffusion import DiffusionModule
from lightning_moe.modules.optim import OptimizerConfig, SchedulerConfig
from lightning_moe.modules.vision_lm import VisionLM

__all__ = ["CausalLM", "DiffusionModule", "OptimizerConfig", "SchedulerConfig", "VisionLM"]
