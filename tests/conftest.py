"""Test-wide settings: offline Hugging Face, quiet logs, one CPU thread per parallel test process."""

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

if "PYTEST_XDIST_WORKER" in os.environ:
    # each of the parallel test processes computes on one core instead of all of them competing for every core
    os.environ.setdefault("OMP_NUM_THREADS", "1")


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
# seed_everything records its seed here, and the weights and data order of later runs in the process follow it
SEED_ENV = ("PL_GLOBAL_SEED", "PL_SEED_WORKERS")


@pytest.fixture(autouse=True)
def no_process_group_left_behind():
    """Each test starts and ends with no process group and no launcher variables: a group left by a test that
    trained in this process keeps its store's port open, and a MASTER_PORT left in the environment sends every
    later subprocess launch to that port (EADDRINUSE). Nor with a seed_everything seed another test set."""
    import torch.distributed as dist

    def clear() -> None:
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
        for name in DISTRIBUTED_ENV + SEED_ENV:
            os.environ.pop(name, None)

    clear()
    yield
    clear()
