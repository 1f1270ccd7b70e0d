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
OTHER_RECIPES = {"qwen2_5_vl/medpix.yaml", "qwen3_next/tulu3_sft.yaml"}
HEADER_FIELD = re.compile(r"^# (Row|Architecture|CPU twin|Hardware): (.+)$")


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
