"""``lightning-moe plan``: will a recipe's layout fit, how fast will it run, and which layout of N GPUs is best.

    lightning-moe plan --config RECIPE.yaml [--gpu h100|h200|b200|gb200|cpu|FILE.yaml] [--json OUT] [overrides]
    lightning-moe plan --config RECIPE.yaml --gpus N [--gpu ...] [--top K] [--json OUT] [overrides]

The first form predicts the recipe's own layout: per-rank memory (``lightning-moe estimate``'s), the step time
split into compute per block kind, element-wise and optimizer passes, communication per mesh dimension (exposed
and overlapped) and the pipeline bubble, and from these tokens/s/GPU, TFLOP/s/GPU and MFU. The second searches
the layouts of N GPUs (``plan/search.py``) and prints the top K that fit with the overrides selecting each.
``--gpu`` defaults to the GPU named in the recipe's ``# Hardware:`` line. Exits 0 when the layout fits (a search
found one), 1 when it does not (none fits), 2 on a bad recipe, option or layout.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from lightning_moe.estimate.memory import GIB
from lightning_moe.estimate.recipe import load_recipe
from lightning_moe.io.atomic import atomic_write_text
from lightning_moe.plan.hardware import Hardware, hardware_named, hardware_of_recipe
from lightning_moe.plan.search import overrides_of, search
from lightning_moe.plan.step_time import Prediction, Workload, predict, workload


def _layout_line(work: Workload) -> str:
    sizes = ", ".join(f"{k}={v}" for k, v in work.dims.sizes.items() if v > 1) or "one rank"
    ac = work.layout.strategy.get("activation_checkpointing", "none")
    pipe = f", vp={work.vp} {work.schedule}" if work.pp > 1 else ""
    return (f"{work.world_size} GPUs: {sizes}{pipe}; micro-batch {work.layout.micro_batch_size} x seq "
            f"{work.layout.seq_length}, {work.micro_batches} micro-batches per step, global batch "
            f"{work.global_rows}; activation checkpointing {ac}; GEMMs in {work.gemm_precision}")


def render(work: Workload, p: Prediction, hw: Hardware) -> str:
    lines = [_layout_line(work), f"Hardware: {hw.name} ({hw.source}; constants: {hw.family})", ""]
    if work.memory:
        unit, scale = ("GiB", GIB) if p.peak_memory_bytes >= GIB else ("MiB", 2**20)
        lines += [f"| memory per rank ({unit}) | " + " | ".join(r.kind for r in work.memory) + " |",
                  "|---|" + "---:|" * len(work.memory)]
        for name in work.memory[0].components:
            lines.append(f"| {name} | " + " | ".join(f"{r.components[name] / scale:.2f}" for r in work.memory) + " |")
        lines.append("| **total** | " + " | ".join(f"**{r.total / scale:.2f}**" for r in work.memory) + " |")
        verdict = "fits" if p.fits else "does NOT fit"
        lines += ["", f"Largest rank {p.peak_memory_bytes / scale:.2f} {unit} of {hw.memory_gib:.1f} GiB -> {verdict}", ""]
    lines += ["| step time (s) | seconds | share |", "|---|---:|---:|"]
    for name, seconds in p.breakdown().items():
        lines.append(f"| {name} | {seconds:.4g} | {100 * seconds / p.step_time_s:.1f} % |")
    lines.append(f"| **step** | **{p.step_time_s:.4g}** | |")
    lines += ["", "| communication | link | total (s) | exposed (s) |", "|---|---|---:|---:|"]
    for dim, seconds in p.comm_s.items():
        share = max((c.offnode for c in work.comm if c.dim == dim), default=0.0)
        link = "NVLink" if share == 0 else ("network" if share == 1 else f"network {100 * share:.0f} %")
        lines.append(f"| {dim} | {link} | {seconds:.4g} | {p.exposed_s.get(dim, 0.0):.4g} |")
    for dim, why in work.not_counted.items():
        lines.append(f"| {dim} | not counted | - | - |")
        lines.append(f"|  | ({why}) | | |")
    lines += ["", f"Predicted: {p.tokens_per_s_per_gpu:,.0f} tokens/s/GPU, {p.tflops_per_gpu:.0f} TFLOP/s/GPU, "
                  f"MFU {100 * p.mfu:.1f} % (of the {work.gemm_precision} peak)"]
    return "\n".join(lines)


def as_json(work: Workload, p: Prediction, hw: Hardware) -> dict:
    return {
        "recipe": work.layout.path, "gpu": hw.name, "world_size": work.world_size, "sizes": work.dims.sizes,
        "overrides": overrides_of(work.layout),
        "step_time_s": p.step_time_s, "tflops_per_gpu": p.tflops_per_gpu,
        "tokens_per_s_per_gpu": p.tokens_per_s_per_gpu, "mfu": p.mfu, "fits": p.fits,
        "peak_memory_bytes": p.peak_memory_bytes, "device_memory_bytes": hw.memory_gib * GIB,
        "memory": [{"kind": r.kind, "components": r.components, "total": r.total} for r in work.memory],
        "time": p.breakdown(), "compute_s": p.compute_s, "comm_s": p.comm_s, "exposed_s": p.exposed_s,
        "comm_bytes": {f"{c.kind} over {c.dim}": c.bytes for c in work.comm},
        "not_counted": work.not_counted, "constants": dataclasses.asdict(hw.constants), "notes": work.notes,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="lightning-moe plan", description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", required=True, help="the recipe YAML")
    parser.add_argument("--gpu", default=None, help="h100, h200, b200, gb200, cpu (this machine, measured) or a YAML file describing the GPU")
    parser.add_argument("--gpus", type=int, default=None, help="search the layouts of this many GPUs")
    parser.add_argument("--top", type=int, default=3, help="layouts the search prints")
    parser.add_argument("--json", default=None, help="also write the prediction as JSON here")
    args, overrides = parser.parse_known_args(argv)
    try:
        if args.gpus is not None and args.gpus < 1:
            raise ValueError(f"--gpus {args.gpus}: must be a positive number of GPUs")
        hw = hardware_named(args.gpu) if args.gpu else None
        layout = load_recipe(args.config, overrides)
        hw = hw or hardware_of_recipe(layout.hardware)
        if hw is None:
            raise ValueError(f"{layout.path}: the recipe names no known GPU in its Hardware line; pass --gpu")
        if args.gpus is None:
            work = workload(layout, domain=hw.nvlink_domain)
    except (OSError, ValueError, TypeError) as error:
        print(f"lightning-moe plan: {str(error).splitlines()[0]}", file=sys.stderr)
        return 2
    if args.gpus is None:
        p = predict(work, hw)
        print(render(work, p, hw))
        if args.json:
            atomic_write_text(args.json, json.dumps(as_json(work, p, hw), indent=2) + "\n")
        return 0 if p.fits else 1
    chosen, counts = search(layout, args.gpus, hw, args.top)
    summary = ", ".join(f"{v} {k}" for k, v in counts.items())
    if not chosen:
        print(f"lightning-moe plan: no layout of {args.gpus} {hw.name} GPUs fits {layout.path} ({summary})",
              file=sys.stderr)
        return 1
    print(f"Layouts of {args.gpus} {hw.name} GPUs for {layout.path} ({summary})\n")
    for rank, c in enumerate(chosen, 1):
        print(f"## {rank}. {c.prediction.tokens_per_s_per_gpu:,.0f} tokens/s/GPU\n")
        print(render(c.work, c.prediction, hw))
        print("\noverrides: " + " ".join(c.overrides) + "\n")
    if args.json:
        atomic_write_text(args.json, json.dumps({"gpus": args.gpus, "counts": counts, "layouts": [
            as_json(c.work, c.prediction, hw) for c in chosen]}, indent=2) + "\n")
    return 0
