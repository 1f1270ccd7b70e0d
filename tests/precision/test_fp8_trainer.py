"""FP8 under the Lightning Trainer (bf16-true): converted modules train, checkpoint and resume."""

from __future__ import annotations

import math

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_moe.data import MockDataModule
from lightning_moe.models.config import AttentionConfig, MLPConfig, ModelConfig, MoEConfig
from lightning_moe.modules import CausalLM, OptimizerConfig
from lightning_moe.precision import Float8Config


class Losses(L.Callback):
    def __init__(self):
        self.values = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.values.append(pl_module.step_stats.loss)


def config() -> ModelConfig:
    return ModelConfig(vocab_size=128, hidden_size=64, pattern="*-*E",
                       attention=AttentionConfig(num_heads=2, num_kv_heads=2, head_dim=32),
                       mlp=MLPConfig(intermediate_size=128), moe=MoEConfig(num_experts=4, top_k=2, intermediate_size=64))


def fit(tmp_path, recipe: str, steps: int, ckpt_path=None) -> tuple[CausalLM, list[float]]:
    losses = Losses()
    trainer = L.Trainer(
        accelerator="cpu", devices=1, precision="bf16-true", max_steps=steps, logger=False, enable_progress_bar=False,
        enable_model_summary=False, default_root_dir=tmp_path, limit_val_batches=0,
        callbacks=[losses, ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=2, save_top_k=-1)],
    )
    module = CausalLM(model=config(), fp8=Float8Config(recipe=recipe, min_dim=64), optimizer=OptimizerConfig(lr=1e-3))
    trainer.fit(module, datamodule=MockDataModule(seq_length=32, micro_batch_size=2, vocab_size=128,
                                                  num_val_samples=0), ckpt_path=ckpt_path)
    return module, losses.values


@pytest.mark.parametrize("recipe", ["rowwise", "mxfp8"])
def test_fp8_fit_checkpoint_and_resume(tmp_path, recipe):
    from torchao.float8.float8_linear import Float8Linear
    from torchao.prototype.moe_training.mxfp8_linear import MXFP8Linear

    module, losses = fit(tmp_path, recipe, steps=4)
    q_proj = module.model.layers["0"].attn.q_proj
    assert isinstance(q_proj, MXFP8Linear if recipe == "mxfp8" else Float8Linear)
    assert q_proj.weight.dtype == torch.bfloat16
    assert len(losses) == 4 and all(math.isfinite(x) for x in losses)

    resumed, resumed_losses = fit(tmp_path / "resume", recipe, steps=4,
                                  ckpt_path=str(tmp_path / "ckpt" / "epoch=0-step=2.ckpt"))
    assert resumed_losses == pytest.approx(losses[2:], rel=1e-3)
    for (name, a), (_, b) in zip(module.model.state_dict().items(), resumed.model.state_dict().items()):
        assert torch.equal(a, b), name
