"""Preemption and kills, with real processes: every interrupted run resumes to the same per-step losses
(bitwise, CPU) as one uninterrupted run, and a kill during any save leaves the previous checkpoints usable.

One run directory carries a chain of six processes, each resuming what the one before left and ending with
another fault:

1. fresh start; SIGTERM inside step 2's accumulation window -> step 2 completes, hpc_ckpt_1 (step 2), exit 143;
2. as a Slurm job (no --ckpt_path: Lightning finds hpc_ckpt_1); SIGUSR1 while the periodic step-4 save is
   being written -> that save and ``last`` complete, then hpc_ckpt_2 (step 4), ``scontrol requeue``, exit 138;
3. the requeued job: the rendered sbatch script (stand-in srun) resumes the newest checkpoint, hpc_ckpt_2;
   kill -9 during the periodic step-6 DCP save, after its shards and before its index;
4. ``--ckpt_path hpc``, single-file checkpoints; kill -9 during the step-6 ``last`` save, once written and
   before it replaces the previous ``last`` (a DCP directory of step 4);
5. from the periodic single-file step-6 checkpoint; SIGTERM at the start of step 7 -> kill -9 during the
   preemption save, before it gets its name;
6. from ``last.ckpt``, the step-4 one every kill left in place, to the end: exit 0, card ``completed``.
"""

from __future__ import annotations

import signal

import pytest
from harness import MAX_STEPS, SLURM_JOB, Run, saved_position

from lightning_moe.io.training import check_complete

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict[int, float]:
    run = Run.fit(tmp_path_factory.mktemp("reference"), "reference")
    assert run.finish() == 0, run.output()[-4000:]
    losses = run.losses()
    assert sorted(losses) == list(range(1, MAX_STEPS + 1))
    assert run.card()["status"] == "completed"
    return losses


def same_losses(run: Run, reference: dict[int, float], steps: range) -> None:
    losses = run.losses()
    assert sorted(losses) == list(steps), (run.name, losses)
    assert {s: reference[s] for s in steps} == losses, run.name  # bitwise: floats compared exactly


def test_signals_and_kills_resume_to_the_uninterrupted_losses(tmp_path, reference):
    run_dir = tmp_path
    ckpts = run_dir / "checkpoints"

    # 1. SIGTERM mid-accumulation: the step in flight completes, then a full checkpoint, then a non-zero exit
    one = Run.fit(run_dir, "one", pause={"point": "batch", "step": 2, "micro": 1, "release": str(run_dir / "go1")})
    one.signal_paused(signal.SIGTERM, "go1")
    assert one.finish() == 128 + signal.SIGTERM, one.output()[-4000:]
    hpc1 = run_dir / "hpc_ckpt_1.ckpt"
    check_complete(hpc1)
    assert saved_position(hpc1) == (2, 4)  # steps and samples agree: 2 steps x 2 samples
    card = one.card()
    assert card["status"].startswith("preempted: SIGTERM at step 2") and card["steps"] == 2
    assert card["preemption"] == {"signal": "SIGTERM", "step": 2, "checkpoint": str(hpc1), "requeued": None}
    assert str(hpc1) in card["checkpoints"]
    same_losses(one, reference, range(1, 3))

    # 2. Slurm's SIGUSR1 during a periodic save: the save finishes, then the preemption save, then requeue
    two = Run.fit(run_dir, "two", slurm=True,
                  pause={"point": "save_publish", "name": "step=4", "release": str(run_dir / "go2")})
    two.signal_paused(signal.SIGUSR1, "go2")
    assert two.finish() == 128 + signal.SIGUSR1, two.output()[-4000:]
    assert f"Restoring states from the checkpoint path at {hpc1}" in two.output()
    for name, position in (("epoch=0-step=4.ckpt", (4, 8)), ("last.ckpt", (4, 8))):
        check_complete(ckpts / name)
        assert saved_position(ckpts / name) == position, name
    hpc2 = run_dir / "hpc_ckpt_2.ckpt"
    check_complete(hpc2)
    assert saved_position(hpc2) == (4, 8)
    assert (run_dir / "scontrol.args").read_text().split() == ["requeue", SLURM_JOB]
    assert two.card()["preemption"]["requeued"] == SLURM_JOB
    same_losses(two, reference, range(3, 5))

    # 3. the requeued job script resumes the newest checkpoint; kill -9 inside a periodic DCP save
    three = Run.sbatch(run_dir, "three", pause={"point": "save_payload", "name": "step=6"})
    three.kill_paused()
    assert f"Restoring states from the checkpoint path at {hpc2}" in three.output()
    assert not (ckpts / "epoch=0-step=6.ckpt").exists()
    partial = ckpts / ".partial" / "epoch=0-step=6.ckpt"
    assert partial.is_dir() and not (partial / ".metadata").exists()  # killed between shards and index
    with pytest.raises(FileNotFoundError, match=r"epoch=0-step=6\.ckpt does not exist \(.*did not finish"):
        check_complete(ckpts / "epoch=0-step=6.ckpt")
    same_losses(three, reference, range(5, 7))

    # 4. kill -9 while a single-file `last` is about to replace the DCP `last`: the old one stays whole
    four = Run.fit(run_dir, "four", "--ckpt_path", "hpc", distributed=False,
                   pause={"point": "save_publish", "name": "last"})
    four.kill_paused()
    assert f"Restoring states from the checkpoint path at {hpc2}" in four.output()
    check_complete(ckpts / "last.ckpt")
    assert (ckpts / "last.ckpt").is_dir() and saved_position(ckpts / "last.ckpt") == (4, 8)
    step6 = ckpts / "epoch=0-step=6.ckpt"
    check_complete(step6)  # the periodic save before it completed, as one file
    assert step6.is_file() and saved_position(step6) == (6, 12)
    assert (ckpts / ".partial" / "last.ckpt").is_file()
    same_losses(four, reference, range(5, 7))

    # 5. SIGTERM at a step's start, then kill -9 inside the preemption save: no hpc_ckpt_3 appears
    five = Run.fit(run_dir, "five", "--ckpt_path", str(step6), distributed=False,
                   pause=[{"point": "batch", "step": 7, "micro": 0, "release": str(run_dir / "go5")},
                          {"point": "save_publish", "name": "hpc_ckpt_3"}])
    five.signal_paused(signal.SIGTERM, "go5")
    five.kill_paused(1)
    hpc3 = run_dir / "hpc_ckpt_3.ckpt"
    assert not hpc3.exists() and (run_dir / ".partial" / hpc3.name).is_file()
    same_losses(five, reference, range(7, 8))

    # 6. the `last` every kill left in place resumes exactly, to the end
    six = Run.fit(run_dir, "six", "--ckpt_path", str(ckpts / "last.ckpt"))
    assert six.finish() == 0, six.output()[-4000:]
    assert six.card()["status"] == "completed" and six.card()["preemption"] is None
    same_losses(six, reference, range(5, MAX_STEPS + 1))
    assert not (ckpts / ".partial").exists()  # the first save of this run cleared what the kills left
    named = [p for p in [*ckpts.iterdir(), *run_dir.glob("hpc_ckpt_*")] if not p.name.startswith(".")]
    assert len(named) >= 6
    for checkpoint in named:  # every checkpoint ever named was saved at an optimizer step's end
        check_complete(checkpoint)
        step, samples = saved_position(checkpoint)
        assert samples == 2 * step, (checkpoint, step, samples)


def test_sigterm_to_one_rank_stops_both_at_the_same_step_and_resumes_on_one_process(tmp_path, reference):
    """Two FSDP ranks, SIGTERM to rank 1 only: the ranks agree on the step, save one sharded checkpoint
    together and exit 143; one process (no FSDP) resumes it and continues the one-process losses (to 1e-5:
    the reduction order differs between the layouts, so not bitwise)."""
    two = Run.fit(tmp_path, "ranks", "--trainer.devices", "2",
                  pause={"point": "batch", "step": 3, "micro": 0, "rank": 1, "release": str(tmp_path / "go")})
    two.signal_paused(signal.SIGTERM, "go")
    assert two.finish() == 128 + signal.SIGTERM, two.output()[-4000:]
    hpc = tmp_path / "hpc_ckpt_1.ckpt"
    check_complete(hpc)
    assert len(list(hpc.glob("*.distcp"))) == 2  # one shard file per rank
    assert saved_position(hpc) == (3, 6)
    assert two.card()["status"].startswith("preempted: SIGTERM at step 3")
    one = Run.fit(tmp_path, "one", "--ckpt_path", str(hpc))
    assert one.finish() == 0, one.output()[-4000:]
    losses = {**two.losses(), **one.losses()}
    assert sorted(losses) == list(range(1, MAX_STEPS + 1))
    assert losses == pytest.approx(reference, rel=1e-5, abs=1e-5)
