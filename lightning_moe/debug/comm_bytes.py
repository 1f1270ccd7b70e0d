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
from collections import defaultdict
from collections.abc import Iterator
from typing import Any

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
