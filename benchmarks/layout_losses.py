"""Per-step losses of the layout tests' configurations, trained through ``lightning-moe fit`` on CPU gloo ranks, so
that two checkouts of the package can be compared bitwise on the same seed (a refactoring must leave them equal).

Layouts: FSDP, TP x EP, PP x TP x EP, CP and TP of the native decoder (MoE, MLA + MoE and Nemotron-H twins), EP,
CP and PP of the generic transformers path (a tiny OLMoE, which has no native family), FSDP of the diffusers path
(a tiny Qwen-Image pipeline). The generic and diffusion checkpoints are written once into ``--work`` by this
checkout's test helpers and reused by every run, so both checkouts train the same weights.

    python benchmarks/layout_losses.py --work DIR --out new.json                  # the package of this checkout
    python benchmarks/layout_losses.py --work DIR --package OTHER --out old.json  # another checkout's package
    python benchmarks/layout_losses.py --compare old.json new.json                # exit 1 unless bitwise equal
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "tiny"
STEPS = 3
STRATEGY = "--trainer.strategy.init_args."

# the generic path's twin names no strategy: the package's, trained as the transformers model itself
GENERIC = ["--trainer.strategy=lightning_moe.ParallelStrategy", "--model.init_args.model.hf={hf}",
           "--model.init_args.model.native=never"]
# name -> (recipe, processes, strategy sizes, extra overrides); "{hf}" / "{pipeline}": the fixtures' paths
LAYOUTS = {
    "fsdp": ("moe_benchmark.yaml", 2, {"dp_shard": 2}, []),
    "tp x ep": ("moe_benchmark.yaml", 2, {"tp": 2, "ep": 2}, []),
    "pp x tp x ep": ("moe_benchmark.yaml", 4, {"pp": 2, "tp": 2, "ep": 2}, []),
    "cp": ("dense_cp_benchmark.yaml", 2, {"cp": 2}, []),
    "tp mla + moe": ("mla_moe_benchmark.yaml", 2, {"tp": 2}, []),
    "tp nemotron-h": ("nemotron_h_benchmark.yaml", 2, {"tp": 2}, []),
    "generic ep": ("hf_causal_lm.yaml", 2, {"ep": 2}, GENERIC),
    "generic cp": ("hf_causal_lm.yaml", 2, {"cp": 2}, GENERIC),
    "generic pp": ("hf_causal_lm.yaml", 2, {"pp": 2}, [*GENERIC, "--data.init_args.global_batch_size=4"]),
    "diffusion fsdp": ("qwen_image_naruto.yaml", 2, {"dp_shard": 2}, ["--model.init_args.model.path={pipeline}"]),
}


def fixtures(work: Path) -> dict[str, str]:
    """The generic path's OLMoE and the diffusion pipeline, written once with the tests' helpers."""
    for folder in ("tests", "tests/hf_path", "tests/diffusion"):
        sys.path.insert(0, str(ROOT / folder))
    from tiny_hf_models import olmoe_config, save_tiny
    from tiny_qwen_image import save_tiny_qwen_image

    hf, pipeline = work / "olmoe", work / "qwen_image"
    if not hf.exists():
        save_tiny(olmoe_config(), hf)
    if not pipeline.exists():
        save_tiny_qwen_image(pipeline)
    return {"hf": str(hf), "pipeline": str(pipeline)}


def fit(package: Path, work: Path, name: str, paths: dict[str, str]) -> list[float]:
    recipe, processes, sizes, extra = LAYOUTS[name]
    root = work / "runs" / package.name / name.replace(" ", "_")
    command = [str(Path(sys.executable).parent / "lightning-moe"), "fit", "--config", str(TINY / recipe),
               f"--trainer.max_steps={STEPS}", "--trainer.enable_progress_bar=false",
               f"--trainer.devices={processes}", f"--trainer.default_root_dir={root}",
               *(item.format(**paths) for item in extra),
               *(f"{STRATEGY}{key}={value}" for key, value in sizes.items())]
    if recipe == "qwen_image_naruto.yaml":
        command.append(f"--model.init_args.export_dir={root / 'transformer'}")
    env = {**os.environ, "PYTHONPATH": str(package), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"{name}: fit failed\n{result.stdout[-2000:]}\n{result.stderr[-4000:]}")
    cards = sorted(root.rglob("run_card.json"), key=lambda p: p.stat().st_mtime)
    return json.loads(cards[-1].read_text())["series"]["loss"]


def compare(old: dict[str, list[float]], new: dict[str, list[float]]) -> bool:
    equal = True
    for name in sorted(set(old) | set(new)):
        a, b = old.get(name), new.get(name)
        same = a == b
        equal &= same
        print(f"{name:16s} {'bitwise equal' if same else 'DIFFERENT'}: {a} | {b}")
    return equal


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", type=Path, help="folder for the fixtures and the runs")
    parser.add_argument("--package", type=Path, default=ROOT, help="checkout whose lightning_moe trains")
    parser.add_argument("--out", type=Path, help="where the losses go (JSON)")
    parser.add_argument("--only", nargs="*", choices=sorted(LAYOUTS),
                        help="a subset of the layouts (their losses are added to those --out holds)")
    parser.add_argument("--compare", nargs=2, type=Path, metavar=("OLD", "NEW"))
    args = parser.parse_args(argv)
    if args.compare:
        old, new = (json.loads(path.read_text()) for path in args.compare)
        return 0 if compare(old, new) else 1
    if args.work is None or args.out is None:
        parser.error("--work and --out are needed to train")
    args.work.mkdir(parents=True, exist_ok=True)
    paths = fixtures(args.work)
    losses = json.loads(args.out.read_text()) if args.only and args.out.exists() else {}
    for name in args.only or LAYOUTS:
        start = time.perf_counter()
        losses[name] = fit(args.package.resolve(), args.work, name, paths)
        print(f"{name:16s} {losses[name]} ({time.perf_counter() - start:.0f} s)", flush=True)
        args.out.write_text(json.dumps(losses, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
