"""Test-wide settings: offline Hugging Face, quiet logs, deterministic CPU threads."""

from __future__ import annotations

import os
import tempfile
import warnings

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# the measured CPU matmul peak (MFU on CPU) is cached per test session, not in the user's cache folder
os.environ.setdefault("LIGHTNING_MOE_CACHE", tempfile.mkdtemp(prefix="lightning-moe-cache-"))

warnings.filterwarnings("ignore", message=".*flex_attention.*")


@pytest.fixture(autouse=True)
def fresh_kernel_checks():
    """Each test checks compiled kernels afresh: a kernel one test made fail (or passed) does not decide
    another test's path."""
    from lightning_moe.kernels import reset_kernel_checks

    reset_kernel_checks()
    yield
    reset_kernel_checks()
