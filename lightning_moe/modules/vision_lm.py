"""``VisionLM``: fine-tuning of a transformers image-text-to-text model (Qwen2.5-VL / Qwen3-VL class).

Everything of :class:`CausalLM` applies (global-batch token loss, optimizer, LoRA/FP8/freeze converters,
FSDP2 and activation checkpointing, callbacks, export); this module adds the image inputs of each batch, the
multimodal rotary positions of packed rows, freezing of the vision tower / projector / embeddings, and a check
that the data module's processor belongs to the model.

YAML::

    model:
      class_path: lightning_moe.VisionLM
      init_args:
        model: {hf: Qwen/Qwen2.5-VL-3B-Instruct}
        freeze_vision: true
    data:
      class_path: lightning_moe.MedPixDataModule
      init_args: {processor: Qwen/Qwen2.5-VL-3B-Instruct, dataset: mmoukouba/MedPix-VQA}
"""

from __future__ import annotations

from typing import Any

import torch

from lightning_moe.models.decoder import LossOutput
from lightning_moe.models.hf import (
    HFModel,
    HFModelConfig,
    build_hf_model,
    hf_converters,
    native_checkpoint_dir,
    resolve_model_dir,
)
from lightning_moe.models.hf_vision import (
    check_processor_matches,
    freeze_vision_parts,
    multimodal_position_ids,
)
from lightning_moe.modules.causal_lm import CausalLM
from lightning_moe.modules.optim import OptimizerConfig, SchedulerConfig
from lightning_moe.peft import LoraConfig
from lightning_moe.precision import Float8Config

# batch keys that are the text model's own arguments or bookkeeping; every other key is a model input
TEXT_KEYS = ("input_ids", "labels", "position_ids", "num_label_tokens", "layout")


class VisionLM(CausalLM):
    """An image-text-to-text model trained on ``{input_ids, labels, position_ids, pixel_values, image_grid_thw,
    mm_token_type_ids}`` batches (:class:`lightning_moe.data.MedPixDataModule`).

    Args:
        model: the checkpoint (``{hf: <dir or hub id>, ...}``); always trained through transformers.
        optimizer, scheduler, seed, fp8, peft, freeze: as for :class:`CausalLM` (names are transformers' own).
        freeze_vision: keep the vision tower (without its projector) frozen.
        freeze_projector: keep the vision-to-text projector frozen.
        freeze_embeddings: keep the input token embeddings frozen.
    """

    hf_task = "image-text-to-text"

    def __init__(
        self,
        model: HFModelConfig,
        optimizer: OptimizerConfig | None = None,
        scheduler: SchedulerConfig | None = None,
        seed: int | None = None,
        fp8: Float8Config | None = None,
        peft: LoraConfig | None = None,
        freeze: list[str] | None = None,
        freeze_vision: bool = True,
        freeze_projector: bool = False,
        freeze_embeddings: bool = False,
    ) -> None:
        if not isinstance(model, HFModelConfig):
            raise ValueError("VisionLM trains transformers checkpoints: model must be {hf: <dir or hub id>, ...}")
        super().__init__(model=model, optimizer=optimizer, scheduler=scheduler, seed=seed, fp8=fp8, peft=peft,
                         freeze=freeze)
        self.freeze_vision, self.freeze_projector, self.freeze_embeddings = (
            freeze_vision, freeze_projector, freeze_embeddings)
        # CausalLM recorded its own arguments too: drop those this class does not take, so checkpoints rebuild it
        self.save_hyperparameters(ignore=["pretrained", "mtp_loss_scale"])

    def _route_hf(self) -> None:
        """Always through transformers: an architecture with a native family is text-only."""
        if self.model_config.native != "never" and native_checkpoint_dir(self.model_config) is not None:
            raise ValueError(f"model.hf={self.model_config.hf!r} is a text-only architecture; VisionLM trains "
                             f"image-text-to-text checkpoints (use CausalLM for this one)")

    def setup(self, stage: str) -> None:
        """Before any weight is read: the data module's processor must belong to the model."""
        super().setup(stage)
        processor = getattr(getattr(self.trainer, "datamodule", None), "processor", None)
        if processor is None:
            return
        from transformers import AutoConfig

        cfg = self.model_config
        config = AutoConfig.from_pretrained(resolve_model_dir(cfg), trust_remote_code=cfg.trust_remote_code)
        check_processor_matches(config, processor, cfg.hf)

    def _build_hf(self, strategy) -> HFModel:
        converters = hf_converters(self.fp8, self.peft, self.freeze)

        def convert(model: HFModel) -> None:
            if converters is not None:
                converters(model)
            freeze_vision_parts(model.hf, self.freeze_vision, self.freeze_projector, self.freeze_embeddings)

        return build_hf_model(self.model_config, task=self.hf_task, convert=convert,
                              parallelize=getattr(strategy, "parallelize", None), device=strategy.root_device,
                              seed=self.seed)

    def _model_inputs(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor | None, dict[str, Any]]:
        """Rotary positions (multimodal where the model has them) and the image inputs of ``batch``."""
        inputs = {k: v for k, v in batch.items() if k not in TEXT_KEYS}
        positions = batch.get("position_ids")
        if positions is not None and "mm_token_type_ids" in batch:
            positions = multimodal_position_ids(self.model.hf, batch["input_ids"], positions,
                                                batch["mm_token_type_ids"], batch.get("image_grid_thw"))
        return positions, inputs

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Logits of a batch (with its images): ``input_ids``, ``pixel_values``, ``image_grid_thw`` and, for packed
        rows, ``position_ids`` and ``mm_token_type_ids``, as the data module or the model's processor makes them."""
        positions, inputs = self._model_inputs(batch)
        return self.model(batch["input_ids"], positions, **inputs)

    def _loss_output(self, batch: dict[str, torch.Tensor]) -> tuple[LossOutput, int]:
        positions, inputs = self._model_inputs(batch)
        out = self.model(batch["input_ids"], positions, labels=batch["labels"], **inputs)
        return out, batch["input_ids"].numel()
