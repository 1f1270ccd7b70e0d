"""Export a LoRA run from its Lightning checkpoint: the HF PEFT adapter and/or the merged HF model.

A LoRA checkpoint holds adapters and buffers only; the frozen weights come back from the run's base, rebuilt
exactly as the run built its model (same config, targets and seed). The run's module, restored from the
checkpoint's hyperparameters (``run_module``), says which base that is, however the recipe named it:
``model: {hf: DIR}`` of a family with a native decoder, ``pretrained: DIR`` (Hugging Face or imported).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lightning_moe.checkpoint.run import model_tensors, read_run_checkpoint
from lightning_moe.peft.lora import is_adapter_parameter


def load_lora_run(ckpt: str | Path) -> tuple[nn.Module, Any]:
    """The adapted model of a LoRA run's Lightning checkpoint (a ``.ckpt`` file or a distributed checkpoint
    directory), and the checkpoint source of its base."""
    path = Path(ckpt).expanduser()
    run = _adapted_model(path, *_read_lora_run(path))
    return run.model, run.source


@dataclass
class LoraRun:
    model: nn.Module
    source: Any  # the checkpoint of the base
    trained: list[str]  # tensors other than adapters the run changed (the router bias of aux-loss-free balancing)


def _adapted_model(path: Path, checkpoint: dict[str, Any], module) -> LoraRun:
    from lightning_moe.checkpoint.load import copy_tensors_into
    from lightning_moe.checkpoint.source import open_checkpoint
    from lightning_moe.models.hf import HFModelConfig
    from lightning_moe.modules.causal_lm import build_decoder

    config = module.resolved_config()  # a model.hf with a native family becomes the run's `pretrained`
    if isinstance(config, HFModelConfig):
        raise ValueError(f"{path}: a LoRA run of a transformers model (model.hf) exports merged (--merged-out, or "
                         f"`lightning-moe convert export --ckpt`); PEFT adapter export covers native models")
    if module.pretrained is None:
        raise ValueError(f"{path}: the run trained adapters on a randomly initialized model (no model.hf or "
                         f"`pretrained` base); a LoRA checkpoint does not hold frozen weights")
    source = open_checkpoint(Path(module.pretrained).expanduser())
    # the checkpoint holds the trained adapters: the run's starting adapter is not needed
    peft = dataclasses.replace(module.peft, adapter_path=None)
    model = build_decoder(config, seed=module.seed, source=source, peft=peft)
    stored = dict(model_tensors(checkpoint))
    copy_tensors_into(model, stored.items())
    trained = sorted(name for name, tensor in stored.items() if not is_adapter_parameter(name)
                     and not torch.equal(tensor, source.get_native(name).to(tensor.dtype)))
    return LoraRun(model.eval(), source, trained)


def _read_lora_run(path: Path):
    """(checkpoint, the run's module without its model); refuses a run without LoRA."""
    from lightning_moe.modules.restore import run_module

    checkpoint = read_run_checkpoint(path)
    module = run_module(checkpoint, path)
    if module.peft is None:
        raise ValueError(f"{path}: the run has no `peft` settings, so it is not a LoRA run")
    return checkpoint, module


def export_lora_run(ckpt: str | Path, *, adapter_out: str | Path | None = None, merged_out: str | Path | None = None,
                    dtype: torch.dtype | None = None, overwrite: bool = False) -> list[Path]:
    """Write the run's HF PEFT adapter (``adapter_out``) and/or merged HF model (``merged_out``)."""
    from lightning_moe.models.hf import HFModelConfig
    from lightning_moe.peft.hf_adapter import export_hf_adapter
    from lightning_moe.peft.merge import export_merged_hf

    if adapter_out is None and merged_out is None:
        raise ValueError("export_lora_run: give adapter_out and/or merged_out")
    checkpoint, module = _read_lora_run(Path(ckpt).expanduser())
    if isinstance(module.resolved_config(), HFModelConfig) and adapter_out is None:
        from lightning_moe.checkpoint.hf_model import export_hf_run

        return [export_hf_run(checkpoint, merged_out, module=module, dtype=dtype, overwrite=overwrite)]
    run = _adapted_model(Path(ckpt).expanduser(), checkpoint, module)
    hf_config = getattr(run.source, "hf_config", None)
    written = []
    if adapter_out is not None:
        written.append(export_hf_adapter(run.model, adapter_out, hf_config=hf_config, trained=run.trained,
                                         dtype=dtype, overwrite=overwrite))
    if merged_out is not None:
        written.append(export_merged_hf(run.model, merged_out, hf_config=hf_config, dtype=dtype,
                                        aux_dir=run.source.directory, overwrite=overwrite))
    return written
