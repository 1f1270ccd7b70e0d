"""The recipes under configs/, what their headers declare, and their resolved configurations."""

from __future__ import annotations

import contextlib
import functools
import io
import re
import sys
from pathlib import Path
from typing import Any
from unittest import mock

import yaml

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "configs"
HUB_CONFIGS = Path(__file__).with_name("hub_configs.yaml")
PUBLISHED_ROWS = ROOT / "benchmarks" / "published_rows.yaml"
# recipe folders owned by other work (their own tests cover them)
OTHER_RECIPES = {"qwen2_5_vl/medpix.yaml", "qwen3_next/tulu3_sft.yaml",
                 # image generation (DiffusionModule): tests/diffusion/test_diffusion_recipes.py
                 "qwen_image/qwen_image_naruto_full_h100.yaml", "hunyuan_image/hunyuan_image_3_lora_h100.yaml"}
HEADER_FIELD = re.compile(r"^# (Row|Architecture|CPU twin|Hardware): (.+)$")
# the FP8 recipes of an "fp8" row (an "mxfp8" row runs the mxfp8 recipe)
FP8_RECIPES = {"tensorwise", "rowwise", "rowwise_with_gw_hp"}


def full_recipes() -> list[str]:
    """Every GPU recipe (``configs/<family>/*.yaml``) of the published rows, relative to configs/."""
    found = sorted(str(p.relative_to(CONFIGS)) for p in CONFIGS.glob("*/*.yaml") if p.parent.name != "tiny")
    return [name for name in found if name not in OTHER_RECIPES]


def header(recipe: str) -> dict[str, str]:
    """The ``# Row:``, ``# Architecture:``, ``# CPU twin:`` and ``# Hardware:`` lines of a recipe's header,
    first word of the value only for Row, Architecture and CPU twin."""
    fields: dict[str, str] = {}
    for line in (CONFIGS / recipe).read_text().splitlines():
        if not line.startswith("#"):
            break
        match = HEADER_FIELD.match(line)
        if match:
            key, value = match.groups()
            fields[key] = value if key == "Hardware" else value.split()[0]
    return fields


@functools.cache
def resolved(recipe: str) -> dict[str, Any]:
    """The recipe (relative to configs/) as LightningCLI resolves it (``fit --print_config``): every default filled
    in, types checked. Cached: callers must not modify it."""
    from lightning_moe.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), contextlib.suppress(SystemExit), \
            mock.patch.object(sys, "argv", ["lightning-moe"]):  # LightningCLI reads args, not pytest's command line
        main(["fit", "--config", str(CONFIGS / recipe), "--print_config"])
    if not out.getvalue().strip():
        raise AssertionError(f"{recipe} does not parse: {err.getvalue()[-2000:]}")
    return yaml.safe_load(out.getvalue())


def load_yaml(path: Path) -> Any:
    return yaml.safe_load(path.read_text())


def differences_block(recipe: str) -> list[dict[str, Any]]:
    """The header's ``# Differences:`` block (YAML inside comments, see configs/README.md): its entries, [] if none."""
    lines = (CONFIGS / recipe).read_text().splitlines()
    block: list[str] = []
    for line in lines:
        if not line.startswith("#"):
            break
        text = line[1:]
        if block and not text.startswith("  "):
            break
        if block or text.startswith(" Differences:"):
            block.append(text)
    if not block:
        return []
    try:
        entries = yaml.safe_load("\n".join(block))["Differences"]
    except yaml.YAMLError as err:
        raise AssertionError(f"{recipe}: the Differences block is not YAML: {err}") from None
    if entries is None or not isinstance(entries, list) or not all(isinstance(e, dict) for e in entries):
        raise AssertionError(f"{recipe}: the Differences block must be a list of mappings, got {entries!r}")
    return entries


def gpus(cfg: dict) -> int:
    return cfg["trainer"]["num_nodes"] * cfg["trainer"]["devices"]


def number_format(cfg: dict) -> str:
    """The row precision a recipe runs: its FP8 recipe, else bf16 when it computes in bf16."""
    fp8 = (cfg["model"]["init_args"].get("fp8") or {}).get("recipe")
    if fp8 is not None:
        return "fp8" if fp8 in FP8_RECIPES else fp8
    trainer = cfg["trainer"]
    param_dtype = (trainer["strategy"].get("init_args") or {}).get("param_dtype")
    bf16 = trainer["precision"] in ("bf16-true", "bf16-mixed") or param_dtype == "bfloat16"
    return "bf16" if bf16 else f"{trainer['precision']} (no bf16 compute)"


def hub_model_config(hub_id: str):
    """The native ModelConfig of a hub checkpoint in hub_configs.yaml, or None (not there, or no native family)."""
    from lightning_moe.models.families import family_for_hf_config

    entry = load_yaml(HUB_CONFIGS).get(hub_id)
    if entry is None or "model_type" in entry["config"]:  # model_type: a transformers-only architecture
        return None
    return family_for_hf_config(entry["config"]).from_hf_config(entry["config"])
