"""The files of a checkpoint directory besides its tensors: JSON configs (read with errors that name the file) and
the files that travel with the weights (tokenizer, generation settings, processors)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

HF_CONFIG = "config.json"
AUX_FILES = (
    "generation_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
    "tokenizer.model", "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja",
    "chat_template.json", "preprocessor_config.json", "processor_config.json",
)


def read_json(path: Path) -> dict[str, Any]:
    if not path.exists():
        raise FileNotFoundError(f"{path.parent}: missing {path.name}")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}: invalid JSON ({err})") from err


def copy_aux_files(source: Path, destination: Path) -> list[str]:
    copied = []
    for name in AUX_FILES:
        if (source / name).is_file():
            shutil.copy2(source / name, destination / name)
            copied.append(name)
    return copied
