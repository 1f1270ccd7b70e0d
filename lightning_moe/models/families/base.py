"""What a family file provides: HF config <-> ModelConfig, and the weight-name map both ways.

A :class:`TensorMap` ties one native tensor to the hub tensor(s) it is made of. Most are renames; stacked
experts gather one hub tensor per expert; a few hub tensors hold several native ones (``joint``, e.g. GPT-OSS's
interleaved gate/up experts). Both directions are exact (stack/unbind, slicing), so an import followed by an
export is bitwise.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from lightning_moe.models.config import ModelConfig


def _single(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    return tensors[0]


def _as_list(tensor: torch.Tensor) -> list[torch.Tensor]:
    return [tensor]


def _stack(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    return torch.stack(list(tensors))


def _unbind(tensor: torch.Tensor) -> list[torch.Tensor]:
    return list(tensor.unbind(0))


@dataclass
class TensorMap:
    """``native`` tensor = ``to_native(hub tensors named hf)``; hub tensors = ``to_hf(native tensor)``."""

    native: str
    hf: tuple[str, ...]
    to_native: Callable[[Sequence[torch.Tensor]], torch.Tensor] = _single
    to_hf: Callable[[torch.Tensor], list[torch.Tensor]] = _as_list
    # further native tensors made from the same hub tensors: then ``to_native`` returns one tensor per name
    # in ``natives`` and ``to_hf`` takes them all, in that order
    joint: tuple[str, ...] = ()

    @property
    def natives(self) -> tuple[str, ...]:
        return (self.native, *self.joint)

    @property
    def stacks_experts(self) -> bool:
        """One hub tensor per expert, stacked along dim 0: rows ``a:b`` of the native tensor are hub tensors
        ``hf[a:b]`` (what lets each rank of a distributed conversion read and write only its experts)."""
        return self.to_native is _stack and self.to_hf is _unbind and not self.joint

    def natives_from_hf(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        out = self.to_native(tensors)
        return list(out) if self.joint else [out]

    def hf_from_natives(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        return self.to_hf(*tensors)

    @classmethod
    def rename(cls, native: str, hf: str) -> TensorMap:
        return cls(native, (hf,))

    @classmethod
    def stacked(cls, native: str, hf_per_expert: Sequence[str]) -> TensorMap:
        return cls(native, tuple(hf_per_expert), _stack, _unbind)


@dataclass
class Family:
    """One Hugging Face architecture. Subclasses implement the three translations."""

    name: str
    architectures: tuple[str, ...]
    model_type: str
    # substrings of hub tensor names that carry no weights, skipped on import: rotary tables that transformers
    # saved as buffers until 2023 (Llama-2's hub files hold ``model.layers.{i}.self_attn.rotary_emb.inv_freq``)
    ignored_hf_tensors: tuple[str, ...] = field(default=("rotary_emb.inv_freq",))

    def from_hf_config(self, hf: dict[str, Any]) -> ModelConfig:
        raise NotImplementedError

    def to_hf_config(self, cfg: ModelConfig) -> dict[str, Any]:
        raise NotImplementedError

    def weight_map(self, cfg: ModelConfig) -> list[TensorMap]:
        raise NotImplementedError

    def from_hf_checkpoint(self, hf: dict[str, Any], tensor_names: Collection[str]) -> ModelConfig:
        """The config of a hub checkpoint whose tensor names are known. Families override it to leave out
        optional parts a checkpoint lacks (transformers saves DeepSeek-V3 without its MTP layers)."""
        return self.from_hf_config(hf)

    def hf_quantization_config(self, method: str) -> dict[str, Any] | None:
        """``quantization_config`` of this family's hub checkpoints in layout ``method`` (fp8-block, mxfp4),
        or None when the hub has no such layout for it."""
        return None

    def quantizes(self, hf_name: str, method: str) -> bool:
        """Whether the hub's ``method`` layout stores this tensor quantized."""
        return False

    def hub_encoding(self, hf_name: str, method: str) -> str | None:
        """How the hub's ``method`` layout stores this tensor: ``fp8-block``, ``mxfp4``, or None (unquantized).
        A layout that mixes encodings (MiMo-V2.6's ``fp8-mxfp4``) overrides this."""
        return method if self.quantizes(hf_name, method) else None

    def quantization_row_shards(self, hf_name: str, hf: dict[str, Any]) -> int:
        """Row shards of this hub tensor that block-FP8 layouts quantize each on its own tile grid (1: one grid)."""
        return 1


def require(hf: dict[str, Any], key: str, architecture: str, *aliases: str) -> Any:
    """A key the family cannot guess (or one of its older ``aliases``): a clear error when config.json lacks it."""
    for name in (key, *aliases):
        if hf.get(name) is not None:
            return hf[name]
    raise ValueError(f"config.json ({architecture}): required key {key!r} is missing")


def rope_parameters(hf: dict[str, Any]) -> dict[str, Any]:
    """transformers 5 keeps rope settings in ``rope_parameters``; older configs use rope_theta/rope_scaling."""
    params = dict(hf.get("rope_parameters") or {})
    if not params:
        params = dict(hf.get("rope_scaling") or {})
        params.setdefault("rope_theta", hf.get("rope_theta", 10000.0))
    if "type" in params and "rope_type" not in params:
        params["rope_type"] = params.pop("type")
    params.setdefault("rope_type", "default")
    return params
