"""LoRA and MXFP8 / FP8 under ParallelStrategy on two gloo ranks: FSDP2 and expert parallelism train, save
distributed checkpoints (adapter-only for LoRA) and resume to the same losses; FP8 all-gather equals the
bf16 all-gather."""

from __future__ import annotations

import parallel_converter_cases
import pytest
import torch
from distributed_harness import run_distributed_test
from tiny_hf import save_tiny

from lightning_moe.workflows.run_export import export_lora_run, load_lora_run

pytestmark = pytest.mark.distributed


def test_converters_under_fsdp_and_expert_parallelism(tmp_path):
    base = save_tiny("qwen3_moe", tmp_path / "base")
    run_distributed_test(parallel_converter_cases.check_converters, 2, str(base), str(tmp_path),
                         init_process_group=False)

    # the LoRA run's distributed checkpoint exports on one process: the adapters the ranks held at step 2
    checkpoint = tmp_path / "lora_fsdp" / "full" / "ckpt" / "epoch=0-step=2.ckpt"
    model, _ = load_lora_run(checkpoint)
    saved = torch.load(tmp_path / "lora_fsdp" / "full" / "adapters-step2.pt", weights_only=True)
    params = dict(model.named_parameters())
    for name, tensor in saved.items():
        assert torch.equal(params[name].detach(), tensor), name
    export_lora_run(checkpoint, merged_out=tmp_path / "merged")
    assert (tmp_path / "merged" / "config.json").is_file()
