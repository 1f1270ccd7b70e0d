"""Qwen-Image (``Qwen/Qwen-Image``): a dual-stream MMDiT (``QwenImageTransformer2DModel``) over 2x2 patches of a
16-channel VAE latent (``AutoencoderKLQwenImage``, 8x downsampling), conditioned on the last hidden states of a
Qwen2.5-VL text encoder.

The frozen parts run through diffusers' own ``QwenImagePipeline`` (built without its transformer): its prompt
template and the dropping of the template's first tokens (``encode_prompt``) and its latent packing. Latents are
the VAE posterior's mode (deterministic, so a cache and online encoding agree), normalized by the VAE config's
``latents_mean`` / ``latents_std`` as the pipeline undoes them before decoding.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from lightning_moe.models.diffusion.config import DiffusionModelConfig


class QwenImageEncoders:
    """The frozen VAE and text encoder: ``encode_images`` and ``encode_prompts``."""

    def __init__(self, directory: Path, cfg: DiffusionModelConfig, device: torch.device | str = "cpu") -> None:
        from diffusers import AutoencoderKLQwenImage, QwenImagePipeline
        from transformers import AutoTokenizer, Qwen2_5_VLForConditionalGeneration

        dtype = cfg.torch_encoder_dtype
        vae = AutoencoderKLQwenImage.from_pretrained(directory / "vae", torch_dtype=dtype)
        text_encoder = Qwen2_5_VLForConditionalGeneration.from_pretrained(directory / "text_encoder", dtype=dtype)
        tokenizer = AutoTokenizer.from_pretrained(directory / "tokenizer")
        for part in (vae, text_encoder):
            part.requires_grad_(False).eval().to(device)
        self.pipeline = QwenImagePipeline(scheduler=None, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer,
                                          transformer=None)
        self.directory, self.cfg, self.device, self.dtype = directory, cfg, torch.device(device), dtype
        mean = torch.tensor(vae.config.latents_mean, dtype=torch.float32)
        self.latents_mean = mean.view(1, -1, 1, 1).to(self.device)
        self.latents_std = torch.tensor(vae.config.latents_std, dtype=torch.float32).view(1, -1, 1, 1).to(self.device)

    def describe(self) -> dict[str, Any]:
        return {"family": "qwen_image", "pipeline": str(self.directory), "encoder_dtype": str(self.dtype),
                "max_sequence_length": self.cfg.max_sequence_length}

    @torch.no_grad()
    def encode_images(self, pixels: torch.Tensor) -> torch.Tensor:
        """``[B, 3, H, W]`` in [-1, 1] -> normalized latents ``[B, C, H / 8, W / 8]`` (float32)."""
        vae = self.pipeline.vae
        posterior = vae.encode(pixels.to(self.device, self.dtype)[:, :, None]).latent_dist
        latents = posterior.mode()[:, :, 0].float()
        return (latents - self.latents_mean) / self.latents_std

    @torch.no_grad()
    def encode_prompts(self, captions: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """Captions -> text states ``[B, L, D]`` (float32, zero-padded) and their mask ``[B, L]``."""
        embeds, mask = self.pipeline.encode_prompt(list(captions), device=self.device,
                                                   max_sequence_length=self.cfg.max_sequence_length)
        if mask is None:  # the pipeline drops an all-ones mask
            mask = torch.ones(embeds.shape[:2], dtype=torch.long, device=embeds.device)
        return embeds.float(), mask.long()


class QwenImageFamily:
    """What the training module needs of Qwen-Image: its transformer class, encoders, scheduler and call."""

    name = "qwen_image"

    def __init__(self, directory: Path, cfg: DiffusionModelConfig) -> None:
        import json

        self.directory, self.cfg = directory, cfg
        scheduler_file = directory / "scheduler" / "scheduler_config.json"
        self.scheduler_config = json.loads(scheduler_file.read_text()) if scheduler_file.is_file() else {}

    @property
    def transformer_dir(self) -> Path:
        return self.directory / "transformer"

    @property
    def transformer_class(self) -> type[nn.Module]:
        from diffusers import QwenImageTransformer2DModel

        return QwenImageTransformer2DModel

    @property
    def pipeline_class(self):
        from diffusers import QwenImagePipeline

        return QwenImagePipeline

    def encoders(self, device: torch.device | str = "cpu") -> QwenImageEncoders:
        return QwenImageEncoders(self.directory, self.cfg, device)

    @staticmethod
    def pack(latents: torch.Tensor) -> torch.Tensor:
        """``[B, C, h, w]`` -> ``[B, h / 2 * w / 2, 4 C]`` (the pipeline's 2x2 patch packing)."""
        from diffusers import QwenImagePipeline

        b, c, h, w = latents.shape
        return QwenImagePipeline._pack_latents(latents, b, c, h, w)

    @staticmethod
    def unused_parameters(transformer: nn.Module) -> list[str]:
        """Parameters no loss reaches: the last block's text-stream output (its ``to_add_out`` and text MLP),
        since only the image stream goes on to the output layer."""
        last = f"transformer_blocks.{len(transformer.transformer_blocks) - 1}."
        prefixes = (f"{last}attn.to_add_out.", f"{last}txt_mlp.")
        return [name for name, _ in transformer.named_parameters() if name.startswith(prefixes)]

    @staticmethod
    def image_tokens(latent_shape: tuple[int, ...]) -> int:
        return (latent_shape[-2] // 2) * (latent_shape[-1] // 2)

    @staticmethod
    def predict(transformer: nn.Module, packed: torch.Tensor, sigmas: torch.Tensor, prompt_embeds: torch.Tensor,
                prompt_mask: torch.Tensor, latent_hw: tuple[int, int]) -> torch.Tensor:
        """The velocity of packed noisy latents at noise levels ``sigmas [B]`` (the transformer's timestep)."""
        shapes = [[(1, latent_hw[0] // 2, latent_hw[1] // 2)]] * packed.shape[0]
        return transformer(hidden_states=packed, encoder_hidden_states=prompt_embeds,
                           encoder_hidden_states_mask=prompt_mask, timestep=sigmas, img_shapes=shapes,
                           return_dict=False)[0]

    @staticmethod
    def check_inputs(transformer_config: dict[str, Any], latent_channels: int, text_dim: int, where: str) -> None:
        """Latents and text states from ``where`` (a cache, the VAE) must fit the transformer (its config)."""
        expected = (transformer_config["in_channels"] // 4, transformer_config["joint_attention_dim"])
        if (latent_channels, text_dim) != expected:
            raise ValueError(f"{where}: latents with {latent_channels} channels and text states of width {text_dim}, "
                             f"but the transformer takes {expected[0]} latent channels (in_channels / 4) and "
                             f"joint_attention_dim {expected[1]}: was it encoded for another model?")

    @staticmethod
    def linear_flops(transformer_config: Any, image_tokens: int, text_tokens: int) -> float:
        """Forward FLOPs of one sample's linear layers: each stream's layers on that stream's tokens, the
        modulation layers (``dim -> 6 dim`` per stream and block) once per sample."""
        c = transformer_config
        dim = c.num_attention_heads * c.attention_head_dim
        joint = image_tokens + text_tokens
        # per block and stream: q, k, v, out (4 dim^2) and the 4x MLP (8 dim^2) per token; modulation per sample
        blocks = c.num_layers * (2 * 12 * dim * dim * joint + 2 * 2 * 6 * dim * dim)
        embed = 2 * (image_tokens * c.in_channels * dim + text_tokens * c.joint_attention_dim * dim)
        out = 2 * image_tokens * dim * (c.patch_size**2 * c.out_channels) + 2 * 2 * dim * dim  # proj_out, norm_out
        timestep = 2 * (256 * dim + dim * dim)  # the sinusoidal projection's two linears
        return float(blocks + embed + out + timestep)

    @staticmethod
    def attention_flops(transformer_config: Any, image_tokens: int, text_tokens: int) -> float:
        """Forward FLOPs of one sample's joint attention (QK^T and attention x V over image + text tokens)."""
        c = transformer_config
        joint = image_tokens + text_tokens
        return float(c.num_layers * 2 * 2 * joint * joint * c.num_attention_heads * c.attention_head_dim)

    @classmethod
    def flops_per_sample(cls, transformer_config: Any, image_tokens: int, text_tokens: int) -> float:
        """Forward FLOPs of one sample."""
        return (cls.linear_flops(transformer_config, image_tokens, text_tokens)
                + cls.attention_flops(transformer_config, image_tokens, text_tokens))
