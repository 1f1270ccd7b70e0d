"""Count the bytes every collective and point-to-point transfer of this rank handles, per kind and process group.

A dispatch mode sees the ``c10d`` operators the ``torch.distributed`` calls dispatch (FSDP2's all-gathers and
reduce-scatters, all-to-alls, pipeline sends and receives) and DTensor's functional collectives. The bytes of a call
are those of the whole tensor it makes or consumes on this rank:

- all-reduce, broadcast, send, receive: the tensor;
- all-gather: the gathered output; reduce-scatter: the input before scattering;
- all-to-all: what this rank sends (its input).

:func:`count_comm_bytes` gives ``{(kind, process group name): [calls, bytes]}`` (a mesh dimension's group name is
``mesh.get_group().group_name``; several dimensions may share one group).
"""

from __future__ import annotations

import contextlib
import json
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


def _bytes(value: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor))


# c10d operator -> (kind, index of the counted tensors, index of the process group)
C10D = {
    "allreduce_": ("all_reduce", 0, 1), "allreduce_coalesced_": ("all_reduce", 0, 1),
    "broadcast_": ("broadcast", 0, 1),
    "_allgather_base_": ("all_gather", 0, 2), "allgather_": ("all_gather", 0, 2),
    "allgather_into_tensor_coalesced_": ("all_gather", 0, 2),
    "_reduce_scatter_base_": ("reduce_scatter", 1, 2), "reduce_scatter_": ("reduce_scatter", 1, 2),
    "reduce_scatter_tensor_coalesced_": ("reduce_scatter", 1, 2),
    "alltoall_base_": ("all_to_all", 1, 2), "alltoall_": ("all_to_all", 1, 2),
    "send": ("send", 0, 1), "recv_": ("recv", 0, 1),
}
# functional collective -> (kind, index of the counted tensors (None: the output), index of the group name)
FUNCTIONAL = {
    "all_reduce": ("all_reduce", 0, 2), "all_reduce_coalesced": ("all_reduce", 0, 2),
    "all_gather_into_tensor": ("all_gather", None, 2), "all_gather_into_tensor_coalesced": ("all_gather", None, 2),
    "reduce_scatter_tensor": ("reduce_scatter", 0, 3), "reduce_scatter_tensor_coalesced": ("reduce_scatter", 0, 3),
    "all_to_all_single": ("all_to_all", 0, 3), "broadcast": ("broadcast", 0, 2),
}


class _CommCounter(TorchDispatchMode):
    def __init__(self, counts: dict) -> None:
        super().__init__()
        self.counts = counts

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = func.overloadpacket.__name__
        if func.namespace == "c10d" and name in C10D:
            kind, counted, group = C10D[name]
            group_name = torch._C._distributed_c10d.ProcessGroup.unbox(args[group]).group_name
            self._add(kind, group_name, _bytes(args[counted]))
        elif func.namespace in ("_c10d_functional", "_c10d_functional_autograd") and name in FUNCTIONAL:
            kind, counted, group = FUNCTIONAL[name]
            self._add(kind, args[group], _bytes(out if counted is None else args[counted]))
        return out

    def _add(self, kind: str, group: str, size: int) -> None:
        entry = self.counts[(kind, group)]
        entry[0] += 1
        entry[1] += size


@contextlib.contextmanager
def count_comm_bytes() -> Iterator[dict[tuple[str, str], list[int]]]:
    """``{(kind, process group name): [calls, bytes]}`` of the collectives run inside."""
    counts: dict[tuple[str, str], list[int]] = defaultdict(lambda: [0, 0])
    with _CommCounter(counts):
        yield counts


class CommBytesCounter(pl.Callback):
    """Counts the collective bytes of one optimizer step during ``fit`` (step ``step``, from its first micro-batch to
    its end) and writes them to ``report`` (``{rank}`` in the path: every rank its own file) as
    ``{"<kind> over <group>": [calls, bytes]}``, each group named by the mesh dimensions of the strategy's
    ``parallel_dims`` over its ranks (``ep=fsdp`` when two share them; groups over the same ranks add up)."""

    def __init__(self, report: str, step: int = 3) -> None:
        self.report, self.step = report, step
        self._context = None
        self.counts: dict = {}

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        if self._context is None and not self.counts and trainer.global_step == self.step - 1:
            self._context = count_comm_bytes()
            self.counts = self._context.__enter__()

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if self._context is not None and trainer.global_step == self.step:
            self._context.__exit__(None, None, None)
            self._context = None
            names = group_names(trainer.strategy.parallel_dims, {group for _, group in self.counts})
            table: dict[str, list[int]] = {}
            for (kind, group), (calls, size) in sorted(self.counts.items()):
                entry = table.setdefault(f"{kind} over {names[group]}", [0, 0])
                entry[0] += calls
                entry[1] += size
            path = Path(self.report.replace("{rank}", str(trainer.global_rank)))
            if "{rank}" in self.report or trainer.is_global_zero:
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(json.dumps(table, indent=2) + "\n")


def group_names(dims, groups) -> dict[str, str]:
    """``{process group name: "dim" or "dim=dim"}`` for ``groups`` (names of process groups), each named by the
    one-dimensional meshes of ``dims`` over the same ranks: DTensor and the meshes of expert parallelism may make
    several process groups over one set of ranks."""
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _resolve_process_group

    by_ranks: dict[tuple[int, ...], list[str]] = {tuple(range(dist.get_world_size())): ["world"]}
    for dim in ("pp", "dp_replicate", "dp_shard", "cp", "tp", "ep", "fsdp", "expert_fsdp", "dp_cp", "stage"):
        try:
            mesh = dims.mesh(dim)
        except KeyError:
            continue
        if mesh.ndim == 1 and mesh.size() > 1:
            by_ranks.setdefault(group_ranks(mesh.get_group()), []).append(dim)
    names = {}
    for group in groups:
        ranks = group_ranks(_resolve_process_group(group))
        names[group] = "=".join(by_ranks.get(ranks, [f"ranks {list(ranks)}"]))
    return names


def group_ranks(group) -> tuple[int, ...]:
    """The global ranks of a process group, in order."""
    import torch.distributed as dist

    return tuple(sorted(dist.get_process_group_ranks(group)))
