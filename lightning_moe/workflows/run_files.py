"""What travels with a training run's model besides its weights: the files of the model it started from
(tokenizer, generation settings, processors), the run's own tokenizer over them (its checkpoints carry the files
of the data module's tokenizer), and a ``generation_config.json`` made from that tokenizer when the base has none
(its end-of-sequence and end-of-turn tokens, so ``generate`` stops where the run's data ended a turn)."""

from __future__ import annotations

import contextlib
import json
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from lightning_moe.data.tokenizer import generation_defaults, load_tokenizer
from lightning_moe.io.files import copy_aux_files
from lightning_moe.models.hf import HFModelConfig, model_dir, resolve_model_dir
from lightning_moe.modules.causal_lm import TOKENIZER_KEY

GENERATION_CONFIG = "generation_config.json"


def base_model_dir(module) -> Path | None:
    """The directory of the model a run started from (``model.hf`` or ``pretrained``), or None (from scratch)."""
    config = module.model_config
    if isinstance(config, HFModelConfig):
        return resolve_model_dir(config)
    return model_dir(module.pretrained, "pretrained") if module.pretrained else None


def base_model_name(module) -> str | None:
    """How a PEFT adapter names its base: the hub id as given, a local directory as an absolute path."""
    config = module.model_config
    name = config.hf if isinstance(config, HFModelConfig) else module.pretrained
    if name is None:
        return None
    path = Path(name).expanduser()
    return str(path.resolve()) if path.exists() else name


@contextlib.contextmanager
def run_files(checkpoint: dict[str, Any], module) -> Iterator[Path | None]:
    """A folder holding the files to write beside the run's weights (see the module docstring), or None when the
    run has none (from scratch, on data without a tokenizer)."""
    base = base_model_dir(module)
    files = checkpoint.get(TOKENIZER_KEY) or {}
    if not files:
        yield base
        return
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        if base is not None:
            copy_aux_files(base, folder)
        for name, data in files.items():
            (folder / Path(name).name).write_bytes(data)  # names only: a checkpoint cannot point elsewhere
        if not (folder / GENERATION_CONFIG).is_file():
            defaults = generation_defaults(load_tokenizer(str(folder)))
            (folder / GENERATION_CONFIG).write_text(json.dumps(defaults, indent=2) + "\n")
        yield folder
