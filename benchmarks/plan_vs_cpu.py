"""``lightning-moe plan --gpu cpu`` against measured step times of the CPU twins, one process on this machine.

Each twin (``configs/tiny/dense_cp_benchmark.yaml``, ``configs/tiny/moe_benchmark.yaml``) trains a few steps
through the package's own CLI (``lightning-moe fit``, one process, mock data), and its measured step time is the
median of the run card's per-step times after the first ``--skip`` steps (the Throughput callback's, from the
end of one optimizer step to the end of the next). The prediction is the planner's for the same recipe and
overrides on the ``cpu`` hardware row: the bf16 matmul peak and memory bandwidth measured on this machine.

Three predictions per twin:

- ``hopper``: the constants fitted on published H100 rows, to show whether GPU-fitted constants carry over;
- ``cpu``: the package's ``cpu`` constants (``plan/hardware.py``: ``gemm`` 1, ``gemm_knee`` fitted here once);
- ``fitted now``: ``gemm`` 1 and the ``gemm_knee`` that makes the dense twin's prediction equal its measured
  step time on this run. The dense twin is the calibration row; the MoE twin is held out (nothing is fitted on
  it), so its error is the model's.

    python benchmarks/plan_vs_cpu.py [--steps 12] [--skip 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TWINS = {
    "dense": ROOT / "configs" / "tiny" / "dense_cp_benchmark.yaml",
    "moe": ROOT / "configs" / "tiny" / "moe_benchmark.yaml",
}
CALIBRATION = "dense"
OVERRIDES = ["--trainer.devices", "1", "--trainer.strategy.init_args.dp_shard", "1"]


def measured_step_time(config: Path, steps: int, skip: int) -> float:
    """Median step time of a ``lightning-moe fit`` run of ``config`` (one process), from its run card."""
    with tempfile.TemporaryDirectory() as run_dir:
        cmd = [sys.executable, "-m", "lightning_moe.cli", "fit", "--config", str(config), *OVERRIDES,
               "--trainer.max_steps", str(steps), "--trainer.default_root_dir", run_dir]
        out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, check=False)
        if out.returncode != 0:
            raise RuntimeError(f"{config.name}: training failed:\n{out.stderr[-3000:]}")
        card = next(Path(run_dir).rglob("run_card.json"))
        times = json.loads(card.read_text())["series"]["step_time_s"]
    if len(times) <= skip:
        raise RuntimeError(f"{config.name}: {len(times)} steps timed, need more than --skip {skip}")
    return statistics.median(times[skip:])


def fit_knee(work, hw, target: float) -> float:
    """The ``gemm_knee`` (``gemm`` 1) whose prediction of ``work`` is ``target`` seconds (bisection on log scale;
    the prediction grows with the knee)."""
    from lightning_moe.plan.step_time import predict, with_constants

    def step(knee: float) -> float:
        return predict(work, with_constants(hw, gemm=1.0, gemm_knee=knee)).step_time_s

    low, high = 1e-3, 1e9
    if step(low) > target:
        return low
    for _ in range(200):
        middle = (low * high) ** 0.5
        low, high = (middle, high) if step(middle) < target else (low, middle)
    return (low * high) ** 0.5


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=12, help="training steps per twin")
    parser.add_argument("--skip", type=int, default=3, help="first steps left out of the median")
    args = parser.parse_args()

    from lightning_moe.estimate.recipe import load_recipe
    from lightning_moe.plan.hardware import FAMILIES, cpu_hardware
    from lightning_moe.plan.step_time import predict, with_constants, workload

    hw = cpu_hardware()
    print(f"{hw.name}: bf16 peak {hw.peak('bf16') / 1e9:.1f} GFLOP/s, memory bandwidth "
          f"{hw.hbm_bytes_per_s / 1e9:.1f} GB/s ({hw.source})")
    works = {name: workload(load_recipe(str(config), OVERRIDES), domain=hw.nvlink_domain)
             for name, config in TWINS.items()}
    measured = {name: measured_step_time(config, args.steps, args.skip) for name, config in TWINS.items()}
    knee = fit_knee(works[CALIBRATION], hw, measured[CALIBRATION])
    print(f"fitted now on {CALIBRATION}: gemm 1, gemm_knee {knee:.4g} "
          f"(the package's cpu constants: gemm {FAMILIES['cpu'].gemm:g}, gemm_knee {FAMILIES['cpu'].gemm_knee:g})\n")
    columns = {"hopper": with_constants(hw, **{k: getattr(FAMILIES["hopper"], k) for k in ("gemm", "gemm_knee")}),
               "cpu": hw, "fitted now": with_constants(hw, gemm=1.0, gemm_knee=knee)}
    print("| twin | role | measured (ms) | " + " | ".join(f"{c} (ms) | error" for c in columns) + " |")
    print("|---|---|---:|" + "---:|---:|" * len(columns))
    for name, work in works.items():
        role = "calibration" if name == CALIBRATION else "held out"
        cells = []
        for constants in columns.values():
            predicted = predict(work, constants).step_time_s
            cells.append(f"{1e3 * predicted:.2f} | {100 * (predicted / measured[name] - 1):+.1f} %")
        print(f"| {name} | {role} | {1e3 * measured[name]:.2f} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
