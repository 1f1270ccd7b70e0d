"""``lightning-moe slurm``: rendered scripts pass ``bash -n`` and launch one ``lightning-moe fit`` task per GPU with
Lightning's SLURM settings; only ``--submit`` calls sbatch; a requeued job resumes; bad sizes fail before writing."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from recipe_files import CONFIGS

from lightning_moe.cli import main

RECIPE = str(CONFIGS / "qwen3_moe" / "qwen3_moe_30b_benchmark.yaml")  # 1 node x 8 GPUs, EP 8


def render(capsys, *args: str) -> str:
    assert main(["slurm", "--config", RECIPE, "--dry-run", *args]) == 0
    return capsys.readouterr().out


@pytest.mark.parametrize("nodes", [1, 4])
def test_rendered_script_is_valid_bash_with_one_task_per_gpu(capsys, tmp_path, nodes):
    script = render(capsys, "--nodes", str(nodes), "--partition", "batch", "--account", "proj", "--time", "01:30:00",
                    "--", "--trainer.max_steps", "40")
    (tmp_path / "job.sh").write_text(script)
    subprocess.run(["bash", "-n", str(tmp_path / "job.sh")], check=True)
    for line in (f"#SBATCH --nodes={nodes}", "#SBATCH --ntasks-per-node=8", "#SBATCH --gpus-per-node=8",
                 "#SBATCH --signal=SIGUSR1@90", "#SBATCH --requeue", "#SBATCH --time=01:30:00",
                 "#SBATCH --partition=batch", "#SBATCH --account=proj",
                 f"#SBATCH --output={Path.cwd()}/runs/qwen3_moe_30b_benchmark/logs/%x-%j.out", f"#SBATCH --chdir={Path.cwd()}",
                 "export TORCH_NCCL_ASYNC_ERROR_HANDLING=1", 'export MASTER_PORT="${MASTER_PORT:-'):
        assert line in script
    assert "srun --kill-on-bad-exit=1" in script
    assert f"lightning-moe fit --config {RECIPE}" in script
    assert f"--trainer.num_nodes {nodes} --trainer.devices 8" in script
    assert script.rstrip().endswith("--trainer.max_steps 40")
    assert "SLURM_NTASKS" in script and "SLURM_PROCID" in script  # how SLURMEnvironment finds the layout


def test_environment_is_a_container_or_a_venv(capsys):
    script = render(capsys, "--container-image", "nvcr.io/nvidia/pytorch:25.11-py3", "--container-mounts", "/data:/data")
    assert "srun --kill-on-bad-exit=1 --container-image=nvcr.io/nvidia/pytorch:25.11-py3" in script
    assert "--container-mounts=/data:/data" in script
    assert "source /opt/venv/bin/activate" in render(capsys, "--venv", "/opt/venv")
    assert main(["slurm", "--config", RECIPE, "--dry-run", "--venv", "/opt/venv", "--container-image", "img:1"]) == 0
    assert "--venv /opt/venv and --container-image img:1 both given" in capsys.readouterr().err


def test_the_job_runs_where_the_script_was_rendered_with_absolute_paths(capsys, tmp_path, monkeypatch):
    """Submitted from anywhere (sbatch's working directory is the submitting shell's), the recipe's relative paths
    mean what they meant where the script was made."""
    monkeypatch.chdir(tmp_path)
    assert main(["slurm", "--config", RECIPE, "--run-dir", "runs/here", "--dry-run"]) == 0
    script = capsys.readouterr().out
    assert f"#SBATCH --chdir={tmp_path}" in script and f"\ncd {tmp_path}\n" in script
    assert f"RUN_DIR={tmp_path / 'runs' / 'here'}" in script
    assert f"#SBATCH --output={tmp_path / 'runs' / 'here' / 'logs'}/%x-%j.out" in script


def fake_commands(directory: Path, *names: str) -> dict[str, str]:
    """Executables that record their arguments in ``<name>.args`` (and print something sbatch-like)."""
    directory.mkdir(exist_ok=True)
    for name in names:
        path = directory / name
        path.write_text(f'#!/bin/bash\necho "$@" > {directory / name}.args\necho "Submitted batch job 42"\n')
        path.chmod(0o755)
    return {**os.environ, "PATH": f"{directory}:{os.environ['PATH']}"}


def test_only_submit_calls_sbatch(tmp_path, capfd, monkeypatch):
    monkeypatch.setenv("PATH", fake_commands(tmp_path / "bin", "sbatch")["PATH"])
    run_dir = tmp_path / "run"
    assert main(["slurm", "--config", RECIPE, "--run-dir", str(run_dir)]) == 0
    assert (run_dir / "sbatch.sh").is_file() and (run_dir / "logs").is_dir()
    assert not (tmp_path / "bin" / "sbatch.args").exists()
    assert main(["slurm", "--config", RECIPE, "--run-dir", str(run_dir), "--submit"]) == 0
    assert (tmp_path / "bin" / "sbatch.args").read_text().split() == [str(run_dir / "sbatch.sh")]
    assert "Submitted batch job" in capfd.readouterr().out


def run_script(tmp_path: Path, run_dir: Path) -> list[str]:
    """Run the rendered script with a fake srun; returns the srun arguments."""
    env = fake_commands(tmp_path / "bin", "srun")
    env.update(SLURM_JOB_ID="1234", SLURM_CPUS_PER_TASK="16")
    script = run_dir / "sbatch.sh"
    subprocess.run(["bash", str(script)], check=True, env=env, cwd=tmp_path)
    return (tmp_path / "bin" / "srun.args").read_text().split()


def test_script_resumes_from_the_newest_hpc_or_last_checkpoint(tmp_path):
    run_dir = tmp_path / "run"
    assert main(["slurm", "--config", RECIPE, "--run-dir", str(run_dir)]) == 0
    args = run_script(tmp_path, run_dir)
    assert args[:4] == ["--kill-on-bad-exit=1", "lightning-moe", "fit", "--config"]
    assert "--ckpt_path" not in args  # a first run starts fresh

    def resumed_from() -> str:
        args = run_script(tmp_path, run_dir)
        return args[args.index("--ckpt_path") + 1]

    last = run_dir / "lightning_logs" / "version_0" / "checkpoints" / "last.ckpt"
    last.mkdir(parents=True)  # distributed checkpoints are directories
    os.utime(last, (1000, 1000))
    assert resumed_from() == str(last)
    hpc = run_dir / "hpc_ckpt_1.ckpt"  # written on SIGUSR1 or SIGTERM by the Preemption callback
    hpc.mkdir()
    os.utime(hpc, (2000, 2000))
    assert resumed_from() == str(hpc)
    os.utime(last, (3000, 3000))  # a periodic save after resuming from the hpc checkpoint: newer, so it wins
    assert resumed_from() == str(last)
    unfinished = last.parent / ".partial" / "last.ckpt"  # a save that was killed is never resumed from
    unfinished.mkdir(parents=True)
    os.utime(unfinished, (4000, 4000))
    assert resumed_from() == str(last)


def test_sizes_that_do_not_fit_the_gpus_fail_before_writing(tmp_path, capsys):
    assert main(["slurm", "--config", RECIPE, "--gpus-per-node", "3", "--run-dir", str(tmp_path / "run")]) == 2
    assert "ep=8 does not divide" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()
    assert main(["slurm", "--config", str(tmp_path / "missing.yaml")]) == 2
    assert "no such recipe" in capsys.readouterr().err
    assert main(["slurm", "--config", RECIPE, "--template", str(tmp_path / "none.sh"), "--dry-run"]) == 2
    assert "pass --template PATH" in capsys.readouterr().err
    assert main(["slurm", "--config", RECIPE, "--container-mounts", "/a:/a", "--dry-run"]) == 2
    assert "--container-mounts needs --container-image" in capsys.readouterr().err


def test_every_recipe_renders_for_its_own_gpus(capsys):
    from recipe_files import full_recipes

    for recipe in full_recipes():
        assert main(["slurm", "--config", str(CONFIGS / recipe), "--dry-run"]) == 0, recipe
    capsys.readouterr()
