"""A run's LightningModule rebuilt from its checkpoint's hyperparameters, with its typed configs and no weights.

This is the one place a checkpoint's hyperparameters become typed again. A run started from Python holds the
config dataclasses themselves; a run of ``lightning-moe fit`` (LightningCLI) holds plain dicts plus
``_class_path`` / ``_instantiator``, which jsonargparse turns back into the same dataclasses by the module's
signature, as ``LightningModule.load_from_checkpoint`` does. Exports then ask the module how it built its model
(``resolved_config``, ``pretrained``, ``peft``, ``seed``) instead of reading the dict themselves.
"""

from __future__ import annotations

from typing import Any

from lightning_moe.modules.causal_lm import CausalLM
from lightning_moe.modules.vision_lm import VisionLM


def run_module(checkpoint: dict[str, Any], where: object = "checkpoint") -> CausalLM:
    """The ``CausalLM`` (or ``VisionLM``) of a run, built from ``checkpoint["hyper_parameters"]`` but without a
    model (``configure_model`` was not called). ``where`` names the checkpoint in errors."""
    hparams = dict(checkpoint.get("hyper_parameters") or {})
    if not hparams:
        raise ValueError(f"{where}: the checkpoint has no hyper_parameters; it was not written by a CausalLM run")
    if "_class_path" in hparams:
        from lightning.pytorch.cli import instantiate_module  # jsonargparse: seconds to import, CLI runs only

        hparams.pop("_instantiator", None)
        try:
            module = instantiate_module(CausalLM, hparams)
        except Exception as err:  # jsonargparse reports a bad key or type with several exception types
            raise ValueError(f"{where}: its hyperparameters do not build {hparams['_class_path']} "
                             f"({type(err).__name__}: {err})") from err
        return module
    # a run from Python: the dataclasses were stored as they were; the module class is the one of its task
    cls = VisionLM if checkpoint.get("hf_task") == VisionLM.hf_task else CausalLM
    try:
        return cls(**hparams)
    except TypeError as err:
        raise ValueError(f"{where}: its hyperparameters {sorted(hparams)} do not build {cls.__name__} ({err})") from err
