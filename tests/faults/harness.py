"""Real ``lightning-moe fit`` processes for the fault tests: start, wait on marker files, signal, kill, read back.

Every run is the tiny MoE benchmark twin (``configs/tiny/moe_benchmark.yaml``: one process, so a strategy that
applies no FSDP) with checkpointing on, shrunk to 32-token rows and 2 micro-batches per optimizer step, so a
signal can land inside an accumulation window; in fp32.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch
import yaml
from distributed_harness import HANG_GUARD_S  # every wait ends on a file or an exit: this stops only a hang

REPO = Path(__file__).resolve().parents[2]
RECIPE = REPO / "configs" / "tiny" / "moe_benchmark.yaml"
MAX_STEPS = 8
EXECUTABLE = Path(sys.executable).parent / "lightning-moe"
SLURM_JOB = "4242"
# the environment before any in-process run: Lightning sets MASTER_PORT, ranks and seeds in os.environ
BASE_ENV = dict(os.environ)


def overlay(run: Path, name: str, pause: dict | list[dict] | None = None, distributed: bool = True) -> Path:
    """The run's settings on top of the recipe, in ``run/<name>.yaml``."""
    callbacks = [
        {"class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
         "init_args": {"dirpath": str(run / "checkpoints"), "every_n_train_steps": 2, "save_last": True,
                       "save_top_k": -1}},
        {"class_path": "fault_hooks.LossLog", "init_args": {"path": str(run / f"{name}.losses")}},
    ]
    for i, point in enumerate([pause] if isinstance(pause, dict) else pause or []):
        callbacks.append({"class_path": "fault_hooks.PauseAt",
                          "init_args": {"marker": str(run / f"{name}.paused{i}"), **point}})
    config = {
        # fp32: the two-rank case compares with one process (bf16 weights would round the layouts apart)
        "trainer": {"max_steps": MAX_STEPS, "precision": "32-true", "enable_checkpointing": True,
                    "enable_progress_bar": False,
                    "enable_model_summary": False, "logger": False, "default_root_dir": str(run),
                    "callbacks": callbacks,
                    "strategy": {"class_path": "lightning_moe.ParallelStrategy",
                                 "init_args": {"dp_shard": -1, "activation_checkpointing": "full",
                                               "save_distributed_checkpoint": distributed}}},
        "data": {"init_args": {"seq_length": 32, "micro_batch_size": 1, "global_batch_size": 2}},
    }
    path = run / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def child_env(run: Path, slurm: bool = False) -> dict[str, str]:
    env = {**BASE_ENV, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), BASE_ENV.get("PYTHONPATH", "")]),
           "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    if slurm:
        bin_dir = run / "bin"
        bin_dir.mkdir(exist_ok=True)
        # the stand-ins: scontrol records its arguments, srun runs its command (after srun's own options)
        (bin_dir / "scontrol").write_text(f'#!/bin/bash\necho "$@" >> {run / "scontrol.args"}\n')
        (bin_dir / "srun").write_text('#!/bin/bash\nwhile [[ "$1" == --* ]]; do shift; done\nexec "$@"\n')
        for tool in ("scontrol", "srun"):
            (bin_dir / tool).chmod(0o755)
        env.update(PATH=f"{bin_dir}{os.pathsep}{EXECUTABLE.parent}{os.pathsep}{env['PATH']}",
                   SLURM_JOB_ID=SLURM_JOB, SLURM_JOB_NAME="faults", SLURM_NTASKS="1", SLURM_NTASKS_PER_NODE="1",
                   SLURM_PROCID="0", SLURM_LOCALID="0", SLURM_NODEID="0", SLURM_NODELIST="localhost",
                   SLURM_CPUS_PER_TASK="1")
    return env


class Run:
    """One training process, its output in ``run/<name>.log``."""

    def __init__(self, run: Path, name: str, command: list[str], env: dict[str, str]) -> None:
        self.run, self.name = run, name
        self.log = run / f"{name}.log"
        with open(self.log, "w") as out:
            self.process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=REPO)

    @classmethod
    def fit(cls, run: Path, name: str, *args: str, pause: dict | list[dict] | None = None, distributed: bool = True,
            slurm: bool = False) -> Run:
        config = overlay(run, name, pause, distributed)
        command = [str(EXECUTABLE), "fit", "--config", str(RECIPE), "--config", str(config), *args]
        return cls(run, name, command, child_env(run, slurm))

    @classmethod
    def sbatch(cls, run: Path, name: str, pause: dict | list[dict] | None = None, distributed: bool = True) -> Run:
        """The job script ``lightning-moe slurm`` renders, as a requeued job runs it (stand-in srun)."""
        from lightning_moe.slurm import main as slurm_main

        config = overlay(run, name, pause, distributed)
        assert slurm_main(["--config", str(RECIPE), "--run-dir", str(run), "--", "--config", str(config)]) == 0
        return cls(run, name, ["bash", str(run / "sbatch.sh")], child_env(run, slurm=True))

    def output(self) -> str:
        return self.log.read_text()

    def wait_for(self, predicate, what: str) -> None:
        deadline = time.monotonic() + HANG_GUARD_S
        while not predicate():
            if self.process.poll() is not None:
                raise AssertionError(f"{self.name} exited ({self.process.returncode}) before {what}:\n"
                                     f"{self.output()[-4000:]}")
            if time.monotonic() > deadline:
                self.process.kill()
                raise AssertionError(f"{self.name}: no {what} after {HANG_GUARD_S} s:\n{self.output()[-4000:]}")
            time.sleep(0.05)

    def paused_pid(self, index: int = 0) -> int:
        """The process id written by pause number ``index`` once it is reached."""
        marker = self.run / f"{self.name}.paused{index}"
        self.wait_for(marker.exists, "pause")
        self.wait_for(lambda: marker.read_text().strip() != "", "pause pid")
        return int(marker.read_text())

    def signal_paused(self, signum: int, release: str) -> None:
        """Signal the paused process, wait until its handler has run, then let it go on."""
        os.kill(self.paused_pid(), signum)
        name = signal.Signals(signum).name
        self.wait_for(lambda: f"received {name}" in self.output(), f"the {name} handler")
        (self.run / release).write_text("")

    def kill_paused(self, index: int = 0) -> None:
        os.kill(self.paused_pid(index), signal.SIGKILL)
        self.process.wait(HANG_GUARD_S)

    def finish(self) -> int:
        return self.process.wait(HANG_GUARD_S)

    def losses(self) -> dict[int, float]:
        path = self.run / f"{self.name}.losses"
        lines = path.read_text().split("\n") if path.exists() else []
        return {int(step): float(loss) for step, loss in (line.split() for line in lines if line)}

    def card(self) -> dict:
        return json.loads((self.run / "run_card.json").read_text())


def trainer_state(checkpoint: Path) -> dict:
    """Lightning's trainer state of a checkpoint (DCP directory or single file)."""
    path = checkpoint / "meta.pt" if checkpoint.is_dir() else checkpoint
    return torch.load(path, map_location="cpu", weights_only=False)


def saved_position(checkpoint: Path) -> tuple[int, int]:
    """(optimizer steps, samples consumed) a checkpoint resumes from."""
    state = trainer_state(checkpoint)
    data = next(v for k, v in state.items() if k.endswith("DataModule"))
    return state["global_step"], data["consumed_samples"]
