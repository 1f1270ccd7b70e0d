"""``lightning-moe slurm``: render the sbatch script that runs a recipe on a Slurm cluster, and submit it on request.

    lightning-moe slurm --config RECIPE.yaml [--nodes N] [--gpus-per-node G] [--time HH:MM:SS]
                        [--partition P] [--account A] [--container-image IMAGE [--container-mounts SRC:DST,...]]
                        [--venv DIR] [--dry-run | --submit] [-- FIT ARGUMENTS ...]

Nodes and GPUs per node default to the recipe's ``trainer.num_nodes`` and ``trainer.devices``; the recipe's
parallel sizes are checked against their product before anything is written. The job runs in the directory the
script was rendered in (``#SBATCH --chdir``), so the recipe's relative paths (``data/...``) mean what they mean
here, wherever the script is submitted from; the recipe and the run directory are written as absolute paths. Without ``--dry-run`` the script
is written to ``RUN_DIR/sbatch.sh`` (``RUN_DIR``: ``--run-dir`` or the recipe's ``trainer.default_root_dir``);
only ``--submit`` hands it to ``sbatch``. Arguments after ``--`` are passed on to ``lightning-moe fit``.
"""

from __future__ import annotations

import argparse
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

from lightning_moe.parallel.dims import MESH_SIZE_NAMES, ParallelDims

# the assets folder next to the package (sbatch templates)
TEMPLATE = Path(__file__).resolve().parents[1] / "slurm" / "sbatch.sh.template"
PLACEHOLDER = re.compile(r"{{(\w+)}}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lightning-moe slurm", description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", required=True, help="recipe YAML (what `lightning-moe fit --config` takes)")
    parser.add_argument("--nodes", type=int, help="nodes (default: the recipe's trainer.num_nodes)")
    parser.add_argument("--gpus-per-node", type=int, help="GPUs and tasks per node (default: trainer.devices)")
    parser.add_argument("--time", default="04:00:00", help="wall-clock limit, HH:MM:SS (default: %(default)s)")
    parser.add_argument("--partition", help="Slurm partition (default: the cluster's)")
    parser.add_argument("--account", help="Slurm account to charge")
    parser.add_argument("--cpus-per-task", type=int, default=16, help="CPU cores per GPU task (default: %(default)s)")
    parser.add_argument("--job-name", help="job name (default: the recipe's file name)")
    parser.add_argument("--run-dir", help="run directory: checkpoints, logs, run card (default: trainer.default_root_dir)")
    parser.add_argument("--container-image", help="run inside this container image (pyxis/enroot srun --container-image)")
    parser.add_argument("--container-mounts", help="container mounts, SRC:DST[,SRC:DST...] (with --container-image)")
    parser.add_argument("--venv", help="Python virtual environment to activate on every node (instead of a container)")
    parser.add_argument("--template", default=str(TEMPLATE), help="sbatch template (default: slurm/sbatch.sh.template)")
    action = parser.add_mutually_exclusive_group()
    action.add_argument("--dry-run", action="store_true", help="print the script; write and submit nothing")
    action.add_argument("--submit", action="store_true", help="write the script and submit it with sbatch")
    return parser


def read_recipe(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise FileNotFoundError(f"--config {path}: no such recipe")
    recipe = yaml.safe_load(path.read_text()) or {}
    if not isinstance(recipe, dict):
        raise ValueError(f"--config {path}: not a recipe (a YAML mapping with trainer/model/data)")
    return recipe


def check_parallel_sizes(trainer: dict[str, Any], world_size: int) -> None:
    """The recipe's ParallelStrategy sizes must multiply out to the GPUs asked for (raises ValueError)."""
    strategy = trainer.get("strategy")
    if not isinstance(strategy, dict) or not str(strategy.get("class_path", "")).endswith("ParallelStrategy"):
        return

    args = strategy.get("init_args") or {}
    ParallelDims(**{name: args[name] for name in MESH_SIZE_NAMES if name in args}, world_size=world_size)


def render(template: str, values: dict[str, str]) -> str:
    def substitute(match: re.Match) -> str:
        if match.group(1) not in values:
            raise KeyError(f"sbatch template: unknown placeholder {match.group(0)}")
        return values[match.group(1)]

    return PLACEHOLDER.sub(substitute, template)


def run_directory(args: argparse.Namespace, recipe: dict[str, Any]) -> Path:
    trainer = recipe.get("trainer") or {}
    return Path(args.run_dir or trainer.get("default_root_dir") or f"runs/{Path(args.config).stem}").absolute()


def script_values(args: argparse.Namespace, recipe: dict[str, Any], fit_args: list[str]) -> dict[str, str]:
    config = Path(args.config).absolute()
    run_dir = str(run_directory(args, recipe))
    directives = [f"#SBATCH --{key}={value}" for key, value in
                  (("partition", args.partition), ("account", args.account)) if value]
    container = ""
    if args.container_image:
        container = f" --container-image={shlex.quote(args.container_image)} --container-workdir=\"$PWD\""
        if args.container_mounts:
            container += f" --container-mounts={shlex.quote(args.container_mounts)}"
    elif args.container_mounts:
        raise ValueError("--container-mounts needs --container-image")
    environment = f"source {shlex.quote(str(Path(args.venv) / 'bin' / 'activate'))}" if args.venv else \
        "# the environment: the container image, or the submitting shell's (sbatch exports it)"
    return {
        "job_name": args.job_name or config.stem,
        "submit_dir": str(Path.cwd()),  # an #SBATCH directive: sbatch reads it unquoted
        "submit_dir_quoted": shlex.quote(str(Path.cwd())),
        "config": shlex.quote(str(config)),
        "nodes": str(args.nodes),
        "gpus_per_node": str(args.gpus_per_node),
        "cpus_per_task": str(args.cpus_per_task),
        "time": args.time,
        "log_dir": str(Path(run_dir) / "logs"),
        "optional_directives": "\n".join(directives),
        "environment": environment,
        "run_dir": shlex.quote(run_dir),
        "container_options": container,
        "fit_args": "".join(f" {shlex.quote(a)}" for a in fit_args),
    }


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    fit_args = argv[argv.index("--") + 1:] if "--" in argv else []
    own_args = argv[: argv.index("--")] if "--" in argv else argv
    args = build_parser().parse_args(own_args)
    try:
        recipe = read_recipe(Path(args.config))
        trainer = recipe.get("trainer") or {}
        args.nodes = args.nodes or int(trainer.get("num_nodes") or 1)
        args.gpus_per_node = args.gpus_per_node or int(trainer.get("devices") or 1)
        if args.nodes < 1 or args.gpus_per_node < 1:
            raise ValueError(f"--nodes {args.nodes} and --gpus-per-node {args.gpus_per_node} must be positive")
        check_parallel_sizes(trainer, args.nodes * args.gpus_per_node)
        if args.venv and args.container_image:
            print(f"lightning-moe slurm: warning: --venv {args.venv} and --container-image {args.container_image} "
                  f"both given: the venv is activated outside the container, and its PATH (carried into the "
                  f"container) may run a Python the image does not have; give one of them", file=sys.stderr)
        values = script_values(args, recipe, fit_args)
        template = Path(args.template)
        if not template.is_file():
            raise FileNotFoundError(f"sbatch template {template} not found (the repository's slurm/ folder holds it); "
                                    f"pass --template PATH")
        script = render(template.read_text(), values)
    except (OSError, ValueError, KeyError) as err:
        print(f"lightning-moe slurm: {err}", file=sys.stderr)
        return 2
    if args.dry_run:
        print(script, end="")
        return 0
    run_dir = run_directory(args, recipe)
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)  # sbatch does not create the log folder
    path = run_dir / "sbatch.sh"
    path.write_text(script)
    path.chmod(0o755)
    if not args.submit:
        print(f"wrote {path}; submit it with: sbatch {path}")
        return 0
    if shutil.which("sbatch") is None:
        print(f"lightning-moe slurm: sbatch not found on PATH; the script is at {path}", file=sys.stderr)
        return 2
    return subprocess.run(["sbatch", str(path)]).returncode
