"""Hub tensor names -> a transformers model's in-memory names, by the model's own conversion mapping.

transformers 5 renames checkpoint keys on load (Nemotron-H's ``backbone.layers.0`` is ``model.layers.0`` in
memory) and fuses per-expert tensors into one parameter (``experts.0.up_proj.weight`` ... ->
``experts.up_proj``): the mapping ``from_pretrained`` applies, which loading and adapter layouts both follow.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn


@dataclass
class HubNames:
    """transformers' weight renamings and converters of one model, and its state-dict names."""

    model: nn.Module
    renamings: list[Any]
    converters: list[Any]
    expected: dict[str, Any]

    @classmethod
    def of(cls, hf_model: nn.Module) -> HubNames:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, WeightRenaming

        transforms = get_model_conversion_mapping(hf_model)
        # adapters (peft LoRA) keep a wrapped layer's own weights under ``base_layer``; checkpoints use plain names
        expected = {name.replace(".base_layer.", "."): t for name, t in hf_model.state_dict().items()}
        return cls(hf_model, [t for t in transforms if isinstance(t, WeightRenaming)],
                   [t for t in transforms if isinstance(t, WeightConverter)], expected)

    def rename(self, key: str) -> tuple[str, str | None]:
        """(in-memory name, the source pattern of the converter that takes the key, or None)."""
        from transformers.core_model_loading import rename_source_key

        return rename_source_key(key, self.renamings, self.converters, self.model.base_model_prefix, self.expected)

    def __call__(self, key: str) -> str:
        return self.rename(key)[0]
