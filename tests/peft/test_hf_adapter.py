"""Adapters in Hugging Face PEFT layout: peft on the transformers model computes our logits; merged export
equals peft's merge_and_unload; adapters load back; wrong adapters are refused with the tensor named."""

from __future__ import annotations

import json

import pytest
import torch
from lora_steps import train_adapters
from tiny_hf import save_tiny

from lightning_moe.checkpoint.load import copy_tensors_into
from lightning_moe.checkpoint.merged_export import export_merged_hf
from lightning_moe.checkpoint.source import open_checkpoint
from lightning_moe.models.config import MTPConfig
from lightning_moe.models.decoder import Decoder
from lightning_moe.peft import (
    LoraConfig,
    apply_lora,
    export_hf_adapter,
    load_hf_adapter,
    reset_lora_parameters,
)

# the tiny Qwen3-MoE keeps layer 0 dense (mlp_only_layers=[0]): see test_dense_mlp_adapters_of_a_fused_moe_model
CASES = {
    "llama": LoraConfig(r=4, alpha=8),
    "qwen3_moe": LoraConfig(r=4, alpha=8, target_experts=True, exclude_modules=["layers.1.mlp.*"]),
    "mixtral": LoraConfig(r=4, alpha=16, target_experts=True),
}


def lora_from_hf(base_dir, lora: LoraConfig, config=None) -> Decoder:
    """The configure_model path: meta model -> adapters -> materialize -> base weights by their plain names."""
    source = open_checkpoint(base_dir)
    with torch.device("meta"):
        model = Decoder(config or source.config)
    apply_lora(model, lora)
    model.to_empty(device="cpu")
    copy_tensors_into(model, source.iter_native())
    torch.manual_seed(0)
    reset_lora_parameters(model)
    return model


def trained_and_exported(family: str, root):
    base = save_tiny(family, root / "base")
    model = lora_from_hf(base, CASES[family])
    train_adapters(model)
    export_hf_adapter(model, root / "adapter")
    return family, base, model.eval(), root


@pytest.fixture(scope="module", params=list(CASES))
def trained(request, tmp_path_factory):
    return trained_and_exported(request.param, tmp_path_factory.mktemp(request.param))


def tokens(vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (2, 12), generator=torch.Generator().manual_seed(5))


def test_peft_loads_the_adapter_onto_transformers_and_gives_our_logits(trained):
    import peft
    import transformers

    family, base, model, root = trained
    config = json.loads((root / "adapter" / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["r"] == 4
    assert bool(config["target_parameters"]) == (family != "llama")
    hf = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    ids = tokens(model.config.vocab_size)
    with torch.no_grad():
        base_logits = hf(ids).logits
        peft_logits = peft.PeftModel.from_pretrained(hf, root / "adapter").eval()(ids).logits
        ours = model(ids)
    assert (ours - base_logits).abs().max() > 1e-3  # the adapters do something
    assert (ours - peft_logits).abs().max() <= 1e-4


def test_merged_export_equals_peft_merge_and_unload(trained):
    import peft
    import transformers

    family, base, model, root = trained
    export_merged_hf(model, root / "merged")
    ours = transformers.AutoModelForCausalLM.from_pretrained(root / "merged", dtype=torch.float32)
    hf = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    theirs = peft.PeftModel.from_pretrained(hf, root / "adapter").merge_and_unload()
    ours_state, theirs_state = ours.state_dict(), theirs.state_dict()
    assert ours_state.keys() == theirs_state.keys()
    for name, tensor in theirs_state.items():
        assert torch.allclose(ours_state[name], tensor, atol=1e-6, rtol=1e-6), name
    ids = tokens(model.config.vocab_size)
    with torch.no_grad():
        assert (ours(ids).logits - model(ids)).abs().max() <= 1e-4


def test_adapter_loads_back_into_a_fresh_model(trained):
    family, base, model, root = trained
    fresh = lora_from_hf(base, CASES[family])
    assert load_hf_adapter(fresh, root / "adapter") > 0
    ids = tokens(model.config.vocab_size)
    with torch.no_grad():
        assert torch.equal(fresh.eval()(ids), model(ids))


def test_adapter_for_a_different_base_names_the_tensor(tmp_path):
    _, base, _, root = trained_and_exported("llama", tmp_path)
    other = open_checkpoint(base).config
    other.mlp.intermediate_size = 128
    wrong = lora_from_hf_no_weights(other, CASES["llama"])
    with pytest.raises(ValueError, match=r"tensor base_model\.model\.model\.layers\.0\.mlp\.gate_proj\.lora_B\.weight "
                                         r"has shape \(96, 4\), the model's adapter layers\.1\.mlp\.gate_proj\.lora_B"
                                         r"\.default\.weight needs \(128, 4\): the adapter belongs to a different base"):
        load_hf_adapter(wrong, root / "adapter")
    with pytest.raises(ValueError, match=r"r=4, lora_alpha=8.*the model's adapters have r=8, alpha=8"):
        load_hf_adapter(lora_from_hf(base, LoraConfig(r=8, alpha=8)), root / "adapter")
    with pytest.raises(ValueError, match=r"tensor\(s\) \[.*k_proj.*\] have no adapter in this model"):
        load_hf_adapter(lora_from_hf(base, LoraConfig(r=4, alpha=8, target_modules=["q_proj", "v_proj", "o_proj",
                                                                                  "*.mlp.*"])), root / "adapter")


def lora_from_hf_no_weights(config, lora: LoraConfig) -> Decoder:
    with torch.device("meta"):
        model = Decoder(config)
    apply_lora(model, lora)
    model.to_empty(device="cpu")
    return model


def test_dense_mlp_adapters_of_a_fused_moe_model_cannot_be_written(tmp_path):
    base = save_tiny("qwen3_moe", tmp_path / "base")
    model = lora_from_hf(base, LoraConfig(r=4, target_experts=True))
    with pytest.raises(ValueError, match=r"adapter on layers\.1\.mlp\.gate_proj: peft does not adapt "
                                         r"model\.layers\.0\.mlp\.gate_proj .* export the merged model instead"):
        export_hf_adapter(model, tmp_path / "adapter")
    assert not (tmp_path / "adapter").exists()


def test_mtp_adapters_are_written_beside_the_peft_adapter_and_read_back(tmp_path):
    """transformers has no MTP layers: their adapters go to mtp_adapter_model.safetensors (native names), which
    peft ignores and load_hf_adapter reads back; an adapter missing that file is refused."""
    from safetensors import safe_open

    base = save_tiny("llama", tmp_path / "base")
    config = open_checkpoint(base).config
    config.mtp = MTPConfig(num_layers=1, pattern="*-")
    lora = LoraConfig(r=4, include_mtp=True)
    model = lora_from_hf_no_weights(config, lora)
    torch.manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".lora_" in name:
                param.normal_(0.0, 0.1)
    export_hf_adapter(model, tmp_path / "adapter")
    mtp = sorted(n for n, _ in model.named_parameters() if n.startswith("mtp.") and ".lora_" in n)
    assert "mtp.depths.0.eh_proj.lora_A.default.weight" in mtp
    with safe_open(str(tmp_path / "adapter" / "mtp_adapter_model.safetensors"), framework="pt") as f:
        assert sorted(f.keys()) == mtp
    with safe_open(str(tmp_path / "adapter" / "adapter_model.safetensors"), framework="pt") as f:
        assert not any(".mtp." in k for k in f.keys())

    fresh = lora_from_hf_no_weights(config, lora)
    load_hf_adapter(fresh, tmp_path / "adapter")
    ours = dict(model.named_parameters())
    for name, param in fresh.named_parameters():
        if ".lora_" in name:
            assert torch.equal(param, ours[name]), name
    (tmp_path / "adapter" / "mtp_adapter_model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match=r"missing mtp_adapter_model\.safetensors; the model has \d+ adapter"):
        load_hf_adapter(fresh, tmp_path / "adapter")
