"""MedPix VQA (``mmoukouba/MedPix-VQA``) for vision-language fine-tuning.

Rows: ``image_id`` (an image: ``datasets`` ``Image`` column, bytes, or a path relative to the data file),
``mode``, ``case_id``, ``question``, ``answer``. Each row is the conversation user [image, question] ->
assistant [answer], with loss on the answer through the end-of-turn token (:mod:`lightning_moe.data.vision_text`).

At setup every row is encoded once to find its length and to find bad rows (missing or undecodable images,
empty text): they are skipped and counted (``bad_rows: skip``) or stop the run naming the row
(``bad_rows: error``). Samples longer than a row are dropped and counted (truncation would cut the image or
the end-of-turn token). Rows are then packed (``packing``: ``none`` = one sample per row, ``greedy``, ``ffd``);
images are decoded and processed again when their row is loaded, so memory holds only token counts.
"""

from __future__ import annotations

import logging
import os
from collections import Counter
from typing import Any, Literal

from torch.utils.data import DataLoader, Dataset

from lightning_moe.data.base import BaseDataModule
from lightning_moe.data.formats import RowError
from lightning_moe.data.packing import PACKERS
from lightning_moe.data.sources import load_source
from lightning_moe.data.vision_text import (
    ImageError,
    VisionCollator,
    VisionTextProcessor,
    decode_image,
    encode_image_question_answer,
    load_vision_processor,
    pack_samples,
)
from lightning_moe.row_length import RowLength, packed_rows

log = logging.getLogger(__name__)
IMAGE_COLUMN = "image_id"
COLUMNS = (IMAGE_COLUMN, "question", "answer")


def _text(row: dict[str, Any], column: str) -> str:
    value = row.get(column)
    if not isinstance(value, str) or not value.strip():
        raise RowError(f"column '{column}' must be a non-empty string, got {value!r:.40}")
    return value


class MedPixRows:
    """Encodes rows of one source: ``encode(i)`` -> sample (raises :class:`RowError` for a bad row)."""

    def __init__(self, dataset: Any, base_dir: str | None, processor: VisionTextProcessor,
                 system_prompt: str | None = None) -> None:
        self.dataset, self.base_dir, self.processor, self.system_prompt = dataset, base_dir, processor, system_prompt

    def encode(self, index: int) -> dict[str, Any]:
        row = self.dataset[index]
        question, answer = _text(row, "question"), _text(row, "answer")
        image = decode_image(row.get(IMAGE_COLUMN), self.base_dir, IMAGE_COLUMN)
        return encode_image_question_answer(self.processor, image, question, answer, self.system_prompt)


class PackedVisionDataset(Dataset):
    """Packed rows: each item concatenates the samples of ``packs[i]`` (row indices of the source)."""

    def __init__(self, rows: MedPixRows, packs: list[list[int]]) -> None:
        self.rows, self.packs = rows, packs

    def __len__(self) -> int:
        return len(self.packs)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return pack_samples([self.rows.encode(j) for j in self.packs[i]])


class MedPixDataModule(BaseDataModule):
    """Image + question -> answer fine-tuning data in the MedPix VQA schema.

    Args:
        processor: the model's directory or hub id, with its tokenizer (and chat template) and image processor.
        dataset: training rows: a ``.jsonl``/``.json``/``.parquet`` file, a ``save_to_disk`` folder or a hub id
            (``mmoukouba/MedPix-VQA``).
        split: split of ``dataset`` (with optional slice, ``train[:1000]``).
        val_dataset: validation rows (same kinds); default: none.
        val_split: split of ``val_dataset``.
        revision: hub revision of the datasets and of a hub processor.
        trust_remote_code: let a hub processor run its own code.
        system_prompt: an optional system turn before each conversation.
        image_token: the image placeholder of the chat template (default: the tokenizer's, else ``<|image_pad|>``).
        packing: ``none`` (one sample per row, padded to the longest row of the micro-batch), ``greedy`` or
            ``ffd`` (several samples per row of ``packed_sequence_size`` tokens, each with its own positions).
        packed_sequence_size: tokens per row; longer samples are dropped (and counted).
        pad_seq_to_mult: unpacked rows are padded to a multiple of this.
        bad_rows: ``skip`` (default: count and log rows with missing/undecodable images or empty text) or
            ``error`` (stop at the first, naming it).
        micro_batch_size: rows per data-parallel rank per step.
        global_batch_size: rows per optimizer step over all data-parallel ranks.
        seed: shuffle seed (default: the ``seed_everything`` seed, else 1234).
        num_workers: DataLoader worker processes.
    """

    def __init__(
        self, processor: str, dataset: str, split: str = "train", val_dataset: str | None = None,
        val_split: str = "train", revision: str | None = None, trust_remote_code: bool = False,
        system_prompt: str | None = None, image_token: str | None = None,
        packing: Literal["none", "greedy", "ffd"] = "none", packed_sequence_size: int = 2048, pad_seq_to_mult: int = 1,
        bad_rows: Literal["skip", "error"] = "skip", micro_batch_size: int = 1, global_batch_size: int | None = None,
        seed: int | None = None, num_workers: int = 0,
    ) -> None:
        super().__init__(micro_batch_size, global_batch_size, seed, num_workers)
        if packing not in PACKERS:
            raise ValueError(f"packing={packing!r} must be one of {sorted(PACKERS)}")
        if bad_rows not in ("skip", "error"):
            raise ValueError(f"bad_rows={bad_rows!r} must be skip or error")
        if pad_seq_to_mult < 1 or packed_sequence_size % pad_seq_to_mult:
            raise ValueError(f"packed_sequence_size {packed_sequence_size} must be a multiple of "
                             f"pad_seq_to_mult {pad_seq_to_mult}")
        self.processor_path, self.revision, self.trust_remote_code = processor, revision, trust_remote_code
        self.dataset, self.split, self.val_dataset, self.val_split = dataset, split, val_dataset, val_split
        self.system_prompt, self.image_token = system_prompt, image_token
        self.packing, self.packed_sequence_size, self.pad_seq_to_mult = packing, packed_sequence_size, pad_seq_to_mult
        self.bad_rows = bad_rows
        self._processor: VisionTextProcessor | None = None
        self.train_data: PackedVisionDataset | None = None
        self.val_data: PackedVisionDataset | None = None
        self.skipped: dict[str, Counter] = {}

    def row_length(self) -> RowLength:
        return packed_rows(self.packing, self.packed_sequence_size, self.pad_seq_to_mult)

    @property
    def processor(self) -> VisionTextProcessor:
        if self._processor is None:
            self._processor = load_vision_processor(self.processor_path, self.revision, self.trust_remote_code,
                                                    self.image_token)
        return self._processor

    def _build(self, name: str, source: str, split: str) -> PackedVisionDataset:
        """``name`` (train / validation) keys the skipped-row counts in ``self.skipped``."""
        src = load_source(source, split, self.revision)
        ds = src.dataset
        missing = [c for c in COLUMNS if c not in ds.column_names]
        if missing:
            raise ValueError(f"{src.name}: column '{missing[0]}' missing (found: {', '.join(ds.column_names)})")
        ds = _undecoded_images(ds, IMAGE_COLUMN)
        base_dir = os.path.dirname(os.path.abspath(source)) if os.path.isfile(source) else None
        rows = MedPixRows(ds, base_dir, self.processor, self.system_prompt)
        kept, lengths, skipped, first = [], [], Counter(), None
        for i in range(len(ds)):
            try:
                length = len(rows.encode(i)["input_ids"])
            except RowError as err:
                if self.bad_rows == "error":
                    raise ValueError(f"{src.name} row {i}: {err} (set bad_rows: skip to skip such rows)") from None
                skipped["missing or undecodable image" if isinstance(err, ImageError) else "invalid text"] += 1
                first = first or f"row {i}: {err}"
                continue
            if length > self.packed_sequence_size:
                skipped["longer than packed_sequence_size"] += 1
                continue
            kept.append(i)
            lengths.append(length)
        if skipped:
            log.warning("%s: skipped %d of %d rows (%s); first bad row: %s", src.name, sum(skipped.values()), len(ds),
                        ", ".join(f"{n} {k}" for k, n in skipped.items()), first)
        if not kept:
            raise ValueError(f"{src.name}: no usable rows ({dict(skipped)}; first: {first})")
        self.skipped[name] = skipped
        packs = PACKERS[self.packing](lengths, self.packed_sequence_size)
        return PackedVisionDataset(rows, [[kept[j] for j in pack] for pack in packs])

    def setup(self, stage: str | None = None) -> None:
        if self.train_data is None:
            self.train_data = self._build("train", self.dataset, self.split)
        if self.val_data is None and self.val_dataset is not None:
            self.val_data = self._build("validation", self.val_dataset, self.val_split)

    def _collator(self) -> VisionCollator:
        if self.packing == "none":
            return VisionCollator(self.processor.pad_id, None, self.pad_seq_to_mult)
        return VisionCollator(self.processor.pad_id, self.packed_sequence_size)

    def train_dataloader(self) -> DataLoader:
        self.setup("fit")
        return self._train_loader(self.train_data, self._collator())

    def val_dataloader(self) -> DataLoader | list:
        self.setup("validate")
        if self.val_data is None:
            return self.no_eval_data("validation", "val_dataset")
        return self._eval_loader(self.val_data, self._collator())


def _undecoded_images(ds: Any, column: str) -> Any:
    """A ``datasets`` ``Image`` column read as ``{bytes, path}``, so a bad image is one bad row, not a crash."""
    from datasets import Image

    if isinstance(ds.features.get(column), Image):
        return ds.cast_column(column, Image(decode=False))
    return ds
