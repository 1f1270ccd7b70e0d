"""Layouts of N GPUs for a recipe's model, batch and sequence length, ranked by predicted throughput.

Enumerated: ``tp`` (powers of two up to the NVLink domain, at most 8), ``pp`` (powers of two up to 16 and the
block count) with ``vp`` 1 or 2 (the default schedule of each), ``cp`` (powers of two while each rank keeps at
least 4096 tokens of a row), ``ep`` (powers of two dividing the experts), ``dp_replicate`` (1, or HSDP over one
replica per NVLink domain's worth of ranks, without ``ep``), activation checkpointing (none, full) and the
micro-batch (1, 2, 4); ``dp_shard`` takes the rest. A layout the package refuses (``ParallelDims``, the block
records' split checks, the schedule's, the batch's divisibility) is left out; the others are predicted, ranked by
tokens/s/GPU, and their memory is estimated in that order until ``top`` of them fit (a layout that does not
fit is dropped). The first ranking leaves out the optimizer's pass (it needs the memory estimate, which is the
slow part); the chosen layouts are ranked again with it.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterator
from dataclasses import dataclass

from lightning_moe.estimate.memory import estimate_memory
from lightning_moe.estimate.recipe import RecipeLayout
from lightning_moe.plan.hardware import Hardware
from lightning_moe.plan.step_time import Prediction, Workload, predict, workload


@dataclass
class Candidate:
    layout: RecipeLayout
    work: Workload
    prediction: Prediction

    @property
    def overrides(self) -> list[str]:
        return overrides_of(self.layout)


STRATEGY_KEYS = ("tp", "pp", "vp", "cp", "ep", "dp_replicate", "activation_checkpointing")


def overrides_of(layout: RecipeLayout) -> list[str]:
    """The recipe overrides that select ``layout``'s sizes."""
    args = layout.strategy
    out = [f"--trainer.strategy.init_args.{key}={args[key]}" for key in STRATEGY_KEYS if key in args]
    out.append("--trainer.strategy.init_args.dp_shard=-1")
    out.append(f"--data.init_args.micro_batch_size={layout.micro_batch_size}")
    return out


def _powers(limit: int) -> list[int]:
    return [2**i for i in range(limit.bit_length()) if 2**i <= limit]


def layouts(base: RecipeLayout, gpus: int, domain: int) -> Iterator[RecipeLayout]:
    cfg = base.model
    blocks = len(cfg.pattern)
    experts = cfg.moe.num_experts if cfg.moe is not None else 1
    keep = {k: v for k, v in base.strategy.items() if k not in STRATEGY_KEYS + ("dp_shard", "pp_schedule")}
    tps = [t for t in _powers(min(8, domain)) if gpus % t == 0]
    pps = [p for p in _powers(min(16, blocks)) if gpus % p == 0]
    cps = [c for c in _powers(max(1, base.seq_length // 4096)) if gpus % c == 0]
    eps = [e for e in _powers(min(experts, gpus)) if experts % e == 0]
    micro = [m for m in (1, 2, 4) if not base.global_batch_size or base.global_batch_size % m == 0]
    for tp, pp, cp, ep, ac, mbs in itertools.product(tps, pps, cps, eps, ("none", "full"), micro):
        replicas = [1]
        per_replica = max(domain // (tp * cp), 1)
        if ep == 1 and gpus // pp > per_replica * tp * cp and (gpus // pp) % (per_replica * tp * cp) == 0:
            replicas.append(gpus // pp // (per_replica * tp * cp))
        for vp, replicate in itertools.product((1, 2) if pp > 1 else (1,), replicas):
            strategy = {**keep, "tp": tp, "pp": pp, "cp": cp, "ep": ep, "dp_replicate": replicate,
                        "activation_checkpointing": ac}
            if pp > 1:
                strategy["vp"] = vp
            yield dataclasses.replace(base, world_size=gpus, strategy=strategy, micro_batch_size=mbs)


def search(base: RecipeLayout, gpus: int, hw: Hardware, top: int = 3) -> tuple[list[Candidate], dict[str, int]]:
    """The ``top`` fitting layouts by predicted tokens/s/GPU, and counts of what was considered."""
    counts = {"enumerated": 0, "refused": 0, "predicted": 0, "memory estimated": 0, "do not fit": 0}
    ranked = []
    for layout in layouts(base, gpus, hw.nvlink_domain):
        counts["enumerated"] += 1
        try:
            work = workload(layout, memory=False, domain=hw.nvlink_domain)
        except ValueError:
            counts["refused"] += 1
            continue
        counts["predicted"] += 1
        ranked.append((predict(work, hw).tokens_per_s_per_gpu, layout, work))
    ranked.sort(key=lambda entry: -entry[0])
    chosen = []
    for _, layout, work in ranked:
        if len(chosen) == top:
            break
        counts["memory estimated"] += 1
        try:
            work.memory = estimate_memory(layout)
        except ValueError:  # the pipeline's split or the batch refuse it
            counts["refused"] += 1
            continue
        prediction = predict(work, hw)
        if not prediction.fits:
            counts["do not fit"] += 1
            continue
        chosen.append(Candidate(layout, work, prediction))
    chosen.sort(key=lambda c: -c.prediction.tokens_per_s_per_gpu)  # the optimizer's pass now included
    return chosen, counts
