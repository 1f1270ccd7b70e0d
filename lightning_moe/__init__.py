"""lightning_moe: Lightning-native training of dense, mixture-of-experts and hybrid language models.

The public names below are imported on first use, so ``import lightning_moe`` stays fast and quiet.
"""

from __future__ import annotations

from lightning_moe.lazy import lazy_exports
from lightning_moe.quiet import quiet_known_noise

quiet_known_noise()  # before any optional dependency is imported

__version__ = "0.1.0"

_PUBLIC = {
    "CausalLM": "lightning_moe.modules.causal_lm",
    "VisionLM": "lightning_moe.modules.vision_lm",
    "DiffusionModule": "lightning_moe.modules.diffusion",
    "HFModelConfig": "lightning_moe.models.hf",
    "OptimizerConfig": "lightning_moe.modules.optim",
    "SchedulerConfig": "lightning_moe.modules.optim",
    "ModelConfig": "lightning_moe.models.config",
    "Decoder": "lightning_moe.models.decoder",
    "load_pretrained": "lightning_moe.modules.restore",
    "import_hf_checkpoint": "lightning_moe.checkpoint.convert",
    "export_hf_checkpoint": "lightning_moe.checkpoint.convert",
    "verify_hf_checkpoints": "lightning_moe.checkpoint.convert",
    "ParallelStrategy": "lightning_moe.parallel",
    "MockDataModule": "lightning_moe.data",
    "SFTDataModule": "lightning_moe.data",
    "PretrainDataModule": "lightning_moe.data",
    "MedPixDataModule": "lightning_moe.data",
    "TextToImageDataModule": "lightning_moe.data",
    "Throughput": "lightning_moe.callbacks.throughput",
    "PeakMemory": "lightning_moe.callbacks.memory",
    "HealthCheck": "lightning_moe.callbacks.health",
    "RunCard": "lightning_moe.callbacks.run_card",
    "PromptsDataModule": "lightning_moe.data",
}

__all__ = sorted(_PUBLIC)


__getattr__ = lazy_exports(__name__, _PUBLIC)
