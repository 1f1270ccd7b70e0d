"""A native training run's Lightning checkpoint exports to a Hugging Face directory transformers loads."""

from __future__ import annotations

import json

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from tiny_hf import build_tiny

from lightning_moe.convert_command import main as convert_main
from lightning_moe.data import MockDataModule
from lightning_moe.modules.causal_lm import CausalLM
from lightning_moe.modules.optim import OptimizerConfig


def test_fine_tuned_run_exports_its_trained_weights(tmp_path):
    import transformers

    base = build_tiny("qwen3_moe")
    base.save_pretrained(tmp_path / "base")
    module = CausalLM(pretrained=str(tmp_path / "base"), optimizer=OptimizerConfig(lr=1e-2))
    trainer = L.Trainer(accelerator="cpu", max_steps=3, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, default_root_dir=tmp_path,
                        callbacks=[ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True)])
    trainer.fit(module, datamodule=MockDataModule(seq_length=16, micro_batch_size=2, vocab_size=160,
                                                  num_val_samples=0))
    assert convert_main(["export", "--ckpt", str(tmp_path / "ckpt" / "last.ckpt"), "--out", str(tmp_path / "hf"),
                         "--max-shard-size", "100000"]) == 0
    assert len(list((tmp_path / "hf").glob("model-*-of-*.safetensors"))) > 1  # the shard size is honoured

    exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    # the run started from a hub directory: its config.json is carried over as it was
    assert json.loads((tmp_path / "hf" / "config.json").read_text()) == json.loads(
        (tmp_path / "base" / "config.json").read_text())
    ids = torch.randint(0, 160, (2, 12))
    with torch.no_grad():
        ours, theirs, before = module.model(ids), exported(ids).logits, base(ids).logits
    assert (ours - theirs).abs().max() <= 1e-4
    assert (before - theirs).abs().max() > 1e-3  # the trained weights, not the base's
