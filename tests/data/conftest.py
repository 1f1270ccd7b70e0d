"""Shared fixtures of the data tests: the shipped assets, offline Hugging Face, private caches."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

REPO = Path(__file__).resolve().parents[2]
DATA = REPO / "data"


@pytest.fixture(scope="session", autouse=True)
def _quiet_datasets(tmp_path_factory):
    import datasets

    datasets.disable_progress_bars()
    datasets.config.HF_DATASETS_CACHE = Path(tmp_path_factory.mktemp("hf-datasets"))
    yield


@pytest.fixture(scope="session")
def data_dir() -> Path:
    return DATA


@pytest.fixture(scope="session")
def tokenizer_path() -> str:
    return str(DATA / "tokenizer")


@pytest.fixture(scope="session")
def tokenizer(tokenizer_path):
    from lightning_moe.data import load_tokenizer

    return load_tokenizer(tokenizer_path)


@pytest.fixture(scope="session")
def tulu_rows():
    from lightning_moe.data.samples import read_jsonl

    return read_jsonl(str(DATA / "tulu3_sample.jsonl"))


@pytest.fixture
def write_rows(tmp_path):
    """``write_rows("name.jsonl", rows)`` writes JSON lines under tmp_path and returns the path."""
    import json

    def write(name: str, rows: list) -> str:
        path = tmp_path / name
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        return str(path)

    return write
