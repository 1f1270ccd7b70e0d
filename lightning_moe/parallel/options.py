"""``ParallelOptions``: how ``parallelize`` applies what is not a parallel size, built once by the strategy."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ParallelOptions:
    """Activation checkpointing (``parallel/activation_checkpoint.py``) every ``activation_checkpointing_every``
    blocks; ``compile`` of every block with ``compile_backend`` (``parallel/compile.py``); FSDP2's
    mixed-precision (``param_dtype`` / ``reduce_dtype``), offload and resharding policies (``parallel/fsdp.py``);
    ``expert_dispatcher(group, num_local_experts)``, the token dispatcher of expert parallelism (default:
    all-to-all); under a pipeline, ``vp`` virtual stages per rank, their ``pp_schedule`` and ``pp_layout``
    (``parallel/pipeline_stages.py``)."""

    activation_checkpointing: str = "none"
    activation_checkpointing_every: int = 1
    compile: bool = False
    compile_backend: str = "inductor"
    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = torch.float32
    cpu_offload: bool = False
    reshard_after_forward: bool = True
    expert_dispatcher: Callable | None = None
    vp: int = 1
    pp_schedule: str = "1f1b"
    pp_layout: str | list[str] | None = None

    def fsdp_applies(self, dims) -> bool:
        """Whether FSDP wraps the model: over data-parallel ranks, and also on one rank when a mixed-precision or
        offload policy is asked for (FSDP is what carries them)."""
        return dims.fsdp_enabled or self.param_dtype is not None or self.cpu_offload
