"""``--ckpt_path last`` and ``--ckpt_path hpc``: the newest complete checkpoint of the run directory.

Lightning looks for ``last`` in the checkpoint folder of the run's *new* logger version only (each run gets a new
``version_N``), so a requeued job that asks for ``last`` finds nothing and silently starts again from step 0;
``hpc`` looks at ``hpc_ckpt_*.ckpt`` files only. Here both look at every checkpoint the run directory holds: the
checkpoint folders of every logger version (``<save_dir>/<name>/*/checkpoints``), each ``ModelCheckpoint``'s own
``dirpath``, and the preemption checkpoints (``hpc_ckpt_<n>.ckpt``) in ``default_root_dir``, and take the newest
that is complete (a save in progress or a killed one lives under ``.partial/`` and is never a candidate). Finding
none is an error that names the folders it looked in.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from lightning_moe.io.training import LIGHTNING_METADATA, check_complete

log = logging.getLogger(__name__)
RESUME_NAMES = ("last", "hpc")


def search_locations(trainer: Any) -> list[tuple[Path, str]]:
    """(folder, glob pattern) of every place the trainer's runs in this run directory write checkpoints to."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    root = Path(trainer.default_root_dir)
    places = [(Path(cb.dirpath), "*.ckpt") for cb in trainer.checkpoint_callbacks
              if isinstance(cb, ModelCheckpoint) and cb.dirpath]
    if trainer.loggers:  # Lightning's folder without a dirpath: <save_dir>/<name>/<version>/checkpoints
        logger = trainer.loggers[0]
        base = Path(logger.save_dir or root)
        places.append((base / logger.name if logger.name else base, "*/checkpoints/*.ckpt"))
    else:
        places.append((root / "checkpoints", "*.ckpt"))
    places.append((root, "hpc_ckpt_*.ckpt"))  # Lightning's Slurm saves and the Preemption callback's
    return list(dict.fromkeys(places))


def _modified(path: Path) -> float:
    # a distributed checkpoint is complete once Lightning's meta.pt is written (it is published by a rename)
    marker = path / LIGHTNING_METADATA if path.is_dir() else path
    return (marker if marker.exists() else path).stat().st_mtime


def resolve_resume_path(name: str, trainer: Any) -> str:
    """The newest complete checkpoint for ``--ckpt_path last|hpc``; ``FileNotFoundError`` naming where it looked
    when there is none."""
    places = search_locations(trainer)
    found = {path for folder, pattern in places if folder.is_dir() for path in folder.glob(pattern)
             if not path.name.startswith(".")}
    for path in sorted(found, key=_modified, reverse=True):
        try:
            check_complete(path)
        except (OSError, ValueError) as err:
            log.warning("--ckpt_path %s: skipping %s (%s)", name, path, err)
            continue
        log.info("--ckpt_path %s: resuming from %s", name, path)
        return str(path)
    searched = "; ".join(f"{folder}/{pattern}" for folder, pattern in places)
    raise FileNotFoundError(f"--ckpt_path {name}: no complete checkpoint to resume from (looked for {searched}); "
                            f"drop --ckpt_path to start a new run, or name a checkpoint file")
