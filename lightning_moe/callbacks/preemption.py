"""Preemption: on SIGTERM or Slurm's requeue signal, finish the optimizer step, save, then exit or requeue.

Schedulers warn a job before they kill it: Slurm sends ``SIGUSR1`` (``#SBATCH --signal=SIGUSR1@90``) ahead of the
time limit, and Slurm, Kubernetes and most others send ``SIGTERM`` before ``SIGKILL``. Lightning's own handlers
either save in the middle of a gradient-accumulation window (its Slurm handler runs inside the signal handler,
so the saved step and the saved data position disagree) or stop without saving, with exit status 0.

Here a signal only sets a flag. At the end of the optimizer step in flight (every rank agrees on the step: one
all-reduce of the host flag per step, over a gloo group, which never waits for the device), the callback writes a complete checkpoint to Lightning's
``<default_root_dir>/hpc_ckpt_<n>.ckpt``, asks Slurm to requeue the job on the requeue signal
(``scontrol requeue $SLURM_JOB_ID``, as Lightning does) and ends the run with :class:`Preempted`: exit status
128 + the signal's number, and the run card records the signal and the step saved. A requeued Slurm job
restores the newest checkpoint by itself (the sbatch template passes it as ``--ckpt_path``); elsewhere resume
with ``--ckpt_path <the printed path>`` (or ``--ckpt_path hpc``).

It also holds Lightning's ``ModelCheckpoint`` to optimizer-step ends (see ``on_train_batch_start``), and, on
resume, re-counts Lightning's micro-batches of the epoch from the data position (``align_batch_count``).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.fabric.plugins.environments import SLURMEnvironment
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities.exceptions import SIGTERMException

from lightning_moe.callbacks.step_end import StepEndCallback


class Preempted(SystemExit):
    """Ends a run once its preemption checkpoint is written; the process exits with ``128 + signal``."""

    def __init__(self, signum: int, step: int, checkpoint: str, requeued: str | None) -> None:
        super().__init__(128 + signum)
        self.signal_name = signal.Signals(signum).name
        self.step, self.checkpoint, self.requeued = step, checkpoint, requeued

    def __str__(self) -> str:
        then = f"Slurm job {self.requeued} requeued" if self.requeued else f"resume with --ckpt_path {self.checkpoint}"
        return f"{self.signal_name} at step {self.step}: saved {self.checkpoint}; {then}"


class Preemption(StepEndCallback):
    """Save at the end of the current optimizer step on SIGTERM or the Slurm requeue signal, then stop.

    Args:
        requeue: on the requeue signal inside a Slurm job, requeue it (``scontrol requeue``) after saving.
    """

    def __init__(self, requeue: bool = True) -> None:
        self.requeue = requeue
        self.received: int | None = None
        self.record: dict[str, Any] | None = None  # what the run card shows
        self._trainer: pl.Trainer | None = None
        self._previous: dict[int, Any] = {}
        self._host_group = None

    # -- signals ---------------------------------------------------------------------------------------
    def signals(self, trainer: pl.Trainer) -> tuple[int, ...]:
        environment = trainer._accelerator_connector.cluster_environment
        requeue_signal = getattr(environment, "requeue_signal", None) if isinstance(environment, SLURMEnvironment) \
            else None
        return tuple(dict.fromkeys((signal.SIGTERM, requeue_signal or signal.SIGUSR1)))

    def _install(self, trainer: pl.Trainer) -> None:
        from threading import current_thread, main_thread

        if current_thread() is not main_thread():
            return
        self._trainer = trainer
        for signum in self.signals(trainer):
            previous = signal.signal(signum, self._on_signal)
            self._previous.setdefault(signum, previous)

    def _restore(self) -> None:
        for signum, previous in self._previous.items():
            signal.signal(signum, previous if previous is not None else signal.SIG_DFL)
        self._previous = {}

    def _on_signal(self, signum: int, frame: Any) -> None:
        name = signal.Signals(signum).name
        if self.received is not None:
            os.write(2, f"lightning-moe: {name} received again; already stopping after this step\n".encode())
            return
        self.received = signum
        # os.write, not print: a handler may interrupt a print in progress
        os.write(2, f"lightning-moe: received {name}; saving after the optimizer step in flight\n".encode())
        launcher = getattr(self._trainer.strategy, "launcher", None) if self._trainer is not None else None
        if launcher is not None and hasattr(launcher, "kill"):
            launcher.kill(signum)  # processes Lightning started itself get it too, as with its own handler

    # -- hooks -----------------------------------------------------------------------------------------
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        # installed before Lightning registers its handlers: it then leaves the requeue signal alone
        if stage == "fit":
            self._install(trainer)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_train_start(trainer, pl_module)
        connector = trainer._signal_connector
        if connector.received_sigterm:  # arrived between Lightning's registration and now
            connector.received_sigterm = False
            self.received = self.received or signal.SIGTERM
        self._install(trainer)  # replaces Lightning's SIGTERM handler (stop without saving, exit status 0)
        # Lightning took the handlers installed in ``setup`` for the originals it restores at its teardown
        for signum, previous in self._previous.items():
            if signum in connector._original_handlers:
                connector._original_handlers[signum] = previous
        align_batch_count(trainer)
        self._host_group = host_group()
        loop = trainer.fit_loop.epoch_loop
        if hasattr(loop, "_broadcast_sigterm_tensor"):
            # Lightning agrees on its SIGTERM flag before every micro-batch through a device tensor it reads back (a
            # host sync on a GPU); the same agreement over the host group
            loop._broadcast_sigterm_tensor = lambda: broadcast_sigterm_on_host(trainer, self._host_group)

    def _agreed_signal(self) -> int:
        """The signal any rank received (0: none), the same on every rank. The flag is a host value, agreed over a
        host (gloo) group: no step waits for the device to learn it."""
        if not (dist.is_available() and dist.is_initialized()):
            return self.received or 0
        flag = torch.tensor([self.received or 0])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._host_group)
        return int(flag.item())

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        # Lightning's ModelCheckpoint decides per micro-batch: resumed at a step that is a multiple of
        # every_n_train_steps, or on a time interval, it saves in the middle of an accumulation window (steps and
        # data position then disagree). Marking the step in flight as saved holds every save to a step's end.
        for callback in trainer.checkpoint_callbacks:
            if isinstance(callback, ModelCheckpoint):
                callback._last_global_step_saved = trainer.global_step

    def on_step_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any) -> None:
        signum = self._agreed_signal()
        if not signum or 0 < trainer.max_steps <= trainer.global_step:
            return  # no signal, or the run is done anyway
        path = trainer.strategy.broadcast(trainer._checkpoint_connector.hpc_save_path(trainer.default_root_dir))
        trainer.save_checkpoint(path)
        requeued = self._requeue(trainer) if signum != signal.SIGTERM else None
        error = Preempted(signum, trainer.global_step, str(path), requeued)
        self.record = {"signal": error.signal_name, "step": error.step, "checkpoint": error.checkpoint,
                       "requeued": requeued}
        if trainer.is_global_zero:
            print(f"lightning-moe: preempted by {error}", file=sys.stderr, flush=True)
        raise error

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._restore()

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._restore()

    # -- Slurm -----------------------------------------------------------------------------------------
    def _requeue(self, trainer: pl.Trainer) -> str | None:
        """Requeue the Slurm job (rank 0); returns its id, or None outside Slurm / with requeue off."""
        environment = trainer._accelerator_connector.cluster_environment
        job = slurm_job_id()
        if not self.requeue or job is None or (isinstance(environment, SLURMEnvironment)
                                               and not environment.auto_requeue):
            return None
        if trainer.is_global_zero:
            result = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True)
            if result.returncode:
                raise RuntimeError(f"scontrol requeue {job} failed ({result.returncode}): "
                                   f"{(result.stderr or result.stdout).strip()}; the checkpoint is saved, resubmit "
                                   f"the job to resume")
        return job


def broadcast_sigterm_on_host(trainer: pl.Trainer, group) -> None:
    """Lightning's check, on every rank before a micro-batch, that rank 0 did not get a SIGTERM through Lightning's
    own handler (which this callback replaces, so the flag stays unset unless something else sets it), with the
    flag a host tensor broadcast over ``group``."""
    flag = torch.tensor([1 if getattr(trainer, "received_sigterm", False) else 0])
    dist.broadcast(flag, src=0, group=group)
    if flag.item() == 1:
        dist.barrier(group=group)  # as Lightning: every rank gets here before any exits
        raise SIGTERMException()


def host_group():
    """A process group that all-reduces host (CPU) tensors: the world group under gloo, else a gloo group over every
    rank, made once (a collective: every rank calls it)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_backend() == "gloo":
        return None
    return dist.new_group(backend="gloo")


def align_batch_count(trainer: pl.Trainer) -> None:
    """Lightning counts micro-batches per epoch in its loop state and ends an accumulation window when that count
    is a multiple of the accumulation; resumed with another data-parallel size or batch sizes, the restored count
    belongs to the old layout and the first window would be cut short. Re-count it from the data position."""
    data = trainer.datamodule
    taken = data.micro_batches_into_epoch() if hasattr(data, "micro_batches_into_epoch") else None
    progress = trainer.fit_loop.epoch_loop.batch_progress.current
    if trainer.global_step == 0 or taken is None or progress.ready == taken:
        return
    shift = taken - progress.ready  # all four counters: Lightning completes the batch a checkpoint was saved in
    progress.ready, progress.started = progress.ready + shift, progress.started + shift
    progress.processed, progress.completed = progress.processed + shift, progress.completed + shift


def slurm_job_id() -> str | None:
    """This job's id as ``scontrol requeue`` takes it (``<array job>_<task>`` for an array task)."""
    array_job = os.environ.get("SLURM_ARRAY_JOB_ID")
    if array_job is not None and "SLURM_ARRAY_TASK_ID" in os.environ:
        return f"{array_job}_{os.environ['SLURM_ARRAY_TASK_ID']}"
    return os.environ.get("SLURM_JOB_ID")
