"""LightningModules: ``CausalLM`` (pretraining, SFT, LoRA)."""

from lightning_moe.modules.causal_lm import CausalLM
from lightning_moe.modules.optim import OptimizerConfig, SchedulerConfig

__all__ = ["CausalLM", "OptimizerConfig", "SchedulerConfig"]
