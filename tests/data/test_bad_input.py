"""Bad SFT input: clear errors naming file, row and column, or counted skips when asked for."""

from __future__ import annotations

import logging

import pytest

from lightning_moe.data import SFTDataModule
from lightning_moe.data.packed_parquet import PackedDataset

GOOD = {"id": "a", "messages": [{"role": "user", "content": "Hi there."},
                                {"role": "assistant", "content": "Hello! How can I help?"}], "source": "s"}


def _build(tmp_path, tokenizer_path, path, **kw):
    args = dict(tokenizer=tokenizer_path, dataset=path, preset="tulu3", packed_sequence_size=256,
                cache_dir=str(tmp_path / "cache"))
    args.update(kw)
    dm = SFTDataModule(**args)
    dm.setup("fit")
    return dm


def test_missing_column_names_the_columns_found(tmp_path, tokenizer_path, write_rows):
    path = write_rows("tulu3.jsonl", [{"id": "a", "text": "hello"}] * 3)
    with pytest.raises(ValueError, match=r"tulu3\.jsonl: column 'messages' missing \(found: id, text\)"):
        _build(tmp_path, tokenizer_path, path)
    math_path = write_rows("math.jsonl", [{"problem": "1+1?", "solution": "2"}])
    with pytest.raises(ValueError, match=r"math\.jsonl: column 'generated_solution' missing \(found: problem, solution\)"):
        _build(tmp_path, tokenizer_path, math_path, preset="openmathinstruct2")


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        ({"id": "b", "messages": [{"role": "user", "content": "Only a question?"}], "source": "s"},
         r"row 17: column 'messages' has no assistant turn \(roles: user\)"),
        ({"id": "b", "messages": [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "  "}],
          "source": "s"}, "row 17: column 'messages' message 1: empty assistant content"),
        ({"id": "b", "messages": [], "source": "s"}, "row 17: column 'messages' must be a non-empty list"),
        ({"id": "b", "messages": [{"role": "user", "content": "Q"}, {"role": "assistant", "content": None}],
          "source": "s"}, "row 17: column 'messages' message 1 must have string 'role' and 'content'"),
        ({"id": "b", "source": "s"}, "row 17: column 'messages' is missing or null"),
    ],
)
def test_bad_row_is_named(tmp_path, tokenizer_path, write_rows, bad, message):
    rows = [GOOD] * 17 + [bad] + [GOOD] * 3
    path = write_rows("tulu3.jsonl", rows)
    with pytest.raises(ValueError, match=r"tulu3\.jsonl " + message):
        _build(tmp_path, tokenizer_path, path)


def test_wrong_types_in_prompt_completion(tmp_path, tokenizer_path, write_rows):
    good = {"problem": "What is 2+2?", "generated_solution": "4", "expected_answer": "4", "problem_source": "m"}
    rows = [good, dict(good, generated_solution=""), good]
    path = write_rows("math.jsonl", rows)
    with pytest.raises(ValueError, match=r"math\.jsonl row 1: column 'generated_solution' is empty"):
        _build(tmp_path, tokenizer_path, path, preset="openmathinstruct2")
    hella = {"ctx": "A man walks.", "endings": ["a", "b", "c", "d"], "label": "7"}
    path = write_rows("hella.jsonl", [hella])
    with pytest.raises(ValueError, match=r"hella\.jsonl row 0: column 'label' is '7' but there are 4 endings"):
        _build(tmp_path, tokenizer_path, path, preset="hellaswag")


def test_json_type_conflict_names_the_file(tmp_path, tokenizer_path, write_rows):
    path = write_rows("mixed.jsonl", [GOOD, {"id": "b", "messages": "not a list", "source": "s"}])
    with pytest.raises(ValueError, match=r"mixed\.jsonl"):
        _build(tmp_path, tokenizer_path, path)


def test_skip_invalid_rows_counts(tmp_path, tokenizer_path, write_rows, caplog):
    bad = {"id": "b", "messages": [{"role": "user", "content": "Only a question?"}], "source": "s"}
    path = write_rows("tulu3.jsonl", [GOOD, bad, GOOD, bad, GOOD])
    with caplog.at_level(logging.WARNING):
        dm = _build(tmp_path, tokenizer_path, path, skip_invalid_rows=True, micro_batch_size=1)
    meta = dm.train_dataset.metadata
    assert meta["num_skipped_invalid"] == 2 and meta["num_samples"] == 3
    assert "skipped 2 invalid rows" in caplog.text


def test_overlong_drop_is_counted_and_logged(tmp_path, tokenizer_path, write_rows, caplog):
    long = {"id": "l", "source": "s", "messages": [{"role": "user", "content": "Tell me everything."},
                                                   {"role": "assistant", "content": "word " * 600}]}
    path = write_rows("tulu3.jsonl", [GOOD, long, GOOD])
    with caplog.at_level(logging.INFO):
        dm = _build(tmp_path, tokenizer_path, path, micro_batch_size=1)
    assert dm.train_dataset.metadata["num_dropped_overlong"] == 1
    assert "1 over-long samples (> 256 tokens) dropped" in caplog.text


def test_missing_sources(tmp_path, tokenizer_path):
    with pytest.raises(FileNotFoundError, match="nothere.jsonl does not exist"):
        _build(tmp_path, tokenizer_path, str(tmp_path / "nothere.jsonl"))
    with pytest.raises(FileNotFoundError, match="not a packed dataset folder"):
        PackedDataset(str(tmp_path))
    with pytest.raises(FileNotFoundError, match="tokenizer"):
        _build(tmp_path, str(tmp_path / "no_tokenizer"), str(tmp_path / "x.jsonl"))
    with pytest.raises(ValueError, match="unknown preset 'tulu4'"):
        SFTDataModule(tokenizer=tokenizer_path, dataset="x.jsonl", preset="tulu4")


def test_failed_pack_leaves_neither_output_nor_temporary(tmp_path):
    import numpy as np

    from lightning_moe.data.packed_parquet import TokenizedSamples, write_packed_dataset

    ids = np.arange(10, dtype=np.int64)
    samples = TokenizedSamples(ids, ids.copy(), np.array([0, 4, 10]))
    with pytest.raises(TypeError, match="not JSON serializable"):
        write_packed_dataset(str(tmp_path / "packed"), samples, 16, metadata={"source": object()})
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"packing": "fdd"}, "packing must be one of ffd, greedy, none, got 'fdd'"),
        ({"overlong": "cut"}, "overlong must be one of drop, truncate, got 'cut'"),
        ({"packed_sequence_size": 1000, "pad_seq_to_mult": 16},
         "packed_sequence_size 1000 must be a positive multiple of pad_seq_to_mult 16"),
    ],
)
def test_bad_packing_options_fail_before_tokenizing(tokenizer_path, options, message):
    """The data module refuses them at construction, not after hours of tokenization."""
    with pytest.raises(ValueError, match=message):
        SFTDataModule(tokenizer=tokenizer_path, dataset="never_read.jsonl", **options)
