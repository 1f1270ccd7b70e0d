"""A run's module back from a checkpoint ``fit`` wrote, for inference (``CausalLM.load_from_checkpoint``).

Lightning's own loader reads single files only and replays what a resumed run needs (the training RNG states);
this one reads either kind of checkpoint (a ``.ckpt`` file, memory-mapped, or a distributed checkpoint directory,
one tensor at a time from its shards, optimizer states never read), checks it is complete first (a truncated
file is named, not torch's "failed finding central directory"), and builds the model unsharded on one process.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from lightning_moe.io.run import read_run_checkpoint


def instantiate_from_hparams(cls: type, hparams: dict[str, Any], where: object) -> Any:
    """``cls`` (or the subclass a ``lightning-moe fit`` run recorded) built from a checkpoint's hyperparameters:
    the config dataclasses of a run from Python as stored, the plain dicts of a LightningCLI run (``_class_path``)
    typed again by jsonargparse, as ``LightningModule.load_from_checkpoint`` does."""
    hparams = dict(hparams)
    if not hparams:
        raise ValueError(f"{where}: the checkpoint has no hyper_parameters; it was not written by a {cls.__name__} run")
    if "_class_path" in hparams:
        from lightning.pytorch.cli import instantiate_module  # jsonargparse: seconds to import, CLI runs only

        hparams.pop("_instantiator", None)
        try:
            return instantiate_module(cls, hparams)
        except Exception as err:  # jsonargparse reports a bad key or type with several exception types
            raise ValueError(f"{where}: its hyperparameters do not build {hparams['_class_path']} "
                             f"({type(err).__name__}: {err})") from err
    try:
        return cls(**hparams)
    except TypeError as err:
        raise ValueError(f"{where}: its hyperparameters {sorted(hparams)} do not build {cls.__name__} ({err})") from err


def load_run_module(cls: type, path: str | Path, *, device: Any = None, strict: bool = True,
                    overrides: dict[str, Any] | None = None) -> Any:
    """The ``cls`` module of checkpoint ``path`` with its trained weights, in eval mode on ``device`` (default
    CPU); ``overrides`` replace hyperparameters."""
    path = Path(path).expanduser()
    checkpoint = read_run_checkpoint(path)
    hparams = {**(checkpoint.get("hyper_parameters") or {}), **(overrides or {})}
    module = instantiate_from_hparams(cls, hparams, path)
    if not isinstance(module, cls):
        raise ValueError(f"{path}: the checkpoint holds a {type(module).__name__}, not a {cls.__name__}")
    module.configure_model()  # without a trainer: the inference model
    state = checkpoint["state_dict"]
    try:
        module.load_state_dict(state if isinstance(state, dict) else {k: state[k] for k in state}, strict=strict)
    except RuntimeError as err:
        raise ValueError(f"{path}: the checkpoint's weights do not fit the model its hyperparameters build "
                         f"({err})") from None
    return module.eval().to(torch.device(device) if isinstance(device, (str, torch.device)) else "cpu")
