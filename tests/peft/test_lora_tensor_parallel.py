"""A LoRA fine-tune under tensor parallelism (tp=2, adapters split with their base layers, stacked experts'
adapters replicated) trains like the same run on one process, and its exports are that run's: the merged HF
model and the HF PEFT adapter agree tensor by tensor, and the adapter loads in ``peft.PeftModel`` with the
one-process adapter's logits."""

from __future__ import annotations

import json

import pytest
import torch
from distributed_harness import run_distributed_test
from lora_tensor_parallel_cases import STEPS, fit_lora
from safetensors.torch import load_file
from tiny_hf import save_tiny

from lightning_moe.workflows.run_export import export_lora_run

pytestmark = pytest.mark.distributed


def exported(root):
    checkpoint = root / "ckpt" / f"epoch=0-step={STEPS}.ckpt"
    export_lora_run(checkpoint, adapter_out=root / "adapter", merged_out=root / "merged")
    merged = {}
    for shard in sorted((root / "merged").glob("*.safetensors")):
        merged.update(load_file(shard))
    return load_file(root / "adapter" / "adapter_model.safetensors"), merged


def test_tensor_parallel_lora_run_exports_the_one_process_run(tmp_path):
    import peft
    import transformers

    base = save_tiny("qwen3_moe", tmp_path / "base")
    run_distributed_test(fit_lora, 2, str(base), str(tmp_path / "tp"), {"tp": 2}, init_process_group=False)
    fit_lora(str(base), str(tmp_path / "one"), None)

    tp_losses = json.loads((tmp_path / "tp" / "losses.json").read_text())
    one_losses = json.loads((tmp_path / "one" / "losses.json").read_text())
    assert len(tp_losses) == STEPS and max(abs(a - b) for a, b in zip(tp_losses, one_losses)) <= 1e-5, (
        tp_losses, one_losses)

    # fp32 sums in another order, after three AdamW steps (which scale the early, tiny adapter gradients up)
    (tp_adapter, tp_merged), (one_adapter, one_merged) = exported(tmp_path / "tp"), exported(tmp_path / "one")
    assert tp_adapter.keys() == one_adapter.keys() and any("experts" in k for k in tp_adapter)
    for name, tensor in one_adapter.items():
        assert torch.allclose(tp_adapter[name], tensor, rtol=1e-4, atol=1e-5), name
    assert tp_merged.keys() == one_merged.keys()
    for name, tensor in one_merged.items():
        assert torch.allclose(tp_merged[name], tensor, rtol=1e-4, atol=1e-5), name

    ids = torch.randint(0, 160, (2, 12), generator=torch.Generator().manual_seed(0))
    logits = []
    with torch.no_grad():
        for run in ("tp", "one"):
            hf = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
            logits.append(peft.PeftModel.from_pretrained(hf, tmp_path / run / "adapter").eval()(ids).logits)
    assert (logits[0] - logits[1]).abs().max() <= 1e-5
