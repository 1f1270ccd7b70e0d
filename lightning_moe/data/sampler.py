"""A data-parallel, resumable sampler.

The sampler walks one global order of sample indices (a seeded permutation per epoch) in steps of
``micro_batch_size * dp_size``; data-parallel rank ``r`` takes the ``r``-th ``micro_batch_size``
chunk of each step (as Megatron's pretraining sampler does). Its position is a single global
number, ``consumed_samples``, so resuming at the same number continues with exactly the next
samples, whatever the number of DataLoader workers. Ranks that share a data-parallel rank
(tensor-, context-, expert-parallel peers) get identical indices.

It subclasses ``DistributedSampler`` so Lightning never replaces it with its own.
"""

from __future__ import annotations

from collections.abc import Iterator, Sized
from typing import Any

import numpy as np
from torch.utils.data import DataLoader, DistributedSampler


class DataParallelSampler(DistributedSampler):
    """Sample indices for one data-parallel rank, starting at a global position.

    Args:
        dataset: anything with ``len()``.
        dp_rank: this process's data-parallel rank.
        dp_size: number of data-parallel ranks.
        micro_batch_size: samples per rank per step.
        global_batch_size: samples per optimizer step over all ranks; an epoch is truncated to a
            multiple of it so every step is full. Defaults to ``micro_batch_size * dp_size``.
        shuffle: permute samples each epoch (seeded by ``(seed, epoch)``); else dataset order.
        seed: shuffling seed.
        consumed_samples: global number of samples already consumed (all ranks, all epochs); the
            next ``iter()`` starts there. The owning data module advances it as batches are used.
    """

    def __init__(self, dataset: Sized, dp_rank: int, dp_size: int, micro_batch_size: int,
                 global_batch_size: int | None = None, shuffle: bool = True, seed: int = 0,
                 consumed_samples: int = 0) -> None:
        super().__init__(dataset, num_replicas=dp_size, rank=dp_rank, shuffle=shuffle, seed=seed, drop_last=True)
        self.micro_batch_size = micro_batch_size
        self.global_batch_size = global_batch_size or micro_batch_size * dp_size
        step = micro_batch_size * dp_size
        if self.global_batch_size % step:
            raise ValueError(
                f"global_batch_size {self.global_batch_size} must be divisible by micro_batch_size * "
                f"data-parallel size = {micro_batch_size} * {dp_size} = {step}"
            )
        self.samples_per_epoch = len(dataset) // self.global_batch_size * self.global_batch_size
        if self.samples_per_epoch == 0:
            raise ValueError(f"the dataset has {len(dataset)} samples (rows), fewer than one global batch "
                             f"of {self.global_batch_size}")
        self.consumed_samples = consumed_samples

    @property
    def step_size(self) -> int:
        """Samples consumed over all data-parallel ranks per micro-batch step."""
        return self.micro_batch_size * self.num_replicas

    def epoch_order(self, epoch: int) -> np.ndarray:
        n = len(self.dataset)
        if not self.shuffle:
            return np.arange(n)
        return np.random.default_rng([self.seed, epoch]).permutation(n)

    def __iter__(self) -> Iterator[int]:
        start = self.consumed_samples
        epoch, offset = divmod(start, self.samples_per_epoch)
        if offset % self.step_size:
            raise ValueError(f"consumed_samples {start} is not a multiple of micro_batch_size * dp_size "
                             f"({self.step_size}); the data-parallel layout changed in a way that cannot resume")
        order = self.epoch_order(epoch)
        mb = self.micro_batch_size
        for step_start in range(offset, self.samples_per_epoch, self.step_size):
            first = step_start + self.rank * mb
            yield from order[first:first + mb].tolist()

    def __len__(self) -> int:
        """Indices this rank yields in a whole epoch (Lightning sizes its epoch from this)."""
        return self.samples_per_epoch // self.num_replicas

    def set_epoch(self, epoch: int) -> None:
        # The epoch follows from consumed_samples; Lightning's calls are accepted and ignored.
        self.epoch = epoch


class ResumableDataLoader(DataLoader):
    """A DataLoader that tells Lightning it is resumable.

    The position lives in the owning data module's ``state_dict`` (Lightning saves it in every
    checkpoint); this loader's own state is informational, so that Lightning does not warn that a
    mid-epoch resume is unreliable.
    """

    def state_dict(self) -> dict[str, Any]:
        sampler = self.sampler
        return {"consumed_samples": getattr(sampler, "consumed_samples", 0)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """The data module restores the position; nothing to do here."""
