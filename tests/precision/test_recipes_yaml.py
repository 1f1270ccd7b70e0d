"""The tiny FP8 and LoRA recipes parse through LightningCLI into Float8Config / LoraConfig and train."""

from __future__ import annotations

from pathlib import Path

import pytest
from tiny_hf import save_tiny

from lightning_moe.peft import LoraConfig
from lightning_moe.precision import Float8Config

CONFIGS = Path(__file__).resolve().parents[2] / "configs" / "tiny"


def cli(*args: str):
    from lightning.pytorch import LightningDataModule, LightningModule
    from lightning.pytorch.cli import LightningCLI

    import lightning_moe.data  # noqa: F401  (short data-module names)

    return LightningCLI(LightningModule, LightningDataModule, subclass_mode_model=True, subclass_mode_data=True,
                        run=False, args=list(args))


def quick(tmp_path: Path) -> list[str]:
    return ["--trainer.max_steps=2", "--trainer.logger=false", "--trainer.enable_progress_bar=false",
            "--trainer.enable_checkpointing=false", f"--trainer.default_root_dir={tmp_path}"]


def test_fp8_recipe(tmp_path):
    from torchao.prototype.moe_training.mxfp8_linear import MXFP8Linear

    run = cli("--config", str(CONFIGS / "fp8_moe.yaml"), *quick(tmp_path))
    assert run.model.fp8 == Float8Config(recipe="mxfp8", min_dim=64)
    run.trainer.fit(run.model, datamodule=run.datamodule)
    assert isinstance(run.model.model.layers["1"].mlp.up_proj, MXFP8Linear)
    assert run.model.step_stats.step == 2


def test_lora_recipe(tmp_path):
    base = save_tiny("qwen3_moe", tmp_path / "base")
    run = cli("--config", str(CONFIGS / "lora_moe.yaml"), f"--model.init_args.pretrained={base}", *quick(tmp_path))
    assert run.model.peft == LoraConfig(r=32, alpha=32.0, target_experts=True, include_mtp=True)
    run.trainer.fit(run.model, datamodule=run.datamodule)
    trainable = [n for n, p in run.model.model.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_" in n for n in trainable)


def test_recipe_with_an_unknown_fp8_recipe_fails_with_the_list(tmp_path, capsys):
    with pytest.raises(SystemExit):
        cli("--config", str(CONFIGS / "fp8_moe.yaml"), "--model.init_args.fp8.recipe=fp4", *quick(tmp_path))
    assert "'tensorwise', 'rowwise', 'rowwise_with_gw_hp', 'mxfp8'" in capsys.readouterr().err
