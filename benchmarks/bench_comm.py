"""Collective bytes of one optimizer step of the MoE twin (``configs/tiny/moe_benchmark.yaml``) on 4 CPU processes,
counted by ``lightning_moe.debug.comm_bytes`` (every collective and point-to-point transfer of each rank, by kind and
mesh dimension), for the layouts tp2 x ep2 and pp2 x fsdp2, with the analytic count of ``parallel/comm.py`` (the run
card's row) where it covers the layout.

    python benchmarks/bench_comm.py [--step 3]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

CONFIG = "configs/tiny/moe_benchmark.yaml"
LAYOUTS = {
    "tp2 x ep2": ["--trainer.strategy.init_args.tp=2", "--trainer.strategy.init_args.ep=2"],
    # 2 micro-batches per step for the 2 pipeline stages
    "pp2 x fsdp2": ["--trainer.strategy.init_args.pp=2", "--data.init_args.global_batch_size=8"],
}


def measure(name: str, overrides: list[str], step: int, root: Path) -> dict[int, dict]:
    folder = root / name.replace(" ", "")
    report = folder / "comm_{rank}.json"
    subprocess.run([sys.executable, "-m", "lightning_moe.cli", "fit", "--config", CONFIG, "--trainer.devices=4",
                    f"--trainer.max_steps={step}", "--trainer.log_every_n_steps=10",
                    f"--trainer.default_root_dir={folder}", "--trainer.enable_checkpointing=false",
                    "--trainer.callbacks+=lightning_moe.debug.comm_bytes.CommBytesCounter",
                    f"--trainer.callbacks.report={report}", f"--trainer.callbacks.step={step}", *overrides],
                   check=True, stdout=subprocess.DEVNULL)
    return {rank: json.loads((folder / f"comm_{rank}.json").read_text()) for rank in range(4)}


def analytic(name: str, root: Path) -> dict:
    """Rank 0's analytic count, from the run card of the layout's run."""
    card = next((root / name.replace(" ", "")).rglob("run_card.json"))
    return json.loads(card.read_text()).get("comm_bytes_per_step") or {}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--step", type=int, default=3, help="the optimizer step counted (after warmup)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as root:
        for name, overrides in LAYOUTS.items():
            ranks = measure(name, overrides, args.step, Path(root))
            print(f"\n{name}: bytes per optimizer step (calls) by rank")
            rows = sorted({key for table in ranks.values() for key in table})
            print(f"  {'collective':<40}" + "".join(f"{'rank ' + str(r):>22}" for r in ranks))
            for row in rows:
                cells = [ranks[r].get(row) for r in ranks]
                print(f"  {row:<40}" + "".join(f"{f'{c[1]:,} ({c[0]})' if c else '-':>22}" for c in cells))
            print(f"{name}: analytic bytes per optimizer step, rank 0 (parallel/comm.py)")
            for row, size in analytic(name, Path(root)).items():
                print(f"  {row:<40}{size if isinstance(size, str) else f'{size:,}':>22}")


if __name__ == "__main__":
    main()
