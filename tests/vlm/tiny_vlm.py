"""A tiny random Qwen2.5-VL checkpoint with its tokenizer (the shipped BPE plus Qwen's vision tokens and a
Qwen2-VL-style chat template) and a small-image Qwen2-VL image processor, saved like a hub model directory."""

from __future__ import annotations

from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
SAMPLE = REPO / "data" / "medpix_sample"
VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
# Qwen2-VL's template, reduced to images and text (default system prompt, ChatML turns)
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    "{% endif %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'text' %}{{ content['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def save_tokenizer_and_image_processor(path: Path, patch_size: int = 14):
    """``patch_size``: 14 for Qwen2-VL / Qwen2.5-VL, 16 for Qwen3-VL."""
    import transformers as t

    tokenizer = t.AutoTokenizer.from_pretrained(REPO / "data" / "tokenizer")
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>", *VISION_TOKENS]})
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(path)
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    side = 2 * patch_size  # one merged token at least, six at most
    image_processor = Qwen2VLImageProcessorPil(min_pixels=side * side, max_pixels=9 * side * side,
                                               patch_size=patch_size)
    image_processor.save_pretrained(path)
    return tokenizer


def vlm_config(tokenizer, **overrides):
    import transformers as t

    ids = {name: tokenizer.convert_tokens_to_ids(token) for name, token in (
        ("vision_start_token_id", "<|vision_start|>"), ("vision_end_token_id", "<|vision_end|>"),
        ("image_token_id", "<|image_pad|>"), ("video_token_id", "<|video_pad|>"))}
    text = dict(vocab_size=4160, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=1024,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
                pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"))
    vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                  fullatt_block_indexes=[1], window_size=56, patch_size=14, spatial_merge_size=2, temporal_patch_size=2)
    special = {"bos_token_id": tokenizer.bos_token_id, "eos_token_id": text["eos_token_id"],
               "pad_token_id": tokenizer.pad_token_id}
    settings = {**ids, **special, "text_config": text, "vision_config": vision}
    return t.Qwen2_5_VLConfig(**{**settings, **overrides})


def qwen3_vl_config(tokenizer):
    """Qwen3-VL: 16-pixel patches, learned vision position embeddings, deepstack features merged into the first
    text layers, interleaved multimodal rotary sections."""
    import transformers as t

    base = vlm_config(tokenizer)
    text = dict(vocab_size=4160, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, max_position_embeddings=1024,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3],
                                 "mrope_interleaved": True},
                pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
                eos_token_id=base.text_config.eos_token_id)
    vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=16,
                  spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=64,
                  deepstack_visual_indexes=[0])
    ids = ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")
    return t.Qwen3VLConfig(text_config=text, vision_config=vision, **{k: getattr(base, k) for k in ids})


def qwen3_5_config(tokenizer):
    """Qwen3.5: a Qwen3-VL-style vision tower over gated-delta-net and gated full-attention layers; transformers
    registers both a causal-LM class (text only) and an image-text-to-text class for its model type."""
    import transformers as t

    base = qwen3_vl_config(tokenizer)
    text = dict(vocab_size=4160, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, linear_num_value_heads=4, linear_num_key_heads=2,
                linear_key_head_dim=16, linear_value_head_dim=16, layer_types=["linear_attention", "full_attention"],
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3],
                                 "mrope_interleaved": True, "partial_rotary_factor": 1.0},
                pad_token_id=tokenizer.pad_token_id, eos_token_id=base.text_config.eos_token_id)
    vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=16,
                  spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=64)
    ids = ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")
    return t.Qwen3_5Config(text_config=text, vision_config=vision, **{k: getattr(base, k) for k in ids})


def save_tiny_vlm(path: Path, seed: int = 0, family: str = "qwen2_5_vl", **config_overrides) -> Path:
    """A random ``family`` model (``qwen2_5_vl``, ``qwen3_vl`` or ``qwen3_5``) with its tokenizer and image
    processor."""
    import transformers as t

    tokenizer = save_tokenizer_and_image_processor(path, patch_size=14 if family == "qwen2_5_vl" else 16)
    torch.manual_seed(seed)
    if family == "qwen3_vl":
        model = t.Qwen3VLForConditionalGeneration(qwen3_vl_config(tokenizer)).float()
    elif family == "qwen3_5":
        model = t.Qwen3_5ForConditionalGeneration(qwen3_5_config(tokenizer)).float()
    else:
        model = t.Qwen2_5_VLForConditionalGeneration(vlm_config(tokenizer, **config_overrides)).float()
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0.0, 0.05)
    model.save_pretrained(path)
    return path
