"""A recipe as the estimate needs it: its YAML with command-line overrides, the typed module and the layout.

Nothing is launched: the trainer is not built (a 64-GPU recipe is read on a laptop), the data module is not
set up, and the model's configuration is read from the recipe, a checkpoint directory or a hub config.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from lightning_moe.models.config import ModelConfig
from lightning_moe.row_length import row_length


@dataclass
class RecipeLayout:
    """What decides a rank's memory, from the recipe."""

    path: str
    model: ModelConfig
    fp8: Any
    peft: Any
    freeze: list[str] | None
    precision: str
    accelerator: str
    world_size: int
    strategy: dict[str, Any]
    micro_batch_size: int
    seq_length: int
    hardware: str | None
    global_batch_size: int | None = None  # the data module's rows per optimizer step (None: one micro-batch per rank)


def apply_overrides(config: dict, overrides: list[str]) -> dict:
    """``--a.b.c VALUE`` / ``--a.b.c=VALUE`` pairs set nested keys (values read as YAML)."""
    items = list(overrides)
    while items:
        key = items.pop(0)
        if not key.startswith("--"):
            raise ValueError(f"override {key!r}: expected --dotted.key VALUE")
        key, _, value = key[2:].partition("=")
        if not _:
            if not items:
                raise ValueError(f"override --{key} has no value")
            value = items.pop(0)
        node = config
        parts = key.split(".")
        for part in parts[:-1]:
            if not isinstance(node.get(part), dict):
                node[part] = {}
            node = node[part]
        node[parts[-1]] = yaml.safe_load(value)
    return config


def _instantiate_module(model_section: dict):
    from jsonargparse import ArgumentParser
    from lightning.pytorch import LightningModule

    import lightning_moe.modules  # noqa: F401  (short class names for jsonargparse)

    parser = ArgumentParser(exit_on_error=False)
    parser.add_subclass_arguments(LightningModule, "model")
    return parser.instantiate_classes(parser.parse_object({"model": model_section})).model


def model_config_of(module) -> ModelConfig:
    """The native ``ModelConfig`` the module would build: spelled out, or read from a directory's config.json,
    or a hub id's config (the hub must then be reachable or cached)."""
    from lightning_moe.models.hf import HFModelConfig

    spec = module.model_config
    if isinstance(spec, ModelConfig):
        return spec
    if isinstance(spec, HFModelConfig) and spec.native != "never" and not Path(spec.hf).expanduser().is_dir():
        from transformers import AutoConfig

        from lightning_moe.models.families import family_for_hf_config

        hf = AutoConfig.from_pretrained(spec.hf, revision=spec.revision,
                                        trust_remote_code=spec.trust_remote_code).to_dict()
        return family_for_hf_config(hf).from_hf_config(hf)
    if isinstance(spec, HFModelConfig) and spec.native == "never":
        raise ValueError(f"model.hf={spec.hf!r} with native: never trains through transformers; estimate covers "
                         f"the native decoder only (set native: auto for an architecture with a native family)")
    return module.resolved_config()


def _data_sizes(data: dict) -> tuple[int, int, int | None]:
    from jsonargparse import ArgumentParser
    from lightning.pytorch import LightningDataModule

    import lightning_moe.data  # noqa: F401

    parser = ArgumentParser(exit_on_error=False)
    parser.add_subclass_arguments(LightningDataModule, "data")
    resolved = parser.parse_object({"data": data}).data
    module = _import(resolved.class_path)(**dict(resolved.init_args))
    rows = row_length(module)
    if rows is None:
        raise ValueError(f"data ({resolved.class_path}): no row length (seq_length / packed_sequence_size) to "
                         f"estimate at")
    gbs = getattr(module, "global_batch_size", None)
    return int(getattr(module, "micro_batch_size", 1) or 1), rows.tokens, int(gbs) if gbs else None


def _import(path: str):
    module, _, name = path.rpartition(".")
    return getattr(__import__(module, fromlist=[name]), name)


def _hardware(path: Path) -> str | None:
    for line in path.read_text().splitlines():
        if not line.startswith("#"):
            break
        if line.startswith("# Hardware:"):
            return line.split(":", 1)[1].strip()
    return None


def load_recipe(path: str | Path, overrides: list[str]) -> RecipeLayout:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"--config {path}: no such recipe file")
    try:
        config = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as error:
        raise ValueError(f"{path}: not valid YAML ({error})") from error
    config = apply_overrides(config, overrides)
    for key in ("trainer", "model", "data"):
        if key not in config:
            raise ValueError(f"{path}: the recipe has no `{key}` section")
    trainer = config["trainer"]
    module = _instantiate_module(config["model"])
    strategy = trainer.get("strategy") or {}
    strategy_args = dict(strategy.get("init_args") or {}) if isinstance(strategy, dict) else {}
    devices = trainer.get("devices", 1)
    if not isinstance(devices, int) or devices < 1:
        raise ValueError(f"{path}: trainer.devices={devices!r}: estimate needs a number of devices per node")
    micro_batch, seq, global_batch = _data_sizes(config["data"])
    return RecipeLayout(
        path=str(path), model=model_config_of(module), fp8=module.fp8, peft=module.peft, freeze=module.freeze,
        precision=str(trainer.get("precision", "32-true")), accelerator=str(trainer.get("accelerator", "auto")),
        world_size=devices * int(trainer.get("num_nodes", 1)),
        strategy=strategy_args, micro_batch_size=micro_batch, seq_length=seq, hardware=_hardware(path),
        global_batch_size=global_batch,
    )
