"""The row-length contract of a data module, named once: what the strategy's sequence split, the run card, the FLOP
summary and ``estimate`` read of it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class RowLength:
    """How long a data module's rows are: ``tokens`` each (``key`` names the setting), or, unpacked, at most
    ``tokens`` and padded to a multiple of ``multiple`` (``pad_seq_to_mult``)."""

    key: str
    tokens: int
    multiple: int | None = None


def packed_rows(packing: str, packed_sequence_size: int, pad_seq_to_mult: int) -> RowLength:
    """Rows packed to ``packed_sequence_size`` tokens, or with ``packing: none`` samples of at most that many,
    each row padded to a multiple of ``pad_seq_to_mult`` (the SFT and vision-language modules)."""
    return RowLength("packed_sequence_size", packed_sequence_size, pad_seq_to_mult if packing == "none" else None)


def row_length(data: Any) -> RowLength | None:
    """What ``data`` states through its ``row_length()`` (the package's data modules: ``data/base.py``); a data
    module of another package is read by the settings the package's modules use (``seq_length``, else
    ``packed_sequence_size``, padded to ``pad_seq_to_mult`` with ``packing: none``). None when rows vary freely."""
    if hasattr(data, "row_length"):
        return data.row_length()
    for key in ("seq_length", "packed_sequence_size"):
        value = getattr(data, key, None)
        if isinstance(value, int):
            unpacked = getattr(data, "packing", None) == "none"
            return RowLength(key, value, getattr(data, "pad_seq_to_mult", None) if unpacked else None)
    return None
