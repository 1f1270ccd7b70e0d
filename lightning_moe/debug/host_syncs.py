"""Count the places where a training step makes the host wait for the device.

On a GPU each of these drains the stream: the CPU stops running ahead, prefetched collectives and the next kernels
are no longer queued. One of them can be seen on a CPU too, by the operations that cause it:

- reading values back: ``aten._local_scalar_dense`` (``.item()``, ``float(t)``, ``bool(t)``, ``int(t)``),
  ``torch.equal``, and ``Tensor.tolist()`` / ``.numpy()`` / ``.cpu()``, ``.to("cpu")`` of an accelerator's tensor;
- operations whose output shape depends on values: ``nonzero``, ``masked_select``, ``bincount``, ``unique``,
  ``repeat_interleave`` without ``output_size``, indexing with a boolean mask;
- ``torch.tensor(host data, device=...)``: a blocking host-to-device copy.

Values a read has already brought to the host are host values: a copy made by ``.cpu()`` / ``.to("cpu")``, a
``torch.tensor`` made without a device (from Python numbers: the host's), and what is computed from those alone; reading them again is not counted
(Lightning keeps logged host values in tensors and calls ``.item()`` on them). A collective's result is where its
input was: a host tensor is all-reduced on the host (gloo), a device tensor on the device.

Use :func:`count_host_syncs` around any code, or the :class:`HostSyncCounter` callback during ``fit``: it gives the
syncs of every optimizer step and their mean over the steady state.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import weakref
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

aten = torch.ops.aten

# operator overload packet -> what the host waits for
READS = {aten._local_scalar_dense: "scalar read", aten.equal: "scalar read"}
DATA_DEPENDENT_SHAPES = {
    aten.nonzero: "nonzero", aten.masked_select: "masked_select",
    aten.bincount: "bincount", aten._unique: "unique", aten._unique2: "unique", aten.unique_dim: "unique",
    aten.unique_consecutive: "unique",
}
DEVICE_TO_HOST = {"tolist", "numpy", "cpu"}

_HERE = os.path.dirname(os.path.abspath(__file__))
_TORCH = os.path.dirname(os.path.abspath(torch.__file__))


@dataclass
class SyncLog:
    """Every host sync seen: ``(kind, site)`` in order; ``site`` is the first frame outside torch and this file."""

    events: list[tuple[str, str]] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.events)

    def by_site(self) -> Counter:
        return Counter(f"{kind} at {site}" for kind, site in self.events)


def _site() -> str:
    frame = sys._getframe(1)
    while frame is not None:
        path = os.path.abspath(frame.f_code.co_filename)
        if not path.startswith((_HERE, _TORCH)):
            return f"{os.path.relpath(path)}:{frame.f_lineno} ({frame.f_code.co_name})"
        frame = frame.f_back
    return "torch"


class _HostValues:
    """Tensors known to hold host values (see the module docstring), by identity."""

    def __init__(self) -> None:
        self._refs: dict[int, weakref.ref] = {}  # by id(): a tensor's ``==`` is elementwise

    def add(self, value: Any) -> None:
        for leaf in tree_flatten(value)[0]:
            if isinstance(leaf, torch.Tensor):
                key = id(leaf)
                self._refs[key] = weakref.ref(leaf, lambda _, key=key: self._refs.pop(key, None))

    def __contains__(self, tensor: torch.Tensor) -> bool:
        ref = self._refs.get(id(tensor))
        return ref is not None and ref() is tensor

    def all_host(self, args: Any) -> bool:
        tensors = [t for t in tree_flatten(args)[0] if isinstance(t, torch.Tensor)]
        return bool(tensors) and all(t in self for t in tensors)


def _bool_index(indices: Any) -> bool:
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in tree_flatten(indices)[0])


class _DispatchCounter(TorchDispatchMode):
    def __init__(self, log: SyncLog, host: _HostValues) -> None:
        super().__init__()
        self.sync_log, self.host = log, host

    def _kind(self, func, args, kwargs) -> str | None:
        packet = func.overloadpacket
        if packet in READS:
            return READS[packet]
        if packet in DATA_DEPENDENT_SHAPES:
            return DATA_DEPENDENT_SHAPES[packet]
        if func is aten.repeat_interleave.Tensor and kwargs.get("output_size") is None:
            return "repeat_interleave without output_size"
        if packet in (aten.index, aten.index_put, aten.index_put_) and _bool_index(args[1]):
            return "boolean mask index"
        return None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        host = self.host.all_host((args, kwargs))
        kind = None if host else self._kind(func, args, kwargs)
        if kind is not None:
            self.sync_log.events.append((kind, _site()))
        out = func(*args, **kwargs)
        if host:
            self.host.add(out)
        return out


class _FunctionCounter(TorchFunctionMode):
    def __init__(self, log: SyncLog, host: _HostValues) -> None:
        super().__init__()
        self.sync_log, self.host = log, host

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        out = func(*args, **kwargs)
        if name in DEVICE_TO_HOST or (name == "to" and _device_to_host(args, kwargs)):
            if not self.host.all_host(args[:1]):
                self.sync_log.events.append((f"device-to-host copy ({name})", _site()))
            if out is not args[0]:  # on a CPU ``.cpu()`` returns the tensor itself, still a device value
                self.host.add(out)
        elif func in (torch.tensor, torch.as_tensor) and not isinstance(args[0] if args else None, torch.Tensor):
            if kwargs.get("device") is not None:
                self.sync_log.events.append(("host-to-device copy (torch.tensor)", _site()))
            else:
                self.host.add(out)
        return out


def _device_to_host(args: tuple, kwargs: dict) -> bool:
    """``tensor.to(...)`` copies a tensor off an accelerator to the CPU. (On a CPU run ``.to(device)`` is no copy:
    only ``.cpu()``, ``.tolist()``, ``.numpy()`` and reads count there.)"""
    target = kwargs.get("device", args[1] if len(args) > 1 else None)
    source = args[0] if args and isinstance(args[0], torch.Tensor) else None
    if source is None or source.device.type == "cpu" or not isinstance(target, (str, torch.device)):
        return False
    return torch.device(target).type == "cpu"


@contextlib.contextmanager
def count_host_syncs(log: SyncLog | None = None) -> Iterator[SyncLog]:
    """Record every host sync of the code inside (see the module docstring) into ``log`` (a new one by default)."""
    log = SyncLog() if log is None else log
    host = _HostValues()
    with _FunctionCounter(log, host), _DispatchCounter(log, host):
        yield log


class HostSyncCounter(pl.Callback):
    """Counts host syncs during ``fit``, per optimizer step (from the end of one to the end of the next).

    Args:
        warmup_steps: first steps left out of :meth:`steady_state` (compilation, first-step setup).
        report: a JSON file written at the end of training: the syncs of every step, the steady-state mean and
            where the steady state's syncs come from; by global rank 0, or by every rank when the path holds
            ``{rank}`` (replaced by the rank).
    """

    def __init__(self, warmup_steps: int = 2, report: str | None = None) -> None:
        self.warmup_steps = warmup_steps
        self.report = report
        self.sync_log = SyncLog()
        self.per_step: list[int] = []  # syncs of optimizer step i + 1
        self.sites_per_step: list[Counter] = []
        self._context = None
        self._seen = 0
        self._last_step = 0

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._last_step = trainer.global_step
        self._context = count_host_syncs(self.sync_log)
        self._context.__enter__()

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if trainer.global_step > self._last_step:
            self._last_step = trainer.global_step
            events = self.sync_log.events[self._seen:]
            self._seen = len(self.sync_log.events)
            self.per_step.append(len(events))
            self.sites_per_step.append(Counter(f"{kind} at {site}" for kind, site in events))

    def _stop(self) -> None:
        if self._context is not None:
            self._context.__exit__(None, None, None)
            self._context = None

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._stop()
        if self.report is not None and ("{rank}" in self.report or trainer.is_global_zero):
            summary = {"per_step": self.per_step, "warmup_steps": self.warmup_steps,
                       "steady_state": self.steady_state() if len(self.per_step) > self.warmup_steps else None,
                       "sites": dict(self.steady_sites().most_common())}
            path = Path(self.report.replace("{rank}", str(trainer.global_rank)))
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(summary, indent=2) + "\n")

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._stop()

    def steady_state(self) -> float:
        """Mean syncs per optimizer step after ``warmup_steps``."""
        steps = self.per_step[self.warmup_steps:]
        if not steps:
            raise ValueError(f"HostSyncCounter: {len(self.per_step)} steps ran, none after warmup_steps="
                             f"{self.warmup_steps}")
        return sum(steps) / len(steps)

    def steady_sites(self) -> Counter:
        """Where the steady state's syncs come from, summed over its steps."""
        return sum(self.sites_per_step[self.warmup_steps:], Counter())
