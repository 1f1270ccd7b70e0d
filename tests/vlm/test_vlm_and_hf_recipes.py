"""The MedPix and generic-path recipes parse through LightningCLI; their CPU twins train a few steps."""

from __future__ import annotations

import sys
from pathlib import Path
from unittest import mock

import pytest
from tiny_hf_models import olmoe_config, save_tiny
from tiny_vlm import save_tiny_vlm

from lightning_moe import HFModelConfig

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def cli(*args: str, run: bool = False):
    from lightning.pytorch import LightningDataModule, LightningModule
    from lightning.pytorch.cli import LightningCLI

    import lightning_moe.data  # noqa: F401  (short data-module names)

    with mock.patch.object(sys, "argv", ["lightning-moe"]):  # the arguments are args, not pytest's command line
        return LightningCLI(LightningModule, LightningDataModule, subclass_mode_model=True, subclass_mode_data=True,
                            run=run, args=list(args))


def quick(tmp_path: Path) -> list[str]:
    return ["--trainer.max_steps=2", "--trainer.logger=false", "--trainer.enable_progress_bar=false",
            "--trainer.enable_checkpointing=false", f"--trainer.default_root_dir={tmp_path}",
            "--trainer.limit_val_batches=0"]


@pytest.mark.parametrize("recipe", ["qwen2_5_vl/medpix.yaml", "qwen3_next/tulu3_sft.yaml"])
def test_gpu_recipes_parse(recipe, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli("--config", str(CONFIGS / recipe), "--print_config")
    assert exit_info.value.code in (0, None)
    assert "hf: Qwen/" in capsys.readouterr().out


def test_medpix_twin_trains(tmp_path):
    model_dir = save_tiny_vlm(tmp_path / "vlm")
    run = cli("--config", str(CONFIGS / "tiny" / "medpix_vlm.yaml"), f"--model.init_args.model.hf={model_dir}",
              f"--data.init_args.processor={model_dir}", *quick(tmp_path))
    assert run.model.model_config == HFModelConfig(hf=str(model_dir))
    run.trainer.fit(run.model, datamodule=run.datamodule)
    assert run.model.step_stats.step == 2
    frozen = [n for n, p in run.model.named_parameters() if not p.requires_grad]
    assert frozen and all(".visual." in n for n in frozen)


def test_generic_twin_trains(tmp_path):
    model_dir = save_tiny(olmoe_config(), tmp_path / "olmoe")  # no native family: trains through transformers
    run = cli("--config", str(CONFIGS / "tiny" / "hf_causal_lm.yaml"), f"--model.init_args.model.hf={model_dir}",
              *quick(tmp_path))
    run.trainer.fit(run.model, datamodule=run.datamodule)
    assert type(run.model.model.hf).__name__ == "OlmoeForCausalLM"
    assert run.model.step_stats.step == 2
