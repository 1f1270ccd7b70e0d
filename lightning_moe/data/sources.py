"""Where SFT rows come from: local JSONL / JSON / parquet files, ``save_to_disk`` folders, or a hub id."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

_FILE_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}


@dataclass
class Source:
    """A loaded source: the ``datasets.Dataset``, a short name for messages, and a fingerprint for caches."""

    dataset: Any
    name: str
    fingerprint: str


def load_source(source: str, split: str = "train", revision: str | None = None, name: str | None = None) -> Source:
    """Load rows.

    Args:
        source: a ``.jsonl`` / ``.json`` / ``.parquet`` file, a folder written by ``Dataset.save_to_disk``
            (or ``DatasetDict.save_to_disk``), or a Hugging Face hub dataset id.
        split: split with optional slice, e.g. ``train`` or ``train[:100000]``. Local files have one
            split, ``train``.
        revision: hub revision (ignored for local sources).
        name: hub dataset configuration name.
    """
    import datasets

    if os.path.isdir(source):
        return _load_from_disk(source, split)
    ext = os.path.splitext(source)[1].lower()
    if ext in _FILE_BUILDERS or os.path.isabs(source) or source.startswith("."):
        if not os.path.isfile(source):
            raise FileNotFoundError(f"dataset file {source} does not exist")
        if ext not in _FILE_BUILDERS:
            raise ValueError(f"{source}: unsupported file type {ext!r} (use .jsonl, .json or .parquet)")
        if ext == ".jsonl":
            check_jsonl(source)  # datasets' own errors on these name neither the file nor the line
        try:
            ds = datasets.load_dataset(_FILE_BUILDERS[ext], data_files={"train": source}, split=split)
        except Exception as e:  # pyarrow/datasets messages name the row and column, not the file
            raise ValueError(f"{source}: could not be read as {ext[1:]}: {type(e).__name__}: {e}") from e
        if len(ds) == 0:
            raise ValueError(f"{source}: no rows (split {split!r})")
        return Source(ds, os.path.basename(source), source_fingerprint(source, split))
    try:
        ds = datasets.load_dataset(source, name, split=split, revision=revision)
    except FileNotFoundError as e:
        raise FileNotFoundError(f"dataset {source!r} is neither a local path nor a reachable hub dataset: {e}") from e
    return Source(ds, source, _hash(source, name, split, revision, ds._fingerprint))


def check_jsonl(path: str) -> None:
    """Raise ``ValueError`` naming the file and line when a JSON-lines file is empty or a line is not a JSON
    object (one pass, a line at a time)."""
    for _ in iter_jsonl(path):
        pass


def iter_jsonl(path: str) -> Iterator[tuple[int, dict[str, Any]]]:
    """``(line number, row)`` of each non-blank line of a JSON-lines file; ``ValueError`` naming the file and line
    when the file is empty or a line is not a JSON object."""
    import json

    rows = 0
    with open(path, "rb") as f:
        for number, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise ValueError(f"{path} line {number}: not UTF-8 text ({e.reason} at byte {e.start})") from None
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path} line {number}: not valid JSON ({e.msg} at column {e.colno})") from None
            if not isinstance(row, dict):
                raise ValueError(f"{path} line {number}: a JSON {type(row).__name__}, not an object of columns")
            rows += 1
            yield number, row
    if rows == 0:
        raise ValueError(f"{path}: empty, no JSON lines")


def source_fingerprint(source: str, split: str = "train", revision: str | None = None,
                       name: str | None = None) -> str:
    """The fingerprint :func:`load_source` would report; local files are not read (path, size, mtime)."""
    if os.path.isfile(source) and os.path.splitext(source)[1].lower() in _FILE_BUILDERS:
        st = os.stat(source)
        return _hash(os.path.realpath(source), st.st_size, st.st_mtime_ns, split)
    return load_source(source, split, revision, name).fingerprint


def _load_from_disk(path: str, split: str) -> Source:
    import datasets

    try:
        loaded = datasets.load_from_disk(path)
    except FileNotFoundError as e:
        raise FileNotFoundError(f"{path}: not a folder written by save_to_disk ({e})") from e
    base, _, rest = split.partition("[")
    if isinstance(loaded, datasets.DatasetDict):
        if base not in loaded:
            raise ValueError(f"{path}: split {base!r} not found (found: {', '.join(loaded)})")
        ds = loaded[base]
    else:
        ds = loaded
    if rest:
        ds = _slice(ds, "[" + rest, path)
    return Source(ds, os.path.basename(os.path.normpath(path)), _hash(os.path.realpath(path), split, ds._fingerprint))


def _slice(ds: Any, spec: str, path: str) -> Any:
    """Apply a ``[a:b]`` slice (row counts or percentages) like ``datasets`` split strings."""
    body = spec.strip()[1:-1]
    parts = body.split(":")
    if len(parts) != 2:
        raise ValueError(f"{path}: bad split slice {spec!r} (use e.g. [:1000] or [10%:])")

    def pos(s: str) -> int | None:
        s = s.strip()
        if not s:
            return None
        if s.endswith("%"):  # datasets' "closest" rounding
            return int(round(float(s[:-1]) * len(ds) / 100.0))
        return int(s)

    return ds.select(range(len(ds))[slice(pos(parts[0]), pos(parts[1]))])


def _hash(*parts: Any) -> str:
    return hashlib.sha256(repr(parts).encode()).hexdigest()[:16]
