"""Context parallelism on the generic path: a transformers model's attention over rows split across ``cp`` ranks.

The batch is split along the sequence by the strategy exactly as for native decoders (``context.shard_batch``:
load-balanced chunks, global ``position_ids``), so rotary embeddings, MLPs, routers and the loss already see the
right tokens. Attention is the only mixing along the sequence; transformers routes it through its attention
interface (``ALL_ATTENTION_FUNCTIONS``), where this module registers :func:`context_parallel_attention` and
switches the model to it. Each forward builds one :class:`ContextParallelRow` from the local ``position_ids``
(a pre-hook on ``HFModel``) and hands it to every attention call through the keyword arguments transformers
passes from the model down to its attention function. There, keys and values are gathered over the ``cp``
group and attended with the package's own ``attend`` (causal, packed-document boundaries from the whole row's
positions, the layer's ``sliding_window``, its attention sinks ``s_aux``), as in the native path.

transformers' own mask is not built (the name is not a mask implementation, so ``masking_utils`` skips it):
it would describe the local tokens only. Mask rules that reach the attention function only through that mask
(chunked attention, bidirectional image tokens, sparse-attention indexers, KV compressors) are refused by
:func:`check_hf_context_parallel`, as are layers that carry a state along the sequence (``parallel/hf.py``); an
attention call with a mask of the model's own making, or a forward in which no attention call arrived, is an
error, never a silent single-rank attention.
"""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import nn

from lightning_moe.models.layers.attention import attend
from lightning_moe.parallel.context import ContextParallelRow

ATTENTION_NAME = "lightning_moe_context_parallel"
ROW_KEY = "lightning_moe_context_parallel_row"  # the keyword argument the attention calls receive
# layer types whose masks carry rules beyond causal + sliding window + document boundaries
UNSUPPORTED_LAYER_TYPES = ("chunked_attention",)
# modules that select or pool keys along the sequence outside the attention function (DeepSeek sparse-attention
# indexers, DeepSeek-V4's KV compressors)
SEQUENCE_SELECTING_CLASSES = re.compile(r"(Indexer|Compressor)$")


class HFContextParallelRow:
    """One forward's split row (``context_parallel``, what ``attend`` gathers with), the backend, and how many
    attention calls used it."""

    def __init__(self, position_ids: torch.Tensor, group, backend: str) -> None:
        self.context_parallel = ContextParallelRow(position_ids, group)
        self.backend = backend
        self.attention_calls = 0


def context_parallel_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                               attention_mask: Any, scaling: float | None = None, dropout: float = 0.0,
                               sliding_window: int | None = None, s_aux: torch.Tensor | None = None,
                               **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention-function contract: [batch, heads, local_seq, dim] in, [batch, local_seq, heads,
    dim] out. ``attention_mask`` (transformers' mask of the local tokens, not built) is ignored: the row masks."""
    name = type(module).__name__
    row = kwargs.get(ROW_KEY)
    if row is None:
        raise RuntimeError(f"{name}: context-parallel attention was called without the split row; the model does "
                           f"not pass its forward's keyword arguments down to attention, so cp>1 cannot run it")
    if dropout:
        raise ValueError(f"{name}: attention dropout {dropout} under context parallelism is not supported; set the "
                         f"config's attention_dropout to 0")
    for unsupported in ("softcap", "position_bias"):
        if kwargs.get(unsupported) is not None:
            raise ValueError(f"{name}: attention with {unsupported} under context parallelism is not supported")
    if not getattr(module, "is_causal", True):
        raise ValueError(f"{name}: non-causal attention under context parallelism is not supported")
    if attention_mask is not None:  # transformers builds none for this name: the model made its own
        raise ValueError(f"{name}: the model passes its own attention mask (e.g. a sparse-attention index mask), "
                         f"which context parallelism does not split; use cp=1")
    row.attention_calls += 1
    if sliding_window is None:
        sliding_window = configured_window(module)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    out = attend(query, key, value, row, backend=row.backend, scale=scale, window=sliding_window, sinks=s_aux)
    return out.transpose(1, 2).contiguous(), None


def configured_window(module: nn.Module) -> int | None:
    """The config's sliding window where the module's layer is a sliding one: a few models (Qwen2-MoE) mask their
    sliding layers through transformers' mask only, without passing ``sliding_window`` to the attention function."""
    config, index = getattr(module, "config", None), getattr(module, "layer_idx", None)
    types = getattr(config, "layer_types", None)
    if types is None or index is None or types[index] != "sliding_attention":
        return None
    return getattr(config, "sliding_window", None) or None


def check_hf_context_parallel(hf_model: nn.Module, cp: int) -> None:
    """Refuse, naming the reason, what the attention interface cannot split along the sequence."""
    name = type(hf_model).__name__
    if not type(hf_model)._can_set_attn_implementation():
        raise ValueError(f"cp={cp}: {name}'s attention does not go through transformers' attention interface "
                         f"(ALL_ATTENTION_FUNCTIONS), so context parallelism cannot replace it; use cp=1")
    vision = [key for key in getattr(hf_model.config, "sub_configs", {}) if key != "text_config"]
    if vision:
        raise ValueError(f"cp={cp}: {name} has sub-models ({', '.join(vision)}) whose tokens are not split along the "
                         f"text sequence; context parallelism on the generic path covers causal LMs; use cp=1")
    selecting = sorted({type(m).__name__ for m in hf_model.modules() if SEQUENCE_SELECTING_CLASSES.search(type(m).__name__)})
    if selecting:
        raise ValueError(f"cp={cp}: {name}'s {', '.join(selecting)} select or pool keys along the sequence outside the "
                         f"attention function, which context parallelism does not split; use cp=1")
    types = getattr(hf_model.config.get_text_config(), "layer_types", None) or []
    masked = sorted({t for t in types if t in UNSUPPORTED_LAYER_TYPES})
    if masked:
        raise ValueError(f"cp={cp}: {name}'s {', '.join(masked)} layers mask by rules the attention function does not "
                         f"receive; use cp=1")


def apply_hf_context_parallel(model: nn.Module, cp_mesh) -> None:
    """Switch ``model.hf`` (an ``HFModel``'s transformers model) to :func:`context_parallel_attention` and give
    every forward its split row."""
    from transformers import AttentionInterface

    hf_model = model.hf
    check_hf_context_parallel(hf_model, cp_mesh.size())
    AttentionInterface.register(ATTENTION_NAME, context_parallel_attention)
    # flex where the model was set to flex, else SDPA (eager attention is the same arithmetic)
    backend = "flex" if hf_model.config._attn_implementation == "flex_attention" else "sdpa"
    hf_model.set_attn_implementation(ATTENTION_NAME)
    group = cp_mesh.get_group()
    current: dict[str, HFContextParallelRow] = {}

    def split_row(module, args, kwargs):
        position_ids = args[1] if len(args) > 1 else kwargs.get("position_ids")
        if position_ids is None:
            raise ValueError(f"cp={cp_mesh.size()}: {type(hf_model).__name__} got no position_ids; under context "
                             f"parallelism each rank's tokens need their global positions (the strategy's "
                             f"shard_batch sets them)")
        current["row"] = HFContextParallelRow(position_ids, group, backend)
        return args, {**kwargs, ROW_KEY: current["row"]}

    def check_attended(module, args, kwargs, output):
        if current.pop("row").attention_calls == 0:
            raise RuntimeError(f"cp={cp_mesh.size()}: no attention layer of {type(hf_model).__name__} called "
                               f"transformers' attention interface in this forward, so its tokens were not "
                               f"attended over the whole row; use cp=1")

    model.register_forward_pre_hook(split_row, with_kwargs=True)
    model.register_forward_hook(check_attended, with_kwargs=True)
