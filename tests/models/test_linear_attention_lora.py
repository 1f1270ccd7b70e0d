"""LoRA's default targets (all-linear) on the Gated DeltaNet and KDA mixers: every projection of the mixers is
adapted, the same layers peft's own all-linear picks on the transformers model (Qwen3.5 dense, Kimi-Linear), and
the exported PEFT adapter on transformers gives our logits. Qwen3-Next's fused hub projections have no PEFT form
for our split ones: the export says so by name."""

from __future__ import annotations

import json

import pytest
import torch
from lora_steps import train_adapters

from lightning_moe.checkpoint.load import load_pretrained
from lightning_moe.peft import LoraConfig, apply_lora, export_hf_adapter

GDN = {"in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj"}
KDA = {"q_proj", "k_proj", "v_proj", "f_a_proj", "f_b_proj", "b_proj", "g_a_proj", "g_b_proj", "out_proj"}


def save_qwen3_5(path):
    from test_qwen3_5 import build_tiny

    build_tiny("dense").save_pretrained(path)
    return path


def save_kimi_linear(path):
    from test_kimi_linear import build_tiny

    build_tiny().save_pretrained(path)
    return path


CASES = {"qwen3_5": (save_qwen3_5, "gdn", GDN), "kimi_linear": (save_kimi_linear, "kda", KDA)}


def lora_model(base, lora: LoraConfig):
    model = load_pretrained(base)
    apply_lora(model, lora)
    return model


def peft_all_linear(base) -> set[str]:
    """The transformers modules peft's ``all-linear`` adapts."""
    import peft
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    model = peft.get_peft_model(hf, peft.LoraConfig(r=2, target_modules="all-linear"))
    return {name.removeprefix("base_model.model.") for name, m in model.named_modules()
            if isinstance(m, peft.tuners.lora.LoraLayer)}


@pytest.mark.parametrize("family", list(CASES))
def test_default_targets_adapt_the_mixers_as_peft_does(family, tmp_path):
    import peft
    import transformers

    save, mixer, projections = CASES[family]
    base = save(tmp_path / "base")
    model = lora_model(base, LoraConfig(r=4, alpha=8))
    adapted = {name for name, m in model.named_modules() if hasattr(m, "lora_A")}
    mixers = [name for name, _ in model.named_modules() if name.endswith(f".{mixer}")]
    assert mixers
    for name in mixers:
        assert {f"{name}.{p}" for p in projections} <= adapted, name

    train_adapters(model)
    # the base's own config.json (the tiny Kimi-Linear's token ids are not KimiLinearConfig's defaults)
    export_hf_adapter(model, tmp_path / "adapter", hf_config=json.loads((base / "config.json").read_text()))
    written = set(json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())["target_modules"])
    hf = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    on_hf = peft.PeftModel.from_pretrained(hf, tmp_path / "adapter").eval()
    ours_on_hf = {name.removeprefix("base_model.model.") for name, m in on_hf.named_modules()
                  if isinstance(m, peft.tuners.lora.LoraLayer)}
    # the same transformers layers as peft's own all-linear (its output layer left out, as ours)
    assert ours_on_hf == peft_all_linear(base), (sorted(ours_on_hf ^ peft_all_linear(base))[:6], sorted(written)[:6])
    ids = torch.randint(0, model.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        base_logits = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)(ids).logits
        theirs, ours = on_hf(ids).logits, model.eval()(ids)
    assert (ours - base_logits).abs().max() > 1e-3
    assert (ours - theirs).abs().max() <= 1e-4


def test_qwen3_next_fused_projections_have_no_peft_form(tmp_path):
    from test_qwen3_next import build_tiny

    base = tmp_path / "base"
    build_tiny().save_pretrained(base)
    model = lora_model(base, LoraConfig(r=4, alpha=8))
    assert model.config.family == "qwen3_next"
    assert hasattr(model.get_submodule("layers.0.gdn.in_proj_qkv"), "lora_A")
    with pytest.raises(ValueError, match=r"in_proj_qkv"):
        export_hf_adapter(model, tmp_path / "adapter")
    assert not (tmp_path / "adapter").exists()
