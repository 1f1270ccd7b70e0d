"""Random-number-generator states in checkpoints, one per rank.

Lightning writes a checkpoint's non-tensor part from rank 0 only, so a state stored as is would give every
rank rank 0's generators on resume (dropout masks repeated across ranks). Each rank's state is gathered into
a list indexed by global rank instead. Only plain tensors, ints and tuples are stored, so checkpoints load
with ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch
import torch.distributed as dist


def _local_state() -> dict[str, Any]:
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    return {
        "torch": torch.get_rng_state(),
        "numpy": (kind, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(gauss)),
        "python": random.getstate(),
        # this rank's device only: restoring all devices would hand every rank rank 0's view of them
        "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
    }


def gather_rng_states() -> list[dict[str, Any]]:
    """Every rank's generator states (a collective when distributed: call it on all ranks)."""
    state = _local_state()
    if not (dist.is_available() and dist.is_initialized()):
        return [state]
    states: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(states, state)
    return states


def restore_rng_states(states: list[dict[str, Any]], rank: int) -> None:
    """This rank's states (a resumed run with more ranks than the saved one reuses them round-robin)."""
    state = states[rank % len(states)]
    torch.set_rng_state(state["torch"])
    kind, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))
    random.setstate(state["python"])
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
