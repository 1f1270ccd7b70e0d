"""The tiny Qwen-Image transformer under 2-way FSDP2 with activation checkpointing (each transformer block a
unit) trains like one process accumulating the same global batch: the same losses over three steps, condition
dropout included (per-sample draws do not depend on the layout); the export gathered from the shards is the
single process's transformer."""

from __future__ import annotations

import json

import diffusion_cases
import pytest
import torch
from distributed_harness import run_distributed_test
from safetensors.torch import load_file


@pytest.mark.distributed
def test_fsdp2_matches_one_process(tiny_pipeline, tiny_cache, tmp_path):
    single, _, _ = diffusion_cases.fit(str(tiny_pipeline), str(tmp_path / "single"), cache=str(tiny_cache),
                                       micro_batch_size=1, global_batch_size=2)
    root = tmp_path / "fsdp"
    root.mkdir()
    run_distributed_test(diffusion_cases.fit_fsdp, 2, str(tiny_pipeline), str(tiny_cache), str(root),
                         init_process_group=False)
    record = json.loads((root / "run.json").read_text())
    assert record["units"] == ["transformer.transformer_blocks.0", "transformer.transformer_blocks.1"]
    assert record["sharded"] > 0
    assert len(single) == 3 and record["losses"] == pytest.approx(single, abs=1e-5)
    # the export gathers every shard: the same transformer as the single process wrote
    single_export = load_file(tmp_path / "single" / "export" / "diffusion_pytorch_model.safetensors")
    fsdp_export = load_file(root / "export" / "diffusion_pytorch_model.safetensors")
    assert sorted(single_export) == sorted(fsdp_export)
    for name, tensor in single_export.items():
        torch.testing.assert_close(fsdp_export[name], tensor, rtol=1e-4, atol=1e-5)
