"""HealthCheck: a NaN step is a true skip (weights and AdamW state bitwise unchanged), stop ends the run, and
all ranks agree when only one of them sees the NaN (also in a local DTensor shard)."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import lightning.pytorch as pl
import pytest
import torch
from distributed_harness import run_distributed_test
from tiny_lm import TinyLM, loader, make_trainer

from lightning_moe.callbacks import HealthCheck, RunCard


class Snapshots(pl.Callback):
    """Weights and optimizer state before and after every step (one micro-batch per step here)."""

    def __init__(self) -> None:
        self.before, self.after = {}, {}

    @staticmethod
    def _take(trainer, pl_module):
        params = {n: p.detach().clone() for n, p in pl_module.named_parameters()}
        return params, copy.deepcopy(trainer.optimizers[0].state_dict())

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.before[trainer.global_step + 1] = self._take(trainer, pl_module)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.after[trainer.global_step] = self._take(trainer, pl_module)


def same_state(a, b) -> bool:
    params_a, optim_a = a
    params_b, optim_b = b
    if any(not torch.equal(params_a[n], params_b[n]) for n in params_a):
        return False
    if optim_a["state"].keys() != optim_b["state"].keys():
        return False
    for key, state in optim_a["state"].items():
        for name, value in state.items():
            if not torch.equal(torch.as_tensor(value), torch.as_tensor(optim_b["state"][key][name])):
                return False
    return True


def test_nan_step_is_skipped_bitwise(tmp_path):
    health, snaps = HealthCheck(), Snapshots()
    trainer = make_trainer(tmp_path, [health, snaps], max_steps=5)
    with pytest.warns(UserWarning, match="step 3: non-finite gradients"):
        trainer.fit(TinyLM(nan_at_step=3, weight_decay=0.1), loader())
    assert trainer.global_step == 5
    assert same_state(snaps.before[3], snaps.after[3])  # weights, moments and step counts untouched
    for step in (2, 4):  # a normal step changes weights and moments (weight decay included)
        assert not same_state(snaps.before[step], snaps.after[step])
    assert health.skipped_steps == [3] and health.nan_steps == [3]
    assert trainer.callback_metrics["train/skipped_steps"] == 1
    assert torch.isfinite(torch.cat([p.flatten() for p in snaps.after[5][0].values()])).all()


def test_stop_drops_the_update_and_ends_the_run(tmp_path):
    health, snaps = HealthCheck(action="stop"), Snapshots()
    trainer = make_trainer(tmp_path, [health, snaps, RunCard(print_card=False)], max_steps=6)
    with pytest.warns(UserWarning, match="stopping the run"):
        trainer.fit(TinyLM(nan_at_step=2), loader())
    assert trainer.global_step == 2
    assert same_state(snaps.before[2], snaps.after[2])
    assert health.stopped_at == 2
    card = (tmp_path / "run" / "version_0" / "run_card.json").read_text()
    assert "stopped by HealthCheck at step 2" in card


def test_max_skipped_steps_stops_a_run_that_keeps_failing(tmp_path):
    class AlwaysNaN(TinyLM):
        def training_step(self, batch, batch_idx):
            return super().training_step(batch, batch_idx) * float("nan")

    health = HealthCheck(max_skipped_steps=2)
    trainer = make_trainer(tmp_path, [health], max_steps=10)
    with pytest.warns(UserWarning):
        trainer.fit(AlwaysNaN(), loader())
    assert health.skipped_steps == [1, 2, 3] and trainer.global_step == 3


def test_bad_action_is_rejected():
    with pytest.raises(ValueError, match="action='ignore'"):
        HealthCheck(action="ignore")


def _one_rank_has_nan() -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    plain = torch.nn.Parameter(torch.ones(4))
    sharded = torch.nn.Parameter(distribute_tensor(torch.ones(4, 3), mesh, [Shard(0)]))
    plain.grad = torch.ones(4)
    grad = torch.ones(4, 3)
    sharded.grad = distribute_tensor(grad, mesh, [Shard(0)])
    if rank == 1:  # only rank 1's local shard of the sharded gradient is bad
        sharded.grad.to_local()[0, 0] = float("inf")
    optimizer = torch.optim.AdamW([plain, sharded])
    health = HealthCheck()
    trainer = SimpleNamespace(global_step=6, should_stop=False)
    health.on_before_optimizer_step(trainer, SimpleNamespace(device=torch.device("cpu")), optimizer)
    assert plain.grad is None and sharded.grad is None, f"rank {rank} kept its gradients"
    assert health.skipped_steps == [7]


@pytest.mark.distributed
def test_all_ranks_skip_when_one_rank_sees_a_nan():
    run_distributed_test(_one_rank_has_nan, 2)
