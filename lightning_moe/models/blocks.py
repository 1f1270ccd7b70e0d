"""What a block kind is: one record per mixer / feed-forward kind (DESIGN "A block kind is one record").

A pattern symbol (``ModelConfig.pattern``) names a kind, attention's by ``attention.type`` as well (``*`` is GQA
or MLA). The record says the sub-config the kind reads and what else it needs of the config, how the decoder
builds the op and under which attribute, whether it mixes the sequence, its forward FLOPs
(``models/block_flops.py``), what tensor parallelism splits and what it leaves replicated, the sizes a split
needs, and how context parallelism treats it. The decoder, the config's checks, the FLOP
count, tensor and context parallelism, the pipeline's balance and the memory estimate read these records;
nothing else tests pattern symbols. A new kind is one layer file plus one record here.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Literal

from torch import nn

from lightning_moe.models.block_flops import (
    ForwardFlops,
    Sequences,
    gated_deltanet_flops,
    gqa_attention_flops,
    kda_flops,
    mamba_flops,
    mla_attention_flops,
    mlp_flops,
    moe_flops,
)
from lightning_moe.models.config import PATTERN_CHECKS, ModelConfig
from lightning_moe.models.layers.attention import Attention
from lightning_moe.models.layers.gated_deltanet import GatedDeltaNet
from lightning_moe.models.layers.kda import KimiDeltaAttention
from lightning_moe.models.layers.mamba2 import Mamba2Mixer
from lightning_moe.models.layers.mla import MLA
from lightning_moe.models.layers.mlp import MLP
from lightning_moe.models.layers.moe import MoE
from lightning_moe.models.splits import divisors


@dataclass(frozen=True)
class Linears:
    """Linears of one submodule (``owner``, relative to the block) that tensor parallelism splits: ``columns``
    by output channels (weight and bias), ``rows`` by input channels (the bias stays whole)."""

    owner: str
    columns: tuple[str, ...]
    rows: tuple[str, ...]


@dataclass(frozen=True)
class TensorSplit:
    """What tensor parallelism does to a block's op (names relative to the block; absent ones are skipped).

    ``gathered``: linears that run on the all-gathered sequence as DTensor styles (Megatron's sequence
    parallelism); ``local``: linears of an op that gathers the sequence itself and computes on local shards (MLA);
    ``replicated``: submodules kept whole on every rank, their gradients summed over the ranks (each saw other
    tokens; the kind's routed experts too, unless expert parallelism splits them); ``head_norms``: per-head
    norms over the local heads; ``sharded``: parameters split by heads along their first dimension;
    ``trades_heads``: the op runs on its sequence shard and trades tokens for heads with the other ranks
    (``parallel/mamba.py``); ``shard_loss``: the op's load-balancing loss covers its shard, made the mean."""

    gathered: tuple[Linears, ...] = ()
    local: Linears | None = None
    replicated: tuple[str, ...] = ()
    head_norms: tuple[str, ...] = ()
    sharded: tuple[str, ...] = ()
    trades_heads: bool = False
    shard_loss: bool = False


@dataclass(frozen=True)
class BlockKind:
    """One block kind. ``config_key``: the sub-config of ``ModelConfig`` its op reads, which a pattern with the
    kind needs set; ``check_config(config)`` raises what else the kind needs of a config (run by its validation).
    ``build(config, attention_index)`` makes its op; ``check_tensor_split(config, tp)`` and
    ``check_context_split(config, cp)`` raise a one-line message naming the config key a split cannot divide;
    ``experts``: the submodule of routed experts, which expert parallelism splits;
    ``traded_heads(config)`` is ``(config key, count, what a rank scans)`` for ops that trade tokens for whole
    heads under tensor and context parallelism; ``context``: ``"attend"`` gathers the row's keys,
    ``"trade_heads"`` scans whole rows by heads."""

    name: str
    symbol: str
    attribute: str
    mixes_sequence: bool
    build: Callable[[ModelConfig, int], nn.Module]
    flops: Callable[[ModelConfig, Sequences, int], ForwardFlops]
    tensor: TensorSplit
    context: Literal["attend", "trade_heads"] | None = None
    check_tensor_split: Callable[[ModelConfig, int], None] | None = None
    check_context_split: Callable[[ModelConfig, int], None] | None = None
    traded_heads: Callable[[ModelConfig], tuple[str, int, str]] | None = None
    experts: str | None = None
    config_key: str | None = None
    check_config: Callable[[ModelConfig], None] | None = None

    def __reduce__(self):
        # a record is a constant of this module: copies and pickles of a model refer to it by name
        return kind_named, (self.name,)


def _attention(cls: type) -> Callable[[ModelConfig, int], nn.Module]:
    def build(cfg: ModelConfig, attention_index: int) -> nn.Module:
        # the qk-norms follow the decoder's norms (1 + weight under norm_offset)
        extra = {"norm_offset": True} if cfg.norm_offset and cls is Attention else {}
        return cls(cfg.attention_for(attention_index), cfg.hidden_size, cfg.max_position_embeddings, cfg.norm_eps,
                   cfg.attention.window_for(attention_index), **extra)

    return build


def _check_gqa_heads(cfg: ModelConfig) -> None:
    att = cfg.attention
    if att.num_heads % att.num_kv_heads:
        raise ValueError(
            f"ModelConfig.attention: num_heads={att.num_heads} is not a multiple of num_kv_heads={att.num_kv_heads}"
        )


def _check_kda(cfg: ModelConfig) -> None:
    la = cfg.linear_attention
    la.validate()
    if la.num_k_heads != la.num_v_heads or la.head_k_dim != la.head_v_dim:
        raise ValueError("ModelConfig.linear_attention: KDA ('K') needs num_k_heads == num_v_heads and "
                         f"head_k_dim == head_v_dim, got {la.num_k_heads}/{la.num_v_heads} heads, "
                         f"{la.head_k_dim}/{la.head_v_dim} dims")
    if la.chunk_size % 16:
        raise ValueError(f"ModelConfig.linear_attention.chunk_size={la.chunk_size}: KDA needs a multiple of 16")


def _check_heads(cfg: ModelConfig, tp: int) -> None:
    att = cfg.attention
    counts = [("num_heads", att.num_heads)]
    if att.type == "gqa":
        counts.append(("num_kv_heads", att.num_kv_heads))
    if cfg.sliding_attention is not None:
        counts += [(f"sliding_attention.{key}", getattr(cfg.sliding_attention, key))
                   for key in ("num_heads", "num_kv_heads")]
    heads = math.gcd(*(value for _, value in counts))
    for key, value in counts:
        if value % tp:
            raise ValueError(f"tp={tp} does not divide {key}={value}; use tp in {divisors(heads)}")


def _check_mla_tensor_split(cfg: ModelConfig, tp: int) -> None:
    if cfg.attention.out_bias:
        raise ValueError(f"tp={tp}: tensor parallelism of MLA with attention.out_bias is not supported; use tp=1")
    _check_heads(cfg, tp)


def _check_attention_backend(cfg: ModelConfig, cp: int) -> None:
    if cfg.attention.backend not in ("sdpa", "flex"):
        raise ValueError(f"cp={cp}: attention backend {cfg.attention.backend!r} is not supported with context "
                         f"parallelism; use backend sdpa or flex")


def _check_mlp_width(cfg: ModelConfig, tp: int) -> None:
    width = cfg.mlp.intermediate_size
    if width % tp:
        raise ValueError(f"tp={tp} does not divide mlp.intermediate_size={width}; use tp in {divisors(width)}")


def _check_shared_experts_width(cfg: ModelConfig, tp: int) -> None:
    moe = cfg.moe
    if moe.num_shared_experts and moe.shared_size % tp:
        raise ValueError(f"tp={tp} does not divide the shared experts' intermediate size {moe.shared_size} "
                         f"(moe.shared_intermediate_size); use tp in {divisors(moe.shared_size)}")


_ATTENTION_SPLIT = TensorSplit(gathered=(Linears("attn", ("q_proj", "k_proj", "v_proj"), ("o_proj",)),),
                               head_norms=("attn.q_norm", "attn.k_norm"), sharded=("attn.sinks",))
_MLA_SPLIT = TensorSplit(local=Linears("attn", ("q_proj", "q_b_proj", "kv_b_proj"), ("o_proj",)),
                         replicated=("attn.q_a_proj", "attn.q_a_norm", "attn.kv_a_proj", "attn.kv_a_norm"))
_MLP_LINEARS = (("gate_proj", "up_proj"), ("down_proj",))

KINDS = (
    BlockKind("gqa", "*", "attn", True, _attention(Attention), gqa_attention_flops, _ATTENTION_SPLIT,
              "attend", _check_heads, _check_attention_backend, config_key="attention",
              check_config=_check_gqa_heads),
    BlockKind("mla", "*", "attn", True, _attention(MLA), mla_attention_flops, _MLA_SPLIT,
              "attend", _check_mla_tensor_split, _check_attention_backend, config_key="attention"),
    BlockKind("mamba", "M", "mamba", True, lambda cfg, i: Mamba2Mixer(cfg.mamba, cfg.hidden_size), mamba_flops,
              TensorSplit(replicated=("mamba",), trades_heads=True), "trade_heads",
              traded_heads=lambda cfg: ("mamba.n_groups", cfg.mamba.n_groups, "whole B/C groups"),
              config_key="mamba", check_config=lambda cfg: cfg.mamba.validate()),
    BlockKind("gated_deltanet", "G", "gdn", True, lambda cfg, i: GatedDeltaNet(cfg.linear_attention, cfg.hidden_size),
              gated_deltanet_flops, TensorSplit(replicated=("gdn",), trades_heads=True), "trade_heads",
              traded_heads=lambda cfg: ("linear_attention.num_k_heads", cfg.linear_attention.num_k_heads,
                                        "whole key heads"),
              config_key="linear_attention", check_config=lambda cfg: cfg.linear_attention.validate()),
    BlockKind("kda", "K", "kda", True, lambda cfg, i: KimiDeltaAttention(cfg.linear_attention, cfg.hidden_size),
              kda_flops, TensorSplit(replicated=("kda",), trades_heads=True), "trade_heads",
              traded_heads=lambda cfg: ("linear_attention.num_v_heads", cfg.linear_attention.num_v_heads,
                                        "whole heads"),
              config_key="linear_attention", check_config=_check_kda),
    BlockKind("mlp", "-", "mlp", False,
              lambda cfg, i: MLP(cfg.hidden_size, cfg.mlp.intermediate_size, cfg.mlp.activation, cfg.mlp.bias),
              mlp_flops, TensorSplit(gathered=(Linears("mlp", *_MLP_LINEARS),)),
              check_tensor_split=_check_mlp_width, config_key="mlp"),
    BlockKind("moe", "E", "moe", False, lambda cfg, i: MoE(cfg.moe, cfg.hidden_size), moe_flops,
              TensorSplit(gathered=(Linears("moe.shared_experts", *_MLP_LINEARS),),
                          replicated=("moe.router", "moe.fc1_latent_proj", "moe.fc2_latent_proj",
                                      "moe.shared_expert_gate"),
                          shard_loss=True),
              check_tensor_split=_check_shared_experts_width, experts="moe.experts", config_key="moe",
              check_config=lambda cfg: cfg.moe.validate()),
)


def kind_named(name: str) -> BlockKind:
    return next(kind for kind in KINDS if kind.name == name)


def check_patterns(cfg: ModelConfig, patterns: dict[str, str]) -> None:
    """``patterns`` (``{config key: pattern}``) use known symbols, each kind's settings are set and hold."""
    allowed = symbol_names()
    for where, pattern in patterns.items():
        unknown = sorted(set(pattern) - set(allowed))
        if unknown:
            raise ValueError(f"ModelConfig.{where} {pattern!r}: unknown symbols {unknown}; allowed: {allowed}")
    kinds = model_kinds(cfg)
    for kind in kinds:
        if kind.config_key is not None and getattr(cfg, kind.config_key) is None:
            where = "pattern" if kind.symbol in cfg.pattern else "mtp.pattern"
            raise ValueError(f"ModelConfig.{where} contains {kind.symbol!r} but ModelConfig.{kind.config_key} "
                             "is not set")
    for kind in kinds:
        if kind.check_config is not None:
            kind.check_config(cfg)


PATTERN_CHECKS.append(check_patterns)


def symbol_names() -> dict[str, str]:
    """Each pattern symbol and the kinds it names (``"gqa/mla"`` for attention)."""
    return {kind.symbol: "/".join(each.name for each in KINDS if each.symbol == kind.symbol) for kind in KINDS}


def block_kind(cfg: ModelConfig, symbol: str, attention_index: int) -> BlockKind:
    """The kind of a pattern symbol; an attention block's by the ``attention.type`` of its settings."""
    attention = cfg.attention_for(attention_index).type if symbol == "*" else None
    for kind in KINDS:
        if kind.symbol == symbol and attention in (None, kind.name):
            return kind
    raise ValueError(f"unknown block symbol {symbol!r}")


def pattern_kinds(cfg: ModelConfig, pattern: str, first_attention_index: int = 0) -> Iterator[tuple[BlockKind, int]]:
    """``(kind, attention index)`` of each symbol of ``pattern``, attention blocks numbered from
    ``first_attention_index`` (the MTP pattern's after the backbone's), which picks their window and settings."""
    attention_index = first_attention_index
    for symbol in pattern:
        yield block_kind(cfg, symbol, attention_index), attention_index
        attention_index += symbol == "*"


def model_kinds(cfg: ModelConfig) -> list[BlockKind]:
    """The kinds the backbone and the MTP pattern use, each once, in record order."""
    used = {kind.name for kind, _ in pattern_kinds(cfg, cfg.pattern)}
    if cfg.mtp is not None and cfg.mtp.num_layers:
        used |= {kind.name for kind, _ in pattern_kinds(cfg, cfg.mtp.pattern, cfg.pattern.count("*"))}
    return [kind for kind in KINDS if kind.name in used]


def split_linears(block: nn.Module, prefix: str) -> Iterator[tuple[str, nn.Module, str]]:
    """``(name, linear, "colwise" | "rowwise")`` of every linear tensor parallelism splits in ``block``."""
    split = block.kind.tensor
    for group in split.gathered + ((split.local,) if split.local else ()):
        owner = submodule(block, group.owner)
        if owner is None:
            continue
        for leaf in group.columns + group.rows:
            if getattr(owner, leaf, None) is not None:
                yield f"{prefix}.{group.owner}.{leaf}", getattr(owner, leaf), "colwise" if leaf in group.columns else "rowwise"


def submodule(block: nn.Module, name: str):
    """``block``'s submodule or parameter at dotted ``name``, or None where the op has none."""
    owner = block
    for part in name.split("."):
        owner = getattr(owner, part, None)
        if owner is None:
            return None
    return owner
