"""``lightning-moe plan`` against every published row with a recorded throughput: the fit and the held-out error.

For each row of ``published_rows.yaml`` with a ``tflops_per_gpu``, a ``step_time_s`` and a recipe, the planner
reads the recipe (its layout, batch and sequence length) and predicts the step time on the row's GPU. The
efficiency constants the model fits (``plan/hardware.py``: ``gemm``, ``gemm_knee``, ``link``) are fitted per GPU
type on a fixed calibration split, never per row: the rows of one GPU type in file order, every other one
(the first, third, ...) is a calibration row, the rest are held out. The fit minimizes the mean absolute log
error of the predicted step time over the calibration rows (a grid over the three constants).

Predicted TFLOP/s/GPU is reported in the row's own units: the published TFLOP/s/GPU x published step time /
predicted step time (the publisher's FLOP count of the step, over the predicted time), so the error is that of
the step time. ``flops ratio`` is the package's count of the step's model FLOPs over the publisher's.

    python benchmarks/plan_vs_published.py [--cache FILE] [--rows ID ...] [--json OUT]

A row whose recipe cannot be read here (a hub config that is not cached offline) is listed as skipped.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import math
import pickle
import statistics
import sys
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from lightning_moe.estimate.recipe import load_recipe  # noqa: E402
from lightning_moe.plan.hardware import FITTED, hardware_named  # noqa: E402
from lightning_moe.plan.step_time import predict, workload  # noqa: E402

ROWS = ROOT / "benchmarks" / "published_rows.yaml"
GRID = {"gemm": [round(0.3 + 0.05 * i, 2) for i in range(15)],
        "gemm_knee": [0.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0, 2048.0],
        "link": [round(0.1 * i, 1) for i in range(1, 11)]}


def measured_rows(only: list[str] | None) -> list[tuple[str, dict]]:
    rows = yaml.safe_load(ROWS.read_text())["rows"]
    return [(key, row) for key, row in rows.items()
            if row.get("tflops_per_gpu") and row.get("step_time_s") and (not only or key in only)]


def split(rows: list[tuple[str, dict]]) -> dict[str, str]:
    """Row id -> "calibration" | "held-out": every other row of each GPU type, in file order."""
    seen: dict[str, int] = {}
    roles = {}
    for key, row in rows:
        if not row.get("recipe"):
            continue
        i = seen.get(row["gpu"], 0)
        seen[row["gpu"]] = i + 1
        roles[key] = "calibration" if i % 2 == 0 else "held-out"
    return roles


def log_error(work, hw, row) -> float:
    return abs(math.log(predict(work, hw).step_time_s / row["step_time_s"]))


def fit(cases: list[tuple[object, object, dict]]) -> dict[str, float]:
    best, best_error = None, math.inf
    for values in itertools.product(*(GRID[name] for name in FITTED)):
        constants = dict(zip(FITTED, values))
        error = statistics.fmean(log_error(work, dataclasses.replace(
            hw, constants=dataclasses.replace(hw.constants, **constants)), row) for work, hw, row in cases)
        if error < best_error:
            best, best_error = constants, error
    return best


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cache", default=None, help="pickle of the rows' workloads (read if present, else written)")
    parser.add_argument("--rows", nargs="*", default=None)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    rows = measured_rows(args.rows)
    roles = split(rows)
    cache = {}
    if args.cache and Path(args.cache).is_file():
        cache = pickle.loads(Path(args.cache).read_bytes())
    skipped = {key: "no recipe" for key, row in rows if not row.get("recipe")}
    works = {}
    for key, row in rows:
        if key not in roles:
            continue
        if key not in cache:
            start = time.time()
            try:
                cache[key] = workload(load_recipe(ROOT / row["recipe"], []))
            except (OSError, ValueError, TypeError) as error:
                cache[key] = f"{type(error).__name__}: {str(error).splitlines()[0][:100]}"
            print(f"  read {key} ({time.time() - start:.0f} s)", file=sys.stderr)
            if args.cache:
                Path(args.cache).write_bytes(pickle.dumps(cache))
        if isinstance(cache[key], str):
            skipped[key] = cache[key]
        else:
            works[key] = cache[key]

    by_gpu: dict[str, list] = {}
    for key, row in rows:
        if key in works and roles[key] == "calibration":
            by_gpu.setdefault(row["gpu"], []).append((works[key], hardware_named(row["gpu"]), row))
    fitted = {gpu: fit(cases) for gpu, cases in by_gpu.items()}
    print("## Fitted constants (per GPU type, on its calibration rows)\n")
    print("| GPU | calibration rows | " + " | ".join(FITTED) + " |")
    print("|---|---:|" + "---:|" * len(FITTED))
    for gpu, constants in fitted.items():
        print(f"| {gpu} | {len(by_gpu[gpu])} | " + " | ".join(f"{constants[n]:g}" for n in FITTED) + " |")

    print("\n## Predicted vs published TFLOP/s/GPU\n")
    print("| row | GPU | layout | published TFLOP/s | calibration: predicted | held-out: predicted | error | "
          "step s (pub / pred) | flops ratio | not counted |")
    print("|---|---|---|---:|---:|---:|---:|---:|---:|---|")
    errors: dict[str, list[float]] = {"calibration": [], "held-out": []}
    table = []
    for key, row in rows:
        if key not in works:
            continue
        work = works[key]
        hw = hardware_named(row["gpu"])
        hw = dataclasses.replace(hw, constants=dataclasses.replace(hw.constants, **fitted.get(row["gpu"], {})))
        p = predict(work, hw)
        predicted = row["tflops_per_gpu"] * row["step_time_s"] / p.step_time_s
        error = predicted / row["tflops_per_gpu"] - 1
        role = roles[key]
        errors[role].append(abs(error))
        ours = work.model_flops * work.world_size
        theirs = row["tflops_per_gpu"] * 1e12 * row["step_time_s"] * row["gpus"]
        sizes = ", ".join(f"{k}{v}" for k, v in work.dims.sizes.items() if v > 1)
        cells = [f"{predicted:.0f}" if role == "calibration" else "", f"{predicted:.0f}" if role == "held-out" else ""]
        print(f"| {key} | {row['gpu']} | {sizes} | {row['tflops_per_gpu']:.0f} | {cells[0]} | {cells[1]} | "
              f"{100 * error:+.0f} % | {row['step_time_s']:.2f} / {p.step_time_s:.2f} | {ours / theirs:.2f} | "
              f"{', '.join(work.not_counted) or '-'} |")
        table.append({"row": key, "gpu": row["gpu"], "role": role, "published": row["tflops_per_gpu"],
                      "predicted": predicted, "error": error, "published_step_s": row["step_time_s"],
                      "predicted_step_s": p.step_time_s, "flops_ratio": ours / theirs,
                      "breakdown": p.breakdown(), "not_counted": work.not_counted})
    print()
    for role, values in errors.items():
        if values:
            within = sum(v <= 0.35 for v in values) / len(values)
            print(f"{role}: {len(values)} rows, median |error| {100 * statistics.median(values):.0f} %, "
                  f"{100 * within:.0f} % of rows within 35 %")
    for key, why in skipped.items():
        print(f"skipped {key}: {why}")
    if args.json:
        Path(args.json).write_text(json.dumps({"fitted": fitted, "rows": table, "skipped": skipped}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
