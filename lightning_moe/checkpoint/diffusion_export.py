"""Writing a trained diffusion transformer: the whole transformer in diffusers' format (``config.json`` +
``diffusion_pytorch_model*.safetensors``, sharded with an index when large: ``from_pretrained`` loads it), or the
LoRA adapters as diffusers' ``pytorch_lora_weights.safetensors`` (``transformer.``-prefixed peft names plus the
adapter config as metadata: the pipeline's ``load_lora_weights`` reads it).

Both are collective under FSDP (each tensor is gathered in turn, every rank taking part) and written by global
rank 0 only, under a temporary name that becomes the output when complete. Other ranks drop each gathered tensor
at once, so no rank but the writer holds the whole model.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from lightning_moe.io.atomic import atomic_directory
from lightning_moe.peft.lora import ADAPTER_NAME, lora_modules
from lightning_moe.peft.merge import full_tensor, merged_state_dict


def _is_writer() -> bool:
    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


@torch.no_grad()
def export_transformer(model: nn.Module, out: str | Path, *, dtype: torch.dtype | None = None,
                       overwrite: bool = False, max_shard_size: str = "10GB") -> Path | None:
    """``model``: a ``DiffusionTransformer`` trained in full (adapters, if any, are folded in first)."""
    from huggingface_hub import save_torch_state_dict

    transformer = model.transformer
    writer = _is_writer()

    def stored(tensor: torch.Tensor) -> torch.Tensor:  # in the export dtype as soon as it is on the host
        tensor = tensor.detach().cpu()
        return (tensor.to(dtype) if dtype is not None and tensor.is_floating_point() else tensor).contiguous()

    if lora_modules(transformer):
        state = {name: stored(t) for name, t in merged_state_dict(transformer).items()} if writer else None
    else:
        state = {}
        for name, tensor in transformer.state_dict().items():
            full = full_tensor(tensor)  # collective
            if writer:
                state[name] = stored(full)
    result = None
    if writer:
        with atomic_directory(out, overwrite=overwrite) as tmp:
            transformer.save_config(tmp)
            save_torch_state_dict(state, tmp, filename_pattern="diffusion_pytorch_model{suffix}.safetensors",
                                  max_shard_size=max_shard_size)
        result = Path(out)
    _barrier()
    return result


@torch.no_grad()
def export_lora(model: nn.Module, out: str | Path, lora, *, overwrite: bool = False) -> Path | None:
    """The adapters of ``model`` (a ``DiffusionTransformer`` with LoRA) and their peft config (``lora``: the
    run's ``LoraConfig``) in diffusers' LoRA layout for the model's pipeline class."""
    import peft

    layers = {}
    owners = lora_modules(model.transformer)
    if not owners:
        raise ValueError("export_lora: the transformer has no LoRA adapters")
    for name, layer in owners.items():
        for which in ("lora_A", "lora_B"):
            full = full_tensor(getattr(layer, which)[ADAPTER_NAME].weight)  # collective
            layers[f"{name}.{which}.weight"] = full.detach().cpu().contiguous()
    result = None
    if _is_writer():
        config = peft.LoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                                 target_modules=sorted(owners))
        metadata = config.to_dict()
        metadata["target_modules"] = sorted(owners)
        with atomic_directory(out, overwrite=overwrite) as tmp:
            model.family.pipeline_class.save_lora_weights(tmp, transformer_lora_layers=layers,
                                                          transformer_lora_adapter_metadata=metadata)
        result = Path(out)
    _barrier()
    return result
