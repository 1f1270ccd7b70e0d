"""Data: tokenizer, SFT formats and packing, Megatron indexed pretraining data, mock data.

``datasets``, ``transformers`` and ``pyarrow`` are imported inside the functions that use them, so
importing this package costs only torch, lightning and numpy. The data modules are imported here so
that LightningCLI finds them by their short names (``--data SFTDataModule``).
"""

from lightning_moe.data.base import BaseDataModule
from lightning_moe.data.collate import Collator, collate_rows
from lightning_moe.data.distributed import data_parallel_rank_and_size
from lightning_moe.data.formats import IGNORE_INDEX, PRESETS, SampleFormat, shift_labels, tokenize_row
from lightning_moe.data.gpt_sampling import BlendedDataset, GPTDataset, parse_blend, parse_split
from lightning_moe.data.indexed import IndexedDataset, IndexedDatasetWriter, build_indexed_dataset_from_jsonl
from lightning_moe.data.medpix import MedPixDataModule
from lightning_moe.data.mock import MockDataModule, MockDataset
from lightning_moe.data.packed_parquet import PackedDataset, write_packed_dataset
from lightning_moe.data.packing import pack_first_fit_decreasing, pack_greedy, packing_stats
from lightning_moe.data.pretrain import PretrainDataModule
from lightning_moe.data.prompts import PromptsDataModule
from lightning_moe.data.sampler import DataParallelSampler
from lightning_moe.data.sft import SFTDataModule, build_packed_sft
from lightning_moe.data.text_to_image import TextToImageDataModule
from lightning_moe.data.tokenizer import load_tokenizer, train_bpe_tokenizer

__all__ = [
    "IGNORE_INDEX",
    "PRESETS",
    "BaseDataModule",
    "BlendedDataset",
    "Collator",
    "DataParallelSampler",
    "GPTDataset",
    "IndexedDataset",
    "IndexedDatasetWriter",
    "MedPixDataModule",
    "MockDataModule",
    "MockDataset",
    "PackedDataset",
    "PretrainDataModule",
    "PromptsDataModule",
    "SFTDataModule",
    "SampleFormat",
    "TextToImageDataModule",
    "build_indexed_dataset_from_jsonl",
    "build_packed_sft",
    "collate_rows",
    "data_parallel_rank_and_size",
    "load_tokenizer",
    "pack_first_fit_decreasing",
    "pack_greedy",
    "packing_stats",
    "parse_blend",
    "parse_split",
    "shift_labels",
    "tokenize_row",
    "train_bpe_tokenizer",
    "write_packed_dataset",
]
