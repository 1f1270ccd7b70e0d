"""Pretraining data module over Megatron indexed datasets (blends, splits), or mock tokens."""

from __future__ import annotations

from typing import Any

from torch.utils.data import DataLoader

from lightning_moe.data.base import BaseDataModule
from lightning_moe.data.collate import Collator
from lightning_moe.data.gpt_sampling import (
    BlendedDataset,
    GPTDataset,
    blended_samples_needed,
    parse_blend,
    parse_split,
    split_ranges,
)
from lightning_moe.data.indexed import IndexedDataset
from lightning_moe.data.mock import MockDataset
from lightning_moe.data.tokenizer import load_tokenizer
from lightning_moe.row_length import RowLength

SPLITS = ("train", "valid", "test")


class PretrainDataModule(BaseDataModule):
    """GPT pretraining samples from Megatron ``.bin/.idx`` files.

    Batches: ``input_ids`` = ``text[:-1]``, ``labels`` = ``text[1:]`` (the package's shifted labels),
    ``position_ids`` (restarting after EOD with ``reset_at_eod``), ``num_label_tokens``.

    Args:
        blend: data for all splits, divided by ``split``: one path prefix, ``["30", "prefix_a", "70",
            "prefix_b"]`` or ``[["prefix_a", "prefix_b"], null]`` (Megatron's formats; weights normalized).
        blend_per_split: ``[train_blend, valid_blend, test_blend]`` (each like ``blend`` or null); used
            instead of ``blend`` + ``split``.
        split: split of ``blend``'s sequences into train/valid/test, e.g. ``"969,30,1"`` (megatron-core's bounds).
        seq_length: tokens per sample.
        tokenizer: tokenizer directory or hub id, only to find the EOD (eos) token id.
        eod_token_id: EOD token id (overrides the tokenizer's eos).
        reset_at_eod: restart positions and attention after each EOD token.
        eod_mask_loss: no loss where the input token is EOD.
        train_samples: training samples to draw (epochs repeat as needed). Default: ``trainer.max_steps *
            global_batch_size`` when the trainer has ``max_steps``, else one epoch.
        eval_samples: validation/test samples. Default: one epoch of the split.
        mock: random tokens instead of files (``vocab_size`` sets their range).
        vocab_size: token range of mock data.
        micro_batch_size: samples per data-parallel rank per step.
        global_batch_size: samples per optimizer step over all data-parallel ranks.
        seed: seed of document, sample and blend shuffles (default: the ``seed_everything`` seed, else 1234).
        num_workers: DataLoader worker processes.
        cache_dir: where the sampling and blending indices are built once (by one process per node, in
            ``prepare_data``) and memory-mapped from by every rank; None builds them in each rank's memory.
    """

    def __init__(
        self, blend: Any = None, blend_per_split: list[Any] | None = None, split: str = "969,30,1",
        seq_length: int = 2048, tokenizer: str | None = None, eod_token_id: int | None = None,
        reset_at_eod: bool = False, eod_mask_loss: bool = False, train_samples: int | None = None,
        eval_samples: int | None = None, mock: bool = False, vocab_size: int = 32000, micro_batch_size: int = 1,
        global_batch_size: int | None = None, seed: int | None = None, num_workers: int = 0, cache_dir: str | None = None,
    ) -> None:
        super().__init__(micro_batch_size, global_batch_size, seed, num_workers)
        if not mock and blend is None and blend_per_split is None:
            raise ValueError("PretrainDataModule needs `blend`, `blend_per_split` or `mock=True`")
        if blend is not None and blend_per_split is not None:
            raise ValueError("give either `blend` (with `split`) or `blend_per_split`, not both")
        if blend_per_split is not None and len(blend_per_split) != 3:
            raise ValueError(f"blend_per_split must have 3 entries (train, valid, test), got {len(blend_per_split)}")
        self.blend, self.blend_per_split, self.split = blend, blend_per_split, split
        self.split_fractions = parse_split(split)
        # parse now so a malformed blend fails at construction, naming the bad weight
        for b in [blend, *(blend_per_split or [])]:
            if b is not None:
                parse_blend(b)
        self.seq_length, self.tokenizer_path, self.eod_token_id = seq_length, tokenizer, eod_token_id
        self.reset_at_eod, self.eod_mask_loss = reset_at_eod, eod_mask_loss
        self.train_samples, self.eval_samples = train_samples, eval_samples
        self.mock, self.vocab_size = mock, vocab_size
        self.cache_dir = cache_dir
        self.datasets: dict[str, Any] = {}
        self.collate = Collator(pad_id=0, pad_to=seq_length)

    def _eod(self) -> int | None:
        if self.eod_token_id is not None:
            return self.eod_token_id
        if self.tokenizer_path is not None:
            return load_tokenizer(self.tokenizer_path).eos_token_id
        return None

    def _num_samples(self, split: str) -> int | None:
        if split != "train":
            return self.eval_samples
        if self.train_samples is not None:
            return self.train_samples
        trainer = self.trainer
        max_steps = getattr(trainer, "max_steps", -1) if trainer is not None else -1
        if max_steps and max_steps > 0:
            return max_steps * self.resolved_global_batch_size()
        return None

    def build(self, split: str) -> Any | None:
        """The dataset of one split (``train``, ``valid``, ``test``), or None when the split is empty."""
        num_samples = self._num_samples(split)
        if self.mock:
            n = num_samples or (10_000 if split == "train" else 256)
            return MockDataset(n, self.seq_length, self.vocab_size, self.seed + SPLITS.index(split))
        k = SPLITS.index(split)
        if self.blend_per_split is not None:
            blend, fraction_range = self.blend_per_split[k], None
            if blend is None:
                return None
        else:
            blend, fraction_range = self.blend, self.split_fractions
            if fraction_range[k] == 0:
                return None
        prefixes, weights = parse_blend(blend)
        eod = self._eod() if (self.reset_at_eod or self.eod_mask_loss) else None
        needed = [None] * len(prefixes) if num_samples is None else blended_samples_needed(weights, num_samples)
        members = []
        for j, (prefix, n) in enumerate(zip(prefixes, needed)):
            indexed = IndexedDataset(prefix)
            seq_range = None
            if fraction_range is not None:
                seq_range = split_ranges(len(indexed), fraction_range)[k]
                if seq_range[1] <= seq_range[0]:
                    raise ValueError(f"{prefix}: split {self.split!r} leaves no {split} sequences "
                                     f"({len(indexed)} sequences in all)")
            members.append(GPTDataset(
                indexed, self.seq_length, n, seed=self.seed + 1000 * k + j, sequence_range=seq_range,
                reset_at_eod=self.reset_at_eod, eod_token_id=eod, eod_mask_loss=self.eod_mask_loss,
                shuffle=split == "train", cache_dir=self.cache_dir,
            ))
        if len(members) == 1 and num_samples is None:
            return members[0]
        size = num_samples
        if size is None:  # one epoch of each member: the largest blend in which no member runs out
            size = int(min((len(m) - 2) / w for m, w in zip(members, weights) if w > 0))
        return BlendedDataset(members, weights, size, cache_dir=self.cache_dir)

    def row_length(self) -> RowLength:
        return RowLength("seq_length", self.seq_length)

    def token_id_bound(self) -> tuple[int, str] | None:
        """From the largest token id of every indexed file the splits read (cached with ``cache_dir``)."""
        if self.mock:
            return self.vocab_size, f"the mock data's vocab_size is {self.vocab_size}"
        largest, where = -1, None
        for blend in [self.blend, *(self.blend_per_split or [])]:
            if blend is None:
                continue
            for prefix in parse_blend(blend)[0]:
                found = IndexedDataset(prefix).max_token_id(self.cache_dir)
                if found > largest:
                    largest, where = found, prefix
        if where is None:
            return None
        return largest + 1, f"{where}.bin holds token id {largest}"

    def prepare_data(self) -> None:
        """With a ``cache_dir``: build the index arrays of every split once (Lightning runs this on one
        process per node, before any rank's ``setup`` memory-maps them)."""
        if self.cache_dir is not None and not self.mock:
            for split in SPLITS:
                self.build(split)

    def setup(self, stage: str | None = None) -> None:
        for split in SPLITS:
            if split not in self.datasets:
                self.datasets[split] = self.build(split)

    def train_dataloader(self) -> DataLoader:
        if "train" not in self.datasets:
            self.setup("fit")
        if self.datasets["train"] is None:
            raise ValueError("no training data: the train split is empty")
        return self._train_loader(self.datasets["train"], self.collate, shuffle=False)

    def val_dataloader(self) -> DataLoader | list:
        if "valid" not in self.datasets:
            self.setup("validate")
        ds = self.datasets["valid"]
        return self.no_eval_data("validation", "split or blend_per_split") if ds is None else self._eval_loader(
            ds, self.collate)

    def test_dataloader(self) -> DataLoader | list:
        if "test" not in self.datasets:
            self.setup("test")
        ds = self.datasets["test"]
        return self.no_eval_data("test", "split or blend_per_split") if ds is None else self._eval_loader(
            ds, self.collate)
