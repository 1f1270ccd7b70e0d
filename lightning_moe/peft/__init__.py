"""LoRA (peft on linear layers, grouped-GEMM adapters on stacked experts), Hugging Face PEFT adapter export and
import, merging adapters into the weights, and freezing by pattern. The merged Hugging Face export is
``checkpoint.merged_export``; a run's export is ``workflows.run_export``."""

from lightning_moe.models.freeze import freeze_parameters
from lightning_moe.peft.hf_adapter import export_hf_adapter, load_hf_adapter
from lightning_moe.peft.lora import (
    LoraConfig,
    apply_lora,
    is_adapter_parameter,
    keep_checkpoints_adapter_only,
    reset_lora_parameters,
)
from lightning_moe.peft.merge import merged_state_dict

__all__ = [
    "LoraConfig",
    "apply_lora",
    "export_hf_adapter",
    "freeze_parameters",
    "is_adapter_parameter",
    "keep_checkpoints_adapter_only",
    "load_hf_adapter",
    "merged_state_dict",
    "reset_lora_parameters",
]
