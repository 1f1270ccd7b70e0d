"""Megatron indexed datasets: round trip, byte-for-byte against the format spec and megatron-core."""

from __future__ import annotations

import struct

import numpy as np
import pytest

from lightning_moe.data import IndexedDataset, IndexedDatasetWriter
from lightning_moe.data.indexed import build_indexed_dataset_from_jsonl


def _docs(seed=0, n=25, vocab=5000):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, size=int(rng.integers(0, 60))) for _ in range(n)]


def _spec_bytes(docs, dtype, code):
    """The expected .idx/.bin bytes, built from the format description alone."""
    lengths = [len(d) for d in docs]
    itemsize = np.dtype(dtype).itemsize
    pointers, p = [], 0
    for n in lengths:
        pointers.append(p)
        p += n * itemsize
    idx = b"MMIDIDX\x00\x00" + struct.pack("<Q", 1) + struct.pack("<B", code)
    idx += struct.pack("<Q", len(docs)) + struct.pack("<Q", len(docs) + 1)
    idx += struct.pack(f"<{len(docs)}i", *lengths)
    idx += struct.pack(f"<{len(docs)}q", *pointers)
    idx += struct.pack(f"<{len(docs) + 1}q", *range(len(docs) + 1))
    bin_ = b"".join(struct.pack(f"<{len(d)}{'H' if code == 8 else 'i'}", *map(int, d)) for d in docs)
    return idx, bin_


@pytest.mark.parametrize(("dtype", "code"), [(np.uint16, 8), (np.int32, 4)])
def test_writer_matches_spec_byte_for_byte(tmp_path, dtype, code):
    docs = _docs()
    prefix = str(tmp_path / "ds")
    with IndexedDatasetWriter(prefix, dtype=dtype) as w:
        for d in docs:
            w.add_document(d)
    idx, bin_ = _spec_bytes(docs, dtype, code)
    assert (tmp_path / "ds.idx").read_bytes() == idx
    assert (tmp_path / "ds.bin").read_bytes() == bin_


def test_round_trip_zero_copy(tmp_path):
    docs = _docs(1)
    prefix = str(tmp_path / "rt")
    with IndexedDatasetWriter(prefix, dtype=np.uint16) as w:
        for d in docs:
            w.add_document(d)
    ds = IndexedDataset(prefix)
    assert len(ds) == len(docs) and ds.num_documents == len(docs) and ds.dtype == np.uint16
    for i, d in enumerate(docs):
        np.testing.assert_array_equal(ds[i], d)
    nonempty = next(i for i, d in enumerate(docs) if len(d) > 5)
    view = ds.get(nonempty, offset=2, length=3)
    np.testing.assert_array_equal(view, docs[nonempty][2:5])
    assert not view.flags.writeable and not view.flags.owndata  # a view into the memory map
    with pytest.raises(IndexError):
        ds[len(docs)]


def test_matches_megatron_core(tmp_path):
    """megatron-core reads our files and writes byte-identical ones."""
    pytest.importorskip("megatron.core.datasets.indexed_dataset")
    import torch
    from megatron.core.datasets.indexed_dataset import IndexedDataset as MDataset
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    docs = _docs(2)
    ours, theirs = str(tmp_path / "ours"), str(tmp_path / "theirs")
    with IndexedDatasetWriter(ours, dtype=np.uint16) as w:
        for d in docs:
            w.add_document(d)
    builder = IndexedDatasetBuilder(theirs + ".bin", dtype=np.uint16)
    for d in docs:
        builder.add_item(torch.tensor(d.astype(np.int64)))
        builder.end_document()
    builder.finalize(theirs + ".idx")
    for ext in (".bin", ".idx"):
        assert (tmp_path / f"ours{ext}").read_bytes() == (tmp_path / f"theirs{ext}").read_bytes()
    m = MDataset(ours, mmap=True)
    assert len(m) == len(docs)
    for i, d in enumerate(docs):
        np.testing.assert_array_equal(m[i], d)
    np.testing.assert_array_equal(m.document_indices, np.arange(len(docs) + 1))


def test_shipped_pretrain_sample(data_dir, tokenizer):
    ds = IndexedDataset(str(data_dir / "pretrain_sample_text_document"))
    assert len(ds) == 200 and ds.dtype == np.uint16
    assert all(ds[i][-1] == tokenizer.eos_token_id for i in range(len(ds)))
    first = tokenizer.decode(ds[0][:-1])
    from lightning_moe.data.samples import read_jsonl

    assert first == read_jsonl(str(data_dir / "pretrain_sample.jsonl"))[0]["text"]


def test_build_from_jsonl_skips_empty(tmp_path, tokenizer, write_rows):
    path = write_rows("docs.jsonl", [{"text": "The quiet garden."}, {"text": "  "}, {"text": "A river."}])
    stats = build_indexed_dataset_from_jsonl(path, tokenizer, str(tmp_path / "out"), append_eod=False)
    assert stats["documents"] == 2 and stats["skipped_empty"] == 1
    ds = IndexedDataset(str(tmp_path / "out"))
    assert tokenizer.decode(ds[1]) == "A river."


def _write_small(tmp_path):
    prefix = str(tmp_path / "c")
    with IndexedDatasetWriter(prefix, dtype=np.int32) as w:
        for d in _docs(3, n=4):
            w.add_document(d + 1)
    return prefix


@pytest.mark.parametrize(
    ("corrupt", "message"),
    [
        (lambda b: b"XXIDIDX\x00\x00" + b[9:], "bad magic"),
        (lambda b: b[:9] + struct.pack("<Q", 2) + b[17:], "unsupported version 2"),
        (lambda b: b[:17] + bytes([42]) + b[18:], "unknown dtype code 42"),
        (lambda b: b[:-5], "does not match its header"),
        (lambda b: b[:40], "does not match its header"),
        (lambda b: b[:10], "truncated header"),
    ],
)
def test_corrupt_idx(tmp_path, corrupt, message):
    prefix = _write_small(tmp_path)
    idx = tmp_path / "c.idx"
    idx.write_bytes(corrupt(idx.read_bytes()))
    with pytest.raises(ValueError, match=message) as e:
        IndexedDataset(prefix)
    assert "c.idx" in str(e.value)


def test_truncated_bin_and_missing_files(tmp_path):
    prefix = _write_small(tmp_path)
    b = tmp_path / "c.bin"
    b.write_bytes(b.read_bytes()[:-4])
    with pytest.raises(ValueError, match=r"c\.bin: size .* do not belong together or one is truncated"):
        IndexedDataset(prefix)
    with pytest.raises(FileNotFoundError, match="nothere.idx does not exist"):
        IndexedDataset(str(tmp_path / "nothere"))


def test_inconsistent_pointers(tmp_path):
    prefix = _write_small(tmp_path)
    idx = tmp_path / "c.idx"
    raw = bytearray(idx.read_bytes())
    pointer_offset = 34 + 4 * 4 + 8  # second pointer
    raw[pointer_offset:pointer_offset + 8] = struct.pack("<q", 3)
    idx.write_bytes(bytes(raw))
    with pytest.raises(ValueError, match="inconsistent"):
        IndexedDataset(prefix)


def test_failed_finalize_leaves_no_temporaries(tmp_path, monkeypatch):
    import lightning_moe.data.indexed as indexed

    def full_disk(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(indexed.os, "replace", full_disk)
    with pytest.raises(OSError, match="No space left"):
        with IndexedDatasetWriter(str(tmp_path / "ds"), dtype=np.uint16) as w:
            w.add_document([1, 2, 3])
    assert list(tmp_path.iterdir()) == []
