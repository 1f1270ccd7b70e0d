"""``lightning-moe estimate``: will a recipe's layout fit, before the job is queued.

    lightning-moe estimate --config RECIPE.yaml [--device-memory GIB] [--json FILE] [--trainer.devices 8 ...]

Prints one table per kind of rank (components in GiB, their total) and the verdict against the device memory:
``--device-memory``, else the local GPU's, else the GPU named in the recipe's ``# Hardware:`` line, else (CPU
recipes) this machine's RAM. Exits 0 when every rank fits, 1 when one does not, 2 on a bad recipe or option.
"""

from __future__ import annotations

import argparse
import json
import sys

from lightning_moe.estimate.memory import COMPONENTS, GIB, RankMemory, estimate_memory
from lightning_moe.estimate.recipe import load_recipe
from lightning_moe.io.atomic import atomic_write_text

# usable memory per GPU (what torch.cuda reports as total), longest name fragment first
DEVICE_MEMORY_GIB = {"GB200": 184.0, "B200": 178.4, "H200": 139.8, "H100": 79.2, "A100": 79.2}


def device_memory(requested: float | None, hardware: str | None, accelerator_is_cpu: bool) -> tuple[float, str]:
    """Bytes per device, and where the figure came from."""
    if requested is not None:
        return requested * GIB, "--device-memory"
    import torch

    if torch.cuda.is_available() and not accelerator_is_cpu:
        props = torch.cuda.get_device_properties(0)
        return float(props.total_memory), f"this machine's {props.name}"
    for name in sorted(DEVICE_MEMORY_GIB, key=len, reverse=True):
        if hardware and name in hardware:
            return DEVICE_MEMORY_GIB[name] * GIB, f"{name} (the recipe's Hardware line)"
    import psutil

    return float(psutil.virtual_memory().total), "this machine's RAM"


def render(ranks: list[RankMemory], device_bytes: float, source: str, title: str) -> str:
    unit, scale = ("GiB", GIB) if max(r.total for r in ranks) >= GIB else ("MiB", 2**20)
    lines = [f"Memory per rank: {title}", ""]
    header = "| component | " + " | ".join(r.kind for r in ranks) + " |"
    lines += [header, "|---|" + "---:|" * len(ranks)]
    for name in COMPONENTS:
        lines.append(f"| {name} ({unit}) | " + " | ".join(f"{r.components[name] / scale:,.3f}" for r in ranks) + " |")
    lines.append(f"| **total ({unit})** | " + " | ".join(f"**{r.total / scale:,.3f}**" for r in ranks) + " |")
    lines.append("| notes | " + " | ".join("; ".join(r.notes) for r in ranks) + " |")
    worst = max(ranks, key=lambda r: r.total)
    verdict = "fits" if worst.total <= device_bytes else "does NOT fit"
    lines += ["", f"Device memory: {device_bytes / GIB:,.1f} GiB ({source}). Largest rank ({worst.kind}): "
                  f"{worst.total / GIB:,.2f} GiB -> {verdict} "
                  f"({100 * worst.total / device_bytes:.0f} % of the device)."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="lightning-moe estimate", description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", required=True, help="the recipe YAML")
    parser.add_argument("--device-memory", type=float, default=None, help="GiB per device to check against")
    parser.add_argument("--json", default=None, help="also write the estimate as JSON here")
    args, overrides = parser.parse_known_args(argv)
    try:
        layout = load_recipe(args.config, overrides)
        ranks = estimate_memory(layout)
    except (OSError, ValueError, TypeError) as error:
        print(f"lightning-moe estimate: {error}", file=sys.stderr)
        return 2
    device_bytes, source = device_memory(args.device_memory, layout.hardware, layout.accelerator == "cpu")
    title = (f"{layout.path} ({layout.world_size} ranks, {layout.strategy or 'default layout'}, micro-batch "
             f"{layout.micro_batch_size} x seq {layout.seq_length}, {layout.precision})")
    print(render(ranks, device_bytes, source, title))
    if args.json:
        atomic_write_text(args.json, json.dumps({
            "recipe": layout.path, "world_size": layout.world_size, "device_memory_bytes": device_bytes,
            "device_memory_source": source,
            "ranks": [{"kind": r.kind, "components": r.components, "total": r.total, "notes": r.notes}
                      for r in ranks],
        }, indent=2) + "\n")
    return 0 if all(r.total <= device_bytes for r in ranks) else 1

