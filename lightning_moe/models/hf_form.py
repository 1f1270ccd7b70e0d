"""The native decoder as its transformers model, in memory: what ``generate`` runs on.

The model is the one ``AutoModelForCausalLM`` builds from the ``config.json`` an export would write, and it holds
the tensors an export would write, put in place by transformers' own conversion mapping (fused experts, renamed
prefixes), so sampling, the KV cache and stopping are transformers' own, on the weights the package trained.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from lightning_moe.models.config import ModelConfig
from lightning_moe.models.families import family_by_name
from lightning_moe.models.hf import materialize_with_buffers, parameters_on_meta
from lightning_moe.models.hf_weights import HubTensors, load_hub_tensors


def hub_tensor_groups(config: ModelConfig, native: Callable[[str], torch.Tensor],
                      dtype: torch.dtype | None = None) -> Iterator[tuple[tuple[str, ...], list[torch.Tensor]]]:
    """(hub names, hub tensors) of each entry of the family's weight map, from native tensors ``native(name)``
    (floating ones cast to ``dtype`` when given), one entry at a time."""
    for entry in family_by_name(config.family).weight_map(config):
        yield entry.hf, entry.hf_from_natives(cast_floating([native(name) for name in entry.natives], dtype))


def cast_floating(tensors: Sequence[torch.Tensor], dtype: torch.dtype | None) -> list[torch.Tensor]:
    return [t.to(dtype) if dtype is not None and t.is_floating_point() else t for t in tensors]


def transformers_config(config: ModelConfig, hf_config: dict[str, Any] | None = None):
    """The transformers config of ``config``: ``hf_config`` (a source checkpoint's config.json) when given, else
    the family's translation."""
    from transformers import AutoConfig

    hf = dict(hf_config) if hf_config is not None else family_by_name(config.family).to_hf_config(config)
    return AutoConfig.for_model(**hf)


def native_as_transformers(config: ModelConfig, state: Mapping[str, torch.Tensor],
                           hf_config: dict[str, Any] | None = None, device: torch.device | str = "cpu") -> nn.Module:
    """A transformers causal LM holding the native tensors ``state`` (full tensors, adapters merged), in eval
    mode on ``device``, in the dtype of the native weights."""
    from transformers import AutoModelForCausalLM

    hub = {name: tensor.detach().to(device) for names, tensors in hub_tensor_groups(config, state.__getitem__)
           for name, tensor in zip(names, tensors, strict=True)}
    dtype = next((t.dtype for t in hub.values() if t.is_floating_point()), torch.float32)
    with parameters_on_meta():
        model = AutoModelForCausalLM.from_config(transformers_config(config, hf_config), dtype=dtype)
    materialize_with_buffers(model, device)
    load_hub_tensors(model, HubTensors(hub, f"the {config.family} model in memory"))
    return model.eval()
