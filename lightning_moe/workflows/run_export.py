"""A training run's Lightning checkpoint exported as a Hugging Face model, and a LoRA run's as a PEFT adapter.

The run's module is restored from the checkpoint's hyperparameters (``modules.restore.run_module``) and says how
the run built its model: native full fine-tuning and pretraining runs hold every weight and export through the
family weight map (with the original hub ``config.json`` when the run started from a hub directory);
transformers-path runs (``model: {hf: ...}`` trained through transformers) export as ``save_pretrained`` writes;
LoRA runs hold adapters and buffers only, and the frozen weights come back from the run's base, rebuilt exactly as
the run built its model (same config, targets and seed), however the recipe named the base: ``model: {hf: DIR}``
of a family with a native decoder, ``pretrained: DIR`` (Hugging Face or imported).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lightning_moe.checkpoint.convert import export_hf_tensors
from lightning_moe.checkpoint.hf_model import export_hf_model
from lightning_moe.checkpoint.load import copy_tensors_into
from lightning_moe.checkpoint.merged_export import export_merged_hf
from lightning_moe.checkpoint.source import expected_tensors, open_checkpoint
from lightning_moe.io.run import model_tensor_keys, model_tensors, read_run_checkpoint
from lightning_moe.models.hf import (
    HFModelConfig,
    build_hf_model,
    hf_converters,
    model_dir,
    read_config_json,
    resolve_model_dir,
)
from lightning_moe.modules.restore import run_module
from lightning_moe.peft.hf_adapter import export_hf_adapter, export_transformers_adapter
from lightning_moe.peft.lora import is_adapter_parameter
from lightning_moe.workflows.run_files import base_model_name, run_files


def export_run(ckpt: str | Path, out: str | Path, *, dtype: torch.dtype | None = None, quantize: str | None = None,
               max_shard_bytes: int | None = None, overwrite: bool = False) -> Path:
    """The model of a ``CausalLM`` run (native, LoRA or transformers path) -> a Hugging Face directory.
    ``quantize`` and ``max_shard_bytes`` apply to native runs only (the others write as ``save_pretrained`` does)."""
    checkpoint = read_run_checkpoint(ckpt)
    module = run_module(checkpoint, ckpt)
    config = module.resolved_config()  # a model.hf with a native family trained the native decoder
    transformers_path = isinstance(config, HFModelConfig)
    if (transformers_path or module.peft is not None) and quantize is not None:
        raise ValueError(f"{ckpt}: quantize={quantize!r} applies to native full-weight runs, not LoRA or model.hf runs")
    if transformers_path:
        return export_hf_run(checkpoint, out, module=module, dtype=dtype, overwrite=overwrite)
    if module.peft is not None:
        return export_lora_run(ckpt, merged_out=out, dtype=dtype, overwrite=overwrite)[0]
    sharding = {} if max_shard_bytes is None else {"max_shard_bytes": max_shard_bytes}
    return _export_native_run(ckpt, checkpoint, module, out, dtype=dtype, quantize=quantize, overwrite=overwrite,
                              **sharding)


def _export_native_run(ckpt, checkpoint: dict[str, Any], module, out, **options) -> Path:
    source = open_checkpoint(model_dir(module.pretrained, "pretrained")) if module.pretrained else None
    config = module.resolved_config()
    # names only: each tensor is read when the export writes it (a distributed checkpoint reads it from its shards)
    stored, keys = checkpoint["state_dict"], model_tensor_keys(checkpoint)
    missing = sorted(set(expected_tensors(config)) - set(keys))
    if missing:
        raise ValueError(f"{ckpt}: the checkpoint lacks {len(missing)} model tensor(s), e.g. {missing[0]!r}")
    with run_files(checkpoint, module) as aux_dir:
        return export_hf_tensors(config, lambda name: stored[keys[name]], out,
                                 hf_config=getattr(source, "hf_config", None), aux_dir=aux_dir, **options)


def export_hf_run(checkpoint: dict[str, Any], out: str | Path, *, module, dtype: torch.dtype | None = None,
                  overwrite: bool = False) -> Path:
    """The model of a generic-path run (``CausalLM``/``VisionLM`` with ``model: {hf: ...}``), from its Lightning
    checkpoint read by ``read_run_checkpoint`` and its module restored by ``run_module`` -> a Hugging Face
    directory. LoRA runs are exported merged; their checkpoints hold only adapters, the base comes from
    ``model.hf`` as in the run."""
    model, _ = _hf_run_model(checkpoint, module)
    with run_files(checkpoint, module) as aux_dir:
        return export_hf_model(model.hf, out, dtype=dtype, aux_dir=aux_dir, overwrite=overwrite)


def _hf_run_model(checkpoint: dict[str, Any], module) -> tuple[Any, str]:
    """(the run's transformers model with its trained weights or adapters, its task)."""
    cfg = module.model_config
    # the run's module class decides (a VisionLM of Qwen3.5 is not its causal-LM class); older runs: the model type
    task = checkpoint.get("hf_task") or _task_of_model_type(cfg)
    model = build_hf_model(cfg, task=task, convert=hf_converters(peft=module.peft), seed=module.seed)
    copy_tensors_into(model, model_tensors(checkpoint))
    return model, task


def _task_of_model_type(cfg) -> str:
    # transformers' import takes seconds: only runs of the transformers path need its class table
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    causal = read_config_json(resolve_model_dir(cfg)).get("model_type") in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    return "causal-lm" if causal else "image-text-to-text"


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
    config = module.resolved_config()  # a model.hf with a native family becomes the run's `pretrained`
    if isinstance(config, HFModelConfig):
        raise ValueError(f"{path}: the run trained a transformers model (model.hf), not the native decoder; "
                         f"export_lora_run exports it")
    if module.pretrained is None:
        raise ValueError(f"{path}: the run trained adapters on a randomly initialized model (no model.hf or "
                         f"`pretrained` base); a LoRA checkpoint does not hold frozen weights")
    source = open_checkpoint(model_dir(module.pretrained, "pretrained"))
    model = module.build_inference_model()  # the base's weights and fresh adapters, for the trained ones
    stored = dict(model_tensors(checkpoint))
    copy_tensors_into(model, stored.items())
    trained = sorted(name for name, tensor in stored.items() if not is_adapter_parameter(name)
                     and not torch.equal(tensor, source.get_native(name).to(tensor.dtype)))
    return LoraRun(model.eval(), source, trained)


def _read_lora_run(path: Path):
    """(checkpoint, the run's module without its model); refuses a run without LoRA."""
    checkpoint = read_run_checkpoint(path)
    module = run_module(checkpoint, path)
    if module.peft is None:
        raise ValueError(f"{path}: the run has no `peft` settings, so it is not a LoRA run")
    return checkpoint, module


def export_lora_run(ckpt: str | Path, *, adapter_out: str | Path | None = None, merged_out: str | Path | None = None,
                    dtype: torch.dtype | None = None, overwrite: bool = False) -> list[Path]:
    """Write the run's HF PEFT adapter (``adapter_out``) and/or merged HF model (``merged_out``)."""
    if adapter_out is None and merged_out is None:
        raise ValueError("export_lora_run: give adapter_out and/or merged_out")
    checkpoint, module = _read_lora_run(Path(ckpt).expanduser())
    if isinstance(module.resolved_config(), HFModelConfig):
        return _export_transformers_lora_run(ckpt, checkpoint, module, adapter_out, merged_out, dtype, overwrite)
    run = _adapted_model(Path(ckpt).expanduser(), checkpoint, module)
    hf_config = getattr(run.source, "hf_config", None)
    written = []
    with run_files(checkpoint, module) as aux_dir:
        if adapter_out is not None:
            written.append(export_hf_adapter(run.model, adapter_out, hf_config=hf_config, trained=run.trained,
                                             dtype=dtype, base_model=base_model_name(module), aux_dir=aux_dir,
                                             overwrite=overwrite))
        if merged_out is not None:
            written.append(export_merged_hf(run.model, merged_out, hf_config=hf_config, dtype=dtype, aux_dir=aux_dir,
                                            overwrite=overwrite))
    return written


def _export_transformers_lora_run(ckpt, checkpoint: dict[str, Any], module, adapter_out, merged_out,
                                  dtype: torch.dtype | None, overwrite: bool) -> list[Path]:
    model, task = _hf_run_model(checkpoint, module)
    if adapter_out is not None and task != "causal-lm":
        raise ValueError(f"{ckpt}: PEFT adapter export of a transformers-path run covers causal LMs, this run "
                         f"trained a {task} model; export it merged (--merged-out)")
    written = []
    with run_files(checkpoint, module) as aux_dir:
        if adapter_out is not None:
            written.append(export_transformers_adapter(model.hf, adapter_out, dtype=dtype,
                                                       base_model=base_model_name(module), aux_dir=aux_dir,
                                                       overwrite=overwrite))
        if merged_out is not None:
            written.append(export_hf_model(model.hf, merged_out, dtype=dtype, aux_dir=aux_dir, overwrite=overwrite))
    return written
