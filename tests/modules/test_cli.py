"""The training CLI: recipes parse and round-trip, bad keys fail before training, and Python use works."""

from __future__ import annotations

import json
import subprocess
import sys

import lightning as L
import pytest
import yaml
from distributed_harness import HANG_GUARD_S

from lightning_moe.cli import add_missing_callbacks, main


def _print_config(capsys, *args) -> str:
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", *args, "--print_config"])
    assert exit_info.value.code in (0, None)
    return capsys.readouterr().out


def test_print_config_round_trips(tmp_path, capsys):
    first = _print_config(capsys, "--config", "configs/quickstart.yaml", "--trainer.max_steps", "7")
    resolved = yaml.safe_load(first)
    assert resolved["trainer"]["max_steps"] == 7
    assert resolved["model"]["init_args"]["model"]["moe"]["num_experts"] == 8
    (tmp_path / "resolved.yaml").write_text(first)
    assert _print_config(capsys, "--config", str(tmp_path / "resolved.yaml")) == first


def test_unknown_key_is_named_and_nothing_trains(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "lightning_moe.cli", "fit", "--config", "configs/quickstart.yaml",
         "--model.init_args.model.hiden_size", "64", "--trainer.default_root_dir", str(tmp_path)],
        capture_output=True, text=True, timeout=HANG_GUARD_S,
    )
    assert out.returncode != 0
    assert "hiden_size" in out.stderr
    assert not list(tmp_path.rglob("run_card.json"))


def test_missing_data_path_fails_before_training(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "lightning_moe.cli", "fit", "--config", "configs/quickstart.yaml",
         "--data.init_args.dataset", str(tmp_path / "missing.jsonl"), "--trainer.default_root_dir", str(tmp_path)],
        capture_output=True, text=True, timeout=HANG_GUARD_S,
    )
    assert out.returncode != 0
    assert "missing.jsonl" in out.stderr


def test_default_callbacks_are_added_unless_configured():
    from lightning_moe.callbacks import HealthCheck, PeakMemory, RunCard, Throughput

    mine = Throughput(window=3)
    callbacks = add_missing_callbacks([mine, L.Callback()])
    assert callbacks[0] is mine
    kinds = [type(c) for c in callbacks]
    assert kinds.count(Throughput) == 1
    assert {HealthCheck, PeakMemory, RunCard} <= set(kinds)

    class MyHealthCheck(HealthCheck):
        pass

    kinds = [type(c) for c in add_missing_callbacks([MyHealthCheck()])]
    assert HealthCheck not in kinds and kinds.count(MyHealthCheck) == 1


def test_python_usage_from_the_readme(tmp_path):
    from lightning_moe import CausalLM, MockDataModule, ModelConfig
    from lightning_moe.models import AttentionConfig, MoEConfig

    config = ModelConfig(
        family="qwen3_moe", vocab_size=512, hidden_size=64, pattern="*E" * 2, mlp=None,
        attention=AttentionConfig(num_heads=4, num_kv_heads=2, head_dim=16, qk_norm=True),
        moe=MoEConfig(num_experts=4, top_k=2, intermediate_size=32, aux_loss_coeff=1e-3),
    )
    module = CausalLM(model=config)
    trainer = L.Trainer(accelerator="cpu", max_steps=3, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, default_root_dir=tmp_path)
    trainer.fit(module, datamodule=MockDataModule(seq_length=32, micro_batch_size=2, vocab_size=512))
    assert module.step_stats.step == 3
    assert module.step_stats.loss == pytest.approx(6.24, abs=0.3)  # ~ln(512) for an untrained model


def test_a_run_logs_tensorboard_and_csv_by_default_and_the_card_says_where(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "lightning_moe.cli", "fit", "--config", "configs/quickstart.yaml",
         "--trainer.max_steps", "2", "--trainer.log_every_n_steps", "1", "--trainer.default_root_dir", str(tmp_path)],
        capture_output=True, text=True, timeout=HANG_GUARD_S,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    run_dir = tmp_path / "lightning_logs" / "version_0"
    assert list(run_dir.glob("events.out.tfevents.*")) and (run_dir / "metrics.csv").is_file()
    card = json.loads((run_dir / "run_card.json").read_text())
    assert [entry["logger"] for entry in card["loggers"]] == ["TensorBoardLogger", "CSVLogger"]
    assert {entry["location"] for entry in card["loggers"]} == {str(run_dir)}
    # the console: a bar in optimizer steps, the model summary with model FLOPs
    assert "Step" in out.stdout and "2/2" in out.stdout
    assert "Model FLOPs per token" in out.stdout and "Total FLOPs" not in out.stdout


def test_the_tracking_example_names_wandb_and_mlflow(capsys):
    resolved = yaml.safe_load(_print_config(capsys, "--config", "configs/quickstart_tracking.yaml"))
    kinds = [logger["class_path"].rsplit(".", 1)[1] for logger in resolved["trainer"]["logger"]]
    assert kinds == ["WandbLogger", "MLFlowLogger", "CSVLogger"]
