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


DISTRIBUTED_ENV = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "NODE_RANK", "GROUP_RANK",
                   "LOCAL_WORLD_SIZE")


@pytest.fixture(autouse=True)
def no_process_group_left_behind():
    """A test that trains in this process (a Trainer, the CLI in-process) ends with no process group and the
    launcher variables it found: a leftover group keeps its store's port open and a leftover MASTER_PORT sends
    every later subprocess launch to that port (EADDRINUSE)."""
    import torch.distributed as dist

    before = {name: os.environ.get(name) for name in DISTRIBUTED_ENV}
    yield
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    for name, value in before.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
