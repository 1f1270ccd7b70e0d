"""A transformers architecture with no native family (tiny Qwen3-Next: linear attention, gated attention, MoE)
trains under a Lightning Trainer: two steps on one process and under 2-way FSDP give the same losses, and the
export of the FSDP-trained model reloads in transformers with the trained weights (bitwise) and logits."""

from __future__ import annotations

import json

import pytest
import torch
import trainer_cases
from distributed_harness import run_distributed_test
from tiny_hf_models import batch, qwen3_next_config, save_tiny


@pytest.mark.distributed
def test_two_steps_single_process_and_fsdp_match_and_export_reloads(tmp_path):
    import transformers as t

    model_dir = str(save_tiny(qwen3_next_config(), tmp_path / "qwen3_next"))
    single, _ = trainer_cases.fit(model_dir, str(tmp_path / "single"))
    assert len(single) == 2 and single[1] < single[0], single

    root = tmp_path / "fsdp"
    run_distributed_test(trainer_cases.fit_fsdp_and_export, 2, model_dir, str(root), init_process_group=False)
    record = json.loads((root / "losses.json").read_text())
    assert record["sharded_parameters"] > 0, "FSDP did not shard the model"
    assert record["losses"] == pytest.approx(single, abs=1e-5)

    trained = torch.load(root / "trained.pt", weights_only=True)
    reloaded = t.AutoModelForCausalLM.from_pretrained(root / "export", dtype=torch.float32)
    state = reloaded.state_dict()
    assert state.keys() == trained["state"].keys()
    assert all(torch.equal(state[k], trained["state"][k]) for k in state)
    with torch.no_grad():
        logits = reloaded(batch()["input_ids"], use_cache=False).logits
    torch.testing.assert_close(logits, trained["logits"], rtol=1e-5, atol=1e-5)
    # the export holds the trained weights, not the starting ones
    start = t.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).state_dict()
    assert not torch.equal(start["model.layers.1.self_attn.q_proj.weight"], state["model.layers.1.self_attn.q_proj.weight"])
