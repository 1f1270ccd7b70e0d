"""Activation checkpointing per block: keep only block inputs, recompute the inside during backward.

``none``: keep every activation. ``full``: every block. ``selective``: every ``every``-th block (0, k, 2k, ...),
trading some of the memory saving for less recompute. The composable ``checkpoint`` works through hooks,
so parameter and state-dict names stay those of the plain model.
"""

from __future__ import annotations

from torch import nn

MODES = ("none", "full", "selective")


def check_mode(mode: str, every: int) -> None:
    if mode not in MODES:
        raise ValueError(f"activation_checkpointing={mode!r} is not one of {MODES}")
    if every < 1:
        raise ValueError(f"activation_checkpointing_every={every} must be >= 1")


def repeated_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The blocks of ``model.layers`` and the MTP depths, by name: the units of checkpointing, compiling and
    sharding."""
    blocks = [(f"layers.{name}", block) for name, block in model.layers.items()]
    if getattr(model, "mtp", None) is not None:
        blocks += [(f"mtp.depths.{d}", depth) for d, depth in enumerate(model.mtp.depths)]
    return blocks


def checkpointed_blocks(model: nn.Module, mode: str, every: int = 1) -> list[tuple[str, nn.Module]]:
    """The blocks ``mode`` checkpoints."""
    check_mode(mode, every)
    if mode == "none":
        return []
    return [(name, block) for i, (name, block) in enumerate(repeated_blocks(model)) if mode == "full" or i % every == 0]


def apply_activation_checkpointing(model: nn.Module, mode: str = "full", every: int = 1) -> list[str]:
    """Checkpoint the blocks of ``model.layers`` (and of MTP depths) chosen by ``mode``; returns their names."""
    chosen = checkpointed_blocks(model, mode, every)
    if chosen:
        from torch.distributed._composable import checkpoint

        for _, block in chosen:
            checkpoint(block)
    return [name for name, _ in chosen]
