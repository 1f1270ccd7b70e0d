"""Freeze parameters by name pattern (embeddings, a vision tower, ...) for full fine-tuning (re-exported by peft).

Patterns are regular expressions that must match a whole native parameter name (``embed\\..*``,
``layers\\.[0-3]\\..*``); adapter wrapping (``base_layer``) is ignored, so the names are the checkpoint's.
"""

from __future__ import annotations

import re

from torch import nn


def freeze_parameters(model: nn.Module, patterns: list[str]) -> list[str]:
    """Set ``requires_grad=False`` on every parameter a pattern matches; returns the frozen names.
    Each pattern must match at least one parameter."""
    compiled = []
    for pattern in patterns:
        try:
            compiled.append((pattern, re.compile(pattern)))
        except re.error as err:
            raise ValueError(f"freeze pattern {pattern!r} is not a valid regular expression ({err})") from err
    names = {name.replace(".base_layer.", "."): param for name, param in model.named_parameters()}
    frozen = []
    for pattern, regex in compiled:
        hits = [n for n in names if regex.fullmatch(n)]
        if not hits:
            examples = ", ".join(list(names)[:4])
            raise ValueError(f"freeze pattern {pattern!r} matches no parameter (it must match a whole name, "
                             f"e.g. {examples})")
        for name in hits:
            names[name].requires_grad_(False)
            frozen.append(name)
    return sorted(set(frozen))
