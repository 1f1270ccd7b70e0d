"""The image-generation recipes run their published rows' workloads (or list the difference), through the recipe
checker of tests/recipes; the HunyuanImage-3.0 recipe is refused saying what is missing; the CPU twins train
through the command line and write a run card with images/s/GPU and their exports."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from unittest import mock

import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "recipes"))

from recipe_files import CONFIGS, differences_block, header, load_yaml, resolved  # noqa: E402
from test_recipe_rows import PUBLISHED_ROWS, problems  # noqa: E402

from lightning_moe.cli import main  # noqa: E402

RECIPES = {"qwen_image/qwen_image_naruto_full_h100.yaml": "tiny/qwen_image_naruto.yaml",
           "hunyuan_image/hunyuan_image_3_lora_h100.yaml": "tiny/qwen_image_lora_cached.yaml"}


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_recipe_runs_its_row_or_lists_the_difference(recipe):
    fields = header(recipe)
    row = load_yaml(PUBLISHED_ROWS)["rows"][fields["Row"]]
    assert row["recipe"] == f"configs/{recipe}" and fields["CPU twin"] == f"configs/{RECIPES[recipe]}"
    cfg = resolved(recipe)
    assert fields["Hardware"].startswith(f"{cfg['trainer']['num_nodes']} node x {cfg['trainer']['devices']} H100")
    assert not (found := problems(recipe)), "\n".join(found)
    callbacks = {c["class_path"].rsplit(".", 1)[-1]: c["init_args"] for c in cfg["trainer"]["callbacks"]}
    assert callbacks["RunCard"]["name"] == fields["Row"] and callbacks["Throughput"]["warmup_steps"] > 0
    readme = (CONFIGS / "README.md").read_text()
    assert f"`{recipe}`" in readme and f"`{RECIPES[recipe]}`" in readme


def test_hunyuan_image_3_recipe_is_refused_saying_what_is_missing(capsys):
    recipe = str(CONFIGS / "hunyuan_image/hunyuan_image_3_lora_h100.yaml")
    with mock.patch.object(sys, "argv", ["lightning-moe"]), pytest.raises((ValueError, SystemExit)) as error:
        main(["fit", "--config", recipe, "--trainer.accelerator=cpu", "--trainer.devices=1"])
    message = str(error.value) + capsys.readouterr().err
    assert "HunyuanImage-3.0" in message and "no implementation in the installed diffusers" in message
    assert "UNet patch embedding" in message and "model.family=hunyuan_image_3 is therefore refused" in message



def test_hunyuan_image_3_recipe_keeps_the_rows_ep_which_the_diffusion_path_refuses(tiny_pipeline):
    """The recipe's ep: 8 (the row's, its header says the diffusion path refuses it) stops the diffusion
    parallelization with an error naming it, whatever transformer it is given: here the tiny Qwen-Image one."""
    from lightning_moe.models.diffusion.config import DiffusionModelConfig
    from lightning_moe.models.diffusion.transformer import build_diffusion_transformer
    from lightning_moe.modules.diffusion import DiffusionModule
    from lightning_moe.parallel.diffusion import DIFFUSERS
    from lightning_moe.parallel.dims import MESH_SIZE_NAMES, ParallelDims
    from lightning_moe.parallel.options import ParallelOptions

    recipe = "hunyuan_image/hunyuan_image_3_lora_h100.yaml"
    cfg = load_yaml(CONFIGS / recipe)
    args = {"dp_shard": -1, **cfg["trainer"]["strategy"]["init_args"]}
    world = cfg["trainer"]["num_nodes"] * cfg["trainer"]["devices"]
    dims = ParallelDims(**{k: v for k, v in args.items() if k in MESH_SIZE_NAMES}, world_size=world)
    assert dims.ep == 8 and any(e["field"] == "expert_parallel" for e in differences_block(recipe))
    model = build_diffusion_transformer(DiffusionModule(DiffusionModelConfig(path=str(tiny_pipeline)))._load_family())
    with pytest.raises(ValueError, match="ep=8: QwenImageTransformer2DModel runs through diffusers, where it trains "
                                         "with data parallelism"):
        DIFFUSERS.check(model, dims, ParallelOptions())

def _fit(twin: str, *overrides: str) -> None:
    with mock.patch.object(sys, "argv", ["lightning-moe"]):
        main(["fit", "--config", str(CONFIGS / twin), "--trainer.max_steps=2", "--trainer.logger=false",
              "--trainer.enable_progress_bar=false", *overrides])


def test_cpu_twins_train_and_export(tiny_pipeline, tiny_cache, tmp_path):
    from diffusers import QwenImagePipeline, QwenImageTransformer2DModel

    full, lora = tmp_path / "full", tmp_path / "lora"
    _fit("tiny/qwen_image_naruto.yaml", f"--model.init_args.model.path={tiny_pipeline}",
         f"--trainer.default_root_dir={full}", f"--model.init_args.export_dir={full / 'transformer'}")
    _fit("tiny/qwen_image_lora_cached.yaml", f"--model.init_args.model.path={tiny_pipeline}",
         f"--data.init_args.cache_dir={tiny_cache}", f"--trainer.default_root_dir={lora}",
         f"--model.init_args.export_dir={lora / 'lora'}")
    for run in (full, lora):
        card = json.loads(next(run.rglob("run_card.json")).read_text())
        assert card["status"] == "completed" and card["steps"] == 2 and card["images_per_s_per_gpu"] > 0
    QwenImageTransformer2DModel.from_pretrained(full / "transformer")
    pipe = QwenImagePipeline.from_pretrained(tiny_pipeline)
    pipe.load_lora_weights(lora / "lora")
    assert any("lora_A" in name for name, _ in pipe.transformer.named_parameters())
