"""All callbacks with the package's CausalLM: its StepStats feed the throughput, the card's losses are the ones
the module logged, and a skipped NaN step reaches the module as a skipped step (no update, no expert-bias move)."""

from __future__ import annotations

import csv
import json

import lightning.pytorch as pl
import pytest
import torch
from tiny_lm import MICRO_BATCH, SEQ, loader, make_trainer, tiny_config

from lightning_moe.callbacks import HealthCheck, PeakMemory, RunCard, Throughput
from lightning_moe.modules import CausalLM


class NaNAtStep2(CausalLM):
    """NaN gradients at step 2 (the reported loss, summed before the objective, stays finite)."""

    def training_step(self, batch, batch_idx):
        objective = super().training_step(batch, batch_idx)
        return objective * float("nan") if self.trainer.global_step == 1 else objective


class StatsLog(pl.Callback):
    def __init__(self) -> None:
        self.stats = {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if pl_module.step_stats is not None:
            self.stats[pl_module.step_stats.step] = pl_module.step_stats


def test_callbacks_with_causal_lm(tmp_path):
    accumulate, steps = 2, 4
    throughput, health, stats = Throughput(window=2), HealthCheck(), StatsLog()
    callbacks = [throughput, PeakMemory(), health, RunCard(print_card=False), stats]
    trainer = make_trainer(tmp_path, callbacks, max_steps=steps, accumulate_grad_batches=accumulate)
    with pytest.warns(UserWarning, match="step 2: non-finite gradients"):
        trainer.fit(NaNAtStep2(model=tiny_config()), loader())

    assert [s.tokens for s in throughput.history.values()] == [MICRO_BATCH * SEQ * accumulate] * steps
    assert [s.label_tokens for s in throughput.history.values()] == [stats.stats[i].label_tokens for i in range(1, steps + 1)]
    assert "model config" in throughput.summary()["flops_method"]
    assert stats.stats[2].skipped and not stats.stats[3].skipped
    assert health.skipped_steps == [2]

    card = json.loads((tmp_path / "run" / "version_0" / "run_card.json").read_text())
    with open(f"{trainer.logger.log_dir}/metrics.csv") as f:
        logged = {int(r["step"]): float(r["train/loss"]) for r in csv.DictReader(f) if r.get("train/loss")}
    # the module logs at step index global_step - 1 (before the optimizer step ends); the card numbers steps so too
    assert len(logged) == steps
    assert card["series"]["step"] == sorted(logged) == [0, 1, 2, 3]
    assert card["series"]["loss"] == pytest.approx([logged[step] for step in (0, 1, 2, 3)], rel=1e-6)
    assert card["skipped_steps"] == 1 and card["nan_steps"] == 1
    assert {"train/loss", "perf/step_time_s", "perf/tokens_per_s_per_gpu"} <= set(trainer.progress_bar_metrics)


def test_a_skipped_step_moves_no_expert_bias(tmp_path):
    """Aux-loss-free balancing: the selection biases move after every applied step, not after a skipped one."""
    from lightning_moe.models.config import MoEConfig

    class BiasLog(pl.Callback):
        def __init__(self) -> None:
            self.before, self.after = {}, {}

        @staticmethod
        def _biases(pl_module):
            return [m.router.score_correction_bias.clone() for m in pl_module.model.moe_layers()]

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            self.before[trainer.global_step + 1] = self._biases(pl_module)

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self.after[trainer.global_step] = self._biases(pl_module)

    config = tiny_config()
    config.pattern, config.moe = "*E*-", MoEConfig(num_experts=4, top_k=2, intermediate_size=32,
                                                    score_correction_bias=True, bias_update_rate=0.01)
    log = BiasLog()
    trainer = make_trainer(tmp_path, [HealthCheck(), log], max_steps=3)
    with pytest.warns(UserWarning, match="step 2: non-finite gradients"):
        trainer.fit(NaNAtStep2(model=config), loader())
    changed = {step: any(not torch.equal(a, b) for a, b in zip(log.before[step], log.after[step]))
               for step in (1, 2, 3)}
    assert changed == {1: True, 2: False, 3: True}
