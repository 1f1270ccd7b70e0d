"""Whether a transformers model keeps the samples of a packed row apart.

transformers builds a document-aware mask from restarting ``position_ids`` only where a model's code hands them to
its mask builders (``masking_utils.create_causal_mask(..., position_ids=...)``). Some do not (GPT-OSS in
transformers 5.24, several older architectures): their packed samples would attend to each other without any
error. :class:`PackedMaskCheck` looks, on the first forward of a packed row, at the masks the decoder layers
receive: the first token of a later sample must not see the token before it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn


def first_restart(position_ids: torch.Tensor) -> tuple[int, int] | None:
    """(row, index) of the first token that starts a later sample of its row; None when no row is packed."""
    restarts = position_ids[:, 1:] == 0
    if not bool(restarts.any()):  # one host sync, until a packed row has been checked
        return None
    row, index = torch.nonzero(restarts)[0].tolist()
    return row, index + 1


def separates(mask, row: int, index: int) -> bool | None:
    """Whether ``mask`` (a layer's ``attention_mask``) keeps token ``index`` of ``row`` from the token before it;
    None for masks this does not read (flex block masks, other layouts)."""
    if mask is None:  # plain causal attention over the whole row
        return False
    if not isinstance(mask, torch.Tensor) or mask.dim() != 4:
        return None
    value = mask[row if mask.shape[0] > 1 else 0, 0, index, index - 1]
    if mask.dtype == torch.bool:
        return not bool(value)
    return bool(value < torch.finfo(mask.dtype).min / 2)


class PackedMaskCheck:
    """Checks once per model, on the first packed row, that every decoder layer's mask separates the samples."""

    def __init__(self, hf_model: nn.Module, enabled: bool = True) -> None:
        from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

        self.name = type(hf_model).__name__
        self.config = hf_model.config  # its attention implementation may change later (context parallelism)
        # vision-language models (other sub-models, 3-D positions) are not checked
        self.done = not enabled or bool([key for key in getattr(self.config, "sub_configs", {}) if key != "text_config"])
        self._mask_implementations = ALL_MASK_ATTENTION_FUNCTIONS._global_mapping

    @contextlib.contextmanager
    def around(self, layers: list[nn.Module], position_ids: torch.Tensor | None) -> Iterator[None]:
        """Run the forward inside this; raises after it where a layer's mask lets a sample see the one before."""
        # implementations transformers builds no mask for (the context-parallel attention) mask by themselves
        skip = (self.done or position_ids is None or position_ids.ndim != 2
                or self.config._attn_implementation not in self._mask_implementations)
        where = None if skip else first_restart(position_ids)
        if where is None:
            yield
            return
        masks: list = []

        def capture(module, args, kwargs):
            if "attention_mask" in kwargs:
                masks.append(kwargs["attention_mask"])

        handles = [layer.register_forward_pre_hook(capture, with_kwargs=True) for layer in layers]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()
        verdicts = [separates(mask, *where) for mask in masks]
        if any(verdict is False for verdict in verdicts):
            raise ValueError(f"{self.name} cannot train on packed rows: its transformers code builds the attention "
                             f"mask without position_ids, so packed samples would attend to each other; use one "
                             f"sample per row (data packing: none)")
        self.done = bool(masks)
