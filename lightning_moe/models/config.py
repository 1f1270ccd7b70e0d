"""Model configuration: one dataclass tree that describes every supported architecture.

A model is a *layer pattern* over a small set of blocks (see DESIGN "One decoder, many families"): each
symbol is one pre-norm residual block of the kind whose record (``models/blocks.py``) has that symbol, so
Llama's 4 layers are ``"*-*-*-*-"`` and a Nemotron-H pattern such as ``"MEM*E"`` maps one symbol to one hub
layer. The records also say which sub-config a kind reads and what else it needs of the config. Family files
translate Hugging Face configs into this tree; nothing here knows about any particular hub checkpoint.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal


@dataclass
class RopeConfig:
    """Rotary position embedding. ``type``: default | llama3 | yarn | none (no positional embedding)."""

    type: Literal["default", "llama3", "yarn", "none"] = "default"
    theta: float = 10000.0
    factor: float = 1.0
    # llama3 scaling
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int | None = None
    # yarn scaling
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True
    # rotate only the first ``partial_rotary_factor`` of each head (GLM)
    partial_rotary_factor: float = 1.0
    # pairs (0,1),(2,3)... instead of halves (DeepSeek's rope_interleave)
    interleave: bool = False


@dataclass
class AttentionConfig:
    """Attention mixer. ``type="gqa"`` covers MHA/GQA/MQA; ``type="mla"`` is DeepSeek's latent attention."""

    type: Literal["gqa", "mla"] = "gqa"
    num_heads: int = 8
    num_kv_heads: int = 8
    head_dim: int = 64
    qkv_bias: bool = False
    out_bias: bool = False
    qk_norm: bool = False
    # learned per-head sink logits that take part in the softmax (GPT-OSS)
    sinks: bool = False
    # sigmoid gate on each head's output from a second half of q_proj, per head [query | gate] (Qwen3-Next)
    output_gate: bool = False
    sliding_window: int | None = None
    # per attention block (in pattern order): True = use ``sliding_window``; None = every block uses it
    sliding_window_layers: list[bool] | None = None
    softmax_scale: float | None = None
    rope: RopeConfig = field(default_factory=RopeConfig)
    backend: Literal["sdpa", "flex", "te"] = "sdpa"
    # MLA (DeepSeek-V3)
    q_lora_rank: int | None = None
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    # MLA's value width; with GQA, value heads narrower than the query/key heads (MiMo-V2), 0 = head_dim
    v_head_dim: int = 0
    # values multiplied by this before attention (MiMo-V2's attention_value_scale)
    value_scale: float = 1.0
    # epsilon of MLA's latent norms (q_a_norm, kv_a_norm) when it differs from ModelConfig.norm_eps
    latent_norm_eps: float | None = None

    @property
    def value_dim(self) -> int:
        """Width of one GQA value head."""
        return self.v_head_dim or self.head_dim

    def window_for(self, attention_index: int) -> int | None:
        """Sliding window of the ``attention_index``-th attention block, or None for full attention. The MTP
        pattern's attention blocks are numbered after the backbone's (every depth shares their entries); a list
        without entries for them leaves them full."""
        if self.sliding_window is None:
            return None
        if self.sliding_window_layers is None:
            return self.sliding_window
        layers = self.sliding_window_layers
        return self.sliding_window if attention_index < len(layers) and layers[attention_index] else None


@dataclass
class MLPConfig:
    """Dense feed-forward. ``activation``: swiglu (gated SiLU) | relu2 (squared ReLU, ungated)."""

    intermediate_size: int = 1024
    activation: Literal["swiglu", "relu2"] = "swiglu"
    bias: bool = False


@dataclass
class MoEConfig:
    """Mixture of experts with stacked expert weights."""

    num_experts: int = 8
    top_k: int = 2
    intermediate_size: int = 512
    # swiglu | relu2 | swiglu_clamped (GPT-OSS: clamp, sigmoid(alpha*g)*g*(u+1))
    activation: Literal["swiglu", "relu2", "swiglu_clamped"] = "swiglu"
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    expert_bias: bool = False  # biases inside the expert linears (GPT-OSS)
    num_shared_experts: int = 0
    # shared experts' output scaled by sigmoid(a learned linear of the token) (Qwen3-Next, Qwen2-MoE)
    shared_expert_gate: bool = False
    shared_intermediate_size: int | None = None  # default: intermediate_size * num_shared_experts
    router_bias: bool = False  # bias of the router linear (GPT-OSS)
    score_func: Literal["softmax", "sigmoid"] = "softmax"
    n_group: int = 1  # group-limited top-k: experts split in n_group groups,
    topk_group: int = 1  # of which topk_group are kept per token
    norm_topk_prob: bool = False
    routed_scaling_factor: float = 1.0
    # aux-loss-free balancing: a bias added to the scores for expert *selection* only
    score_correction_bias: bool = False
    bias_update_rate: float = 0.0
    aux_loss_coeff: float = 0.0
    force_balanced: bool = False  # benchmarks: round-robin routing, ignores the router's choice
    latent_size: int | None = None  # Nemotron LatentMoE: experts run in a smaller latent width
    shared_latent_bias: bool = False  # biases in the shared experts and latent projections (Nemotron-H mlp_bias)
    backend: Literal["grouped_mm", "loop"] = "grouped_mm"

    @property
    def shared_size(self) -> int:
        return self.shared_intermediate_size or self.intermediate_size * self.num_shared_experts

    def validate(self) -> None:
        if self.top_k > self.num_experts:
            raise ValueError(f"ModelConfig.moe.top_k={self.top_k} > num_experts={self.num_experts}")
        if self.n_group < 1 or self.num_experts % self.n_group:
            raise ValueError(f"ModelConfig.moe.num_experts={self.num_experts} not divisible by n_group={self.n_group}")
        if self.n_group > 1:
            # groups are ranked by their two best experts; a token then picks top_k experts in topk_group groups
            per_group = self.num_experts // self.n_group
            if per_group < 2 or not 1 <= self.topk_group <= self.n_group or self.top_k > self.topk_group * per_group:
                raise ValueError(
                    f"ModelConfig.moe: group-limited routing needs >= 2 experts per group, 1 <= topk_group <= n_group "
                    f"and top_k <= topk_group * experts per group; got num_experts={self.num_experts}, "
                    f"n_group={self.n_group}, topk_group={self.topk_group}, top_k={self.top_k}"
                )


@dataclass
class MambaConfig:
    """Mamba-2 mixer (SSD)."""

    num_heads: int = 8
    head_dim: int = 64
    state_size: int = 128
    n_groups: int = 1
    conv_kernel: int = 4
    chunk_size: int = 128
    conv_bias: bool = True
    proj_bias: bool = False
    time_step_limit: tuple[float, float] = (0.0, float("inf"))
    time_step_min: float = 0.001
    time_step_max: float = 0.1
    time_step_floor: float = 1e-4
    norm_eps: float = 1e-5

    def validate(self) -> None:
        if self.num_heads % self.n_groups:
            raise ValueError(
                f"ModelConfig.mamba: num_heads={self.num_heads} is not a multiple of n_groups={self.n_groups}"
            )


@dataclass
class LinearAttentionConfig:
    """The linear-attention mixers (gated delta rule): short conv, L2-normed queries and keys, the gated delta
    rule (chunked), gated RMSNorm. Each of ``num_k_heads`` query/key heads serves ``num_v_heads / num_k_heads``
    value heads; a kind that needs more says so in its record's ``check_config``."""

    num_k_heads: int = 4
    num_v_heads: int = 8
    head_k_dim: int = 64
    head_v_dim: int = 64
    conv_kernel: int = 4
    chunk_size: int = 64
    norm_eps: float = 1e-6
    # torch: the chunked algorithm of ``layers/delta_rule.py``; fla: flash-linear-attention's GPU kernels
    backend: Literal["torch", "fla"] = "torch"

    def validate(self) -> None:
        if self.num_v_heads % self.num_k_heads:
            raise ValueError(f"ModelConfig.linear_attention: num_v_heads={self.num_v_heads} is not a multiple of "
                             f"num_k_heads={self.num_k_heads}")


@dataclass
class MTPConfig:
    """Multi-token prediction: ``num_layers`` depths, each a small stack described by ``pattern``."""

    num_layers: int = 0
    pattern: str = "*E"
    loss_scale: float = 0.3  # weight of the mean MTP loss over depths (Megatron's mtp_loss_scaling_factor)
    # keep the MTP weights (they round-trip through checkpoints) but skip their compute and loss
    enabled: bool = True
    # the hub's MTP layers hold copies of the embedding and output layer (DeepSeek-V3, GLM-4.5; not GLM-4.6)
    hub_weight_copies: bool = True
    # one MTP layer whose weights every depth applies (Megatron-Core's ``mtp_use_repeated_layer``): checkpoints
    # hold that one layer, and each of the ``num_layers`` depths still runs it and adds its own loss
    shared: bool = False

    @property
    def stored_layers(self) -> int:
        """MTP layers with weights of their own (in the model and its checkpoints): one when ``shared``."""
        return min(self.num_layers, 1) if self.shared else self.num_layers



# what the patterns of a config must satisfy, registered by the block-kind records (``models/blocks.py``, loaded by
# ``lightning_moe.models``): the records import this module, so this module never imports them
PATTERN_CHECKS: list[Callable[[ModelConfig, dict[str, str]], None]] = []

@dataclass
class ModelConfig:
    """The whole model. ``family`` names the Hugging Face architecture file used for import/export."""

    family: str = "llama"
    vocab_size: int = 32000
    hidden_size: int = 512
    pattern: str = "*-*-"
    attention: AttentionConfig = field(default_factory=AttentionConfig)
    mlp: MLPConfig | None = field(default_factory=MLPConfig)
    moe: MoEConfig | None = None
    mamba: MambaConfig | None = None
    linear_attention: LinearAttentionConfig | None = None
    mtp: MTPConfig | None = None
    # the settings of the attention blocks that slide (``attention.window_for``), where they differ from
    # ``attention``'s: MiMo-V2's sliding layers have more kv heads, another rope theta and sinks. The window
    # itself stays ``attention.sliding_window``; None: every attention block uses ``attention``
    sliding_attention: AttentionConfig | None = None
    norm_eps: float = 1e-6
    # RMSNorms scale by ``1 + weight`` (zero-initialized weights, in fp32: Qwen3-Next, Qwen3.5)
    norm_offset: bool = False
    # RMSNorm multiplies by its weight in fp32 before casting back (GPT-OSS, Nemotron-H); matters below fp32
    norm_weight_fp32: bool = False
    tie_embeddings: bool = False
    max_position_embeddings: int = 4096
    init_std: float = 0.02
    # tokens per chunk of the fused output-layer cross entropy
    loss_chunk_size: int = 512
    # Transformer Engine te.Linear / te.RMSNorm for the dense layers' linears and norms (layers/te.py;
    # pip install .[te], NVIDIA GPUs); the attention kernel is chosen apart, attention.backend: te
    te_modules: bool = False

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        patterns = {"pattern": self.pattern}
        if self.mtp is not None and self.mtp.num_layers > 0:
            patterns["mtp.pattern"] = self.mtp.pattern
        if not PATTERN_CHECKS:
            raise RuntimeError("the block-kind records (lightning_moe.models.blocks) are not loaded")
        for check in PATTERN_CHECKS:
            check(self, patterns)
        att = self.attention
        if att.sliding_window_layers is not None:
            backbone = self.pattern.count("*")
            counts = {backbone, backbone + patterns.get("mtp.pattern", "").count("*")}
            if len(att.sliding_window_layers) not in counts:
                raise ValueError(
                    f"ModelConfig.attention.sliding_window_layers has {len(att.sliding_window_layers)} entries, "
                    f"the pattern has {backbone} attention blocks (and the MTP pattern {max(counts) - backbone})"
                )
        sliding = self.sliding_attention
        if sliding is not None:
            if att.type != "gqa" or sliding.type != "gqa" or sliding.num_heads % sliding.num_kv_heads:
                raise ValueError("ModelConfig.sliding_attention: GQA settings (type gqa, num_heads a multiple of "
                                 f"num_kv_heads) beside a GQA attention; got {sliding.type} with {sliding.num_heads} "
                                 f"heads, {sliding.num_kv_heads} kv heads, attention.type {att.type}")
            if att.sliding_window is None or sliding.sliding_window is not None or sliding.sliding_window_layers:
                raise ValueError("ModelConfig.sliding_attention applies to the blocks attention.sliding_window and "
                                 "attention.sliding_window_layers make slide: set the window there, not in "
                                 "sliding_attention")

    @property
    def num_blocks(self) -> int:
        return len(self.pattern)

    def attention_for(self, attention_index: int) -> AttentionConfig:
        """The settings of the ``attention_index``-th attention block (``sliding_attention`` where it slides)."""
        if self.sliding_attention is not None and self.attention.window_for(attention_index) is not None:
            return self.sliding_attention
        return self.attention

    # ------------------------------------------------------------------ serialization
    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelConfig:
        return _from_dict(cls, data, "ModelConfig")

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> ModelConfig:
        return cls.from_dict(json.loads(Path(path).read_text()))


_SUBCONFIGS = {
    "rope": RopeConfig,
    "attention": AttentionConfig,
    "sliding_attention": AttentionConfig,
    "mlp": MLPConfig,
    "moe": MoEConfig,
    "mamba": MambaConfig,
    "linear_attention": LinearAttentionConfig,
    "mtp": MTPConfig,
}


def _from_dict(cls: type, data: dict[str, Any], where: str) -> Any:
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise ValueError(f"{where}: unknown keys {unknown}; expected some of {sorted(names)}")
    kwargs = {}
    for key, value in data.items():
        if key in _SUBCONFIGS and isinstance(value, dict):
            value = _from_dict(_SUBCONFIGS[key], value, f"{where}.{key}")
        elif key == "time_step_limit" and value is not None:
            value = tuple(float(v) for v in value)
        kwargs[key] = value
    return cls(**kwargs)
