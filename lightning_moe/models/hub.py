"""Names that are a local directory or a Hugging Face hub id: local paths are checked first, and only a name
shaped like a hub id (``org/name``) that is not a local path is sent to the hub."""

from __future__ import annotations

import os
import re
from pathlib import Path

HUB_ID = re.compile(r"[\w.-]+/[\w.-]+")


def hub_offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on")


def local_dir_or_hub_id(value: str, key: str) -> Path | str:
    """``value`` as a local directory (a ``Path``), or as a hub id (the string); ``FileNotFoundError`` naming
    ``key`` for a path that does not exist. A name whose first folder exists here (``data/tokeniser`` beside
    ``data/``) is a local path with a typo, not a hub id."""
    path = Path(value).expanduser()
    if path.is_dir():
        return path
    if path.exists():
        raise FileNotFoundError(f"{key}: {value!r} is a file, not a directory")
    shaped_like_id = HUB_ID.fullmatch(value) is not None and not value.startswith((".", "~"))
    first, _, rest = value.partition("/")
    if shaped_like_id and Path(first).is_dir():
        raise FileNotFoundError(f"{key}: directory {value!r} does not exist ({first}/ has no {rest!r})")
    if not shaped_like_id:
        raise FileNotFoundError(f"{key}: directory {value!r} does not exist")
    return value


def snapshot_dir(hub_id: str, key: str, revision: str | None = None, patterns: list[str] | None = None) -> Path:
    """The local snapshot of ``hub_id`` (downloaded when missing and the hub may be asked)."""
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(hub_id, revision=revision, allow_patterns=patterns))
    except Exception as err:  # offline mode, unknown repo, gated repo: huggingface_hub has many error types
        raise FileNotFoundError(not_fetched(hub_id, key, err)) from err


def not_fetched(hub_id: str, key: str, err: BaseException) -> str:
    """The message for a hub id that is not a local directory and could not be had from the hub."""
    head = f"{key}={hub_id!r} is not a local directory and could not be fetched from the hub"
    if hub_offline():
        return f"{head}: HF_HUB_OFFLINE=1 keeps the hub from being asked, and the Hugging Face cache has no copy"
    first_line = str(err).strip().splitlines()[0] if str(err).strip() else ""
    return f"{head} ({type(err).__name__}: {first_line})"
