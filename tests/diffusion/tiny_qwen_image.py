"""A tiny random Qwen-Image pipeline folder, as the hub's ``Qwen/Qwen-Image`` is laid out (``model_index.json``,
``transformer/``, ``vae/``, ``text_encoder/``, ``tokenizer/``, ``scheduler/``), built from configs offline: a
two-block ``QwenImageTransformer2DModel``, a small ``AutoencoderKLQwenImage`` (8x downsampling, 4 latent channels),
a two-layer Qwen2.5-VL text encoder with the shipped BPE tokenizer, and Qwen-Image's scheduler settings."""

from __future__ import annotations

from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
SAMPLE = REPO / "data" / "naruto_sample" / "train.parquet"
RESOLUTION = 32
Z_DIM = 4
TEXT_DIM = 32
# Qwen/Qwen-Image's scheduler_config.json
SCHEDULER = dict(base_image_seq_len=256, base_shift=0.5, invert_sigmas=False, max_image_seq_len=8192, max_shift=0.9,
                 num_train_timesteps=1000, shift=1.0, shift_terminal=0.02, stochastic_sampling=False,
                 time_shift_type="exponential", use_beta_sigmas=False, use_dynamic_shifting=True,
                 use_exponential_sigmas=False, use_karras_sigmas=False)


def tiny_transformer_config() -> dict:
    return dict(patch_size=2, in_channels=4 * Z_DIM, out_channels=Z_DIM, num_layers=2, attention_head_dim=16,
                num_attention_heads=2, joint_attention_dim=TEXT_DIM, axes_dims_rope=(4, 6, 6))


def save_tiny_qwen_image(path: Path, seed: int = 0) -> Path:
    import transformers as t
    from diffusers import (
        AutoencoderKLQwenImage,
        FlowMatchEulerDiscreteScheduler,
        QwenImagePipeline,
        QwenImageTransformer2DModel,
    )

    tokenizer = t.AutoTokenizer.from_pretrained(REPO / "data" / "tokenizer")
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    torch.manual_seed(seed)
    text = dict(vocab_size=4160, hidden_size=TEXT_DIM, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=1024,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
                pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
                eos_token_id=tokenizer.eos_token_id)
    vision = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=TEXT_DIM,
                  fullatt_block_indexes=[0], window_size=56, patch_size=14, spatial_merge_size=2)
    text_encoder = t.Qwen2_5_VLForConditionalGeneration(
        t.Qwen2_5_VLConfig(text_config=text, vision_config=vision, pad_token_id=tokenizer.pad_token_id,
                           bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)).float()
    vae = AutoencoderKLQwenImage(base_dim=8, z_dim=Z_DIM, dim_mult=[1, 2, 2, 2], num_res_blocks=1,
                                 temperal_downsample=[False, True, True], latents_mean=[0.1, -0.2, 0.3, 0.0],
                                 latents_std=[1.5, 0.8, 1.2, 1.0])
    transformer = QwenImageTransformer2DModel(**tiny_transformer_config())
    with torch.no_grad():  # diffusers zero-initializes some output layers: random everywhere, so gradients flow
        for param in transformer.parameters():
            param.normal_(0.0, 0.05)
    pipe = QwenImagePipeline(scheduler=FlowMatchEulerDiscreteScheduler(**SCHEDULER), vae=vae,
                             text_encoder=text_encoder, tokenizer=tokenizer, transformer=transformer)
    pipe.save_pretrained(path)
    return path
