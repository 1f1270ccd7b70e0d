"""Host syncs per optimizer step during ``fit``, counted by the package's own counter (``debug/host_syncs.py``).

Targets (``log_every_n_steps`` 10, steady state after two steps): at most 2 per optimizer step for the dense twin,
the MoE twin and packed SFT (the quickstart); with expert parallelism 1 more per MoE layer and micro-batch (the
all-to-all-v split sizes); under a pipeline 2. A ``.item()`` planted in a layer is caught, with its line.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from distributed_harness import run_distributed_test

from lightning_moe.cli import main as cli_main
from lightning_moe.debug.host_syncs import count_host_syncs

ROOT = Path(__file__).resolve().parents[1]
DENSE, MOE, SFT = (str(ROOT / "configs" / name) for name in
                   ("tiny/dense_cp_benchmark.yaml", "tiny/moe_benchmark.yaml", "quickstart.yaml"))
STEPS, LOG_EVERY, TARGET = 20, 10, 2


def fit_counting(config: str, root: Path, *overrides: str, steps: int = STEPS) -> dict:
    """Train ``config`` through the command line under a HostSyncCounter; its report (rank 0's)."""
    report = root / "host_syncs_{rank}.json"
    cli_main(["fit", "--config", config, f"--trainer.max_steps={steps}", f"--trainer.log_every_n_steps={LOG_EVERY}",
              f"--trainer.default_root_dir={root}", "--trainer.enable_checkpointing=false",
              "--trainer.callbacks+=lightning_moe.debug.host_syncs.HostSyncCounter",
              f"--trainer.callbacks.report={report}", *overrides])
    return json.loads((root / "host_syncs_0.json").read_text())


def test_counter_sees_each_kind_of_sync_and_not_host_values():
    x, counts = torch.arange(6.0), torch.tensor([1, 2, 3])
    with count_host_syncs() as log:
        x[0].item(), bool(x[1]), float(x[2]), x.tolist(), x.numpy(), torch.equal(x, x)
        x[x > 1], torch.nonzero(x), torch.bincount(counts), torch.repeat_interleave(x[:3], counts, dim=0)
        torch.tensor(1.0, device="cpu"), x.cpu()
        x.to("cpu"), x.to(torch.float64)  # on a CPU these copy nothing off a device
    kinds = [kind for kind, _ in log.events]
    assert kinds.count("scalar read") == 4
    assert {"device-to-host copy (tolist)", "device-to-host copy (numpy)", "boolean mask index", "nonzero",
            "bincount", "repeat_interleave without output_size", "host-to-device copy (torch.tensor)",
            "device-to-host copy (cpu)"} <= set(kinds)
    assert len(kinds) == 12, log.events
    assert all(site.startswith("tests/test_host_syncs.py:") for _, site in log.events), log.events
    with count_host_syncs() as quiet:
        host = torch.tensor([1.0, 2.0])  # from Python numbers: a host tensor
        host[0].item(), host.clone().sum().item(), host.to(torch.float64).tolist()  # host values: no sync
        torch.repeat_interleave(x[:3], counts, dim=0, output_size=6)
        torch.zeros(3, dtype=torch.long).scatter_add_(0, counts - 1, torch.ones_like(counts))
    assert quiet.events == []


@pytest.mark.parametrize("config", [DENSE, MOE, SFT], ids=["dense", "moe", "packed_sft"])
def test_fit_syncs_per_step(config, tmp_path):
    report = fit_counting(config, tmp_path)
    assert len(report["per_step"]) == STEPS
    assert report["steady_state"] <= TARGET, report["sites"]


def test_a_planted_item_in_a_layer_is_counted(tmp_path, monkeypatch):
    from lightning_moe.models.layers import mlp

    forward = mlp.MLP.forward

    def reads_back(self, x):
        if x.sum().item() == float("inf"):  # planted: a read of the device in every MLP forward
            raise AssertionError("unreachable")
        return forward(self, x)

    monkeypatch.setattr(mlp.MLP, "forward", reads_back)
    report = fit_counting(DENSE, tmp_path, steps=6)
    assert report["steady_state"] > TARGET
    assert any("test_host_syncs.py" in site and "reads_back" in site for site in report["sites"]), report["sites"]


def _fit_parallel(root: str) -> None:
    root = Path(root)
    # EP 2 on the MoE twin (dp_shard 2, 1 micro-batch per step); PP 2 on the dense twin (2 micro-batches)
    fit_counting(MOE, root / "ep", "--trainer.devices=2", "--trainer.strategy.init_args.ep=2")
    fit_counting(DENSE, root / "pp", "--trainer.devices=2", "--trainer.strategy.init_args.pp=2")


@pytest.mark.distributed
def test_fit_syncs_per_step_with_expert_and_pipeline_parallelism(tmp_path):
    run_distributed_test(_fit_parallel, 2, str(tmp_path), init_process_group=False)
    moe_layers, micro_batches = 2, 1
    for rank in range(2):  # every rank's steps
        ep = json.loads((tmp_path / "ep" / f"host_syncs_{rank}.json").read_text())
        assert ep["steady_state"] <= TARGET + moe_layers * micro_batches, (rank, ep["sites"])
        pp = json.loads((tmp_path / "pp" / f"host_syncs_{rank}.json").read_text())
        assert pp["steady_state"] <= TARGET, (rank, pp["sites"])
