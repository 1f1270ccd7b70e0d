"""Distributed checkpoints of pipelined runs: optimizer states keyed by parameter name.

Torch's default optimizer state dict keeps ``param_groups`` as a list per rank; the ranks of a pipeline hold
different parameters, so their lists differ under the same keys and a distributed checkpoint keeps only one of
them. The flattened form (``param_groups.<name>.lr``, ``state.<name>.exp_avg``) names every entry by its
parameter, as torchtitan saves pipelined runs; such a checkpoint loads on any ``pp``/``vp`` or mesh, pipelined or
not, through the same flattened form.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lightning_moe.io.training import LIGHTNING_METADATA


def flat_options(**kwargs):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(flatten_optimizer_state_dict=True, **kwargs)


def flattened_optimizer_state(model, optimizer) -> dict[str, Any]:
    """What a pipelined run saves for ``optimizer`` (CPU copies)."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    return get_optimizer_state_dict(model, optimizer, options=flat_options(cpu_offload=True))


def has_flattened_optimizer_state(path: Path) -> bool:
    """Whether the distributed checkpoint at ``path`` holds flattened optimizer states (see above)."""
    from torch.distributed.checkpoint import FileSystemReader

    if not path.is_dir():
        return False
    keys = FileSystemReader(str(path)).read_metadata().state_dict_metadata
    groups = [k for k in keys if k.startswith("optimizer_0.param_groups.")]
    return bool(groups) and not any(k.startswith("optimizer_0.param_groups.0.") for k in groups)


def load_flattened(path: Path, model, optimizers: list, strict: bool = True,
                   weights_only: bool | None = None) -> dict[str, Any]:
    """Read a checkpoint with flattened optimizer states into ``model`` (the LightningModule, any layout) and
    ``optimizers``; returns the rest of the checkpoint (loops, callbacks, data module, schedulers)."""
    import torch
    from torch.distributed.checkpoint import load
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )


    state = {"state_dict": get_model_state_dict(model)}
    load(state, checkpoint_id=path)
    set_model_state_dict(model, state["state_dict"], options=flat_options(strict=strict))
    for i, optimizer in enumerate(optimizers):
        key = f"optimizer_{i}"
        optimizer_state = {key: get_optimizer_state_dict(model, optimizer, options=flat_options())}
        load(optimizer_state, checkpoint_id=path)
        set_optimizer_state_dict(model, optimizer, optim_state_dict=optimizer_state[key], options=flat_options())
    return torch.load(path / LIGHTNING_METADATA, weights_only=weights_only)
