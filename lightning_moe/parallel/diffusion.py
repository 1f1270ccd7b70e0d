"""A diffusers transformer (``models/diffusion/transformer.py``'s ``DiffusionTransformer``) as a model kind
(``parallel/model_kind.py``): activation checkpointing and ``torch.compile`` per transformer block, then
FSDP2/HSDP ``fully_shard`` per block and on the root (whose group keeps the input projections, timestep embedding,
output norm and projection), with the same helpers and options as the language models. Tensor, context and
expert parallelism are refused (the dual-stream blocks have no sequence split or expert dispatcher here;
Qwen-Image has no experts).
"""

from __future__ import annotations

from torch import nn

from lightning_moe.parallel.model_kind import Refusal, refuse_unsupported

_DATA_PARALLEL_ONLY = "where it trains with data parallelism (FSDP2/HSDP), activation checkpointing and compile"


class DiffusersTransformer:
    name = "diffusers"
    refusals = (Refusal(("tp",), _DATA_PARALLEL_ONLY), Refusal(("cp",), _DATA_PARALLEL_ONLY),
                Refusal(("ep",), _DATA_PARALLEL_ONLY))

    def check(self, model: nn.Module, dims, options) -> None:
        name = type(model.transformer).__name__
        refuse_unsupported(self, name, dims, options)
        if not model.layers:
            raise ValueError(f"{name}: no repeated blocks found to shard (no _no_split_modules and no ModuleList)")

    def apply_model_parallel(self, model: nn.Module, dims, options) -> None:
        pass  # data parallelism only (refused above)

    def split_experts(self, unit: nn.Module) -> list[nn.Module]:
        return []

    def checkpoint_outside(self, dims) -> bool:
        return False

    def without_fsdp(self, model: nn.Module, dims) -> None:
        pass


DIFFUSERS = DiffusersTransformer()
