"""A transformers architecture with no native family (tiny Qwen3-Next: linear attention, gated attention, MoE)
trains under a Lightning Trainer: two steps on one process and under 2-way FSDP give the same losses, and the
export of the FSDP-trained model reloads in transformers with the trained weights (bitwise) and logits."""

from __future__ import annotations

import json

import pytest
import torch
import trainer_cases
from distributed_harness import run_distributed_test
from tiny_hf_models import VOCAB, batch, qwen3_next_config, save_tiny


@pytest.mark.distributed
def test_two_steps_single_process_and_fsdp_match_and_export_reloads(tmp_path):
    import transformers as t

    model_dir = str(save_tiny(qwen3_next_config(), tmp_path / "qwen3_next"))
    single, _ = trainer_cases.fit(model_dir, str(tmp_path / "single"), native="never")
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
    # the run's distributed checkpoint exports to the same files
    from lightning_moe.convert_command import main

    checkpoint = next((root / "ckpt").glob("*step=2.ckpt"))
    assert checkpoint.is_dir(), "expected a distributed (DCP) checkpoint directory"
    assert main(["export", "--ckpt", str(checkpoint), "--out", str(tmp_path / "from_run")]) == 0
    from lightning_moe.checkpoint.convert import verify_hf_checkpoints

    report = verify_hf_checkpoints(root / "export", tmp_path / "from_run")
    assert report.ok and report.tensors > 0, report.summary()
    # the export holds the trained weights, not the starting ones
    start = t.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).state_dict()
    assert not torch.equal(start["model.layers.1.self_attn.q_proj.weight"], state["model.layers.1.self_attn.q_proj.weight"])


def test_lora_run_trains_adapters_only_and_its_checkpoint_exports_merged(tmp_path, capsys):
    import transformers as t

    from lightning_moe.convert_command import main
    from lightning_moe.peft import LoraConfig, merged_state_dict

    model_dir = str(save_tiny(qwen3_next_config(), tmp_path / "qwen3_next"))
    lora = LoraConfig(r=4, alpha=8, target_modules=["q_proj", "in_proj_qkvz", "shared_expert.up_proj"])
    losses, module = trainer_cases.fit(model_dir, str(tmp_path / "run"), checkpoint=True, peft=lora,
                                       native="never")
    assert len(losses) == 2
    checkpoint = next((tmp_path / "run" / "ckpt").glob("*step=2.ckpt"))
    saved = torch.load(checkpoint, map_location="cpu", weights_only=True)["state_dict"]
    assert saved and all(".lora_" in name for name in saved), "a LoRA checkpoint holds only the adapters"

    assert main(["export", "--ckpt", str(checkpoint), "--out", str(tmp_path / "merged")]) == 0
    assert main(["export-lora", "--ckpt", str(checkpoint), "--adapter-out", str(tmp_path / "adapter")]) == 1
    # peft cannot place an adapter on one of the fused shared-expert projections of transformers' Qwen3-Next
    assert "export the merged model (--merged-out, or `lightning-moe convert export --ckpt`)" in capsys.readouterr().err
    assert not (tmp_path / "adapter").exists()
    exported = t.AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32).state_dict()
    merged = merged_state_dict(module.model.hf)
    assert exported.keys() == merged.keys()
    assert all(torch.equal(exported[k], merged[k]) for k in exported)
    start = t.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).state_dict()
    assert not torch.equal(exported["model.layers.1.self_attn.q_proj.weight"], start["model.layers.1.self_attn.q_proj.weight"])
    assert torch.equal(exported["model.layers.1.self_attn.k_proj.weight"], start["model.layers.1.self_attn.k_proj.weight"])


@pytest.mark.distributed
def test_tensor_parallel_splits_a_tied_output_layer_once(tmp_path):
    """The output layer is the input embedding: one vocabulary-split parameter under both names, so the loss and
    every gradient equal one process."""
    import transformers as t

    from lightning_moe.models.hf import HFModelConfig, build_hf_model

    config = t.Qwen3Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=True)
    model_dir = str(save_tiny(config, tmp_path / "tied"))
    run_distributed_test(trainer_cases.tensor_parallel_gradients, 2, model_dir, str(tmp_path / "tp.pt"))
    split = torch.load(tmp_path / "tp.pt", weights_only=True)
    assert split["tied"]
    model = build_hf_model(HFModelConfig(hf=model_dir, native="never"))
    data = batch()
    loss = model(data["input_ids"], labels=data["labels"]).loss_sum
    loss.backward()
    torch.testing.assert_close(split["loss"], loss.detach(), rtol=1e-6, atol=1e-5)
    for name, param in model.hf.named_parameters():
        torch.testing.assert_close(split["grads"][name], param.grad, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.distributed
def test_tensor_parallel_with_the_models_own_plan_matches_one_process(tmp_path):
    import transformers as t

    config = t.Qwen3Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    model_dir = str(save_tiny(config, tmp_path / "qwen3"))
    single, _ = trainer_cases.fit(model_dir, str(tmp_path / "single"), native="never")
    root = tmp_path / "tp"
    root.mkdir()
    run_distributed_test(trainer_cases.fit_tensor_parallel, 2, model_dir, str(root), init_process_group=False)
    record = json.loads((root / "losses.json").read_text())
    assert {"lm_head.weight", "model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight",
            "model.layers.1.mlp.down_proj.weight"} <= set(record["sharded"])
    assert record["losses"] == pytest.approx(single, abs=1e-5)


@pytest.mark.distributed
def test_tensor_parallel_with_fsdp_matches_one_process(tmp_path):
    """tp=2 x dp_shard=2 on four ranks: the model's own tp_plan, then FSDP2 over the data-parallel pairs (2-D
    DTensors); five steps' losses and the first backward's gradients equal one process's."""
    import transformers as t

    config = t.Qwen3Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    model_dir = str(save_tiny(config, tmp_path / "qwen3"))
    single, _ = trainer_cases.fit(model_dir, str(tmp_path / "single"), steps=5, native="never")
    root = tmp_path / "tp_fsdp"
    root.mkdir()
    run_distributed_test(trainer_cases.fit_tensor_parallel, 4, model_dir, str(root), {"tp": 2, "dp_shard": 2}, 5,
                         init_process_group=False)
    record = json.loads((root / "losses.json").read_text())
    assert "model.layers.0.self_attn.q_proj.weight" in record["sharded"]
    assert len(record["losses"]) == 5 and record["losses"] == pytest.approx(single, abs=1e-5)

    # the first backward's gradients, element by element
    from lightning_moe.models.hf import HFModelConfig, build_hf_model

    run_distributed_test(trainer_cases.tensor_parallel_fsdp_gradients, 4, model_dir, str(tmp_path / "grads.pt"))
    split = torch.load(tmp_path / "grads.pt", weights_only=True)
    model = build_hf_model(HFModelConfig(hf=model_dir, native="never"))
    data = batch(rows=4)
    loss = model(data["input_ids"], labels=data["labels"]).loss_sum
    loss.backward()
    torch.testing.assert_close(split["loss"], loss.detach(), rtol=1e-6, atol=1e-5)
    for name, param in model.hf.named_parameters():
        torch.testing.assert_close(split["grads"][name], param.grad, rtol=1e-5, atol=1e-5, msg=name)


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_run_of_a_native_family_named_by_hf_exports_what_it_trained(lora, tmp_path):
    """``model: {hf: DIR}`` of an architecture with a native family trains the native decoder from DIR; the run's
    checkpoint exports (full: every weight; LoRA: merged onto DIR) to a model whose logits are the run's."""
    import transformers as t
    from tiny_hf import save_tiny as save_native

    from lightning_moe.convert_command import main
    from lightning_moe.models.decoder import Decoder
    from lightning_moe.peft import LoraConfig

    model_dir = str(save_native("llama", tmp_path / "llama"))
    options = {"peft": LoraConfig(r=4, alpha=8, target_modules=["all-linear"])} if lora else {}
    _, module = trainer_cases.fit(model_dir, str(tmp_path / "run"), checkpoint=True, **options)
    assert isinstance(module.model, Decoder)
    checkpoint = next((tmp_path / "run" / "ckpt").glob("*step=2.ckpt"))
    assert main(["export", "--ckpt", str(checkpoint), "--out", str(tmp_path / "export")]) == 0
    exported = t.AutoModelForCausalLM.from_pretrained(tmp_path / "export", dtype=torch.float32)
    input_ids = batch()["input_ids"]
    with torch.no_grad():
        torch.testing.assert_close(exported(input_ids, use_cache=False).logits, module.model.eval()(input_ids),
                                   rtol=1e-5, atol=1e-5)
