"""``torch.compile`` per block, as torchtitan applies it: every decoder block (and MTP depth) is compiled on its
own, so graphs stay small, identical blocks share compiled code, and FSDP's per-block hooks stay outside them.

Only each block's ``forward`` is replaced: parameter and state-dict names stay those of the plain model. A block
that activation checkpointing chose is compiled together with its checkpoint (``torch.utils.checkpoint``, which
the compiler traces) instead of getting the hook-based checkpoint of ``activation_checkpoint.py``. Data-dependent
shapes (MoE token counts, expert-parallel all-to-all) end a graph and continue eagerly, as torch.compile does.
On CPU each block kind is checked against its eager forward at first use (``lightning_moe/kernels``).
"""

from __future__ import annotations

import torch
from torch import nn

from lightning_moe.kernels.compiled_blocks import guard_compiled_block
from lightning_moe.parallel.activation_checkpoint import (
    apply_activation_checkpointing,
    checkpointed_blocks,
    repeated_blocks,
)


def checkpoint_and_compile(model: nn.Module, mode: str, every: int, compile: bool, backend: str,
                           checkpoint_outside: bool = False) -> None:
    """Activation checkpointing, then compilation, of the model's blocks (compiled blocks checkpoint inside, or
    with ``checkpoint_outside`` are checkpointed around their compiled forward)."""
    if compile:
        apply_compile(model, backend, mode, every, checkpoint_outside)
    else:
        apply_activation_checkpointing(model, mode, every)


def check_compile(backend: str) -> None:
    """A one-line error for a ``torch.compile`` backend that does not exist, before any model is built."""
    import torch._dynamo

    if backend not in torch._dynamo.list_backends(exclude_tags=()):
        raise ValueError(f"compile_backend={backend!r} is not a torch.compile backend; the main ones: "
                         f"{', '.join(torch._dynamo.list_backends())} (and aot_eager, eager for debugging)")


def apply_compile(model: nn.Module, backend: str = "inductor", checkpoint_mode: str = "none",
                  checkpoint_every: int = 1, checkpoint_outside: bool = False) -> list[str]:
    """Compile the blocks of ``model`` with ``backend``, with activation checkpointing ``checkpoint_mode`` (see
    :func:`~lightning_moe.parallel.activation_checkpoint.checkpointed_blocks`) inside; returns the blocks' names.

    ``checkpoint_outside``: the checkpoint wraps the compiled forward instead. Tensor-parallel blocks need it: a
    traced checkpoint cannot save the device mesh that DTensor redistributions inside the block hold on to."""
    checkpointed = {name for name, _ in checkpointed_blocks(model, checkpoint_mode, checkpoint_every)}
    if checkpointed:
        # blocks fill the layout's mask cache on first use; replaying that in the recomputation is not needed
        torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint = True
    names = []
    for name, block in repeated_blocks(model):
        if name in checkpointed and checkpoint_outside:
            forward = _with_checkpoint(block.forward)
            compiled = _with_checkpoint(torch.compile(block.forward, backend=backend))
        else:
            forward = _with_checkpoint(block.forward) if name in checkpointed else block.forward
            compiled = torch.compile(forward, backend=backend)
        # on CPU, the compiled block serves only after its first call matched the eager block on this machine
        block.forward = guard_compiled_block(block, forward, compiled, backend)
        names.append(name)
    return names


def _with_checkpoint(forward):
    from torch.utils.checkpoint import checkpoint

    def checkpointed_forward(*args, **kwargs):
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)

    return checkpointed_forward
