"""LoRA (peft on linear layers, grouped-GEMM adapters on stacked experts), Hugging Face PEFT adapter export and
import, merged export, and freezing by pattern."""

from lightning_moe.peft.freeze import freeze_parameters
from lightning_moe.peft.hf_adapter import export_hf_adapter, load_hf_adapter
from lightning_moe.peft.lora import (
    LoraConfig,
    apply_lora,
    is_adapter_parameter,
    keep_checkpoints_adapter_only,
    reset_lora_parameters,
)
from lightning_moe.peft.merge import export_merged_hf, merged_state_dict

__all__ = [
    "LoraConfig",
    "apply_lora",
    "export_hf_adapter",
    "export_merged_hf",
    "freeze_parameters",
    "is_adapter_parameter",
    "keep_checkpoints_adapter_only",
    "load_hf_adapter",
    "merged_state_dict",
    "reset_lora_parameters",
]
