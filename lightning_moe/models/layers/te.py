"""Transformer Engine backend (``pip install .[te]``, GPU only): ``attention: te`` and TE linear / RMSNorm.

``attention: te`` runs TE's ``DotProductAttention`` on packed rows in its ``thd`` layout with the layout's
``cu_seqlens`` (no token attends across a packed boundary, as with every backend). :func:`use_te_modules` swaps
the dense layers' ``nn.Linear`` and :class:`RMSNorm` for TE's, keeping parameter names, shapes and math (TE's
RMSNorm, zero-centred gamma for 1 + w norms), so checkpoints load unchanged; ``ModelConfig.te_modules: true``
applies it when the model is built. Chosen without TE installed: a clear error.
"""

from __future__ import annotations

import functools
import importlib.util

import torch
from torch import nn


def require_transformer_engine(what: str, instead: str = "use attention backend sdpa or flex"):
    """``transformer_engine.pytorch``, or a clear error naming what needed it (and what to choose instead)."""
    if importlib.util.find_spec("transformer_engine") is None:
        raise ValueError(f"{what} needs Transformer Engine, which is not installed: pip install '.[te]' "
                         f"(transformer-engine[pytorch], NVIDIA GPUs only), or {instead}")
    import transformer_engine.pytorch as te

    return te


_attention_modules: dict[tuple, nn.Module] = {}


def te_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout, scale: float,
                 window: int | None) -> torch.Tensor:
    """Causal attention within each packed sequence; [batch, heads, seq, dim] in and out (GQA allowed)."""
    te = require_transformer_engine("attention backend 'te'")
    if layout.context_parallel is not None:
        raise ValueError("attention backend 'te' under context parallelism is not supported; use sdpa or flex")
    batch, heads, seq, qk_dim = q.shape
    kv_heads, v_dim = k.shape[1], v.shape[-1]
    key = (heads, kv_heads, qk_dim, v_dim, scale, window, q.device)
    if key not in _attention_modules:
        _attention_modules[key] = te.DotProductAttention(
            heads, qk_dim if qk_dim == v_dim else (qk_dim, v_dim), num_gqa_groups=kv_heads,
            attn_mask_type="padding_causal", qkv_format="thd", softmax_scale=scale,
            window_size=(window - 1, 0) if window is not None else None,
        )
    # thd: all rows' tokens back to back, [tokens, heads, dim]; cu_seqlens index the flattened batch
    q, k, v = (t.transpose(1, 2).reshape(batch * seq, t.shape[1], t.shape[-1]) for t in (q, k, v))
    cu_seqlens = layout.cu_seqlens
    max_len = layout.max_length
    out = _attention_modules[key](q, k, v, cu_seqlens_q=cu_seqlens, cu_seqlens_kv=cu_seqlens,
                                  max_seqlen_q=max_len, max_seqlen_kv=max_len)
    return out.view(batch, seq, heads, v_dim).transpose(1, 2)


@functools.cache
def _package_contract(te) -> tuple[type, type]:
    """TE's Linear and RMSNorm with the package's ``reset_parameters(init_std)`` call (``Decoder.init_weights``
    after meta-device construction): TE's own setup runs, the values stay the package's (a linear keeps what
    the block that owns it drew, as nn.Linear does; a norm gets ones, or zeros for a 1 + w norm). TE's own
    calls, ``reset_parameters(defer_init=...)``, pass through unchanged."""

    def te_call(init_std) -> bool:
        return init_std is None or isinstance(init_std, bool)  # defer_init, by keyword or by position

    class Linear(te.Linear):
        def reset_parameters(self, init_std=None, **kwargs):
            if te_call(init_std):
                return super().reset_parameters(*([] if init_std is None else [init_std]), **kwargs)
            values = {name: p.detach().clone() for name, p in self.named_parameters(recurse=False)}
            super().reset_parameters()
            with torch.no_grad():
                for name, value in values.items():
                    getattr(self, name).copy_(value)

    class RMSNorm(te.RMSNorm):
        def reset_parameters(self, init_std=None, **kwargs):
            if te_call(init_std):
                return super().reset_parameters(*([] if init_std is None else [init_std]), **kwargs)
            super().reset_parameters()  # ones, or zeros with zero-centred gamma

    return Linear, RMSNorm


def use_te_modules(model: nn.Module, dense_only: bool = True) -> list[str]:
    """Replace ``nn.Linear`` and the package's RMSNorm with TE's, in place (weights moved over, names kept).
    ``dense_only``: leave MoE experts, routers and Mamba mixers alone. Returns the replaced modules' names.
    ``ModelConfig.te_modules: true`` does this when the Decoder is built."""
    te = require_transformer_engine("model te_modules: true (Transformer Engine linear / RMSNorm layers)",
                                    instead="set te_modules: false (torch's layers)")
    from lightning_moe.models.layers.norm import RMSNorm

    te_linear, te_norm = _package_contract(te)
    replaced = []
    for name, module in list(model.named_modules()):
        parts = name.split(".")
        if "lm_head" in parts or dense_only and any(p in parts for p in ("moe", "mamba", "experts", "router")):
            continue  # the output layer's weight feeds the chunked loss directly
        if isinstance(module, nn.Linear) and type(module) is nn.Linear:
            new = te_linear(module.in_features, module.out_features, bias=module.bias is not None,
                            params_dtype=module.weight.dtype, device=module.weight.device)
        elif isinstance(module, RMSNorm) and not module.weight_fp32:
            # a 1 + w norm (Qwen3-Next) is TE's zero-centred gamma
            new = te_norm(module.weight.numel(), eps=module.eps, zero_centered_gamma=module.offset,
                          params_dtype=module.weight.dtype, device=module.weight.device)
        else:
            continue
        if module.weight.device.type != "meta":  # on meta (before materialization) there is nothing to move
            with torch.no_grad():
                for param, value in module.named_parameters(recurse=False):
                    getattr(new, param).copy_(value)
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, new)
        replaced.append(name)
    return replaced
