"""Random-token data: the "Mock" workload of benchmark tables, and a dependency-free smoke test."""

from __future__ import annotations

import numpy as np
from torch.utils.data import DataLoader, Dataset

from lightning_moe.data.base import BaseDataModule
from lightning_moe.data.collate import Collator
from lightning_moe.row_length import RowLength


class MockDataset(Dataset):
    """``num_samples`` rows of ``seq_length`` random tokens; row ``i`` depends only on ``(seed, i)``."""

    def __init__(self, num_samples: int, seq_length: int, vocab_size: int, seed: int = 0) -> None:
        self.num_samples, self.seq_length, self.vocab_size, self.seed = num_samples, seq_length, vocab_size, seed

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, i: int) -> dict[str, np.ndarray]:
        if not 0 <= i < self.num_samples:
            raise IndexError(i)
        text = np.random.default_rng([self.seed, i]).integers(0, self.vocab_size, self.seq_length + 1)
        return {"input_ids": text[:-1], "labels": text[1:], "position_ids": np.arange(self.seq_length)}


class MockDataModule(BaseDataModule):
    """Random tokens with the package's batch keys, sharded and resumable like the real data modules.

    Args:
        seq_length: tokens per row.
        micro_batch_size: rows per data-parallel rank per step.
        global_batch_size: rows per optimizer step over all data-parallel ranks (default micro * dp).
        vocab_size: tokens are drawn uniformly from ``[0, vocab_size)``.
        seed: data seed; row ``i`` is a function of ``(seed, i)`` only (default: the ``seed_everything`` seed, else
            1234).
        num_train_samples: rows per training epoch.
        num_val_samples: rows of the validation/test set (0: no validation data).
        num_workers: DataLoader worker processes.
    """

    def __init__(self, seq_length: int = 2048, micro_batch_size: int = 1, global_batch_size: int | None = None,
                 vocab_size: int = 32000, seed: int | None = None, num_train_samples: int = 1_000_000,
                 num_val_samples: int = 64, num_workers: int = 0) -> None:
        super().__init__(micro_batch_size, global_batch_size, seed, num_workers)
        if seq_length < 1 or vocab_size < 2:
            raise ValueError(f"seq_length must be >= 1 and vocab_size >= 2, got {seq_length} and {vocab_size}")
        self.seq_length, self.vocab_size = seq_length, vocab_size
        self.num_train_samples, self.num_val_samples = num_train_samples, num_val_samples
        self.collate = Collator(pad_id=0, pad_to=seq_length)

    def row_length(self) -> RowLength:
        return RowLength("seq_length", self.seq_length)

    def token_id_bound(self) -> tuple[int, str]:
        return self.vocab_size, f"the mock data's vocab_size is {self.vocab_size}"

    def train_dataloader(self) -> DataLoader:
        ds = MockDataset(self.num_train_samples, self.seq_length, self.vocab_size, self.seed)
        return self._train_loader(ds, self.collate, shuffle=False)

    def val_dataloader(self) -> DataLoader | list:
        if self.num_val_samples == 0:
            return self.no_eval_data("validation/test", "num_val_samples")
        ds = MockDataset(self.num_val_samples, self.seq_length, self.vocab_size, self.seed + 1)
        return self._eval_loader(ds, self.collate)

    def test_dataloader(self) -> DataLoader | list:
        return self.val_dataloader()
