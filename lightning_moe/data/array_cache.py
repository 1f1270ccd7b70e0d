"""Arrays built once and memory-mapped by every process after (sampling and blending indices, scans of a file)."""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any

import numpy as np


def cached_arrays(cache_dir: str, kind: str, description: dict[str, Any], build) -> dict[str, np.ndarray]:
    """The arrays ``build()`` returns, memory-mapped from ``cache_dir`` (built and written first if missing).

    Files are named by a hash of ``description``; each is written to a temporary name and renamed, so
    processes building the same arrays at once (a node per shared file system) leave complete files.
    """
    key = hashlib.sha256(json.dumps(description, sort_keys=True).encode()).hexdigest()[:20]
    stem = os.path.join(cache_dir, f"{kind}-{key}")
    manifest = stem + ".json"
    if not os.path.isfile(manifest):
        os.makedirs(cache_dir, exist_ok=True)
        arrays = build()
        for name, array in arrays.items():
            _write_atomically(f"{stem}-{name}.npy", lambda f, a=array: np.save(f, a))
        text = json.dumps({"description": description, "arrays": sorted(arrays)}, indent=1, sort_keys=True)
        _write_atomically(manifest, lambda f: f.write(text.encode()))
    with open(manifest, encoding="utf-8") as f:
        names = json.load(f)["arrays"]
    return {name: np.load(f"{stem}-{name}.npy", mmap_mode="r") for name in names}


def _write_atomically(path: str, write) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            write(f)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
