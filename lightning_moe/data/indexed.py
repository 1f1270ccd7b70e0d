"""Megatron-Core indexed datasets: ``<prefix>.bin`` (tokens) + ``<prefix>.idx`` (index), read and write.

Byte-compatible with ``megatron.core.datasets.indexed_dataset``. The ``.idx`` file, little-endian:

=========================  ============================================================
``b"MMIDIDX\\x00\\x00"``    9-byte magic
``<Q`` version              always 1
``<B`` dtype code           1 uint8, 2 int8, 3 int16, 4 int32, 5 int64, 6 float64, 7 float32, 8 uint16
``<Q`` sequence count N
``<Q`` document count D     number of documents + 1
``int32[N]``                sequence lengths (tokens)
``int64[N]``                byte offsets of each sequence in ``.bin``
``int64[D]``                document indices: sequence index where each document starts, then N
``int8[N]``                 sequence modes (multimodal files only)
=========================  ============================================================

``.bin`` is the token arrays concatenated, no header. Reading memory-maps both files and returns
zero-copy numpy views.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from lightning_moe.data.array_cache import cached_arrays

INDEX_MAGIC = b"MMIDIDX\x00\x00"
INDEX_VERSION = 1
HEADER_SIZE = 9 + 8 + 1 + 8 + 8
DTYPE_CODES: dict[int, type] = {
    1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64, 7: np.float32, 8: np.uint16,
}
_CODE_OF = {np.dtype(v): k for k, v in DTYPE_CODES.items()}


def optimal_dtype(vocab_size: int | None) -> type:
    """Megatron's choice: uint16 when the vocabulary is below 65500 tokens, else int32."""
    return np.uint16 if vocab_size is not None and vocab_size < 65500 else np.int32


class IndexedDataset:
    """A memory-mapped Megatron indexed dataset: ``len(ds)`` sequences, ``ds[i]`` a numpy token array.

    Args:
        path_prefix: files are ``path_prefix + ".idx"`` and ``path_prefix + ".bin"``.
        multimodal: the ``.idx`` carries per-sequence modes (``int8[N]``) after the document indices.

    Attributes: ``dtype``, ``sequence_lengths`` (int32[N]), ``sequence_pointers`` (int64[N], bytes),
    ``document_indices`` (int64[D]), ``sequence_modes`` (int8[N] or None), all zero-copy views.
    """

    def __init__(self, path_prefix: str, multimodal: bool = False) -> None:
        self.path_prefix = path_prefix
        idx_path, bin_path = path_prefix + ".idx", path_prefix + ".bin"
        for p in (idx_path, bin_path):
            if not os.path.isfile(p):
                raise FileNotFoundError(f"indexed dataset: {p} does not exist")
        idx_size = os.path.getsize(idx_path)
        if idx_size < HEADER_SIZE:
            raise ValueError(f"{idx_path}: truncated header ({idx_size} bytes, need {HEADER_SIZE})")
        with open(idx_path, "rb") as f:
            header = f.read(HEADER_SIZE)
        if header[:9] != INDEX_MAGIC:
            raise ValueError(f"{idx_path}: bad magic {header[:9]!r} (expected {INDEX_MAGIC!r}); "
                             "not a Megatron indexed dataset")
        (version,) = struct.unpack("<Q", header[9:17])
        if version != INDEX_VERSION:
            raise ValueError(f"{idx_path}: unsupported version {version} (expected {INDEX_VERSION})")
        code = header[17]
        if code not in DTYPE_CODES:
            raise ValueError(f"{idx_path}: unknown dtype code {code} (known: {sorted(DTYPE_CODES)})")
        self.dtype = np.dtype(DTYPE_CODES[code])
        n, d = struct.unpack("<QQ", header[18:34])
        expected = HEADER_SIZE + n * (4 + 8) + d * 8 + (n if multimodal else 0)
        if idx_size != expected:
            raise ValueError(
                f"{idx_path}: size {idx_size} bytes does not match its header ({n} sequences, {d} document "
                f"indices{', multimodal' if multimodal else ''} -> {expected} bytes); truncated or corrupt"
            )
        self._idx_mmap = np.memmap(idx_path, mode="r", dtype=np.uint8)
        buf = memoryview(self._idx_mmap)
        off = HEADER_SIZE
        self.sequence_lengths = np.frombuffer(buf, dtype="<i4", count=n, offset=off)
        off += 4 * n
        self.sequence_pointers = np.frombuffer(buf, dtype="<i8", count=n, offset=off)
        off += 8 * n
        self.document_indices = np.frombuffer(buf, dtype="<i8", count=d, offset=off)
        off += 8 * d
        self.sequence_modes = np.frombuffer(buf, dtype=np.int8, count=n, offset=off) if multimodal else None
        if d == 0 or self.document_indices[0] != 0 or self.document_indices[-1] != n:
            raise ValueError(f"{idx_path}: document indices must start with 0 and end with the sequence count {n}")
        if n and (self.sequence_lengths.min() < 0 or self.sequence_pointers[0] != 0 or np.any(
            np.diff(self.sequence_pointers) != self.sequence_lengths[:-1].astype(np.int64) * self.dtype.itemsize
        )):
            raise ValueError(f"{idx_path}: sequence lengths and byte offsets are inconsistent; corrupt index")
        bin_size = os.path.getsize(bin_path)
        needed = int(self.sequence_pointers[-1]) + int(self.sequence_lengths[-1]) * self.dtype.itemsize if n else 0
        if bin_size != needed:
            raise ValueError(f"{bin_path}: size {bin_size} bytes but {idx_path} describes {needed} bytes; "
                             "the .bin and .idx files do not belong together or one is truncated")
        # An empty file cannot be memory-mapped; an empty dataset has nothing to read anyway.
        self._bin = np.memmap(bin_path, mode="r", dtype=np.uint8) if bin_size else np.zeros(0, np.uint8)

    def __len__(self) -> int:
        return len(self.sequence_lengths)

    def __getitem__(self, idx: int) -> np.ndarray:
        return self.get(idx)

    def get(self, idx: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens ``[offset : offset + length]`` of sequence ``idx`` as a read-only zero-copy view."""
        n = len(self)
        if not -n <= idx < n:
            raise IndexError(f"{self.path_prefix}: sequence {idx} out of range ({n} sequences)")
        idx %= n
        seq_len = int(self.sequence_lengths[idx])
        if length is None:
            length = seq_len - offset
        ptr = int(self.sequence_pointers[idx]) + offset * self.dtype.itemsize
        return np.frombuffer(self._bin, dtype=self.dtype, count=length, offset=ptr)

    @property
    def num_documents(self) -> int:
        return len(self.document_indices) - 1

    @property
    def num_tokens(self) -> int:
        return int(self.sequence_lengths.sum(dtype=np.int64))

    def max_token_id(self, cache_dir: str | None = None) -> int:
        """The largest token id in the ``.bin`` file (-1 when empty): one pass over the memory map, remembered
        in ``cache_dir`` when given (keyed by the file's path, size and modification time)."""
        def scan() -> dict[str, np.ndarray]:
            tokens = np.frombuffer(self._bin, dtype=self.dtype)
            return {"max": np.array([int(tokens.max()) if tokens.size else -1], dtype=np.int64)}

        if cache_dir is None:
            return int(scan()["max"][0])
        bin_path = os.path.realpath(self.path_prefix + ".bin")
        stat = os.stat(bin_path)
        key = {"bin": bin_path, "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}
        return int(cached_arrays(cache_dir, "max-token-id", key, scan)["max"][0])


class IndexedDatasetWriter:
    """Write a Megatron indexed dataset. Use as a context manager; files appear only when complete.

    Args:
        path_prefix: output ``<prefix>.bin`` / ``<prefix>.idx``.
        dtype: token dtype (one of the codes in the module docstring); see :func:`optimal_dtype`.
        multimodal: also write per-sequence modes.

    ``add_item(tokens)`` appends one sequence; ``end_document()`` closes the current document
    (Megatron's convention: one sequence per document for text).
    """

    def __init__(self, path_prefix: str, dtype: Any = np.int32, multimodal: bool = False) -> None:
        self.dtype = np.dtype(dtype)
        if self.dtype not in _CODE_OF:
            raise ValueError(f"dtype {self.dtype} has no Megatron dtype code")
        self.path_prefix = path_prefix
        self.multimodal = multimodal
        self._tmp = f".tmp-{os.getpid()}"
        self._bin = open(path_prefix + ".bin" + self._tmp, "wb")
        self.sequence_lengths: list[int] = []
        self.document_indices: list[int] = [0]
        self.sequence_modes: list[int] = []

    def add_item(self, tokens: Sequence[int] | np.ndarray, mode: int = 0) -> None:
        arr = np.asarray(tokens)
        if arr.ndim != 1:
            raise ValueError(f"a sequence must be 1-D, got shape {arr.shape}")
        if arr.size and arr.dtype.kind in "iu":
            info = np.iinfo(self.dtype) if self.dtype.kind in "iu" else None
            if info is not None and (arr.min() < info.min or arr.max() > info.max):
                raise ValueError(f"token ids [{arr.min()}, {arr.max()}] do not fit dtype {self.dtype}")
        self._bin.write(arr.astype(self.dtype.newbyteorder("<"), copy=False).tobytes(order="C"))
        self.sequence_lengths.append(int(arr.size))
        self.sequence_modes.append(int(mode))

    def end_document(self) -> None:
        self.document_indices.append(len(self.sequence_lengths))

    def add_document(self, tokens: Sequence[int] | np.ndarray) -> None:
        """One sequence that is a whole document."""
        self.add_item(tokens)
        self.end_document()

    def finalize(self) -> None:
        """Write the ``.idx`` and move both files into place."""
        if self.document_indices[-1] != len(self.sequence_lengths):
            self.end_document()
        self._bin.close()
        lengths = np.asarray(self.sequence_lengths, dtype="<i4")
        pointers = np.zeros(len(lengths), dtype="<i8")
        if len(lengths) > 1:
            np.cumsum(lengths[:-1].astype(np.int64) * self.dtype.itemsize, out=pointers[1:])
        idx_tmp = self.path_prefix + ".idx" + self._tmp
        with open(idx_tmp, "wb") as f:
            f.write(INDEX_MAGIC)
            f.write(struct.pack("<Q", INDEX_VERSION))
            f.write(struct.pack("<B", _CODE_OF[self.dtype]))
            f.write(struct.pack("<Q", len(lengths)))
            f.write(struct.pack("<Q", len(self.document_indices)))
            f.write(lengths.tobytes())
            f.write(pointers.tobytes())
            f.write(np.asarray(self.document_indices, dtype="<i8").tobytes())
            if self.multimodal:
                f.write(np.asarray(self.sequence_modes, dtype=np.int8).tobytes())
        os.replace(self.path_prefix + ".bin" + self._tmp, self.path_prefix + ".bin")
        os.replace(idx_tmp, self.path_prefix + ".idx")

    def abort(self) -> None:
        self._bin.close()
        for suffix in (".bin", ".idx"):
            try:
                os.remove(self.path_prefix + suffix + self._tmp)
            except FileNotFoundError:
                pass

    def __enter__(self) -> IndexedDatasetWriter:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is not None:
            self.abort()
            return
        try:
            self.finalize()
        except BaseException:  # e.g. a full disk while writing the index: no temporaries left behind
            self.abort()
            raise


def iter_jsonl_texts(path: str, json_key: str = "text") -> Iterable[tuple[int, str]]:
    """Yield ``(row, text)`` from a JSON-lines file, with clear errors for bad rows."""
    name = os.path.basename(path)
    with open(path, encoding="utf-8") as f:
        for row, line in enumerate(f):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{name} row {row}: invalid JSON ({e.msg})") from e
            if not isinstance(obj, dict) or json_key not in obj:
                found = ", ".join(obj) if isinstance(obj, dict) else type(obj).__name__
                raise ValueError(f"{name} row {row}: column '{json_key}' missing (found: {found})")
            text = obj[json_key]
            if not isinstance(text, str):
                raise ValueError(f"{name} row {row}: column '{json_key}' must be a string, got {type(text).__name__}")
            yield row, text


def build_indexed_dataset_from_jsonl(
    input_path: str, tokenizer: Any, output_prefix: str, json_key: str = "text", append_eod: bool = True,
    batch_size: int = 1000,
) -> dict[str, int]:
    """Tokenize ``input_path`` (JSONL, one document per row) into ``<output_prefix>.{bin,idx}``.

    Like Megatron's ``preprocess_data.py``: one sequence per document, EOD (the tokenizer's eos)
    appended when ``append_eod``. Empty documents are skipped and counted. Returns counts.
    """
    if not os.path.isfile(input_path):
        raise FileNotFoundError(f"input file {input_path} does not exist")
    eod = tokenizer.eos_token_id
    if append_eod and eod is None:
        raise ValueError("append_eod needs a tokenizer with an eos token")
    vocab = len(tokenizer)
    stats = {"documents": 0, "tokens": 0, "skipped_empty": 0}
    os.makedirs(os.path.dirname(os.path.abspath(output_prefix)), exist_ok=True)
    with IndexedDatasetWriter(output_prefix, dtype=optimal_dtype(vocab)) as writer:
        batch: list[str] = []

        def flush() -> None:
            for ids in tokenizer(batch, add_special_tokens=False)["input_ids"]:
                if append_eod:
                    ids = list(ids) + [eod]
                writer.add_document(np.asarray(ids, dtype=np.int64))
                stats["documents"] += 1
                stats["tokens"] += len(ids)
            batch.clear()

        for _, text in iter_jsonl_texts(input_path, json_key):
            if not text.strip():
                stats["skipped_empty"] += 1
                continue
            batch.append(text)
            if len(batch) >= batch_size:
                flush()
        if batch:
            flush()
    return stats
