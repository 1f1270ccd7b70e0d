"""Imported once by the distributed tests' fork server, so that every rank starts with the heavy libraries loaded.

One thread, set before torch loads: the server forks the ranks, a fork must find no thread pool to copy, and the
ranks inherit the setting (the one place it is made for them).
"""

import os

os.environ["OMP_NUM_THREADS"] = "1"

import torch  # noqa: E402

torch.set_num_threads(1)

import lightning  # noqa: E402,F401
import torch.distributed  # noqa: E402,F401
import transformers  # noqa: E402,F401

import lightning_moe.modules.causal_lm  # noqa: E402,F401
import lightning_moe.parallel.strategy  # noqa: E402,F401
