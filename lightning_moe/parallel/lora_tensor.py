"""Tensor parallelism of peft LoRA linears: the adapter is split to match its base layer, so no rank ever holds
a whole base weight or a whole ``B @ A``.

``y = W x + s * B (A x)`` with ``W`` [out, in], ``A`` [r, in], ``B`` [out, r]:

* column-wise (``W`` split by output rows): ``B`` is split by the same rows and ``A`` is whole on every rank.
  ``A x`` is the same everywhere, each rank's ``B`` rows give its output columns; the gradient of ``A`` is a
  partial sum per rank (its rows of ``B``), summed over the group.
* row-wise (``W`` split by input columns, partial outputs summed): ``A`` is split by the same input columns and
  ``B`` is whole. ``A x`` is then a partial sum too, ``B`` is linear, so ``B (A x)`` adds to the base's partial
  output and the one reduce-scatter (or all-reduce) of the layer sums both; ``B``'s gradient is partial per
  rank, summed over the group.

The stacked experts' adapters follow the experts (never split by tensor parallelism: replicated, or split
over ``ep``), and adapters of replicated layers (Mamba-2 mixers, MTP projections, MLA down projections) are
replicated with them.
"""

from __future__ import annotations

from functools import partial

from torch import nn
from torch.distributed.tensor import Partial, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from lightning_moe.parallel.local_params import use_local_parameters

# where each part of a LoRA linear goes, for a base layer split column-wise (Shard(0)) or row-wise (Shard(1))
_PLACEMENTS = {
    "colwise": {"base_layer": Shard(0), "base_bias": Shard(0), "lora_A": Replicate(), "lora_B": Shard(0)},
    "rowwise": {"base_layer": Shard(1), "base_bias": Replicate(), "lora_A": Shard(1), "lora_B": Replicate()},
}


def is_lora_linear(module: nn.Module) -> bool:
    from peft.tuners.lora import Linear as LoraLinear

    return isinstance(module, LoraLinear)


def _check_plain(lora: nn.Module) -> None:
    """Only vanilla LoRA splits this way (DoRA's magnitude needs whole-weight norms)."""
    if getattr(lora, "lora_variant", None):
        raise ValueError(f"tensor parallelism of LoRA variants {sorted(lora.lora_variant)} is not supported; "
                         f"use plain LoRA or tp=1")
    if not isinstance(lora.base_layer, nn.Linear):
        raise ValueError(f"tensor parallelism of a LoRA layer over {type(lora.base_layer).__name__} is not "
                         f"supported (apply LoRA to plain linear layers, or use tp=1)")


def lora_placement(style: str, part: str, leaf: str):
    """Where tensor parallelism puts parameter ``leaf`` of ``part`` of a linear split ``style``-wise."""
    if part == "base_layer" and leaf == "bias":
        return _PLACEMENTS[style]["base_bias"]
    return _PLACEMENTS[style][part]


def lora_parts(linear: nn.Module):
    """(part name, submodule) of a linear that own parameters: the base layer and, for a LoRA linear, every
    adapter's A and B (a plain linear is its own base layer)."""
    if not is_lora_linear(linear):
        yield "base_layer", linear
        return
    lora = linear
    yield "base_layer", lora.base_layer
    for part in ("lora_A", "lora_B"):
        for module in getattr(lora, part).values():
            yield part, module


def _distribute(module: nn.Module, mesh, style: str, part: str) -> None:
    for leaf, param in list(module._parameters.items()):
        if param is not None:
            tensor = distribute_tensor(param.detach(), mesh, [lora_placement(style, part, leaf)])
            module._parameters[leaf] = nn.Parameter(tensor, requires_grad=param.requires_grad)


class _LoraStyle:
    """A torch column/row-wise style whose partition places each part of a LoRA linear (see the module doc)."""

    style: str

    def _partition_lora(self, name: str, module: nn.Module, mesh) -> None:
        part = name.split(".")[0]
        if part in ("base_layer", "lora_A", "lora_B") and module._parameters:
            _distribute(module, mesh, self.style, part)

    def _apply(self, module: nn.Module, device_mesh):
        if not is_lora_linear(module):
            return super()._apply(module, device_mesh)
        _check_plain(module)
        if self.style == "rowwise":
            self.desired_input_layouts = (Shard(-1),)
        return distribute_module(
            module, device_mesh, self._partition_lora,
            partial(self._prepare_input_fn, self.input_layouts, self.desired_input_layouts),
            partial(self._prepare_output_fn, self.output_layouts, self.use_local_output),
        )


class LoraColwiseParallel(_LoraStyle, ColwiseParallel):
    """``ColwiseParallel`` for a peft LoRA linear (a plain ``nn.Linear`` is split as torch splits it)."""

    style = "colwise"


class LoraRowwiseParallel(_LoraStyle, RowwiseParallel):
    """``RowwiseParallel`` for a peft LoRA linear (a plain ``nn.Linear`` is split as torch splits it)."""

    style = "rowwise"


def shard_lora_locally(lora: nn.Module, mesh, style: str) -> None:
    """The same split for a LoRA linear inside a module that computes on local tensors (MLA): each part's
    DTensor parameters are seen as their local shards in its forward; the whole ones' gradients are partial
    per rank and summed over ``mesh``."""
    _check_plain(lora)
    if style == "rowwise" and lora.base_layer.bias is not None:
        raise ValueError("a row-wise split LoRA linear computing on local shards cannot have a bias (each rank "
                         "would add it); use a layer without bias or tp=1")
    for part, module in lora_parts(lora):
        leaves = [leaf for leaf, param in module._parameters.items() if param is not None]
        _distribute(module, mesh, style, part)
        for leaf in leaves:
            replicated = lora_placement(style, part, leaf) == Replicate()
            use_local_parameters(module, grad_placements=[Partial()] if replicated else None, names=[leaf])
