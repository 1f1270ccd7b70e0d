"""Registry of native families, keyed by Hugging Face architecture name and by family name."""

from __future__ import annotations

import importlib

from lightning_moe.models.families.base import Family, TensorMap

# family module names; each defines FAMILY (and may define VARIANTS)
_MODULES = ("llama", "qwen2", "qwen3", "qwen3_moe", "mixtral", "deepseek_v3", "glm4_moe", "gpt_oss", "nemotron_h",
            "qwen3_next", "qwen3_5", "qwen3_5_moe", "kimi_linear", "mimo_v2")

_by_architecture: dict[str, Family] = {}
_by_name: dict[str, Family] = {}


def _load() -> None:
    if _by_name:
        return
    for module in _MODULES:
        loaded = importlib.import_module(f"{__name__}.{module}")
        # VARIANTS: other checkpoint layouts of the same architecture, found by family name only
        for family in (loaded.FAMILY, *getattr(loaded, "VARIANTS", ())):
            _by_name[family.name] = family
            for arch in family.architectures:
                _by_architecture[arch] = family


def supported_architectures() -> list[str]:
    _load()
    return sorted(_by_architecture)


def family_for_architecture(architecture: str) -> Family:
    _load()
    if architecture not in _by_architecture:
        raise ValueError(
            f"architecture {architecture!r} has no native implementation; supported: {', '.join(supported_architectures())}"
        )
    return _by_architecture[architecture]


def family_by_name(name: str) -> Family:
    _load()
    if name not in _by_name:
        raise ValueError(f"unknown model family {name!r}; known: {', '.join(sorted(_by_name))}")
    return _by_name[name]


def family_for_hf_config(hf: dict) -> Family:
    architectures = hf.get("architectures") or []
    if not architectures:
        raise ValueError(
            f"config.json has no 'architectures' entry (model_type={hf.get('model_type')!r}); "
            f"supported: {', '.join(supported_architectures())}"
        )
    return family_for_architecture(architectures[0])


__all__ = [
    "Family",
    "TensorMap",
    "family_by_name",
    "family_for_architecture",
    "family_for_hf_config",
    "supported_architectures",
]
