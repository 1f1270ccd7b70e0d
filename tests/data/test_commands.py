"""``lightning-moe data ...``: pack, index, samples; errors are one line on stderr."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
from distributed_harness import HANG_GUARD_S

from lightning_moe.data import IndexedDataset, SFTDataModule
from lightning_moe.data.commands import main
from lightning_moe.data.packed_parquet import PackedDataset


def test_pack_then_train_from_packed(tmp_path, tokenizer_path, data_dir, capsys):
    out = tmp_path / "packed"
    rc = main(["pack", "--dataset", str(data_dir / "tulu3_sample.jsonl"), "--tokenizer", tokenizer_path,
               "--preset", "tulu3", "--packed-sequence-size", "4096", "--pad-seq-to-mult", "8",
               "--output", str(out)])
    assert rc == 0
    printed = json.loads(capsys.readouterr().out)
    meta = json.loads((out / "metadata.json").read_text())
    assert sorted(os.listdir(out)) == ["metadata.json", "packed.arrow", "packed.parquet"]
    for key in ("packing_efficiency", "packing_factor", "max_samples_per_pack", "packed_sequence_size"):
        assert key in meta
    assert meta["packed_sequence_size"] == 4096 and meta["pad_seq_to_mult"] == 8
    assert printed["num_packs"] == meta["num_packs"] == len(PackedDataset(str(out)))
    assert meta["packing_efficiency"] > 0.95

    dm = SFTDataModule(tokenizer=tokenizer_path, packed_path=str(out), packed_sequence_size=4096,
                       pad_seq_to_mult=8, micro_batch_size=2)
    dm.setup("fit")
    batch = next(iter(dm.train_dataloader()))
    assert batch["input_ids"].shape == (2, 4096)
    check_memory_mapped_rows_equal_the_parquet_rows(out)


def check_memory_mapped_rows_equal_the_parquet_rows(folder):
    """Training reads ``packed.arrow`` in place (no Arrow allocation for the rows); its rows are the parquet file's,
    which a folder without ``packed.arrow`` is read from."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    before = pa.total_allocated_bytes()
    mapped = PackedDataset(str(folder))
    assert pa.total_allocated_bytes() - before < 2**16, "the rows were copied into memory"
    table = pq.read_table(folder / "packed.parquet").to_pydict()
    assert len(mapped) == len(table["input_ids"]) > 1
    (folder / "packed.arrow").unlink()
    from_parquet = PackedDataset(str(folder))
    for i in range(len(mapped)):
        row, parquet_row = mapped[i], from_parquet[i]
        assert row["input_ids"].tolist() == table["input_ids"][i]
        assert row["labels"].tolist() == table["labels"][i]
        for key in row:
            assert np.array_equal(row[key], parquet_row[key]), (i, key)


def test_pack_prompt_completion_options(tmp_path, tokenizer_path, data_dir):
    out = tmp_path / "math"
    rc = main(["pack", "--dataset", str(data_dir / "openmathinstruct2_sample.jsonl"), "--tokenizer", tokenizer_path,
               "--format", "prompt_completion", "--prompt-template", "Q: {problem} A:",
               "--completion-column", "expected_answer", "--packed-sequence-size", "512", "--packing", "greedy",
               "--split", "train[:50]", "--output", str(out)])
    assert rc == 0
    meta = json.loads((out / "metadata.json").read_text())
    assert meta["num_input_samples"] == 50 and meta["packing"] == "greedy"
    assert meta["format"]["prompt_template"] == "Q: {problem} A:"


def test_index_command(tmp_path, tokenizer_path, data_dir, tokenizer, capsys):
    prefix = tmp_path / "idx" / "sample_text_document"
    rc = main(["index", "--input", str(data_dir / "pretrain_sample.jsonl"), "--tokenizer", tokenizer_path,
               "--output-prefix", str(prefix), "--append-eod"])
    assert rc == 0
    assert json.loads(capsys.readouterr().out)["documents"] == 200
    ours = IndexedDataset(str(prefix))
    shipped = IndexedDataset(str(data_dir / "pretrain_sample_text_document"))
    assert (tmp_path / "idx" / "sample_text_document.bin").read_bytes() == \
        (data_dir / "pretrain_sample_text_document.bin").read_bytes()
    np.testing.assert_array_equal(ours.sequence_lengths, shipped.sequence_lengths)


def test_errors_are_one_line_and_leave_no_output(tmp_path, tokenizer_path, write_rows, capsys):
    bad = write_rows("docs.jsonl", [{"text": "fine"}, {"body": "no text key"}])
    prefix = tmp_path / "out"
    rc = main(["index", "--input", bad, "--tokenizer", tokenizer_path, "--output-prefix", str(prefix)])
    err = capsys.readouterr().err
    assert rc == 1 and err.count("\n") == 1
    assert "docs.jsonl row 1: column 'text' missing (found: body)" in err
    assert not [p for p in os.listdir(tmp_path) if p.startswith("out")]

    rc = main(["pack", "--dataset", bad, "--tokenizer", tokenizer_path, "--preset", "tulu3",
               "--packed-sequence-size", "64", "--output", str(tmp_path / "packed")])
    err = capsys.readouterr().err
    assert rc == 1 and "column 'messages' missing" in err and err.count("\n") == 1
    assert not (tmp_path / "packed").exists()


def test_module_entry_point_in_subprocess(tmp_path, tokenizer_path, data_dir):
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    proc = subprocess.run(
        [sys.executable, "-m", "lightning_moe.data.commands", "index", "--input",
         str(data_dir / "pretrain_sample.jsonl"), "--tokenizer", tokenizer_path, "--output-prefix",
         str(tmp_path / "p"), "--append-eod"],
        capture_output=True, text=True, env=env, timeout=HANG_GUARD_S,
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["documents"] == 200


def test_missing_input_fails_fast(tmp_path, tokenizer_path, capsys):
    rc = main(["index", "--input", "missing.jsonl", "--tokenizer", tokenizer_path, "--output-prefix", str(tmp_path / "q")])
    assert rc == 1 and "missing.jsonl does not exist" in capsys.readouterr().err


def test_samples_command_regenerates_the_shipped_files(tmp_path, data_dir):
    assert main(["samples", "--output", str(tmp_path / "d")]) == 0
    for name in ("tulu3_sample.jsonl", "openmathinstruct2_sample.jsonl", "hellaswag_sample.jsonl",
                 "pretrain_sample.jsonl", "pretrain_sample_text_document.idx", "pretrain_sample_text_document.bin"):
        assert (tmp_path / "d" / name).read_bytes() == (data_dir / name).read_bytes(), name
    assert json.loads((tmp_path / "d" / "tokenizer" / "tokenizer.json").read_text()) == \
        json.loads((data_dir / "tokenizer" / "tokenizer.json").read_text())
