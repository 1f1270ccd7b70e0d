"""Supervised fine-tuning data: rows -> tokens + loss masks -> packed rows -> batches.

Tokenization runs through ``datasets.map`` (``num_proc`` workers) and is cached; packing runs on the
tokenized lengths and is cached as a packed folder (the same files ``lightning-moe data pack``
writes). Both caches are keyed by a hash of the source's fingerprint, the tokenizer, the format and
the packing settings, so changing any of them rebuilds.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from typing import Any

import numpy as np
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch.utils.data import DataLoader

from lightning_moe.data.base import BaseDataModule
from lightning_moe.data.collate import Collator
from lightning_moe.data.formats import PRESETS, RowError, SampleFormat, shift_labels, tokenize_row
from lightning_moe.data.packed_parquet import (
    PackedDataset,
    TokenizedSamples,
    check_packing_options,
    flat_list_column,
    read_metadata,
    write_packed_dataset,
)
from lightning_moe.data.sources import load_source, source_fingerprint
from lightning_moe.data.tokenizer import load_tokenizer, pad_token_id, tokenizer_fingerprint
from lightning_moe.row_length import RowLength, packed_rows

log = logging.getLogger(__name__)
DEFAULT_CACHE_DIR = os.path.join(os.path.expanduser("~"), ".cache", "lightning_moe", "packed")
_CACHE_VERSION = 1


def make_sample_format(preset: str | None = None, format: str | None = None, **overrides: Any) -> SampleFormat:
    """A :class:`SampleFormat` from a preset name plus overrides (``None`` overrides are ignored)."""
    base: dict[str, Any] = {}
    if preset is not None:
        if preset not in PRESETS:
            raise ValueError(f"unknown preset {preset!r}; choose one of {', '.join(PRESETS)}")
        base = dict(PRESETS[preset])
    if format is not None:
        base["format"] = format
    base.update({k: v for k, v in overrides.items() if v is not None})
    if isinstance(base.get("role_map"), dict):  # hashable and ordered: the format is part of cache keys
        base["role_map"] = tuple(sorted(base["role_map"].items()))
    return SampleFormat(**base)


class _TokenizeRow:
    """The ``datasets.map`` function (a picklable class, so workers can run it)."""

    def __init__(self, tokenizer: Any, fmt: SampleFormat) -> None:
        self.tokenizer, self.fmt = tokenizer, fmt

    def __call__(self, row: dict[str, Any], idx: int) -> dict[str, Any]:
        try:
            ids, mask = tokenize_row(row, self.tokenizer, self.fmt)
            labels = shift_labels(ids, mask)
            if all(t == -100 for t in labels):
                raise RowError("no token carries loss (empty completion?)")
            return {"input_ids": ids, "labels": labels, "error": ""}
        except RowError as e:
            return {"input_ids": [], "labels": [], "error": f"row {idx}: {e}"}


def tokenize_source(
    source: str, tokenizer: Any, fmt: SampleFormat, split: str = "train", revision: str | None = None,
    dataset_name: str | None = None, num_proc: int | None = None, cache_dir: str | None = None,
    skip_invalid_rows: bool = False,
) -> tuple[TokenizedSamples, dict[str, Any]]:
    """Load and tokenize a source; returns the samples and a description (for metadata and cache keys).

    Bad rows raise ``ValueError`` naming the file and row, unless ``skip_invalid_rows``, in which
    case they are skipped and counted.
    """
    src = load_source(source, split, revision, dataset_name)
    ds = src.dataset
    missing = [c for c in fmt.required_columns() if c not in ds.column_names]
    if missing:
        raise ValueError(f"{src.name}: column '{missing[0]}' missing (found: {', '.join(ds.column_names)})")
    if len(ds) == 0:
        raise ValueError(f"{src.name}: no rows (split {split!r})")
    desc = {"source": source, "split": split, "source_fingerprint": src.fingerprint,
            "tokenizer": tokenizer_fingerprint(tokenizer), "format": fmt.to_dict(), "version": _CACHE_VERSION}
    key = _hash(desc)
    map_kwargs: dict[str, Any] = {}
    if cache_dir is not None:
        tok_dir = os.path.join(cache_dir, f"tokenized-{key}")
        os.makedirs(tok_dir, exist_ok=True)
        map_kwargs["cache_file_name"] = os.path.join(tok_dir, "tokenized.arrow")
    mapped = ds.map(
        _TokenizeRow(tokenizer, fmt), with_indices=True, remove_columns=ds.column_names, num_proc=num_proc,
        new_fingerprint=key, load_from_cache_file=True, desc=f"tokenizing {src.name}", **map_kwargs,
    )
    errors = [(i, e) for i, e in enumerate(mapped["error"]) if e]
    if errors and not skip_invalid_rows:
        more = f" (and {len(errors) - 1} more bad rows)" if len(errors) > 1 else ""
        raise ValueError(f"{src.name} {errors[0][1]}{more}")
    if errors:
        log.warning("%s: skipped %d invalid rows, first: %s", src.name, len(errors), errors[0][1])
    table = mapped.data.table
    ids, offsets = flat_list_column(table.column("input_ids"))
    labels, _ = flat_list_column(table.column("labels"))
    samples = TokenizedSamples(ids.astype(np.int64, copy=False), labels.astype(np.int64, copy=False), offsets)
    if errors:  # skipped rows have no tokens; drop their (empty) slots
        keep = np.diff(samples.offsets) > 0
        samples = TokenizedSamples(samples.ids, samples.labels,
                                   np.concatenate([[0], samples.offsets[1:][keep]]))
    desc["num_rows"] = len(ds)
    desc["num_skipped_invalid"] = len(errors)
    return samples, desc


def build_packed_sft(
    output_dir: str, source: str, tokenizer: Any, fmt: SampleFormat, packed_sequence_size: int,
    pad_seq_to_mult: int = 1, packing: str = "ffd", overlong: str = "drop", split: str = "train",
    revision: str | None = None, dataset_name: str | None = None, num_proc: int | None = None,
    cache_dir: str | None = None, skip_invalid_rows: bool = False,
) -> dict[str, Any]:
    """Tokenize ``source`` and write a packed folder to ``output_dir``; returns its metadata."""
    samples, desc = tokenize_source(source, tokenizer, fmt, split, revision, dataset_name, num_proc, cache_dir,
                                    skip_invalid_rows)
    return write_packed_dataset(output_dir, samples, packed_sequence_size, pad_seq_to_mult,
                                pad_id=pad_token_id(tokenizer), packing=packing, overlong=overlong, metadata=desc)


def cached_packed_sft(cache_dir: str, source: str, tokenizer: Any, fmt: SampleFormat, packed_sequence_size: int,
                      pad_seq_to_mult: int, packing: str, overlong: str, split: str, revision: str | None,
                      dataset_name: str | None, num_proc: int | None, skip_invalid_rows: bool) -> str:
    """The cached packed folder for these inputs and settings, built if missing; returns its path."""
    fingerprint = source_fingerprint(source, split, revision, dataset_name)
    key = _hash({"source": source, "split": split, "fp": fingerprint, "tok": tokenizer_fingerprint(tokenizer),
                 "format": fmt.to_dict(), "size": packed_sequence_size, "mult": pad_seq_to_mult,
                 "packing": packing, "overlong": overlong, "skip": skip_invalid_rows, "v": _CACHE_VERSION})
    path = os.path.join(cache_dir, key)
    if _is_packed_folder(path):
        return path
    try:
        build_packed_sft(path, source, tokenizer, fmt, packed_sequence_size, pad_seq_to_mult, packing, overlong,
                         split, revision, dataset_name, num_proc, cache_dir, skip_invalid_rows)
    except OSError:
        # nodes sharing the cache directory (Lightning runs prepare_data once per node) build the same folder at
        # once; the rename of whichever finishes second fails, and the folder in place is the same
        if not _is_packed_folder(path):
            raise
    return path


def _is_packed_folder(path: str) -> bool:
    try:
        read_metadata(path)
    except (FileNotFoundError, ValueError):
        return False
    return True


def _hash(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:20]


class SFTDataModule(BaseDataModule):
    """Packed supervised fine-tuning data (Tulu-3 chats, OpenMathInstruct-2, HellaSwag, your own rows).

    Batches: ``input_ids``, ``labels`` (shifted, -100 without loss), ``position_ids`` (restart per
    sample) and ``num_label_tokens``; see :mod:`lightning_moe.data.collate`.

    Args:
        tokenizer: tokenizer directory or hub id (with a chat template for chat formats).
        dataset: training rows: a ``.jsonl``/``.json``/``.parquet`` file, a ``save_to_disk`` folder or a hub
            id. Not needed when ``packed_path`` is given.
        split: split of ``dataset``, with optional slice (``train[:100000]``).
        val_dataset: validation rows (same kinds as ``dataset``); default: no validation.
        val_split: split of ``val_dataset``.
        test_dataset: test rows (``lightning-moe test``; same kinds as ``dataset``); default: the validation rows.
        test_split: split of ``test_dataset``.
        revision: hub revision of the datasets.
        tokenizer_revision: hub revision of a hub tokenizer.
        dataset_name: hub configuration name.
        preset: ``tulu3``, ``openmathinstruct2``, ``openmathinstruct2_chat`` or ``hellaswag``: sets the
            format options below (which override it when given).
        format: ``messages``, ``prompt_completion`` or ``hellaswag`` (default from the preset, else ``messages``).
        messages_column: column of the chat messages (``messages`` format).
        last_turn_only: loss only on the last assistant turn (default: every assistant turn).
        prompt_template: ``prompt_completion``: ``str.format`` template over columns, e.g. ``"Problem: {problem} Solution:"``.
        completion_column: ``prompt_completion``: column of the target text.
        separator: text between prompt and completion.
        use_chat_template: ``prompt_completion``: render as a user/assistant chat.
        add_bos: prepend bos to non-chat formats.
        append_eos: append eos to the completion/ending (with loss).
        role_map: chat roles other than system/user/assistant/tool, renamed to one of them
            (``{human: user, gpt: assistant}``); any other role is an error naming its row.
        packed_sequence_size: tokens per packed row.
        pad_seq_to_mult: pad each sample to a multiple of this first (2 * CP with context parallel,
            CP * TP with sequence parallel); ``packed_sequence_size`` must be a multiple of it.
        packing: ``ffd`` (first-fit-decreasing), ``greedy`` (in order) or ``none`` (one sample per row, rows
            padded to the longest in the micro-batch).
        overlong: samples longer than ``packed_sequence_size``: ``drop`` (default; truncation would cut the
            end-of-turn token) or ``truncate``. The counts are printed at setup and kept in the run card.
        skip_invalid_rows: skip (and count) rows that fail validation instead of raising.
        packed_path: a folder written by ``lightning-moe data pack``; used instead of ``dataset``.
        val_packed_path: the same for validation.
        test_packed_path: the same for test.
        cache_dir: where tokenized and packed data are cached (default ``~/.cache/lightning_moe/packed``).
        num_proc: tokenization worker processes (``datasets.map``).
        micro_batch_size: packed rows per data-parallel rank per step.
        global_batch_size: packed rows per optimizer step over all data-parallel ranks.
        seed: shuffle seed (default: the ``seed_everything`` seed, else 1234).
        num_workers: DataLoader worker processes.
    """

    def __init__(
        self, tokenizer: str, dataset: str | None = None, split: str = "train", val_dataset: str | None = None,
        val_split: str = "train", test_dataset: str | None = None, test_split: str = "train",
        revision: str | None = None, tokenizer_revision: str | None = None,
        dataset_name: str | None = None,
        preset: str | None = None, format: str | None = None, messages_column: str | None = None,
        last_turn_only: bool | None = None, prompt_template: str | None = None, completion_column: str | None = None,
        separator: str | None = None, use_chat_template: bool | None = None, add_bos: bool | None = None,
        append_eos: bool | None = None, role_map: dict[str, str] | None = None, packed_sequence_size: int = 4096, pad_seq_to_mult: int = 1,
        packing: str = "ffd", overlong: str = "drop", skip_invalid_rows: bool = False,
        packed_path: str | None = None, val_packed_path: str | None = None, test_packed_path: str | None = None,
        cache_dir: str | None = None,
        num_proc: int | None = None, micro_batch_size: int = 1, global_batch_size: int | None = None,
        seed: int | None = None, num_workers: int = 0,
    ) -> None:
        super().__init__(micro_batch_size, global_batch_size, seed, num_workers)
        if dataset is None and packed_path is None:
            raise ValueError("SFTDataModule needs `dataset` (rows to tokenize) or `packed_path` (packed folder)")
        check_packing_options(packed_sequence_size, pad_seq_to_mult, packing, overlong)
        self.tokenizer_path, self.tokenizer_revision, self.revision = tokenizer, tokenizer_revision, revision
        self.dataset, self.split, self.val_dataset, self.val_split = dataset, split, val_dataset, val_split
        self.test_dataset, self.test_split, self.test_packed_path = test_dataset, test_split, test_packed_path
        self.dataset_name = dataset_name
        self.sample_format = make_sample_format(
            preset, format, messages_column=messages_column, last_turn_only=last_turn_only,
            prompt_template=prompt_template, completion_column=completion_column, separator=separator,
            use_chat_template=use_chat_template, add_bos=add_bos, append_eos=append_eos, role_map=role_map,
        )
        self.packed_sequence_size, self.pad_seq_to_mult = packed_sequence_size, pad_seq_to_mult
        self.packing, self.overlong, self.skip_invalid_rows = packing, overlong, skip_invalid_rows
        self.packed_path, self.val_packed_path = packed_path, val_packed_path
        self.cache_dir = cache_dir or DEFAULT_CACHE_DIR
        self.num_proc = num_proc
        self._tokenizer: Any = None
        self.train_dataset: PackedDataset | None = None
        self.val_dataset_packed: PackedDataset | None = None
        self.test_dataset_packed: PackedDataset | None = None

    def row_length(self) -> RowLength:
        return packed_rows(self.packing, self.packed_sequence_size, self.pad_seq_to_mult)

    @property
    def tokenizer(self) -> Any:
        if self._tokenizer is None:
            self._tokenizer = load_tokenizer(self.tokenizer_path, self.tokenizer_revision)
        return self._tokenizer

    def _packed_dir(self, dataset: str | None, split: str, packed_path: str | None) -> str | None:
        if packed_path is not None:
            return packed_path
        if dataset is None:
            return None
        return cached_packed_sft(
            self.cache_dir, dataset, self.tokenizer, self.sample_format, self.packed_sequence_size,
            self.pad_seq_to_mult, self.packing, self.overlong, split, self.revision, self.dataset_name,
            self.num_proc, self.skip_invalid_rows,
        )

    def prepare_data(self) -> None:
        """Tokenize and pack into the cache (Lightning runs this on one process per node)."""
        self._packed_dir(self.dataset, self.split, self.packed_path)
        self._packed_dir(self.val_dataset, self.val_split, self.val_packed_path)
        self._packed_dir(self.test_dataset, self.test_split, self.test_packed_path)

    def setup(self, stage: str | None = None) -> None:
        if self.train_dataset is None:
            self.train_dataset = self._open(self._packed_dir(self.dataset, self.split, self.packed_path))
            self._report_counts()
        if self.val_dataset_packed is None:
            path = self._packed_dir(self.val_dataset, self.val_split, self.val_packed_path)
            self.val_dataset_packed = self._open(path) if path is not None else None
        if self.test_dataset_packed is None:
            path = self._packed_dir(self.test_dataset, self.test_split, self.test_packed_path)
            self.test_dataset_packed = self._open(path) if path is not None else self.val_dataset_packed

    def token_id_bound(self) -> tuple[int, str]:
        size = len(self.tokenizer)
        return size, f"tokenizer {self.tokenizer_path} has {size} tokens (added tokens included)"

    def data_counts(self) -> dict[str, Any] | None:
        if self.train_dataset is None:
            return None
        meta = self.train_dataset.metadata
        return {key: meta.get(key) for key in ("num_input_samples", "num_samples", "num_packs", "num_dropped_overlong",
                                               "num_truncated", "num_skipped_invalid", "packed_sequence_size")}

    def _report_counts(self) -> None:
        counts = self.data_counts()
        if counts is None:
            return
        lost = {"over-long samples dropped": counts["num_dropped_overlong"],
                "over-long samples truncated": counts["num_truncated"],
                "invalid rows skipped": counts["num_skipped_invalid"]}
        message = (f"SFT data {self.packed_path or self.dataset}: {counts['num_samples']} samples in "
                   f"{counts['num_packs']} rows of {counts['packed_sequence_size']} tokens; "
                   + ", ".join(f"{n or 0} {what}" for what, n in lost.items()))
        (rank_zero_warn if any(lost.values()) else rank_zero_info)(message)

    def _open(self, path: str | None) -> PackedDataset | None:
        if path is None:
            return None
        ds = PackedDataset(path)
        meta = ds.metadata
        if meta["packed_sequence_size"] > self.packed_sequence_size:
            raise ValueError(f"{path}: packed with packed_sequence_size {meta['packed_sequence_size']}, larger than "
                             f"this module's {self.packed_sequence_size}")
        if meta["pad_seq_to_mult"] % self.pad_seq_to_mult:
            raise ValueError(f"{path}: samples padded to multiples of {meta['pad_seq_to_mult']}, "
                             f"not of pad_seq_to_mult {self.pad_seq_to_mult}")
        return ds

    def _collator(self, dataset: PackedDataset) -> Collator:
        pad_id = int(dataset.metadata.get("pad_id", 0))
        if dataset.metadata.get("packing") == "none":
            return Collator(pad_id, None, self.pad_seq_to_mult)
        return Collator(pad_id, self.packed_sequence_size)

    def train_dataloader(self) -> DataLoader:
        if self.train_dataset is None:
            self.setup("fit")
        assert self.train_dataset is not None
        return self._train_loader(self.train_dataset, self._collator(self.train_dataset))

    def val_dataloader(self) -> DataLoader | list:
        return self._split_loader("validate", "val_dataset_packed", "validation", "val_dataset (or val_packed_path)")

    def test_dataloader(self) -> DataLoader | list:
        return self._split_loader("test", "test_dataset_packed", "test", "test_dataset or val_dataset")

    def _split_loader(self, stage: str, attribute: str, what: str, keys: str) -> DataLoader | list:
        if self.train_dataset is None:
            self.setup(stage)
        dataset = getattr(self, attribute)
        if dataset is None:
            return self.no_eval_data(what, keys)
        return self._eval_loader(dataset, self._collator(dataset))
