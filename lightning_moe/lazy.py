"""Module-level ``__getattr__`` that imports a package's public names on first use (PEP 562)."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from typing import Any


def lazy_exports(package: str, public: dict[str, str]) -> Callable[[str], Any]:
    """``public`` maps each name to the module defining it; a resolved name is cached in the package."""

    def __getattr__(name: str) -> Any:
        if name not in public:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(public[name]), name)
        setattr(sys.modules[package], name, value)
        return value

    return __getattr__
