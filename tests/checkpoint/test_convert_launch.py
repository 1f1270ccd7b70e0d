"""How ``convert`` finds its ranks (torchrun's variables, Slurm's and LSF's through Lightning's cluster
environments), and the one-line errors of distributed options given to one process."""

from __future__ import annotations

import pytest

from lightning_moe import convert_command as commands
from lightning_moe.checkpoint.distributed_convert import ConversionLayout, launched_ranks

LAUNCH_VARIABLES = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "GROUP_RANK", "LOCAL_WORLD_SIZE", "TORCHELASTIC_RUN_ID",
                    "SLURM_NTASKS", "SLURM_NTASKS_PER_NODE", "SLURM_PROCID", "SLURM_LOCALID", "SLURM_NODELIST", "SLURM_JOB_ID",
                    "SLURM_JOB_NAME", "LSB_JOBID")


@pytest.fixture
def no_launcher(monkeypatch):
    for name in LAUNCH_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_ranks_of_one_process_torchrun_and_slurm(no_launcher):
    assert launched_ranks() == (1, 0, 0)
    no_launcher.setenv("WORLD_SIZE", "8")
    no_launcher.setenv("RANK", "5")
    no_launcher.setenv("LOCAL_RANK", "1")
    assert launched_ranks() == (8, 5, 1)
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        no_launcher.delenv(name)
    for name, value in {"SLURM_NTASKS": "16", "SLURM_NTASKS_PER_NODE": "8", "SLURM_PROCID": "9", "SLURM_LOCALID": "1", "SLURM_NODELIST": "gpu-[3-4]",
                        "SLURM_JOB_ID": "4242", "SLURM_JOB_NAME": "convert"}.items():
        no_launcher.setenv(name, value)
    assert launched_ranks() == (16, 9, 1)


def test_layout_blocks_follow_the_expert_mesh():
    """EP 2 on 4 ranks: ranks 0 and 2 hold expert-parallel block 0 (FSDP halves 0 and 1), ranks 1 and 3 block 1."""
    rows = {rank: ConversionLayout(4, rank, ep=2).rows(32) for rank in range(4)}
    assert rows == {0: (0, 8), 2: (8, 16), 1: (16, 24), 3: (24, 32)}
    assert ConversionLayout(4, 3, ep=4).rows(6) == (6, 6)  # torch.chunk's split: 2, 2, 2 and an empty block
    with pytest.raises(ValueError, match="--ep 3 on 4 ranks"):
        ConversionLayout(4, 0, ep=3)


@pytest.mark.parametrize(("argv", "message"), [
    (["import", "--hf-path", "{hub}", "--out", "{out}", "--ep", "2"], "--ep 2 converts on several ranks"),
    (["export", "--ckpt", "{hub}", "--out", "{out}", "--distributed-save"], "--distributed-save converts on several"),
    (["import", "--hf-path", "{hub}", "--hf-revision", "abc", "--out", "{out}"], "--hf-revision abc applies to a hub"),
    (["import", "--hf-path", "./no/such/dir", "--out", "{out}"], "--hf-path: directory './no/such/dir' does not exist"),
    (["import", "--hf-path", "org/not-downloaded", "--hf-revision", "abc", "--out", "{out}"],
     "--hf-path='org/not-downloaded' is not a local directory and could not be fetched"),
])
def test_distributed_options_on_one_process_fail_in_one_line(no_launcher, tmp_path, capsys, argv, message):
    (tmp_path / "hub").mkdir()
    argv = [a.format(hub=tmp_path / "hub", out=tmp_path / "out") for a in argv]
    assert commands.main(argv) == 1
    assert message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
