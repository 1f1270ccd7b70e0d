"""``lightning-moe plan``: its counts are the package's own, its model moves the right way, its search drops what
does not fit, its JSON holds the required keys and bad inputs get one clear line each."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lightning_moe.estimate.memory import stored_dtype
from lightning_moe.estimate.recipe import load_recipe
from lightning_moe.models.block_flops import Sequences
from lightning_moe.models.flops import forward_flops
from lightning_moe.parallel.comm import StepShape, model_comm_bytes
from lightning_moe.plan.command import main as plan_main
from lightning_moe.plan.hardware import hardware_named
from lightning_moe.plan.search import search
from lightning_moe.plan.step_time import predict, workload

ROOT = Path(__file__).resolve().parents[2]
RECIPE = str(ROOT / "configs" / "tiny" / "moe_benchmark.yaml")
EP2 = ["--trainer.devices", "2", "--trainer.strategy.init_args.ep", "2"]
REQUIRED_JSON = ("step_time_s", "tflops_per_gpu", "tokens_per_s_per_gpu", "mfu", "fits", "memory", "time",
                 "comm_s", "exposed_s", "compute_s")


@pytest.fixture(scope="module")
def ep2():
    return load_recipe(RECIPE, EP2)


def one_line_error(capsys, argv: list[str], status: int, words: str) -> str:
    assert plan_main(argv) == status
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert words in err, err
    return err


def test_comm_bytes_are_model_comm_bytes(ep2):
    work = workload(ep2, memory=False)
    shape = StepShape(rows=ep2.micro_batch_size, seq_len=ep2.seq_length, micro_batches=work.micro_batches,
                      dtype=stored_dtype(ep2.precision), activation_checkpointing="full")
    expected = model_comm_bytes(ep2.model, work.dims, shape)
    assert expected, "the EP-2 layout has collectives"
    assert {(c.kind, c.dim): c.bytes for c in work.comm} == expected
    assert not work.not_counted


def test_model_flops_are_forward_flops(ep2):
    """Without recompute the per-kind items sum to the model's training FLOPs (the records' formulas)."""
    layout = dataclasses.replace(ep2, strategy={**ep2.strategy, "activation_checkpointing": "none"})
    work = workload(layout, memory=False)
    total = forward_flops(layout.model, Sequences.of_length(layout.seq_length, work.global_rows)).training()
    assert sum(item.flops for item in work.compute) == pytest.approx(total / layout.world_size, rel=1e-9)
    assert work.model_flops == pytest.approx(total / layout.world_size, rel=1e-9)
    recomputed = workload(ep2, memory=False)  # full checkpointing runs each block's forward again
    assert sum(i.flops for i in recomputed.compute) > sum(i.flops for i in work.compute)


def test_faster_hardware_is_never_slower(ep2):
    work = workload(ep2)
    h100 = hardware_named("h100")
    base = predict(work, h100)
    double_flops = dataclasses.replace(h100, peak_flops={k: 2 * v for k, v in h100.peak_flops.items()})
    faster = predict(work, double_flops)
    assert faster.step_time_s <= base.step_time_s
    for label, seconds in base.compute_s.items():
        assert faster.compute_s[label] == pytest.approx(seconds / 2)
    wider = dataclasses.replace(h100, nvlink_bytes_per_s=2 * h100.nvlink_bytes_per_s)
    assert predict(work, wider).step_time_s <= base.step_time_s
    assert base.tokens_per_s_per_gpu == pytest.approx(work.tokens_per_step / work.world_size / base.step_time_s)
    assert base.fits


def test_pipeline_bytes_are_the_busiest_stage():
    layout = load_recipe(RECIPE, ["--trainer.devices", "2", "--trainer.strategy.init_args.pp", "2"])
    work = workload(layout, memory=False)
    shape = StepShape(rows=layout.micro_batch_size, seq_len=layout.seq_length, micro_batches=work.micro_batches,
                      dtype=stored_dtype(layout.precision), activation_checkpointing="full")
    stages = [model_comm_bytes(layout.model, work.dims, shape, pp_rank=rank) for rank in range(2)]
    assert stages[0][("send", "pp")] > 0 and not work.not_counted
    assert {(c.kind, c.dim): c.bytes for c in work.comm} == {
        key: max(stage.get(key, 0) for stage in stages) for key in {*stages[0], *stages[1]}}
    assert predict(work, hardware_named("h100")).bubble_s > 0


def test_interleaved_pipelines_are_named_as_not_counted():
    layout = load_recipe(RECIPE, ["--trainer.devices", "2", "--trainer.strategy.init_args.pp", "2",
                                  "--trainer.strategy.init_args.vp", "2"])
    work = workload(layout, memory=False)
    assert "interleaved_1f1b schedule" in work.not_counted["pp"]


def test_search_drops_layouts_that_do_not_fit(ep2, tmp_path):
    h100 = hardware_named("h100")
    chosen, counts = search(ep2, 2, h100, top=2)
    assert chosen and counts["do not fit"] == 0
    best = chosen[0]
    rates = [c.prediction.tokens_per_s_per_gpu for c in chosen]
    assert rates == sorted(rates, reverse=True)
    # a device just smaller than the best layout's largest rank: that layout is dropped, the rest fit it
    small = dataclasses.replace(h100, memory_gib=best.prediction.peak_memory_bytes / 1024**3 * 0.999)
    kept, counts = search(ep2, 2, small, top=2)
    assert counts["do not fit"] >= 1
    assert all(c.prediction.fits and c.prediction.peak_memory_bytes <= small.memory_gib * 1024**3 for c in kept)
    assert best.overrides not in [c.overrides for c in kept]


def test_unknown_gpu(capsys):
    one_line_error(capsys, ["--config", RECIPE, "--gpu", "tpu9000"], 2, "unknown GPU")


def test_refused_layout(capsys):
    one_line_error(capsys, ["--config", RECIPE, "--gpu", "h100", "--trainer.devices", "2",
                            "--trainer.strategy.init_args.ep", "3"], 2, "ep=3 does not divide")


def test_no_layout_fits(capsys, tmp_path):
    gpu = tmp_path / "tiny_gpu.yaml"
    gpu.write_text("name: Tiny\npeak_flops: {bf16: 1.0e+12}\nmemory_gib: 1.0e-6\nhbm_bytes_per_s: 1.0e+11\n"
                   "nvlink_bytes_per_s: 1.0e+10\nnetwork_bytes_per_s: 1.0e+9\nnvlink_domain: 8\n")
    one_line_error(capsys, ["--config", RECIPE, "--gpu", str(gpu), "--gpus", "2", "--top", "1"], 1,
                   "no layout of 2 Tiny GPUs fits")


def test_bad_hardware_file(capsys, tmp_path):
    gpu = tmp_path / "half.yaml"
    gpu.write_text("name: Half\npeak_flops: {bf16: 1.0e+12}\n")
    one_line_error(capsys, ["--config", RECIPE, "--gpu", str(gpu)], 2, "missing memory_gib")


def test_cli_json(tmp_path):
    out = tmp_path / "plan.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([sys.executable, "-m", "lightning_moe.cli", "plan", "--config", RECIPE, "--gpu", "gb200",
                           "--json", str(out), *EP2], capture_output=True, text=True, env=env, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert "tokens/s/GPU" in done.stdout
    data = json.loads(out.read_text())
    for key in REQUIRED_JSON:
        assert key in data, key
    assert data["fits"] is True and data["step_time_s"] > 0
    assert data["step_time_s"] == pytest.approx(sum(data["time"].values()))
    assert torch.isfinite(torch.tensor(data["mfu"]))


def test_cpu_hardware_predicts_a_step(capsys, monkeypatch, tmp_path):
    """``--gpu cpu``: this machine's measured peak and bandwidth (cached in a folder of the test's own), one
    process with no links, a positive step time."""
    monkeypatch.setenv("LIGHTNING_MOE_CACHE", str(tmp_path))
    out = tmp_path / "plan.json"
    assert plan_main(["--config", RECIPE, "--gpu", "cpu", "--json", str(out), "--trainer.devices", "1"]) == 0
    assert "Hardware: CPU" in capsys.readouterr().out
    result = json.loads(out.read_text())
    assert result["step_time_s"] > 0 and result["world_size"] == 1 and result["fits"]
    assert sorted(p.name for p in tmp_path.glob("cpu_*.json")) == ["cpu_memory_bandwidth.json", "cpu_peak_flops.json"]
