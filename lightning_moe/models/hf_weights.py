"""Hub safetensors into a (sharded) transformers model, by the model's own conversion mapping.

transformers 5 renames checkpoint keys on load (Nemotron-H's ``backbone.layers.0`` is ``model.layers.0`` in
memory) and fuses per-expert tensors into one parameter (``experts.0.up_proj.weight`` ... ->
``experts.up_proj``): the mapping ``from_pretrained`` applies. Loading streams the checkpoint one conversion
group at a time and :func:`copy_tensors_into` puts each full tensor into the parameters, where FSDP/TP shards
keep only their slice; adapter layouts (``peft.hf_adapter``) name tensors by the same mapping (:class:`HubNames`).
"""

from __future__ import annotations

import copy
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lightning_moe.io.safetensors_io import SafetensorsDir
from lightning_moe.models.weights import copy_tensors_into


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


def _ignored(patterns) -> re.Pattern | None:
    patterns = list(patterns or [])
    return re.compile("|".join(f"({p})" for p in patterns)) if patterns else None


def iter_model_tensors(hf_model: nn.Module, reader: SafetensorsDir,
                       elsewhere: frozenset[str] = frozenset()) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors under the model's in-memory names, one conversion group at a time.

    Raises on a checkpoint tensor the model has no place for (unless the model declares it ignorable, e.g.
    Qwen3-Next's ``mtp.*``, or ``elsewhere`` names it: held by another pipeline stage's rank)."""
    from transformers.core_model_loading import WeightConverter, WeightRenaming, dot_natural_key

    names = HubNames.of(hf_model)
    by_pattern = {pattern: c for c in names.converters for pattern in c.source_patterns}
    ignored = _ignored(getattr(hf_model, "_keys_to_ignore_on_load_unexpected", None))
    groups: dict[str, WeightRenaming | WeightConverter] = {}
    for key in sorted(reader.keys(), key=dot_natural_key):
        name, pattern = names.rename(key)
        if name not in names.expected:
            if name in elsewhere or (ignored is not None and ignored.search(key)):
                continue
            raise ValueError(f"{reader.directory}: checkpoint tensor {key!r} has no counterpart in "
                             f"{type(hf_model).__name__} (is this the right checkpoint for the model?)")
        if pattern is None:
            group, pattern = groups.setdefault(name, WeightRenaming(key, name)), key
        else:
            group = groups.setdefault(name, copy.deepcopy(by_pattern[pattern]))
        # read lazily: a group's tensors are loaded only when the group is converted
        group.add_tensor(name, key, pattern, lambda key=key: reader.get(key))
    for first, group in groups.items():
        for name, tensor in group.convert(first, model=hf_model, config=hf_model.config).items():
            yield name, tensor[0] if isinstance(tensor, list) else tensor


def load_hf_weights(hf_model: nn.Module, directory: str | Path, elsewhere: frozenset[str] = frozenset()) -> int:
    """Copy a Hugging Face checkpoint into ``hf_model`` (materialized, possibly sharded); returns the tensor count.
    Every persistent tensor of the model must come from the checkpoint (tied ones excepted); tensors named in
    ``elsewhere`` (other pipeline stages') are skipped."""
    return load_hub_tensors(hf_model, SafetensorsDir(directory), elsewhere)


class HubTensors:
    """Hub-named tensors in memory, read like a :class:`SafetensorsDir` (``directory`` names them in errors)."""

    def __init__(self, tensors: dict[str, torch.Tensor], directory: str) -> None:
        self.tensors, self.directory = tensors, directory

    def keys(self) -> list[str]:
        return list(self.tensors)

    def get(self, name: str) -> torch.Tensor:
        return self.tensors[name]

    def close(self) -> None:
        self.tensors = {}


def load_hub_tensors(hf_model: nn.Module, reader: SafetensorsDir | HubTensors,
                     elsewhere: frozenset[str] = frozenset()) -> int:
    """:func:`load_hf_weights` from a reader of hub-named tensors (a directory's files, or tensors in memory);
    closes the reader."""
    directory = reader.directory
    loaded: set[str] = set()

    def tensors():
        for name, tensor in iter_model_tensors(hf_model, reader, elsewhere):
            loaded.add(name)
            yield name, tensor

    try:
        count = copy_tensors_into(hf_model, tensors())
    finally:
        reader.close()
    # a tied tensor needs no checkpoint entry only while it really is its source (else it was never loaded)
    tied = {target for target, source in (getattr(hf_model, "all_tied_weights_keys", None) or {}).items()
            if hf_model.get_parameter(target) is hf_model.get_parameter(source)}
    optional = _ignored(getattr(hf_model, "_keys_to_ignore_on_load_missing", None))
    missing = sorted(n for n in hf_model.state_dict() if n not in loaded and n not in tied
                     and ".lora_" not in n and not (optional is not None and optional.search(n)))
    missing = [n for n in missing if n.replace(".base_layer.", ".") not in loaded]
    if missing:
        more = f" (+{len(missing) - 3} more)" if len(missing) > 3 else ""
        raise ValueError(f"{directory}: the checkpoint has no tensor for {', '.join(missing[:3])}{more} of "
                         f"{type(hf_model).__name__}; a partial checkpoint would start those weights at random")
    return count
