"""The seeds in force: a component's own seed when the recipe sets one, else the one ``seed_everything`` set.

Weight initialization and data order use generators of their own (so that a layout change keeps the weights
and the sample order), not the global RNGs that Lightning's ``seed_everything(s)`` seeds; they read ``s`` from
``PL_GLOBAL_SEED``, where ``seed_everything`` records it, unless the recipe gives the module or data module a
``seed``. Without either, each keeps its fixed default (0 for weights, 1234 for data, as before).
"""

from __future__ import annotations

import os
from typing import Any

GLOBAL_SEED_ENV = "PL_GLOBAL_SEED"  # Lightning's record of the seed_everything seed


def global_seed() -> int | None:
    """The seed of the last ``seed_everything`` call in this process (or the launcher's), if any."""
    value = os.environ.get(GLOBAL_SEED_ENV)
    return int(value) if value else None


def seed_in_force(own: int | None, default: int, trainer: Any = None) -> int:
    """``own`` when set, else the ``seed_everything`` seed, else ``default``. With a ``trainer`` of several
    processes (a collective: call it on every rank) rank 0's value wins: a seed ``seed_everything`` drew at random
    differs between processes launched separately (torchrun, srun)."""
    if own is not None:
        return int(own)
    seed = global_seed()
    seed = default if seed is None else seed
    if trainer is not None and getattr(trainer, "world_size", 1) > 1:
        seed = int(trainer.strategy.broadcast(seed, src=0))
    return seed
