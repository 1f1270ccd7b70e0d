"""Packed SFT datasets on disk: ``packed.parquet`` + ``metadata.json`` in one folder, and ``packed.arrow``.

Each parquet row is one pack, stored without its end padding (added at collate time):

- ``input_ids`` (list<int32>): the samples' tokens, each sample padded to a multiple of ``pad_seq_to_mult``;
- ``labels`` (list<int32>): shifted labels, -100 where there is no loss (padding, prompts, sample ends);
- ``seq_start_id`` (list<int32>): offset of each sample in the row (positions restart there).

``metadata.json`` records the packing (``packing_efficiency``, ``packing_factor``,
``max_samples_per_pack``, ``packed_sequence_size``, ...) and what was packed. ``packed.arrow`` holds the same
rows uncompressed (Arrow IPC): training memory-maps it, so the ranks of a node share one copy in the page cache
instead of each decompressing the whole parquet file into its own memory. The same folder is written by
``lightning-moe data pack`` and by the on-the-fly cache, and read by :class:`PackedDataset` (from the parquet
file alone when a folder has no ``packed.arrow``).
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from typing import Any

import numpy as np

from lightning_moe.data.formats import IGNORE_INDEX
from lightning_moe.data.packing import PACKERS, packing_stats
from lightning_moe.io.atomic import atomic_directory

log = logging.getLogger(__name__)
PACKED_FILE = "packed.parquet"
MAPPED_FILE = "packed.arrow"
METADATA_FILE = "metadata.json"
FORMAT_VERSION = 1
OVERLONG = ("drop", "truncate")


@dataclass
class TokenizedSamples:
    """Variable-length samples as flat arrays: sample ``i`` is ``ids[offsets[i]:offsets[i + 1]]``."""

    ids: np.ndarray
    labels: np.ndarray
    offsets: np.ndarray

    def __len__(self) -> int:
        return len(self.offsets) - 1

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)


def flat_list_column(column: Any) -> tuple[np.ndarray, np.ndarray]:
    """A pyarrow list column (chunked) as flat values and int64 offsets: row ``i`` is
    ``values[offsets[i]:offsets[i + 1]]``. Walked chunk by chunk because combining the chunks into one list
    array overflows its int32 offsets past 2**31 values (a few billion tokens)."""
    values, offsets, base = [], [np.zeros(1, dtype=np.int64)], 0
    for chunk in column.chunks:
        off = chunk.offsets.to_numpy().astype(np.int64)
        # a sliced chunk's offsets index its whole (unsliced) values buffer
        values.append(chunk.values.to_numpy(zero_copy_only=False)[off[0]:off[-1]])
        offsets.append(off[1:] - off[0] + base)
        base += int(off[-1] - off[0])
    flat = np.concatenate(values) if values else np.zeros(0, dtype=np.int64)
    return flat, np.concatenate(offsets)


def check_packing_options(packed_sequence_size: int, pad_seq_to_mult: int, packing: str, overlong: str) -> None:
    """The packing settings, checked before any row is tokenized."""
    if pad_seq_to_mult < 1 or packed_sequence_size < 1 or packed_sequence_size % pad_seq_to_mult:
        raise ValueError(f"packed_sequence_size {packed_sequence_size} must be a positive multiple of "
                         f"pad_seq_to_mult {pad_seq_to_mult}")
    if packing not in PACKERS:
        raise ValueError(f"packing must be one of {', '.join(PACKERS)}, got {packing!r}")
    if overlong not in OVERLONG:
        raise ValueError(f"overlong must be one of {', '.join(OVERLONG)}, got {overlong!r}")


def write_packed_dataset(
    output_dir: str, samples: TokenizedSamples, packed_sequence_size: int, pad_seq_to_mult: int = 1,
    pad_id: int = 0, packing: str = "ffd", overlong: str = "drop", metadata: dict[str, Any] | None = None,
    rows_per_group: int = 2048,
) -> dict[str, Any]:
    """Pack ``samples`` and write ``output_dir`` (through a temporary folder renamed at the end, removed if
    writing fails).

    Over-long samples (longer than ``packed_sequence_size`` after padding to ``pad_seq_to_mult``) are
    dropped, or cut to the pack size with ``overlong="truncate"``; samples left without any label
    token are dropped too. Both counts go into the metadata and the log. Returns the metadata.
    """
    import pyarrow as pa
    import pyarrow.parquet as pq

    check_packing_options(packed_sequence_size, pad_seq_to_mult, packing, overlong)
    psize, mult = packed_sequence_size, pad_seq_to_mult

    lengths = samples.lengths
    padded = -(-lengths // mult) * mult
    too_long = padded > psize
    keep_len = np.minimum(lengths, psize)
    if overlong == "truncate":
        ends = samples.offsets[:-1] + keep_len
        has_label = np.array([(samples.labels[s:e] != IGNORE_INDEX).any()
                              for s, e in zip(samples.offsets[:-1][too_long], ends[too_long])], dtype=bool)
        truncated_ok = np.zeros(len(samples), dtype=bool)
        truncated_ok[np.flatnonzero(too_long)[has_label]] = True
        keep = ~too_long | truncated_ok
        num_truncated, num_dropped = int(truncated_ok.sum()), int((too_long & ~truncated_ok).sum())
    else:
        keep = ~too_long
        num_truncated, num_dropped = 0, int(too_long.sum())
    if num_dropped or num_truncated:
        log.info("packing: %d over-long samples (> %d tokens) dropped, %d truncated", num_dropped, psize, num_truncated)
    kept = np.flatnonzero(keep)
    if len(kept) == 0:
        raise ValueError(f"no sample fits in packed_sequence_size {psize} ({len(samples)} samples, all over-long)")
    kept_padded = np.minimum(padded[kept], psize)
    bins = PACKERS[packing](kept_padded, psize)
    stats = packing_stats(bins, kept_padded, psize)

    meta = {
        "format_version": FORMAT_VERSION, **stats.to_dict(), "pad_seq_to_mult": mult, "packing": packing,
        "overlong": overlong, "num_input_samples": len(samples), "num_dropped_overlong": num_dropped,
        "num_truncated": num_truncated, "pad_id": pad_id, "num_label_tokens": int(
            sum(int((samples.labels[samples.offsets[i]:samples.offsets[i] + keep_len[i]] != IGNORE_INDEX).sum())
                for i in kept)),
        **(metadata or {}),
    }
    schema = pa.schema([("input_ids", pa.list_(pa.int32())), ("labels", pa.list_(pa.int32())),
                        ("seq_start_id", pa.list_(pa.int32()))])
    with atomic_directory(output_dir, overwrite=True) as tmp:
        with pq.ParquetWriter(str(tmp / PACKED_FILE), schema) as writer, \
                pa.ipc.new_file(str(tmp / MAPPED_FILE), schema) as mapped:
            for g in range(0, len(bins), rows_per_group):
                cols: dict[str, list[np.ndarray]] = {"input_ids": [], "labels": [], "seq_start_id": []}
                for b in bins[g:g + rows_per_group]:
                    ids_parts, lab_parts, starts, pos = [], [], [], 0
                    for k in b:
                        i = int(kept[k])
                        s, n, width = int(samples.offsets[i]), int(keep_len[i]), int(kept_padded[k])
                        starts.append(pos)
                        ids_parts += [samples.ids[s:s + n], np.full(width - n, pad_id)]
                        lab_parts += [samples.labels[s:s + n], np.full(width - n, IGNORE_INDEX)]
                        pos += width
                    cols["input_ids"].append(np.concatenate(ids_parts).astype(np.int32))
                    cols["labels"].append(np.concatenate(lab_parts).astype(np.int32))
                    cols["seq_start_id"].append(np.asarray(starts, dtype=np.int32))
                table = pa.table({k: pa.array(v, type=pa.list_(pa.int32())) for k, v in cols.items()}, schema=schema)
                writer.write_table(table)
                mapped.write_table(table)
        (tmp / METADATA_FILE).write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return meta


def read_metadata(path: str) -> dict[str, Any]:
    meta_path = os.path.join(path, METADATA_FILE)
    if not os.path.isfile(meta_path) or not os.path.isfile(os.path.join(path, PACKED_FILE)):
        raise FileNotFoundError(f"{path}: not a packed dataset folder (needs {PACKED_FILE} and {METADATA_FILE})")
    with open(meta_path, encoding="utf-8") as f:
        try:
            meta = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"{meta_path}: invalid JSON ({e.msg})") from e
    if meta.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"{meta_path}: format_version {meta.get('format_version')!r}, expected {FORMAT_VERSION}")
    return meta


class PackedDataset:
    """Packed rows from a folder written by :func:`write_packed_dataset`.

    ``ds[i]`` is a dict of int64 arrays ``input_ids``, ``labels``, ``position_ids`` (restarting at
    every ``seq_start_id``), without end padding; :class:`~lightning_moe.data.collate.Collator` pads.
    """

    def __init__(self, path: str) -> None:
        self.path = path
        self.metadata = read_metadata(path)
        table, source = _open_table(path)
        missing = {"input_ids", "labels", "seq_start_id"} - set(table.column_names)
        if missing:
            raise ValueError(f"{path}/{source}: columns {sorted(missing)} missing "
                             f"(found: {', '.join(table.column_names)})")
        self._cols = {name: ListRows(table.column(name)) for name in ("input_ids", "labels", "seq_start_id")}
        bad = np.flatnonzero(self._cols["input_ids"].lengths() != self._cols["labels"].lengths())
        if len(bad):
            raise ValueError(f"{path}/{source} row {int(bad[0])}: input_ids and labels differ in length")

    def __len__(self) -> int:
        return len(self._cols["input_ids"])

    def _row(self, name: str, i: int) -> np.ndarray:
        return self._cols[name][i].astype(np.int64)

    def __getitem__(self, i: int) -> dict[str, np.ndarray]:
        ids = self._row("input_ids", i)
        starts = self._row("seq_start_id", i)
        positions = np.arange(len(ids)) - np.repeat(starts, np.diff(np.append(starts, len(ids))))
        return {"input_ids": ids, "labels": self._row("labels", i), "position_ids": positions}


def _open_table(path: str):
    """The folder's rows as a pyarrow table: memory-mapped from ``packed.arrow``, else read from the parquet file."""
    import pyarrow as pa

    mapped = os.path.join(path, MAPPED_FILE)
    if os.path.isfile(mapped):
        try:
            return pa.ipc.open_file(pa.memory_map(mapped)).read_all(), MAPPED_FILE
        except pa.ArrowInvalid as e:
            raise ValueError(f"{mapped}: not a readable Arrow file ({e}); delete it to read {PACKED_FILE}") from e
    import pyarrow.parquet as pq

    return pq.read_table(os.path.join(path, PACKED_FILE)), PACKED_FILE


class ListRows:
    """The rows of a pyarrow list column as numpy views of its chunks (no copy: a memory-mapped column stays on
    disk until its rows are read)."""

    def __init__(self, column: Any) -> None:
        self._values, self._offsets, ends = [], [], [0]
        for chunk in column.chunks:
            # ``values`` is the chunk's whole child buffer; ``offsets`` (of the slice) index into it
            self._values.append(chunk.values.to_numpy(zero_copy_only=False))
            self._offsets.append(chunk.offsets.to_numpy(zero_copy_only=False))
            ends.append(ends[-1] + len(chunk))
        self._ends = np.asarray(ends, dtype=np.int64)

    def __len__(self) -> int:
        return int(self._ends[-1])

    def lengths(self) -> np.ndarray:
        return np.concatenate([np.diff(o) for o in self._offsets]) if self._offsets else np.zeros(0, np.int64)

    def __getitem__(self, i: int) -> np.ndarray:
        if not 0 <= i < len(self):
            raise IndexError(f"row {i} out of range for {len(self)} rows")
        c = int(np.searchsorted(self._ends, i, side="right")) - 1
        offsets, row = self._offsets[c], i - int(self._ends[c])
        return self._values[c][offsets[row]:offsets[row + 1]]
