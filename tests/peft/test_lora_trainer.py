"""LoRA under the Lightning Trainer: base bitwise unchanged, adapter-only checkpoints, exact resume, export."""

from __future__ import annotations

import json
import math

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from tiny_hf import save_tiny

from lightning_moe.checkpoint.source import open_checkpoint
from lightning_moe.convert_command import main as convert_main
from lightning_moe.data import MockDataModule
from lightning_moe.modules import CausalLM, OptimizerConfig
from lightning_moe.peft import LoraConfig, is_adapter_parameter

LORA = LoraConfig(r=4, alpha=8, target_experts=True, exclude_modules=["layers.1.mlp.*"])


def fit(tmp_path, base, steps: int, ckpt_path=None, every: int | None = None) -> CausalLM:
    callbacks = [ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=every, save_top_k=-1)] if every else []
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=steps, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, enable_checkpointing=bool(every), callbacks=callbacks,
                        default_root_dir=tmp_path, limit_val_batches=0)
    module = CausalLM(pretrained=str(base), peft=LORA, optimizer=OptimizerConfig(lr=1e-2))
    trainer.fit(module, datamodule=MockDataModule(seq_length=16, micro_batch_size=2, vocab_size=160,
                                                  num_val_samples=0), ckpt_path=ckpt_path)
    return module


def test_lora_fit_checkpoint_resume_and_export(tmp_path):
    import peft
    import transformers

    base = save_tiny("qwen3_moe", tmp_path / "base")
    full = fit(tmp_path, base, steps=4, every=2)

    # the frozen base is bitwise the pretrained checkpoint; every adapter moved
    pretrained = dict(open_checkpoint(base).iter_native())
    params = dict(full.model.named_parameters())
    for name, param in params.items():
        plain = name.replace(".base_layer.", ".")
        if is_adapter_parameter(name):
            assert param.requires_grad and param.detach().abs().sum() > 0, name
        else:
            assert not param.requires_grad and torch.equal(param.detach(), pretrained[plain]), name
    assert any(".experts.adapter.lora_B" in n for n in params)

    # checkpoints hold adapters (and buffers), no frozen weights
    ckpt = tmp_path / "ckpt" / "epoch=0-step=2.ckpt"
    state = torch.load(ckpt, map_location="cpu", weights_only=True)["state_dict"]
    frozen = {f"model.{n}" for n, p in params.items() if not p.requires_grad}
    assert state and not frozen & set(state)
    assert {f"model.{n}" for n in params if is_adapter_parameter(n)} <= set(state)

    # resuming from step 2 reaches the uninterrupted run's adapters
    resumed = fit(tmp_path / "resume", base, steps=4, ckpt_path=str(ckpt))
    for name, param in resumed.model.named_parameters():
        assert torch.allclose(param, params[name], atol=1e-6, rtol=0), name

    # loading is strict about everything but the frozen weights: a checkpoint missing an adapter is refused
    broken = torch.load(ckpt, map_location="cpu", weights_only=True)
    del broken["state_dict"]["model.layers.0.attn.q_proj.lora_A.default.weight"]
    torch.save(broken, tmp_path / "broken.ckpt")
    with pytest.raises(RuntimeError, match=r"Missing key\(s\) in state_dict: \"model\.layers\.0\.attn\.q_proj\.lora_A"):
        fit(tmp_path / "broken", base, steps=4, ckpt_path=str(tmp_path / "broken.ckpt"))

    # the CLI writes the run's PEFT adapter and merged model; peft on transformers agrees with ours
    last = tmp_path / "ckpt" / "epoch=0-step=4.ckpt"
    assert convert_main(["export-lora", "--ckpt", str(last), "--adapter-out", str(tmp_path / "adapter"),
                         "--merged-out", str(tmp_path / "merged")]) == 0
    assert json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())["r"] == 4
    ids = torch.randint(0, 160, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = full.model.eval()(ids)
        hf = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
        theirs = peft.PeftModel.from_pretrained(hf, tmp_path / "adapter").eval()(ids).logits
        merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32)(ids).logits
    assert (ours - theirs).abs().max() <= 1e-4
    assert (ours - merged).abs().max() <= 1e-4


@pytest.mark.parametrize("precision,base_dtype", [("32-true", "bfloat16"), ("bf16-mixed", "bfloat16"),
                                                  ("bf16-true", None)])
def test_lora_trains_under_each_precision(tmp_path, precision, base_dtype):
    """bf16 frozen base with fp32 adapters (plain or under autocast: fp32 master weights), or all bf16."""
    base = save_tiny("qwen3_moe", tmp_path / "base")
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=2, precision=precision, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        default_root_dir=tmp_path, limit_val_batches=0)
    lora = LoraConfig(r=4, target_experts=True, exclude_modules=["layers.1.mlp.*"], base_dtype=base_dtype)
    module = CausalLM(pretrained=str(base), peft=lora, optimizer=OptimizerConfig(lr=1e-2))
    trainer.fit(module, datamodule=MockDataModule(seq_length=16, micro_batch_size=2, vocab_size=160,
                                                  num_val_samples=0))
    params = dict(module.model.named_parameters())
    adapter_dtype = torch.bfloat16 if precision == "bf16-true" else torch.float32
    assert params["layers.3.moe.experts.adapter.lora_A.gate_up"].dtype == adapter_dtype
    assert params["layers.3.moe.experts.up_proj"].dtype == torch.bfloat16
    assert math.isfinite(module.step_stats.loss)
    assert params["layers.3.moe.experts.adapter.lora_B.gate_up"].abs().sum() > 0


def test_export_lora_refuses_a_run_without_peft(tmp_path, capsys):
    base = save_tiny("llama", tmp_path / "base")
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=1, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, default_root_dir=tmp_path, limit_val_batches=0)
    trainer.fit(CausalLM(pretrained=str(base)), datamodule=MockDataModule(seq_length=8, vocab_size=160,
                                                                         num_val_samples=0))
    trainer.save_checkpoint(tmp_path / "full.ckpt")
    assert convert_main(["export-lora", "--ckpt", str(tmp_path / "full.ckpt"), "--adapter-out",
                         str(tmp_path / "out")]) == 1
    assert "the run has no `peft` settings" in capsys.readouterr().err
