"""Data: tokenizer, SFT formats and packing, Megatron indexed pretraining data, mock data.

Importing this package is cheap: submodules (and ``datasets`` / ``transformers``) load on first use.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "SFTDataModule": "sft",
    "PretrainDataModule": "pretrain",
    "MockDataModule": "mock",
    "BaseDataModule": "base",
    "IndexedDataset": "indexed",
    "IndexedDatasetWriter": "indexed",
    "build_indexed_dataset_from_jsonl": "indexed",
    "GPTDataset": "gpt_sampling",
    "BlendedDataset": "gpt_sampling",
    "parse_blend": "gpt_sampling",
    "parse_split": "gpt_sampling",
    "pack_first_fit_decreasing": "packing",
    "pack_greedy": "packing",
    "packing_stats": "packing",
    "PackedDataset": "packed_parquet",
    "write_packed_dataset": "packed_parquet",
    "DataParallelSampler": "sampler",
    "data_parallel_rank_and_size": "distributed",
    "collate_rows": "collate",
    "load_tokenizer": "tokenizer",
    "train_bpe_tokenizer": "tokenizer",
    "SampleFormat": "formats",
    "tokenize_row": "formats",
    "shift_labels": "formats",
    "IGNORE_INDEX": "formats",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'lightning_moe.data' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"lightning_moe.data.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
