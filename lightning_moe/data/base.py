"""Shared machinery of the data modules: batch sizes, data-parallel sharding, resumable position."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import lightning as L
from lightning.pytorch.utilities import rank_zero_warn
from torch.utils.data import DataLoader, Dataset

from lightning_moe.data.distributed import data_parallel_rank_and_size
from lightning_moe.data.sampler import DataParallelSampler, ResumableDataLoader
from lightning_moe.row_length import RowLength
from lightning_moe.seeds import seed_in_force

log = logging.getLogger(__name__)
DEFAULT_SEED = 1234  # without a recipe seed or seed_everything


class BaseDataModule(L.LightningDataModule):
    """Base of the package's data modules.

    The training position (``consumed_samples``, a global sample count) advances each time a
    training batch reaches the model (``on_after_batch_transfer``), is returned by ``state_dict()``
    (Lightning stores it in checkpoints) and restored by ``load_state_dict()``, so a resumed run
    continues with exactly the next samples. Samplers shard by data-parallel rank; build the
    Trainer with ``use_distributed_sampler=False`` or leave the default: the sampler is a
    ``DistributedSampler`` subclass, which Lightning does not replace.

    Args:
        micro_batch_size: rows per data-parallel rank per step.
        global_batch_size: rows per optimizer step over all data-parallel ranks; must be divisible by
            ``micro_batch_size * dp_size`` (the quotient is the gradient-accumulation count). Default:
            ``micro_batch_size * dp_size``.
        seed: seed of the per-epoch shuffle; default: the ``seed_everything`` seed, else 1234.
        num_workers: DataLoader worker processes.
    """

    def __init__(self, micro_batch_size: int = 1, global_batch_size: int | None = None, seed: int | None = None,
                 num_workers: int = 0) -> None:
        super().__init__()
        if micro_batch_size < 1:
            raise ValueError(f"micro_batch_size must be >= 1, got {micro_batch_size}")
        if global_batch_size is not None and (global_batch_size < 1 or global_batch_size % micro_batch_size):
            raise ValueError(f"global_batch_size {global_batch_size} must be a positive multiple of "
                             f"micro_batch_size {micro_batch_size}")
        self.micro_batch_size = micro_batch_size
        self.global_batch_size = global_batch_size
        self.own_seed = seed
        self.num_workers = num_workers
        self.consumed_samples = 0
        self._train_sampler: DataParallelSampler | None = None

    @property
    def seed(self) -> int:
        """The data seed in force (read where the data is built: ``prepare_data`` runs on one process per node, so
        this is no collective; every rank of a run shares the ``seed_everything`` seed of the recipe)."""
        return seed_in_force(self.own_seed, DEFAULT_SEED)

    # -- sharding -------------------------------------------------------------------------------
    def data_parallel_rank_and_size(self) -> tuple[int, int]:
        return data_parallel_rank_and_size(self.trainer)

    def resolved_global_batch_size(self) -> int:
        _, dp_size = self.data_parallel_rank_and_size()
        gbs = self.global_batch_size or self.micro_batch_size * dp_size
        if gbs % (self.micro_batch_size * dp_size):
            raise ValueError(
                f"global_batch_size {gbs} must be divisible by micro_batch_size * data-parallel size = "
                f"{self.micro_batch_size} * {dp_size} = {self.micro_batch_size * dp_size}"
            )
        return gbs

    def _train_loader(self, dataset: Dataset, collate_fn: Callable, shuffle: bool = True) -> DataLoader:
        rank, size = self.data_parallel_rank_and_size()
        gbs = self.resolved_global_batch_size()
        trainer = self.trainer
        accumulate = gbs // (self.micro_batch_size * size)
        if trainer is not None:
            self._set_accumulation(trainer, gbs, size, accumulate)
        self._train_sampler = DataParallelSampler(
            dataset, rank, size, self.micro_batch_size, gbs, shuffle=shuffle, seed=self.seed,
            consumed_samples=self.consumed_samples,
        )
        return ResumableDataLoader(
            dataset, batch_size=self.micro_batch_size, sampler=self._train_sampler, collate_fn=collate_fn,
            num_workers=self.num_workers, drop_last=True, persistent_workers=False,
        )

    def _set_accumulation(self, trainer: Any, gbs: int, dp_size: int, accumulate: int) -> None:
        """The batch sizes decide gradient accumulation (as in Megatron recipes); a Trainer set to a different
        count is an error, not a silent change of the global batch."""
        current = getattr(trainer, "accumulate_grad_batches", 1)
        if current == accumulate:
            return
        if current != 1:
            raise ValueError(
                f"global_batch_size {gbs} = micro_batch_size {self.micro_batch_size} x data-parallel size {dp_size} "
                f"x {accumulate} accumulation steps, but trainer.accumulate_grad_batches={current}; "
                f"drop trainer.accumulate_grad_batches or set it to {accumulate}"
            )
        log.info("gradient accumulation: %d micro-batches per optimizer step", accumulate)
        trainer.accumulate_grad_batches = accumulate

    def _eval_loader(self, dataset: Dataset, collate_fn: Callable) -> DataLoader:
        """In-order evaluation, sharded by data-parallel rank (a final partial step is dropped)."""
        rank, size = self.data_parallel_rank_and_size()
        sampler = DataParallelSampler(dataset, rank, size, self.micro_batch_size, shuffle=False)
        return DataLoader(dataset, batch_size=self.micro_batch_size, sampler=sampler, collate_fn=collate_fn,
                          num_workers=self.num_workers, drop_last=True)

    def no_eval_data(self, what: str, keys: str) -> list:
        """What a loader returns for a split the data module has none of: nothing to evaluate in ``fit``, an error
        naming the settings (``keys``) for ``validate`` / ``test``, whose only job that split is."""
        command = getattr(getattr(getattr(self, "trainer", None), "state", None), "fn", None)
        command = getattr(command, "value", command)
        if command in ("validate", "test"):
            raise ValueError(f"{command}: {type(self).__name__} has no {what} data; set data.init_args.{keys}")
        return []

    # -- what the data holds ----------------------------------------------------------------------
    def row_length(self) -> RowLength | None:
        """The length of the rows this module yields (``lightning_moe/row_length.py``); None when rows vary freely."""
        return None

    def token_id_bound(self) -> tuple[int, str] | None:
        """``(n, what)``: every token id in the data is below ``n``; ``what`` names where ``n`` comes from.
        None when unknown."""
        return None

    def check_vocabulary(self, vocab_size: int, key: str = "model.vocab_size") -> None:
        """Raise before the first step when token ids of the data can reach past the model's embedding (the
        error would otherwise be an IndexError deep in the embedding, or a device-side assert)."""
        bound = self.token_id_bound()
        if bound is not None and bound[0] > vocab_size:
            raise ValueError(f"{key} is {vocab_size}, but {bound[1]}: the model needs a vocabulary of at least "
                             f"{bound[0]} (or data tokenized for it)")

    def data_counts(self) -> dict[str, Any] | None:
        """What setup read, dropped, truncated or skipped (printed at setup, recorded in the run card)."""
        return None

    # -- position -------------------------------------------------------------------------------
    def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        trainer = self.trainer
        if trainer is not None and trainer.training:
            self.advance(1)
        return batch

    def advance(self, num_micro_batches: int) -> None:
        """Count ``num_micro_batches`` training steps (of every data-parallel rank) as consumed."""
        _, size = self.data_parallel_rank_and_size()
        self.consumed_samples += num_micro_batches * self.micro_batch_size * size
        if self._train_sampler is not None:
            self._train_sampler.consumed_samples = self.consumed_samples

    def micro_batches_into_epoch(self) -> int | None:
        """Micro-batches this rank has taken of the current epoch at the data position, in the current layout
        (None before the training loader exists)."""
        sampler = self._train_sampler
        if sampler is None:
            return None
        return self.consumed_samples % sampler.samples_per_epoch // sampler.step_size

    def state_dict(self) -> dict[str, Any]:
        return {"consumed_samples": self.consumed_samples, "seed": self.seed,
                "micro_batch_size": self.micro_batch_size, "global_batch_size": self.global_batch_size}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if state_dict.get("seed", self.seed) != self.seed:
            rank_zero_warn(f"resuming with seed {self.seed} but the checkpoint used {state_dict['seed']}: "
                           "the sample order differs from the original run")
        self.consumed_samples = int(state_dict.get("consumed_samples", 0))
        for key in ("micro_batch_size", "global_batch_size"):
            saved, now = state_dict.get(key), getattr(self, key)
            if saved is not None and now is not None and saved != now:
                rank_zero_warn(f"resuming with {key} {now} but the checkpoint used {saved}: the data position "
                               f"carries over in samples ({self.consumed_samples} consumed), so no sample is repeated "
                               f"or skipped, but the run's steps from here hold different batches than the "
                               f"original run's")
        if self._train_sampler is not None:
            self._train_sampler.consumed_samples = self.consumed_samples
