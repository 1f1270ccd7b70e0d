"""Write a directory completely or not at all: build it under a temporary sibling, then rename."""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def atomic_directory(path: str | Path, overwrite: bool = False) -> Iterator[Path]:
    """Yield a temporary directory that becomes ``path`` when the block succeeds, and vanishes if it fails."""
    final = Path(path)
    if final.exists() and not overwrite and (not final.is_dir() or any(final.iterdir())):
        raise FileExistsError(f"output {final} already exists and is not empty (pass overwrite to replace it)")
    final.parent.mkdir(parents=True, exist_ok=True)
    # mkdir honours the umask (tempfile.mkdtemp would leave the output readable by its owner only)
    tmp = final.parent / f".{final.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
    tmp.mkdir()
    try:
        yield tmp
        with_umask_modes(tmp)
        if final.is_dir() and not final.is_symlink():
            shutil.rmtree(final)
        elif final.exists() or final.is_symlink():
            final.unlink()
        os.replace(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def with_umask_modes(folder: Path) -> None:
    """Give the files under ``folder`` the mode the process umask allows (``0o666 & ~umask``): writers that go
    through temporary files (safetensors) leave them readable by their owner only, so nobody else on a cluster
    could read an export."""
    umask = os.umask(0)
    os.umask(umask)
    for file in folder.rglob("*"):
        if file.is_file() and not file.is_symlink():
            file.chmod(0o666 & ~umask)


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}")
    try:
        tmp.write_bytes(data)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def atomic_write_text(path: str | Path, text: str) -> None:
    atomic_write_bytes(path, text.encode())
