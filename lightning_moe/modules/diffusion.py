"""``DiffusionModule``: rectified-flow fine-tuning of a diffusers transformer (Qwen-Image) under Lightning.

The VAE and text encoder are frozen: they encode a batch's images and captions on the fly (online data), or not at
all when the data module reads a latent cache. The transformer trains fully (fp32 master weights, FSDP2's
``param_dtype`` for compute) or through LoRA adapters (peft), with the same ``ParallelStrategy`` (FSDP2/HSDP,
activation checkpointing, compile), optimizer, schedule and callbacks as the language models. Noise, timesteps and
condition dropout follow :mod:`lightning_moe.models.diffusion.flow_matching`.

The loss of a micro-batch is the mean over its samples of the weighted mean squared velocity error; Lightning's
gradient accumulation and FSDP's mean over data-parallel ranks make each step's gradient that of the global batch's
mean (micro-batches hold equal sample counts). At the end of ``fit`` the result is written to ``export_dir``: the
transformer in diffusers' format (full fine-tuning) or the adapters as diffusers' ``pytorch_lora_weights.safetensors``
(LoRA).

YAML::

    model:
      class_path: lightning_moe.DiffusionModule
      init_args:
        model: {path: Qwen/Qwen-Image}
        flow_matching: {timestep_density: logit_normal, condition_dropout: 0.1}
        export_dir: runs/qwen_image/export
    data:
      class_path: lightning_moe.TextToImageDataModule
      init_args: {dataset: lambdalabs/naruto-blip-captions, resolution: 1024}
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist

from lightning_moe.checkpoint.diffusion_export import export_lora, export_transformer
from lightning_moe.data.latent_cache import pad_prompts
from lightning_moe.models.converters import apply_converters
from lightning_moe.models.diffusion.config import DiffusionModelConfig
from lightning_moe.models.diffusion.family import load_family
from lightning_moe.models.diffusion.flow_matching import (
    FlowMatchingConfig,
    draw_sample,
    loss_weights,
    noisy_latents,
    sample_generator,
)
from lightning_moe.models.diffusion.transformer import build_diffusion_transformer
from lightning_moe.modules.clipping import clip_gradients
from lightning_moe.modules.optim import OptimizerConfig, SchedulerConfig, build_adamw, build_scheduler
from lightning_moe.modules.step_stats import StepStats
from lightning_moe.peft import LoraConfig, keep_checkpoints_adapter_only
from lightning_moe.seeds import seed_in_force


class DiffusionModule(L.LightningModule):
    """A text-to-image diffusion transformer trained on :class:`lightning_moe.TextToImageDataModule` batches.

    Args:
        model: the diffusers pipeline (``{path: <folder or hub id>}``).
        optimizer: AdamW settings.
        scheduler: warmup + decay settings.
        flow_matching: timestep density and shift, loss weighting, condition dropout.
        seed: seed of the adapters' initialization and of every sample's noise and timestep; default: the
            ``seed_everything`` seed, else 0.
        peft: LoRA adapters on the transformer (names are diffusers' own: ``to_q``, ``attn.add_k_proj``,
            ``transformer_blocks.*.img_mlp.net.2``); only they train.
        freeze: regular expressions of transformer parameter names kept frozen (full fine-tuning).
        export_dir: where ``fit`` writes the result at its end (none: no export).
        export_dtype: dtype of the exported transformer (null: the training dtype, float32).
    """

    throughput_unit = "images"  # what Throughput counts per second and GPU (see throughput_counts)

    def __init__(
        self,
        model: DiffusionModelConfig,
        optimizer: OptimizerConfig | None = None,
        scheduler: SchedulerConfig | None = None,
        flow_matching: FlowMatchingConfig | None = None,
        seed: int | None = None,
        peft: LoraConfig | None = None,
        freeze: list[str] | None = None,
        export_dir: str | None = None,
        export_dtype: str | None = "bfloat16",
    ) -> None:
        super().__init__()
        if not isinstance(model, DiffusionModelConfig):
            raise ValueError("DiffusionModule: model must be a DiffusionModelConfig ({path: <pipeline folder or hub "
                             "id>})")
        if export_dtype is not None and not isinstance(getattr(torch, export_dtype, None), torch.dtype):
            raise ValueError(f"export_dtype={export_dtype!r} is not a torch dtype (bfloat16, float32) or null")
        self.save_hyperparameters()
        self.model_config = model
        self.optimizer_config = optimizer or OptimizerConfig(weight_decay=0.0)
        self.scheduler_config = scheduler or SchedulerConfig(decay_style="constant")
        self.flow_matching = flow_matching or FlowMatchingConfig()
        self.own_seed, self.peft, self.freeze = seed, peft, freeze
        self.seed = seed_in_force(seed, 0)  # settled again in setup, once every rank is up
        self.export_dir, self.export_dtype = export_dir, export_dtype
        if peft is not None:
            # checkpoints hold the adapters only: the frozen transformer comes from the pipeline on resume
            keep_checkpoints_adapter_only(self)
        self.model = None
        self.family = None
        self.step_stats: StepStats | None = None
        self._encoders = None  # frozen VAE + text encoder (not submodules: never sharded, saved or optimized)
        self._empty_prompt: torch.Tensor | None = None
        self._step_sums: list[torch.Tensor] = []
        self._batch_counts = (0, 0, 0, 0.0)
        self._trainable_fraction: float | None = None

    # ------------------------------------------------------------------ construction
    def _load_family(self):
        if self.family is None:
            self.family = load_family(self.model_config)
        return self.family

    def setup(self, stage: str) -> None:
        """Before any weight is read: a latent cache must have been encoded for this transformer."""
        self.seed = seed_in_force(self.own_seed, 0, self.trainer)
        family = self._load_family()
        data = getattr(getattr(self, "_trainer", None), "datamodule", None)
        meta = getattr(data, "cache_metadata", None) if data is not None else None
        if meta is None and data is not None and getattr(data, "cached", False):
            data.setup(stage)
            meta = data.cache_metadata
        if meta is not None:
            config = family.transformer_class.load_config(family.transformer_dir)
            family.check_inputs(config, meta["latent_shape"][0], meta["text_dim"],
                                f"latent cache {data.cache_dir}")

    def configure_model(self) -> None:
        if self.model is not None:
            return

        strategy = self.trainer.strategy
        convert = None
        if self.peft is not None or self.freeze:
            def convert(transformer):
                apply_converters(transformer, None, self.peft, self.freeze)

        self.model = build_diffusion_transformer(
            self._load_family(), convert=convert, parallelize=getattr(strategy, "parallelize", None),
            device=strategy.root_device, seed=self.seed)

    def encoders(self):
        """The frozen VAE and text encoder, loaded on first use (online batches, the empty caption)."""
        if self._encoders is None:
            self._encoders = self._load_family().encoders(self.device)
        return self._encoders

    # ------------------------------------------------------------------ inputs
    def encode_batch(self, batch: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(latents [B, C, h, w], prompt_embeds [B, L, D], prompt_mask [B, L])`` of a cached or online batch."""
        if "latents" in batch:
            return batch["latents"].float(), batch["prompt_embeds"].float(), batch["prompt_mask"]
        encoders = self.encoders()
        latents = encoders.encode_images(batch["pixel_values"])
        embeds, mask = encoders.encode_prompts(batch["captions"])
        return latents, embeds.to(self.device), mask.to(self.device)

    def empty_prompt(self) -> torch.Tensor:
        """Text states of the empty caption: the cache's, else encoded once."""
        if self._empty_prompt is None:
            data = getattr(self.trainer, "datamodule", None)
            cached = getattr(data, "empty_prompt_embeds", None)
            if cached is None:
                embeds, mask = self.encoders().encode_prompts([""])
                cached = embeds[0, : int(mask[0].sum())]
            self._empty_prompt = cached.float().to(self.device)
        return self._empty_prompt

    def drop_conditions(self, embeds: torch.Tensor, mask: torch.Tensor,
                        drop: list[bool]) -> tuple[torch.Tensor, torch.Tensor]:
        """The empty caption's states in place of the rows marked in ``drop`` (classifier-free guidance)."""
        empty = self.empty_prompt()
        rows = [empty if d else e[: int(m.sum())] for e, m, d in zip(embeds, mask, drop)]
        return pad_prompts(rows)

    def flow_inputs(self, batch: dict[str, Any]) -> dict[str, torch.Tensor]:
        """The transformer inputs and velocity targets of a batch, with this step's per-sample noise draws."""
        latents, embeds, mask = self.encode_batch(batch)
        family, step = self._load_family(), self.trainer.global_step if self._trainer is not None else 0
        image_tokens = family.image_tokens(latents.shape)
        draws = [draw_sample(sample_generator(self.seed, step, int(i)), self.flow_matching, family.scheduler_config,
                             tuple(latents.shape[1:]), image_tokens) for i in batch["index"].tolist()]
        noise = torch.stack([d[0] for d in draws]).to(latents.device, latents.dtype)
        sigmas = torch.stack([d[1] for d in draws]).to(latents.device, torch.float32)
        drop = [d[2] for d in draws]
        if any(drop):
            embeds, mask = self.drop_conditions(embeds, mask, drop)
        noisy, target = noisy_latents(latents, noise, sigmas)
        return {"packed": family.pack(noisy), "target": family.pack(target), "sigmas": sigmas,
                "prompt_embeds": embeds, "prompt_mask": mask, "latent_hw": tuple(latents.shape[-2:])}

    def forward(self, packed: torch.Tensor, sigmas: torch.Tensor, prompt_embeds: torch.Tensor,
                prompt_mask: torch.Tensor, latent_hw: tuple[int, int]) -> torch.Tensor:
        """The predicted velocity (packed, as the transformer returns it)."""
        return self.model(packed, sigmas, prompt_embeds, prompt_mask, latent_hw)

    def loss(self, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        """Per-sample weighted mean squared velocity error ``[B]``."""
        pred = self(inputs["packed"], inputs["sigmas"], inputs["prompt_embeds"], inputs["prompt_mask"],
                    inputs["latent_hw"])
        error = (pred.float() - inputs["target"].float()).pow(2).flatten(1).mean(dim=1)
        return loss_weights(self.flow_matching, inputs["sigmas"]).to(error) * error

    # ------------------------------------------------------------------ steps
    def training_step(self, batch: dict[str, Any], batch_idx: int) -> torch.Tensor:
        inputs = self.flow_inputs(batch)
        per_sample = self.loss(inputs)
        text_tokens = inputs["prompt_mask"].sum(dim=1)
        self._step_sums.append(torch.stack([per_sample.detach().sum().double(),
                                            torch.full((), per_sample.numel(), dtype=torch.float64,
                                                       device=per_sample.device),
                                            text_tokens.sum().double()]))
        self._batch_counts = self._count(inputs["packed"].shape[1], text_tokens.tolist())
        return per_sample.mean()

    def _count(self, image_tokens: int, text_tokens: list[int]) -> tuple[int, int, int, float]:
        """``(images, tokens, image tokens, model FLOPs)`` of a micro-batch: tokens are every image's patches and
        the valid caption tokens it attends with; FLOPs are forward, input gradients and the weight gradients of
        the trainable share of the parameters (as the language models count them)."""
        if self._trainable_fraction is None:
            params = list(self.model.parameters())
            total = max(sum(p.numel() for p in params), 1)
            self._trainable_fraction = sum(p.numel() for p in params if p.requires_grad) / total
        family, config = self._load_family(), self.model.config
        flops = sum((2.0 + self._trainable_fraction) * family.flops_per_sample(config, image_tokens, t)
                    for t in text_tokens)
        images = len(text_tokens)
        return images, images * image_tokens + sum(text_tokens), images * image_tokens, flops

    def throughput_counts(self, batch: dict[str, Any]) -> tuple[int, int, int, float]:
        """What :class:`~lightning_moe.Throughput` counts for the micro-batch just trained: ``(images, tokens,
        image tokens, model FLOPs)`` (see ``_count``)."""
        return self._batch_counts

    def _loss_group(self):
        strategy = self.trainer.strategy
        if hasattr(strategy, "loss_reduction_group"):
            return strategy.loss_reduction_group
        return dist.group.WORLD if dist.is_available() and dist.is_initialized() else None

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        totals = torch.stack(self._step_sums).sum(dim=0)
        self._step_sums = []
        group = self._loss_group()
        if group is not None:
            dist.all_reduce(totals, group=group)
        loss_sum, images, text_tokens = totals.tolist()
        loss = loss_sum / max(images, 1.0)
        self.log("train/loss", loss, prog_bar=True, rank_zero_only=True)
        self.log("train/lr", optimizer.param_groups[0]["lr"], rank_zero_only=True)
        image_tokens = int(images) * (self._batch_counts[2] // max(self._batch_counts[0], 1))
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        self.step_stats = StepStats(step=self.trainer.global_step + 1, loss=loss,
                                    tokens=image_tokens + int(text_tokens), label_tokens=image_tokens,
                                    skipped=not grads)

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None) -> None:
        clip_gradients(self, gradient_clip_val, gradient_clip_algorithm)

    def configure_optimizers(self):
        optimizer = build_adamw(self.model, self.optimizer_config)
        scheduler = build_scheduler(optimizer, self.scheduler_config, self.optimizer_config.lr,
                                    int(self.trainer.max_steps or 0))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    # ------------------------------------------------------------------ export
    def export(self, out: str | Path, overwrite: bool = True) -> Path | None:
        """The trained transformer in diffusers' format, or (LoRA) its adapters as diffusers' LoRA file.
        Collective: call on every rank; rank 0 writes (atomically). Returns the folder on rank 0."""
        if self.peft is not None:
            return export_lora(self.model, out, self.peft, overwrite=overwrite)
        dtype = getattr(torch, self.export_dtype) if self.export_dtype else None
        return export_transformer(self.model, out, dtype=dtype, overwrite=overwrite)

    def on_fit_end(self) -> None:
        if self.export_dir is not None:
            self.export(self.export_dir)


torch.serialization.add_safe_globals([DiffusionModelConfig, FlowMatchingConfig])
