"""A tiny Qwen2.5-VL under 2-way FSDP2 (language layers and vision blocks each a unit) trains like one process:
the same losses for two steps, and the frozen vision tower stays bitwise as loaded."""

from __future__ import annotations

import json

import fsdp_cases
import pytest
import torch
from distributed_harness import run_distributed_test
from tiny_vlm import save_tiny_vlm


@pytest.mark.distributed
def test_fsdp_over_language_layers_and_vision_blocks_matches_one_process(tmp_path):
    import transformers as t

    model_dir = str(save_tiny_vlm(tmp_path / "vlm"))
    single, _ = fsdp_cases.fit(model_dir, str(tmp_path / "single"), fsdp=False)
    root = tmp_path / "fsdp"
    root.mkdir()
    run_distributed_test(fsdp_cases.fit_fsdp, 2, model_dir, str(root), init_process_group=False)
    record = json.loads((root / "run.json").read_text())
    assert record["units"] == ["hf.model.language_model.layers.0", "hf.model.language_model.layers.1",
                               "hf.model.visual.blocks.0", "hf.model.visual.blocks.1"]
    assert record["sharded"] > 0
    assert record["losses"] == pytest.approx(single, abs=1e-5)
    trained = torch.load(root / "trained.pt", weights_only=True)
    start = t.Qwen2_5_VLForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).state_dict()
    vision = [n for n in start if n.startswith("model.visual.") and ".merger." not in n]
    assert vision and all(torch.equal(trained[n], start[n]) for n in vision)
    assert not torch.equal(trained["lm_head.weight"], start["lm_head.weight"])
