"""The Trainer's checkpoints: written completely or not at all, checked before they are read.

A checkpoint (one file, or a DCP directory of shards + ``.metadata`` + Lightning's ``meta.pt``) is written under
``<folder>/.partial/<name>`` and moved to ``<folder>/<name>`` only once every rank has finished writing it. An
existing checkpoint of that name (``last.ckpt``) is swapped out in one step (Linux ``renameat2`` exchange), so a
kill at any moment leaves either the previous checkpoint or the new one under the name, never a mix; leftovers
of a killed save stay under ``.partial/`` (which Lightning's ``last``/``hpc`` lookups never match) and the next
save there clears them.

Reading checks that everything a checkpoint's index names is there: ``.metadata`` and ``meta.pt``, every shard
file it refers to, each at least as long as the bytes it must hold; a single file must end in its zip directory.
Errors name the missing or truncated file.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import pickle
import shutil
import zipfile
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

STAGING = ".partial"
DCP_METADATA = ".metadata"
LIGHTNING_METADATA = "meta.pt"  # what Lightning's ModelParallelStrategy writes next to the shards


def staging_path(final: str | Path) -> Path:
    """Where a checkpoint is written before it is complete (the same on every rank)."""
    final = Path(final)
    return final.parent / STAGING / final.name


def clear_staging(final: str | Path) -> None:
    """Remove what killed saves left in ``final``'s staging folder (call on one rank, before a save)."""
    folder = staging_path(final).parent
    if not folder.is_dir():
        return
    for leftover in sorted(folder.iterdir()):
        log.warning("removing %s, left by a save that did not finish", leftover)
        _remove(leftover)


def publish(staged: str | Path, final: str | Path) -> None:
    """Move a completely written checkpoint to its name; an older one there is replaced in a single step."""
    staged, final = Path(staged), Path(final)
    _fsync(staged)
    if not final.exists() and not final.is_symlink():
        os.rename(staged, final)
    elif staged.is_file() and final.is_file() and not final.is_symlink():
        os.replace(staged, final)
    elif _exchange(staged, final):
        _remove(staged)  # now the previous checkpoint
    else:  # a file system without exchange: the previous one moves aside for the instant between two renames
        previous = staged.with_name(staged.name + ".previous")
        _remove(previous)
        os.rename(final, previous)
        os.rename(staged, final)
        _remove(previous)
    _fsync_dir(final.parent)
    try:
        staged.parent.rmdir()  # the staging folder goes once empty
    except OSError:
        pass


def check_complete(path: str | Path, trainer_state: bool = True) -> None:
    """Raise ``FileNotFoundError``/``ValueError`` naming what is missing or truncated in checkpoint ``path``
    (a DCP directory needs Lightning's ``meta.pt`` only with ``trainer_state``)."""
    path = Path(path)
    if not path.exists():
        staged = staging_path(path)
        hint = f" ({staged} holds a save of it that did not finish)" if staged.exists() else ""
        raise FileNotFoundError(f"checkpoint {path} does not exist{hint}")
    if path.is_file():
        _check_zip(path, "checkpoint file")
        return
    index = path / DCP_METADATA
    if not index.is_file():
        raise ValueError(f"checkpoint {path} is incomplete: {index} is missing (the save did not finish, or "
                         f"this is not a checkpoint directory)")
    metadata = read_dcp_metadata(path)
    needed: dict[str, int] = {}
    for info in metadata.storage_data.values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for name, size in sorted(needed.items()):
        shard = path / name
        if not shard.is_file():
            raise ValueError(f"checkpoint {path} is incomplete: shard {shard} is missing")
        if shard.stat().st_size < size:
            raise ValueError(f"checkpoint {path} is incomplete: shard {shard} is truncated "
                             f"({shard.stat().st_size} bytes, its index needs {size})")
    extra = path / LIGHTNING_METADATA
    if not trainer_state and not extra.exists():
        return
    if not extra.is_file():
        raise ValueError(f"checkpoint {path} is incomplete: {extra} (trainer state) is missing")
    _check_zip(extra, "checkpoint trainer state")


def check_resume_path(path: str | Path | None) -> None:
    """``check_complete`` for a Trainer's ``ckpt_path``, except Lightning's names (``last``, ``hpc``, ``best``) and
    remote URLs, which Lightning resolves itself."""
    if path is None or str(path) in ("last", "hpc", "best") or "://" in str(path):
        return
    check_complete(path)


def read_dcp_metadata(path: str | Path) -> Any:
    """The ``.metadata`` index of DCP directory ``path``; a corrupt one is an error naming it."""
    index = Path(path) / DCP_METADATA
    try:
        with open(index, "rb") as f:
            return pickle.load(f)  # what torch's FileSystemReader.read_metadata does
    except (pickle.UnpicklingError, EOFError, AttributeError, ValueError) as err:
        raise ValueError(f"checkpoint index {index} is truncated or corrupt: {err}") from None


def _check_zip(path: Path, what: str) -> None:
    # torch.save writes a zip archive; its directory sits at the end, so a cut-off file has none (and bytes of a
    # tensor that happen to look like the directory's end record do not point to a directory that is there)
    try:
        with zipfile.ZipFile(path) as archive:
            last = max((info.header_offset for info in archive.infolist()), default=0)
    except (zipfile.BadZipFile, OSError, ValueError):
        last = None
    if last is None or last >= path.stat().st_size:
        raise ValueError(f"{what} {path} is truncated or corrupt ({path.stat().st_size} bytes, no zip "
                         f"directory at its end)")


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths atomically (Linux renameat2 RENAME_EXCHANGE); False where the system cannot."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    at_fdcwd, rename_exchange = -100, 2
    if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP):
        return False
    raise OSError(code, f"could not swap {a} into place: {os.strerror(code)}", str(b))


def _fsync(path: Path) -> None:
    """Flush what this rank wrote (the single file, or Lightning's ``meta.pt``: DCP syncs its own shards) before
    the checkpoint gets its name, so a crash of the node cannot leave a named checkpoint with lost pages."""
    file = path if path.is_file() else path / LIGHTNING_METADATA
    if file.is_file():
        fd = os.open(file, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    if path.is_dir():
        _fsync_dir(path)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError:  # some file systems do not sync directories
        pass
    finally:
        os.close(fd)


def load_unsharded(path: Path, model: Any, optimizers: list, strict: bool = True,
                   weights_only: bool | None = None) -> dict[str, Any]:
    """Read checkpoint ``path`` into a model without DTensor parameters (one process, no FSDP or TP), which
    Lightning's ModelParallelStrategy refuses; through the same torch state-dict API it uses for sharded ones.
    Returns the rest of the checkpoint (loops, callbacks, data module, schedulers), as Lightning's loader does."""
    import torch
    from torch.distributed.checkpoint import load
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )

    if path.is_dir():
        state = {"state_dict": get_model_state_dict(model)}
        load(state, checkpoint_id=path)
        model.load_state_dict(state["state_dict"], strict=strict)
        for i, optimizer in enumerate(optimizers):
            key = f"optimizer_{i}"
            optimizer_state = {key: get_optimizer_state_dict(model, optimizer)}
            load(optimizer_state, checkpoint_id=path)
            set_optimizer_state_dict(model, optimizer, optim_state_dict=optimizer_state[key])
        return torch.load(path / LIGHTNING_METADATA, weights_only=weights_only)
    from lightning.fabric.strategies.model_parallel import _rekey_optimizer_state_if_needed

    checkpoint = torch.load(path, mmap=True, map_location="cpu", weights_only=weights_only)
    model.load_state_dict(checkpoint.pop("state_dict"), strict=strict)
    for optimizer, optimizer_state in zip(optimizers, checkpoint.get("optimizer_states", [])):
        set_optimizer_state_dict(model, optimizer, optim_state_dict=_rekey_optimizer_state_if_needed(optimizer_state, model),
                                 options=StateDictOptions(full_state_dict=True))
    return checkpoint
