"""Tiny random transformers models of every natively supported dense/MoE family, saved to disk."""

from __future__ import annotations

from pathlib import Path

import torch

COMMON = dict(vocab_size=160, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)


def tiny_config(family: str):
    import transformers as t

    if family == "llama":
        rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 16}
        return t.LlamaConfig(**COMMON, intermediate_size=96, rope_parameters=rope)
    if family == "llama_tied_bias":
        return t.LlamaConfig(**COMMON, intermediate_size=96, tie_word_embeddings=True, attention_bias=True, mlp_bias=True)
    if family == "qwen2":
        return t.Qwen2Config(**COMMON, intermediate_size=96)
    if family == "qwen3":
        return t.Qwen3Config(**COMMON, intermediate_size=96, head_dim=32)
    if family == "qwen3_moe":
        return t.Qwen3MoeConfig(**COMMON, intermediate_size=96, moe_intermediate_size=32, head_dim=16,
                                num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[0])
    if family == "mixtral":
        return t.MixtralConfig(**COMMON, intermediate_size=48, num_local_experts=4, num_experts_per_tok=2)
    raise ValueError(family)


FAMILIES = ["llama", "llama_tied_bias", "qwen2", "qwen3", "qwen3_moe", "mixtral"]


def build_tiny(family: str, seed: int = 0):
    """A random transformers model with weights large enough that routing and logits are not degenerate."""
    return random_model(tiny_config(family), seed)


def random_model(config, seed: int = 0):
    """The causal LM of ``config`` initialized as :func:`build_tiny`'s."""
    import transformers as t

    torch.manual_seed(seed)
    model = t.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0.0, 0.1)
    return model


def save_tiny(family: str, path: Path, dtype: torch.dtype = torch.float32, **save_kwargs) -> Path:
    model = build_tiny(family).to(dtype)
    model.save_pretrained(path, **save_kwargs)
    return path


def save_nemotron_h_twin(path: Path) -> Path:
    """A Hugging Face Nemotron-H directory (hub layout, with its MTP depth) of the Nemotron-H pretraining twin's
    model (configs/tiny/nemotron_h_pretrain.yaml), as the LoRA and SFT twins expect."""
    import yaml

    from lightning_moe.checkpoint.convert import export_model
    from lightning_moe.models.config import ModelConfig
    from lightning_moe.models.decoder import Decoder

    recipe = Path(__file__).resolve().parents[1] / "configs" / "tiny" / "nemotron_h_pretrain.yaml"
    spec = yaml.safe_load(recipe.read_text())["model"]["init_args"]["model"]
    torch.manual_seed(0)
    model = Decoder(ModelConfig.from_dict(spec))
    model.init_weights()
    return export_model(model, path)
