"""Every recipe's CPU twin has the recipe's structure (model source, converters, data module and format, strategy,
callbacks) and trains 2 optimizer steps on one CPU process; benchmark twins write a run card with averages."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from unittest import mock

import pytest
import torch
from recipe_files import CONFIGS, full_recipes, header, resolved

TWINS = sorted({header(r)["CPU twin"].removeprefix("configs/") for r in full_recipes()})


def structure(cfg: dict) -> dict:
    """What a twin must share with its full recipes (sizes, widths and hardware aside)."""
    args = cfg["model"]["init_args"]
    data = cfg["data"]["init_args"]
    return {
        "module": cfg["model"]["class_path"],
        "weights": "hub checkpoint" if "hf" in args["model"] else "initialized",
        "options": sorted(k for k, v in args.items() if v is not None and k not in ("model", "optimizer", "scheduler")),
        "fp8": (args.get("fp8") or {}).get("recipe"),
        "data": (cfg["data"]["class_path"], data.get("preset"), data.get("packing")),
        "strategy": cfg["trainer"]["strategy"]["class_path"],
        "precision": (cfg["trainer"]["precision"], cfg["trainer"]["strategy"]["init_args"].get("param_dtype")),
        "callbacks": sorted(c["class_path"] for c in cfg["trainer"]["callbacks"]),
    }


@pytest.mark.parametrize("recipe", full_recipes())
def test_twin_has_the_structure_of_its_recipe(recipe):
    twin = header(recipe)["CPU twin"].removeprefix("configs/")
    assert structure(resolved(twin)) == structure(resolved(recipe))


def nemotron_h_checkpoint(path: Path) -> Path:
    from tiny_hf import save_nemotron_h_twin

    return save_nemotron_h_twin(path)


def llama_checkpoint(path: Path) -> Path:
    from tiny_hf import save_tiny

    return save_tiny("llama", path)


def kimi_linear_checkpoint(path: Path) -> Path:
    """A Kimi-Linear checkpoint saved by transformers: KDA, MLA and MoE layers (imported by the native family)."""
    import transformers

    config = transformers.KimiLinearConfig(
        vocab_size=4160, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, num_experts=4, num_experts_per_token=2, num_shared_experts=1,
        kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, linear_head_dim=16,
        linear_num_heads=4, layer_types=["linear_attention", "full_attention"], mlp_layer_types=["dense", "sparse"],
        pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(path)
    return path


def qwen3_5_vlm_checkpoint(path: Path) -> Path:
    """A Qwen3.5 image-text-to-text checkpoint with its tokenizer and image processor (the twin's processor)."""
    from vlm.tiny_vlm import save_tiny_vlm

    return save_tiny_vlm(path, family="qwen3_5")


def generic_moe_checkpoint(model_type: str, **settings):
    """A checkpoint writer for a small random transformers MoE without a native family (trained through
    transformers), ``settings`` on top of the shared small sizes."""

    def write(path: Path) -> Path:
        import transformers

        config = transformers.AutoConfig.for_model(
            model_type, vocab_size=4160, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
            num_hidden_layers=2, num_attention_heads=4, num_experts_per_tok=2, pad_token_id=0, bos_token_id=1,
            eos_token_id=2, **settings)
        torch.manual_seed(0)
        transformers.AutoModelForCausalLM.from_config(config).save_pretrained(path)
        return path

    return write


def mimo_v2_checkpoint(path: Path) -> Path:
    """A MiMo-V2 hub checkpoint (fused QKV, sliding layers with sinks, MTP layers) for the shipped tokenizer."""
    from models.tiny_mimo_v2 import save_mimo_v2

    save_mimo_v2(path, torch.bfloat16, vocab=4160)
    return path


laguna_checkpoint = generic_moe_checkpoint(
    "laguna", num_key_value_heads=2, head_dim=16, num_experts=4, shared_expert_intermediate_size=32, sliding_window=64,
    layer_types=["sliding_attention", "full_attention"])
glm_moe_dsa_checkpoint = generic_moe_checkpoint(
    "glm_moe_dsa", num_key_value_heads=4, n_routed_experts=4, n_shared_experts=1, n_group=2, topk_group=1,
    kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, index_topk=16,
    index_head_dim=16, index_n_heads=2, first_k_dense_replace=1)


CHECKPOINTS = {"tiny/nemotron_h_sft.yaml": nemotron_h_checkpoint, "tiny/nemotron_h_sft_tulu3.yaml": nemotron_h_checkpoint,
               "tiny/nemotron_h_lora.yaml": nemotron_h_checkpoint, "tiny/dense_lora_benchmark.yaml": llama_checkpoint,
               "tiny/kimi_linear_hellaswag_sft.yaml": kimi_linear_checkpoint,
               "tiny/qwen3_5_medpix_vlm.yaml": qwen3_5_vlm_checkpoint,
               "tiny/laguna_hellaswag_sft.yaml": laguna_checkpoint,
               "tiny/glm_moe_dsa_tulu3_sft.yaml": glm_moe_dsa_checkpoint,
               "tiny/mimo_v2_hellaswag_sft.yaml": mimo_v2_checkpoint, "tiny/mimo_v2_tulu3_sft.yaml": mimo_v2_checkpoint}


def cli(*args: str):
    from lightning.pytorch import LightningDataModule, LightningModule
    from lightning.pytorch.cli import LightningCLI

    import lightning_moe.data  # noqa: F401  (short data-module names)

    with mock.patch.object(sys, "argv", ["lightning-moe"]):  # the arguments are args, not pytest's command line
        return LightningCLI(LightningModule, LightningDataModule, subclass_mode_model=True, subclass_mode_data=True,
                            run=False, args=list(args))


@pytest.mark.parametrize("twin", TWINS)
def test_twin_trains_two_steps_on_cpu(twin, tmp_path):
    overrides = ["--trainer.max_steps=2", "--trainer.logger=false", "--trainer.enable_progress_bar=false",
                 f"--trainer.default_root_dir={tmp_path / 'run'}"]
    if twin in CHECKPOINTS:
        overrides.append(f"--model.init_args.model.hf={CHECKPOINTS[twin](tmp_path / 'hf')}")
    if resolved(twin)["data"]["class_path"].endswith("MedPixDataModule"):
        overrides.append(f"--data.init_args.processor={tmp_path / 'hf'}")  # the checkpoint's own processor
    if resolved(twin)["data"]["class_path"].endswith(("SFTDataModule", "PretrainDataModule")):
        overrides.append(f"--data.init_args.cache_dir={tmp_path / 'cache'}")
    run = cli("--config", str(CONFIGS / twin), *overrides)
    run.trainer.fit(run.model, datamodule=run.datamodule)
    stats = run.model.step_stats
    assert stats.step == 2 and math.isfinite(stats.loss)
    card = json.loads((tmp_path / "run" / "run_card.json").read_text())
    assert card["status"] == "completed" and card["steps"] == 2
    if twin.endswith(("benchmark.yaml", "mxfp8.yaml")):
        assert card["averaged_steps"] == 1 and card["warmup_steps"] == 1  # step 1 left out
        assert card["tflops_per_gpu"] > 0 and card["tokens_per_s_per_gpu"] > 0
    if run.model.peft is not None:
        trainable = [n for n, p in run.model.model.named_parameters() if p.requires_grad]
        assert trainable and all(".lora_" in n for n in trainable)


def test_twins_are_tiny_and_commented():
    for twin in TWINS:
        text = (CONFIGS / twin).read_text()
        assert text.startswith("# CPU twin of"), twin
        assert resolved(twin)["trainer"]["accelerator"] == "cpu"
        assert (CONFIGS / twin).stat().st_size < 6000
