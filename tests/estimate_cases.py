"""Worker side of the estimate-against-parallelization test: each rank builds the recipe's model as the training
module does (meta device, converters, ``parallelize``, materialize), runs one step, and compares the bytes of the
parameters, gradients and AdamW moments it really holds (its local shards) with ``estimate_memory``'s per-rank
figures for the same layout."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

from lightning_moe.dtypes import dtype_option
from lightning_moe.estimate.memory import estimate_memory, stored_dtype
from lightning_moe.estimate.probe import default_dtype
from lightning_moe.estimate.recipe import load_recipe
from lightning_moe.models.converters import apply_converters
from lightning_moe.models.decoder import Decoder
from lightning_moe.parallel import ParallelDims, ParallelOptions, parallelize

ROOT = Path(__file__).resolve().parents[1]
SEQ = 16


def local_bytes(tensors) -> int:
    from torch.distributed.tensor import DTensor

    local = [t.to_local() if isinstance(t, DTensor) else t for t in tensors]
    return sum(t.numel() * t.element_size() for t in local)


def held_bytes(recipe: str, sizes: dict[str, int], overrides: list[str]) -> tuple[dict[str, float], dict[str, int]]:
    """(estimated, held) parameter, gradient and optimizer-state bytes of this rank."""
    strategy = [item for name, size in sizes.items() for item in (f"--trainer.strategy.init_args.{name}", str(size))]
    layout = load_recipe(ROOT / "configs" / "tiny" / recipe,
                         ["--trainer.devices", str(dist.get_world_size()), *strategy, *overrides])
    (estimate,) = estimate_memory(layout)
    dims = ParallelDims(**sizes, world_size=dist.get_world_size())
    dims.build_meshes("cpu")
    with torch.device("meta"), default_dtype(stored_dtype(layout.precision)):
        model = Decoder(layout.model)
    apply_converters(model, layout.fp8, layout.peft, layout.freeze)
    # the recipe's mixed-precision policy: FSDP then wraps the model even on one data-parallel rank
    args = layout.strategy
    parallelize(model, dims, ParallelOptions(param_dtype=dtype_option(args.get("param_dtype"), "param_dtype"),
                                             reduce_dtype=dtype_option(args.get("reduce_dtype", "float32"),
                                                                       "reduce_dtype")))
    model.to_empty(device="cpu")
    model.init_weights(0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(0, layout.model.vocab_size, (1, SEQ), generator=torch.Generator().manual_seed(dims.dp_rank))
    out = model(ids, None, labels=ids)
    # every head and the load-balancing loss, so that every trainable parameter gets a gradient and AdamW states
    (out.loss_sum + sum(out.mtp_loss_sums, torch.zeros(())) + (out.aux_loss if out.aux_loss is not None else 0)).backward()
    optimizer.step()
    params = list(model.parameters())
    moments = [t for state in optimizer.state.values() for key, t in state.items() if key != "step"]
    held = {"parameters": local_bytes(params), "gradients": local_bytes(p.grad for p in params if p.grad is not None),
            "optimizer states": local_bytes(moments)}
    return {name: estimate.components[name] for name in held}, held


CASES = [
    # Mamba-2 mixers, latent-MoE projections, routers and experts (no EP) stay whole under TP; MTP depths too
    ("tp Nemotron-H", "nemotron_h_benchmark.yaml", {"tp": 2}, ["--model.init_args.model.moe.latent_size", "32"]),
    # MLA's down projections and norms stay whole, its up projections split by heads
    ("tp MLA + MoE", "mla_moe_benchmark.yaml", {"tp": 2}, ["--trainer.precision", "32-true"]),
    ("tp x ep", "moe_benchmark.yaml", {"tp": 2, "ep": 2}, ["--trainer.precision", "32-true"]),
    ("fsdp2", "moe_benchmark.yaml", {"dp_shard": 2}, ["--trainer.precision", "32-true"]),
]


def check_estimates() -> None:
    problems = []
    for case, recipe, sizes, overrides in CASES:
        estimated, held = held_bytes(recipe, sizes, overrides)
        for name, value in held.items():
            if estimated[name] != value:
                problems.append(f"{case} rank {dist.get_rank()}: {name} estimated {estimated[name]:.0f} bytes, "
                                f"the rank holds {value}")
    assert not problems, "\n".join(problems)
