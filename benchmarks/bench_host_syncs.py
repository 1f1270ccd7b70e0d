"""Host syncs per optimizer step of the CPU twins' training, counted by ``lightning_moe.debug.host_syncs``.

    python benchmarks/bench_host_syncs.py [--steps 22] [--log-every 10] [--sites 8] [CONFIG ...]

Each recipe (default: the dense twin, the MoE twin and the packed SFT quickstart) is trained through the
command line with ``log_every_n_steps`` set, under a :class:`HostSyncCounter`; printed: the steady-state syncs per
optimizer step (after two warmup steps) and the places most of them come from.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from lightning_moe.cli import main as cli_main

CONFIGS = ("configs/tiny/dense_cp_benchmark.yaml", "configs/tiny/moe_benchmark.yaml", "configs/quickstart.yaml")


def measure(config: str, steps: int, log_every: int, root: Path) -> dict:
    report = root / f"{Path(config).stem}.json"
    cli_main(["fit", "--config", config, f"--trainer.max_steps={steps}", f"--trainer.log_every_n_steps={log_every}",
              f"--trainer.default_root_dir={root / Path(config).stem}", "--trainer.enable_checkpointing=false",
              "--trainer.callbacks+=lightning_moe.debug.host_syncs.HostSyncCounter",
              f"--trainer.callbacks.report={report}"])
    return json.loads(report.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("configs", nargs="*", default=list(CONFIGS))
    parser.add_argument("--steps", type=int, default=22)
    parser.add_argument("--log-every", type=int, default=10)
    parser.add_argument("--sites", type=int, default=8, help="sync sites printed per recipe")
    args = parser.parse_args()
    results = {}
    with tempfile.TemporaryDirectory() as root:
        for config in args.configs:
            results[config] = measure(config, args.steps, args.log_every, Path(root))
    for config, result in results.items():
        print(f"{config}: {result['steady_state']:.2f} host syncs per optimizer step "
              f"(steps {result['warmup_steps'] + 1}-{len(result['per_step'])}, log_every_n_steps {args.log_every})")
        steady = len(result["per_step"]) - result["warmup_steps"]
        for site, count in list(result["sites"].items())[:args.sites]:
            print(f"  {count / steady:6.2f}/step  {site}")


if __name__ == "__main__":
    main()
