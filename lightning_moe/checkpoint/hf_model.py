"""Checkpoint I/O of the generic transformers path: hub safetensors into a (sharded) transformers model, and back.

Loading streams the checkpoint one conversion group at a time: transformers' own weight-conversion mapping
(the one ``from_pretrained`` uses, e.g. hub per-expert tensors fused into one ``experts.gate_up_proj``) turns
hub tensors into the model's in-memory names, and :func:`copy_tensors_into` puts each full tensor into the
parameters, where FSDP/TP shards keep only their slice. Exporting writes what ``save_pretrained`` writes
for the same weights (hub names, transformers' reverse conversion), gathered from the shards.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lightning_moe.checkpoint.atomic import atomic_directory
from lightning_moe.checkpoint.load import copy_tensors_into
from lightning_moe.checkpoint.safetensors_io import SafetensorsDir
from lightning_moe.models.hf_names import HubNames


def _ignored(patterns) -> re.Pattern | None:
    patterns = list(patterns or [])
    return re.compile("|".join(f"({p})" for p in patterns)) if patterns else None


def iter_model_tensors(hf_model: nn.Module, reader: SafetensorsDir) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors under the model's in-memory names, one conversion group at a time.

    Raises on a checkpoint tensor the model has no place for (unless the model declares it ignorable, e.g.
    Qwen3-Next's ``mtp.*``)."""
    from transformers.core_model_loading import WeightConverter, WeightRenaming, dot_natural_key

    names = HubNames.of(hf_model)
    by_pattern = {pattern: c for c in names.converters for pattern in c.source_patterns}
    ignored = _ignored(getattr(hf_model, "_keys_to_ignore_on_load_unexpected", None))
    groups: dict[str, WeightRenaming | WeightConverter] = {}
    for key in sorted(reader.keys(), key=dot_natural_key):
        name, pattern = names.rename(key)
        if name not in names.expected:
            if ignored is not None and ignored.search(key):
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


def load_hf_weights(hf_model: nn.Module, directory: str | Path) -> int:
    """Copy a Hugging Face checkpoint into ``hf_model`` (materialized, possibly sharded); returns the tensor count.
    Every persistent tensor of the model must come from the checkpoint (tied ones excepted)."""
    reader = SafetensorsDir(directory)
    loaded: set[str] = set()

    def tensors():
        for name, tensor in iter_model_tensors(hf_model, reader):
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


def gathered_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Full CPU tensors of a (possibly FSDP/TP-sharded) model with adapters folded in; collective: call on every
    rank. transformers' own names (no ``base_layer``, no adapters)."""
    from lightning_moe.peft.merge import merged_state_dict

    return {name: tensor.detach().cpu() for name, tensor in merged_state_dict(model).items()}


def export_hf_model(hf_model: nn.Module, out: str | Path, *, dtype: torch.dtype | None = None,
                    aux_dir: str | Path | None = None, overwrite: bool = False,
                    max_shard_size: int | str = "5GB") -> Path:
    """Write ``hf_model`` (a transformers model, possibly sharded or with LoRA adapters) as a directory that
    ``from_pretrained`` loads: the files ``save_pretrained`` writes for the same weights. Collective under
    torch.distributed (every rank gathers, rank 0 writes); written completely or not at all."""
    from lightning_moe.checkpoint.convert import copy_aux_files

    state = gathered_state_dict(hf_model)
    if dist.is_available() and dist.is_initialized() and dist.get_rank() != 0:
        dist.barrier()
        return Path(out)
    if dtype is not None:
        state = {n: t.to(dtype) if t.is_floating_point() else t for n, t in state.items()}
    config = copy.deepcopy(hf_model.config)
    if dtype is not None:
        config.dtype = dtype
    try:
        with atomic_directory(out, overwrite=overwrite) as tmp:
            if aux_dir is not None:
                copy_aux_files(Path(aux_dir), tmp)
            original, hf_model.config = hf_model.config, config
            try:
                hf_model.save_pretrained(tmp, state_dict=state, max_shard_size=max_shard_size)
            finally:
                hf_model.config = original
    finally:
        if dist.is_available() and dist.is_initialized():
            dist.barrier()
    return Path(out)


def export_hf_run(checkpoint: dict[str, Any], out: str | Path, *, module, dtype: torch.dtype | None = None,
                  overwrite: bool = False) -> Path:
    """The model of a generic-path run (``CausalLM``/``VisionLM`` with ``model: {hf: ...}``), from its Lightning
    checkpoint read by ``read_run_checkpoint`` and its module restored by ``run_module`` -> a Hugging Face
    directory. LoRA runs are exported merged; their checkpoints hold only adapters, the base comes from
    ``model.hf`` as in the run."""
    from lightning_moe.checkpoint.run import model_tensors
    from lightning_moe.models.hf import build_hf_model, hf_converters

    cfg = module.model_config
    # the run's module class decides (a VisionLM of Qwen3.5 is not its causal-LM class); older runs: the model type
    task = checkpoint.get("hf_task") or _task_of_model_type(cfg)
    model = build_hf_model(cfg, task=task, convert=hf_converters(peft=module.peft), seed=module.seed)
    copy_tensors_into(model, model_tensors(checkpoint))
    return export_hf_model(model.hf, out, dtype=dtype, aux_dir=model.model_dir, overwrite=overwrite)


def _task_of_model_type(cfg) -> str:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    from lightning_moe.models.hf import read_config_json, resolve_model_dir

    causal = read_config_json(resolve_model_dir(cfg)).get("model_type") in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    return "causal-lm" if causal else "image-text-to-text"
