"""A tiny MiMo-V2 (``mimo_v2``) hub checkpoint and the reference model it is checked against.

``mimo_v2`` is not in transformers 5.24, but the network is transformers' ``mimo_v2_flash`` (the reference here)
with another config and checkpoint layout. :func:`save_mimo_v2` writes a random ``MiMoV2FlashForCausalLM`` in the
``mimo_v2`` hub layout as the public inference engines read it (vLLM's and SGLang's ``mimo_v2``, AutoModel's
``mimo_v25``): config keys ``hybrid_layer_pattern`` / ``moe_layer_freq`` / ``swa_*``, a fused ``qkv_proj`` whose rows
are ``num_key_value_heads`` shards ``[q_s | k_s | v_s]``, and MTP layers ``model.mtp.layers.{d}`` that transformers does
not have. Each MTP layer's reference is plain torch around a one-layer ``MiMoV2FlashModel`` (a sliding-window
attention layer with a dense MLP, its final norm the MTP layer's ``final_layernorm``), as vLLM's ``mimo_v2_mtp``
describes it: ``eh_proj([enorm(embed(token ahead)) | hnorm(previous)])``.

The tiny config keeps the published config's structure (``XiaomiMiMo/MiMo-V2.6-Flash-RL``): full attention first,
sliding windows with sinks after it, a dense first MLP then MoE, value heads narrower than query/key heads, scaled
values, partial rotary, a sigmoid router with a selection bias and no shared expert, MTP depths.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

VOCAB, HIDDEN, HEADS, KV, HEAD_DIM, V_DIM, WINDOW = 96, 64, 4, 2, 24, 16, 5
THETA, SWA_THETA, ROTARY, VALUE_SCALE = 1.0e6, 1.0e4, 0.334, 0.707
LAYER_TYPES = ["full_attention", "sliding_attention", "sliding_attention"]
MLP_TYPES = ["dense", "sparse", "sparse"]
MTP_DEPTHS = 2


def flash_config(layer_types=LAYER_TYPES, mlp_types=MLP_TYPES, vocab: int = VOCAB):
    import transformers

    rope = {kind: {"rope_type": "default", "rope_theta": theta, "partial_rotary_factor": ROTARY}
            for kind, theta in (("full_attention", THETA), ("sliding_attention", SWA_THETA))}
    return transformers.MiMoV2FlashConfig(
        vocab_size=vocab, hidden_size=HIDDEN, intermediate_size=96, moe_intermediate_size=32,
        num_hidden_layers=len(layer_types), num_attention_heads=HEADS, num_key_value_heads=KV, head_dim=HEAD_DIM,
        v_head_dim=V_DIM, n_routed_experts=8, num_experts_per_tok=2, layer_types=list(layer_types),
        mlp_layer_types=list(mlp_types), rope_parameters=rope, sliding_window=WINDOW,
        attention_value_scale=VALUE_SCALE, rms_norm_eps=1e-6, max_position_embeddings=64,
    )


def _randomized(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Weights large enough that routing, sinks and logits are not degenerate."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.normal_(1.0 if name.endswith("norm.weight") else 0.0, 0.1)
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.normal_(0.0, 0.1)
    return model.eval()


def reference_model(seed: int = 0, vocab: int = VOCAB):
    import transformers

    return _randomized(transformers.AutoModelForCausalLM.from_config(flash_config(vocab=vocab)), seed)


class ReferenceMTP(torch.nn.Module):
    """One MTP layer as the hub holds it, on transformers' modules."""

    def __init__(self, seed: int) -> None:
        import transformers

        super().__init__()
        torch.manual_seed(seed)
        self.enorm = torch.nn.Parameter(1 + 0.1 * torch.randn(HIDDEN))
        self.hnorm = torch.nn.Parameter(1 + 0.1 * torch.randn(HIDDEN))
        self.eh_proj = torch.nn.Linear(2 * HIDDEN, HIDDEN, bias=False)
        torch.nn.init.normal_(self.eh_proj.weight, std=0.1)
        self.layer = _randomized(transformers.MiMoV2FlashModel(flash_config(["sliding_attention"], ["dense"])), seed)
        del self.layer.embed_tokens  # the MTP layer shares the backbone's embedding

    @staticmethod
    def rms(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
        return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))

    def forward(self, embedded: torch.Tensor, previous: torch.Tensor) -> torch.Tensor:
        h = self.eh_proj(torch.cat([self.rms(embedded, self.enorm), self.rms(previous, self.hnorm)], dim=-1))
        return self.layer(inputs_embeds=h).last_hidden_state

    def hub_tensors(self, prefix: str) -> dict[str, torch.Tensor]:
        tensors = {f"{prefix}.enorm.weight": self.enorm, f"{prefix}.hnorm.weight": self.hnorm,
                   f"{prefix}.eh_proj.weight": self.eh_proj.weight, f"{prefix}.final_layernorm.weight": self.layer.norm.weight}
        renames = {"post_attention_layernorm": "pre_mlp_layernorm", "self_attn.sinks": "self_attn.attention_sink_bias"}
        for name, tensor in self.layer.layers[0].state_dict().items():
            for theirs, hub in renames.items():
                name = name.replace(theirs, hub)
            tensors[f"{prefix}.{name}"] = tensor
        return {k: v.detach().clone() for k, v in tensors.items()}


def mtp_losses(model, depths: list[ReferenceMTP], ids: torch.Tensor) -> list[torch.Tensor]:
    """Summed cross entropy of each MTP depth on one unpacked row batch: depth ``d`` (from 1) at position ``t``
    predicts token ``t + d + 1`` from the previous depth's output and the embedding of token ``t + d``."""
    previous = model.model(ids).last_hidden_state
    losses = []
    for d, depth in enumerate(depths, start=1):
        ahead = torch.cat([ids[:, d:], torch.zeros_like(ids[:, :d])], dim=1)
        previous = depth(model.model.embed_tokens(ahead), previous)
        logits = model.lm_head(previous)[:, : ids.shape[1] - d - 1]
        target = ids[:, d + 1 :]
        losses.append(torch.nn.functional.cross_entropy(logits.flatten(0, 1), target.flatten(), reduction="sum"))
    return losses


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, shards: int) -> torch.Tensor:
    """The hub's fused rows: shard ``s`` is ``[q_s | k_s | v_s]`` (written here from the description, without the
    family's maps)."""
    return torch.cat([torch.cat([q.chunk(shards)[s], k.chunk(shards)[s], v.chunk(shards)[s]]) for s in range(shards)])


def mimo_v2_hub_config(dtype: torch.dtype, depths: int = MTP_DEPTHS, fused: bool = True, vocab: int = VOCAB) -> dict:
    """config.json in the published V2.6-Flash config's keys."""
    sliding = [int(t == "sliding_attention") for t in LAYER_TYPES]
    return {
        "architectures": ["MiMoV2ForCausalLM"], "model_type": "mimo_v2", "vocab_size": vocab, "hidden_size": HIDDEN,
        "intermediate_size": 96, "moe_intermediate_size": 32, "num_hidden_layers": len(LAYER_TYPES),
        "num_attention_heads": HEADS, "num_key_value_heads": KV, "head_dim": HEAD_DIM, "v_head_dim": V_DIM,
        "swa_num_attention_heads": HEADS, "swa_num_key_value_heads": 2 * KV, "swa_head_dim": HEAD_DIM,
        "swa_v_head_dim": V_DIM, "rope_theta": THETA, "swa_rope_theta": SWA_THETA, "partial_rotary_factor": ROTARY,
        "attention_value_scale": VALUE_SCALE, "attention_projection_layout": "fused_qkv" if fused else "split",
        "add_full_attention_sink_bias": False, "add_swa_attention_sink_bias": True, "attention_bias": False,
        "sliding_window": WINDOW, "sliding_window_size": WINDOW, "hybrid_layer_pattern": sliding,
        "moe_layer_freq": [int(t == "sparse") for t in MLP_TYPES], "n_routed_experts": 8, "num_experts_per_tok": 2,
        "n_shared_experts": None, "scoring_func": "sigmoid", "topk_method": "noaux_tc", "n_group": 1, "topk_group": 1,
        "norm_topk_prob": True, "routed_scaling_factor": None, "num_nextn_predict_layers": depths,
        "layernorm_epsilon": 1e-6, "max_position_embeddings": 64, "hidden_act": "silu", "tie_word_embeddings": False,
        "torch_dtype": str(dtype).removeprefix("torch."),
    }


def hub_tensors(model, depths: list[ReferenceMTP], fused: bool = True) -> dict[str, torch.Tensor]:
    """The model's and the MTP layers' tensors in the ``mimo_v2`` hub layout (transformers' own save conversion
    writes the per-expert tensors)."""
    import tempfile

    from safetensors.torch import load_file

    with tempfile.TemporaryDirectory() as scratch:
        model.save_pretrained(scratch)
        tensors = load_file(Path(scratch) / "model.safetensors")
    for d, depth in enumerate(depths):
        tensors.update(depth.hub_tensors(f"model.mtp.layers.{d}"))
    if fused:
        for name in [n for n in tensors if n.endswith("self_attn.q_proj.weight")]:
            prefix = name.removesuffix("q_proj.weight")
            q, k, v = (tensors.pop(f"{prefix}{p}_proj.weight") for p in "qkv")
            tensors[f"{prefix}qkv_proj.weight"] = fuse_qkv(q, k, v, KV)
    return {k: v.contiguous() for k, v in tensors.items()}


def save_mimo_v2(path: Path, dtype: torch.dtype = torch.float32, depths: int = MTP_DEPTHS, fused: bool = True,
                 seed: int = 0, vocab: int = VOCAB):
    """Writes the hub directory; returns (transformers reference model, reference MTP layers)."""
    model = reference_model(seed, vocab)
    layers = [ReferenceMTP(seed + 1 + d) for d in range(depths)]
    path.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.to(dtype) for k, v in hub_tensors(model, layers, fused).items()}
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(mimo_v2_hub_config(dtype, depths, fused, vocab), indent=2))
    return model, layers
