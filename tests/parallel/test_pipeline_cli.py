"""``lightning-moe fit`` of the DeepSeek-V3 twin on 2 CPU ranks with ``--trainer.strategy.init_args.pp 2`` (and with
``dp_shard 2``) writes a run card whose per-step losses equal the 1-process run's, from scratch (the same seed
gives the same weights on every layout) and from a Hugging Face checkpoint; the card records the pipeline."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from distributed_harness import HANG_GUARD_S

pytestmark = pytest.mark.distributed

TWIN = Path(__file__).parents[2] / "configs" / "tiny" / "mla_moe_benchmark.yaml"
STEPS = 2


def fit(root: Path, *overrides: str) -> dict:
    command = [str(Path(sys.executable).parent / "lightning-moe"), "fit", "--config", str(TWIN),
               f"--trainer.max_steps={STEPS}", "--trainer.enable_progress_bar=false",
               f"--trainer.default_root_dir={root}", *overrides]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=HANG_GUARD_S)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    (card,) = root.rglob("run_card.json")
    return json.loads(card.read_text())


def twin_checkpoint(path: Path) -> Path:
    """A Hugging Face directory of the twin's model (random weights from another seed)."""
    from lightning_moe.checkpoint.convert import export_model
    from lightning_moe.models.config import ModelConfig
    from lightning_moe.models.decoder import Decoder

    spec = yaml.safe_load(TWIN.read_text())["model"]["init_args"]["model"]
    model = Decoder(ModelConfig.from_dict(spec)).to(torch.bfloat16)
    model.init_weights(seed=123)
    return export_model(model, path)


def test_cli_pipeline_losses_equal_one_process(tmp_path):
    one = fit(tmp_path / "one")
    pipelined = fit(tmp_path / "pp2", "--trainer.devices=2", "--trainer.strategy.init_args.pp=2")
    sharded = fit(tmp_path / "fsdp2", "--trainer.devices=2", "--trainer.strategy.init_args.dp_shard=2")
    assert len(one["series"]["loss"]) == STEPS
    assert pipelined["series"]["loss"] == pytest.approx(one["series"]["loss"], abs=1e-5)
    assert sharded["series"]["loss"] == pytest.approx(one["series"]["loss"], abs=1e-5)
    assert pipelined["parallel_sizes"]["pp"] == 2 and one["pipeline"] is None
    card = pipelined["pipeline"]
    assert (card["schedule"], card["pp"], card["vp"], card["micro_batches"]) == ("1f1b", 2, 1, 2)
    assert len(card["split"]) == 2 and 0.0 <= card["bubble_fraction"] < 1.0
    assert card["bubble_fraction_theoretical"] == pytest.approx(1 / 3)

    hub = twin_checkpoint(tmp_path / "hf")
    start = [f"--model.init_args.pretrained={hub}"]
    one_hub = fit(tmp_path / "one_hub", *start)
    pipelined_hub = fit(tmp_path / "pp2_hub", *start, "--trainer.devices=2", "--trainer.strategy.init_args.pp=2")
    assert pipelined_hub["series"]["loss"] == pytest.approx(one_hub["series"]["loss"], abs=1e-5)
    assert abs(one_hub["series"]["loss"][0] - one["series"]["loss"][0]) > 1e-4  # the checkpoint's weights were used
