"""Tiny random transformers models of the DeepSeek-V3, GLM-4.5 and GPT-OSS families, and hub-layout extras
transformers does not write itself (DeepSeek-style MTP layers)."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

COMMON = dict(vocab_size=96, hidden_size=64, num_attention_heads=4)


def tiny_config(name: str):
    import transformers as t

    if name == "deepseek_v3":  # q LoRA, yarn with mscale, interleaved rope, group-limited routing
        rope = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16,
                "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 0.8, "mscale_all_dim": 0.6}
        return t.DeepseekV3Config(
            **COMMON, num_key_value_heads=4, num_hidden_layers=3, intermediate_size=96, moe_intermediate_size=32,
            n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, n_group=4, topk_group=2,
            first_k_dense_replace=1, routed_scaling_factor=2.5, q_lora_rank=32, kv_lora_rank=24,
            qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12, max_position_embeddings=64,
            rope_parameters=rope, rope_interleave=True,
        )
    if name == "moonlight":  # DeepSeek-V3 architecture without q LoRA, plain rope, biased projections
        return t.DeepseekV3Config(
            **COMMON, num_key_value_heads=4, num_hidden_layers=2, intermediate_size=96, moe_intermediate_size=32,
            n_routed_experts=4, n_shared_experts=2, num_experts_per_tok=2, n_group=1, topk_group=1,
            first_k_dense_replace=1, q_lora_rank=None, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8,
            v_head_dim=16, rope_interleave=False, attention_bias=True, norm_topk_prob=False,
        )
    if name == "glm4_moe":
        return t.Glm4MoeConfig(
            **COMMON, num_key_value_heads=2, head_dim=32, num_hidden_layers=3, intermediate_size=96,
            moe_intermediate_size=32, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
            first_k_dense_replace=1, use_qk_norm=True, attention_bias=True, routed_scaling_factor=1.5,
        )
    if name == "gpt_oss":  # widths are multiples of 32 so the experts can be stored as MXFP4
        return t.GptOssConfig(
            **COMMON, num_key_value_heads=2, head_dim=16, num_hidden_layers=2, intermediate_size=32,
            num_local_experts=4, num_experts_per_tok=2, sliding_window=5,
        )
    raise ValueError(name)


def build_tiny(name: str, seed: int = 0, config=None):
    """Random weights (and expert biases) large enough that routing and logits are not degenerate (``config``:
    another config of the family than ``tiny_config(name)``)."""
    import transformers as t

    torch.manual_seed(seed)
    model = t.AutoModelForCausalLM.from_config(config or tiny_config(name)).eval()
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0.0, 0.1)
        for buffer_name, buffer in model.named_buffers():
            if buffer_name.endswith("e_score_correction_bias"):
                buffer.normal_(0.0, 0.1)
    return model


def save_tiny(name: str, path: Path, dtype: torch.dtype = torch.float32, config=None) -> Path:
    build_tiny(name, config=config).to(dtype).save_pretrained(path)
    return path


def add_mtp_layer(hf_dir: Path, name: str, dtype: torch.dtype = torch.float32, seed: int = 1,
                  weight_copies: bool = True, config=None) -> dict[str, torch.Tensor]:
    """Write a DeepSeek-style MTP layer ``model.layers.{L}`` next to a saved tiny model, as the hub stores it:
    enorm, hnorm, eh_proj, one full decoder layer (here a transformers decoder layer), ``shared_head.norm`` and,
    with ``weight_copies`` (DeepSeek-V3, GLM-4.5; GLM-4.6 has none), copies of the embedding and output layer.
    Returns the tensors written."""
    import transformers as t
    from safetensors import safe_open

    config = config or tiny_config(name)
    layer_index = config.num_hidden_layers
    layer_cls = {"deepseek_v3": t.models.deepseek_v3.modeling_deepseek_v3.DeepseekV3DecoderLayer,
                 "glm4_moe": t.models.glm4_moe.modeling_glm4_moe.Glm4MoeDecoderLayer}[config.model_type]
    torch.manual_seed(seed)
    layer = layer_cls(config, layer_index)
    with safe_open(str(hf_dir / "model.safetensors"), "pt") as f:
        embed, head = f.get_tensor("model.embed_tokens.weight"), f.get_tensor("lm_head.weight")
    prefix = f"model.layers.{layer_index}"
    hidden = config.hidden_size
    tensors = {
        f"{prefix}.enorm.weight": 1 + 0.1 * torch.randn(hidden),
        f"{prefix}.hnorm.weight": 1 + 0.1 * torch.randn(hidden),
        f"{prefix}.eh_proj.weight": 0.1 * torch.randn(hidden, 2 * hidden),
        f"{prefix}.shared_head.norm.weight": 1 + 0.1 * torch.randn(hidden),
    }
    # the layer in hub layout: transformers' own save conversion unfuses its experts
    scratch = t.AutoModelForCausalLM.from_config(config)
    scratch.model.layers[0] = layer
    with torch.no_grad():
        for param in layer.parameters():
            param.normal_(0.0, 0.1)
    scratch.save_pretrained(hf_dir / "scratch")
    with safe_open(str(hf_dir / "scratch" / "model.safetensors"), "pt") as f:
        for key in f.keys():
            if key.startswith("model.layers.0."):
                tensors[prefix + key.removeprefix("model.layers.0")] = f.get_tensor(key)
    shutil.rmtree(hf_dir / "scratch")
    if weight_copies:
        tensors.update({f"{prefix}.embed_tokens.weight": embed.clone(), f"{prefix}.shared_head.head.weight": head.clone()})
    tensors = {k: v.to(dtype) for k, v in tensors.items()}
    save_file(tensors, str(hf_dir / "mtp.safetensors"), metadata={"format": "pt"})
    return tensors


# ---------------------------------------------------------------------------------------------- shared checks
TOL = 1e-4


def max_logit_diff(hf, native, ids: torch.Tensor) -> float:
    with torch.no_grad():
        return (native(ids) - hf(ids).logits).abs().max().item()


def max_packed_diff(hf, native, lengths: list[int], seed: int = 2) -> float:
    """One packed row against transformers run on each of its sequences alone."""
    gen = torch.Generator().manual_seed(seed)
    seqs = [torch.randint(0, hf.config.vocab_size, (n,), generator=gen) for n in lengths]
    packed = torch.cat(seqs)[None]
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    worst, start = 0.0, 0
    with torch.no_grad():
        got = native(packed, position_ids=positions)[0]
        for seq in seqs:
            alone = hf(seq[None]).logits[0]
            worst = max(worst, (got[start : start + len(seq)] - alone).abs().max().item())
            start += len(seq)
    return worst


def round_trip(hf_dir: Path, work: Path):
    """import -> export -> verify against the source directory."""
    from lightning_moe.checkpoint.convert import (
        export_hf_checkpoint,
        import_hf_checkpoint,
        verify_hf_checkpoints,
    )

    import_hf_checkpoint(hf_dir, work / "native")
    export_hf_checkpoint(work / "native", work / "export")
    return verify_hf_checkpoints(hf_dir, work / "export")


def check_bitwise_round_trip(name: str, work: Path, dtype: torch.dtype) -> Path:
    """A saved tiny model survives import -> export bitwise, and transformers loads the export with the same
    state. Returns the source directory."""
    import transformers

    from lightning_moe.io.safetensors_io import SafetensorsDir

    hf_dir = save_tiny(name, work / "hf", dtype)
    report = round_trip(hf_dir, work)
    assert report.ok, report.summary()
    assert report.tensors == len(SafetensorsDir(hf_dir).keys())
    original = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=dtype)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(work / "export", dtype=dtype)
    for (key, a), (_, b) in zip(original.state_dict().items(), reloaded.state_dict().items()):
        assert torch.equal(a, b), key
    return hf_dir
