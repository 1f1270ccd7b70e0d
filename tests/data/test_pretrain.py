"""GPT sampling over indexed data, splits, blends and PretrainDataModule batches."""

from __future__ import annotations

import numpy as np
import pytest

from lightning_moe.data import IndexedDataset, IndexedDatasetWriter, PretrainDataModule
from lightning_moe.data.formats import IGNORE_INDEX
from lightning_moe.data.gpt_sampling import GPTDataset, parse_blend, parse_split, split_ranges

EOD = 0


def _write(prefix, docs):
    with IndexedDatasetWriter(prefix, dtype=np.uint16) as w:
        for d in docs:
            w.add_document(d)
    return prefix


def _random_docs(seed, n, lo=1, hi=1000, eod=False):
    rng = np.random.default_rng(seed)
    docs = [rng.integers(lo, hi, size=int(rng.integers(3, 80))) for _ in range(n)]
    return [np.append(d, EOD) for d in docs] if eod else docs


def _documents_in_stream(stream, docs):
    """Walk the stream and name the document found at each position (documents are distinct)."""
    found, pos, unused = [], 0, set(range(len(docs)))
    while pos < len(stream):
        match = [k for k in unused if np.array_equal(stream[pos:pos + len(docs[k])], docs[k][:len(stream) - pos])]
        assert len(match) == 1, f"no unique document at stream position {pos}"
        found.append(match[0])
        unused.discard(match[0])
        pos += len(docs[match[0]])
    return found


def test_samples_tile_one_shuffled_epoch(tmp_path):
    docs = _random_docs(0, 40)
    ds = GPTDataset(IndexedDataset(_write(str(tmp_path / "a"), docs)), seq_length=32, seed=7)
    assert len(ds) == (sum(map(len, docs)) - 1) // 32
    by_position = np.argsort(ds.shuffle_index)  # sample index of stream window j
    texts = [ds.text(int(i)) for i in by_position]
    for a, b in zip(texts, texts[1:]):
        assert a[-1] == b[0]  # consecutive windows overlap by one token
    stream = np.concatenate([t[:-1] for t in texts] + [texts[-1][-1:]])
    order = _documents_in_stream(stream, docs)
    assert len(set(order)) == len(order) and order != sorted(order)  # each document once, shuffled
    item = ds[0]
    np.testing.assert_array_equal(item["labels"], ds.text(0)[1:])
    np.testing.assert_array_equal(item["input_ids"], ds.text(0)[:-1])


def test_more_samples_than_an_epoch_adds_epochs(tmp_path):
    docs = _random_docs(1, 10)
    indexed = IndexedDataset(_write(str(tmp_path / "b"), docs))
    one = GPTDataset(indexed, 16, seed=3)
    three = GPTDataset(indexed, 16, num_samples=3 * len(one), seed=3)
    assert three.num_epochs >= 3 and len(three) == 3 * len(one)
    epochs = three.doc_order.reshape(three.num_epochs, len(docs))
    assert all(sorted(e) == list(range(len(docs))) for e in epochs.tolist())  # every document once per epoch
    assert len({tuple(e) for e in epochs.tolist()}) == three.num_epochs  # each epoch shuffled anew
    again = GPTDataset(indexed, 16, num_samples=3 * len(one), seed=3)
    assert all(np.array_equal(three.text(i), again.text(i)) for i in range(len(three)))
    other = GPTDataset(indexed, 16, num_samples=3 * len(one), seed=4)
    assert any(not np.array_equal(three.text(i), other.text(i)) for i in range(len(three)))


def test_reset_at_eod_and_eod_loss_mask(tmp_path):
    docs = _random_docs(2, 30, eod=True)
    indexed = IndexedDataset(_write(str(tmp_path / "c"), docs))
    plain = GPTDataset(indexed, 64, seed=1)
    reset = GPTDataset(indexed, 64, seed=1, reset_at_eod=True, eod_token_id=EOD)
    masked = GPTDataset(indexed, 64, seed=1, reset_at_eod=True, eod_token_id=EOD, eod_mask_loss=True)
    for i in range(len(plain)):
        tokens = plain[i]["input_ids"]
        np.testing.assert_array_equal(plain[i]["position_ids"], np.arange(64))
        pos = reset[i]["position_ids"]
        for t in range(1, 64):
            assert pos[t] == (0 if tokens[t - 1] == EOD else pos[t - 1] + 1)
        eod_at = tokens == EOD
        np.testing.assert_array_equal(reset[i]["labels"], plain[i]["labels"])  # kept, as Megatron does
        assert (masked[i]["labels"][eod_at] == IGNORE_INDEX).all()
        np.testing.assert_array_equal(masked[i]["labels"][~eod_at], plain[i]["labels"][~eod_at])


def test_parse_split_and_ranges():
    assert parse_split("969,30,1") == pytest.approx([0.969, 0.03, 0.001])
    assert parse_split("1") == [1.0, 0.0, 0.0]
    assert split_ranges(1000, parse_split("969,30,1")) == [(0, 969), (969, 999), (999, 1000)]
    for bad in ("a,b", "1,2,3,4", "0,0"):
        with pytest.raises(ValueError, match="split"):
            parse_split(bad)


def test_parse_blend_forms():
    assert parse_blend(["30", "a", "70", "b"]) == (["a", "b"], [0.3, 0.7])
    assert parse_blend([["a", "b"], None]) == (["a", "b"], [0.5, 0.5])
    assert parse_blend([["a", "b"], [1, 3]]) == (["a", "b"], [0.25, 0.75])
    assert parse_blend("a") == (["a"], [1.0])
    with pytest.raises(ValueError, match="weight 'thirty' at position 0 is not a number"):
        parse_blend(["thirty", "a", "70", "b"])
    with pytest.raises(ValueError, match="even length"):
        parse_blend(["30", "a", "70"])


def test_blend_proportions_within_one_percent(tmp_path):
    a = _write(str(tmp_path / "a"), _random_docs(3, 50, lo=1, hi=1000))
    b = _write(str(tmp_path / "b"), _random_docs(4, 20, lo=1000, hi=2000))
    dm = PretrainDataModule(blend=["30", a, "70", b], split="100,0,0", seq_length=16, train_samples=10_000)
    dm.setup("fit")
    ds = dm.datasets["train"]
    assert len(ds) == 10_000 and dm.datasets["valid"] is None
    from_a = sum(int(ds[i]["input_ids"][0] < 1000) for i in range(len(ds)))
    assert abs(from_a / 10_000 - 0.3) < 0.01


def test_blend_per_split_and_batches(tmp_path, data_dir, tokenizer_path):
    shipped = str(data_dir / "pretrain_sample_text_document")
    other = _write(str(tmp_path / "o"), _random_docs(5, 30))
    dm = PretrainDataModule(blend_per_split=[[[shipped, other], None], [other], None], seq_length=128,
                            tokenizer=tokenizer_path, reset_at_eod=True, micro_batch_size=2, global_batch_size=4,
                            train_samples=64)
    dm.setup("fit")
    assert dm.datasets["test"] is None and dm.test_dataloader() == []
    batch = next(iter(dm.train_dataloader()))
    assert set(batch) == {"input_ids", "labels", "position_ids", "num_label_tokens", "layout"}
    assert batch["input_ids"].shape == (2, 128)
    assert (batch["layout"].labels == batch["labels"].numpy()).all()
    assert (batch["labels"][:, :-1] == batch["input_ids"][:, 1:]).all()
    assert len(list(dm.train_dataloader())) == 64 // 2
    val = next(iter(dm.val_dataloader()))
    assert val["input_ids"].shape == (2, 128)


def test_split_of_shipped_sample(data_dir):
    dm = PretrainDataModule(blend=str(data_dir / "pretrain_sample_text_document"), split="90,8,2", seq_length=64)
    dm.setup()
    sizes = {k: len(v) for k, v in dm.datasets.items()}
    assert sizes["train"] > 10 * sizes["valid"] > 0 and sizes["test"] > 0


def test_bad_blend_weight_rejected_at_construction():
    with pytest.raises(ValueError, match="weight 'x' at position 2 is not a number"):
        PretrainDataModule(blend=["30", "a", "x", "b"])


def test_mock_pretrain():
    dm = PretrainDataModule(mock=True, seq_length=32, vocab_size=100, micro_batch_size=4, train_samples=16)
    batches = list(dm.train_dataloader())
    assert len(batches) == 4 and batches[0]["input_ids"].max() < 100


def test_split_bounds_match_megatron_core(tmp_path):
    """Splits are sequence ranges bounded as megatron-core's builder bounds them (documents of several
    sequences, fractions whose rounding differs per split and cumulatively)."""
    pytest.importorskip("megatron.core.datasets.blended_megatron_dataset_builder")
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset as MegatronGPTDataset
    from megatron.core.datasets.gpt_dataset import GPTDatasetConfig

    prefix = str(tmp_path / "multi")
    rng = np.random.default_rng(0)
    with IndexedDatasetWriter(prefix, dtype=np.uint16) as w:
        for _ in range(10):
            for _ in range(int(rng.integers(1, 4))):
                w.add_item(rng.integers(1, 1000, size=int(rng.integers(20, 40))))
            w.end_document()
    assert len(IndexedDataset(prefix)) > IndexedDataset(prefix).num_documents

    class _Tokenizer:
        eod, pad, vocab_size, unique_identifiers = EOD, -1, 1000, {}

    split = "15,15,70"
    config = GPTDatasetConfig(random_seed=1, sequence_length=8, blend=([prefix], None), split=split,
                              tokenizer=_Tokenizer(), reset_position_ids=False, reset_attention_mask=False,
                              eod_mask_loss=False, path_to_cache=str(tmp_path / "cache"))
    theirs = BlendedMegatronDatasetBuilder(MegatronGPTDataset, [4, 4, 4], lambda: True, config).build()
    dm = PretrainDataModule(blend=prefix, split=split, seq_length=8)
    dm.setup()
    for name, megatron in zip(("train", "valid", "test"), theirs):
        assert set(dm.datasets[name].doc_order.tolist()) == set(megatron.indices.tolist()), name


def test_cached_indices_are_memory_mapped_and_give_the_same_samples(tmp_path):
    """With a cache directory the data module's ``prepare_data`` writes the sampling and blending indices once;
    ``setup`` memory-maps them, and every sample equals the uncached one. Other settings get other files."""
    a = _write(str(tmp_path / "a"), _random_docs(6, 40, lo=1, hi=1000))
    b = _write(str(tmp_path / "b"), _random_docs(7, 30, lo=1000, hi=2000))
    cache = tmp_path / "cache"
    settings = dict(blend=["40", a, "60", b], split="90,10,0", seq_length=16, train_samples=500)
    plain = PretrainDataModule(**settings)
    plain.setup("fit")
    PretrainDataModule(**settings, cache_dir=str(cache)).prepare_data()
    written = sorted(p.name for p in cache.iterdir())
    # train: two GPT members + their blend; valid: the same (one epoch of each member, blended)
    assert sum(name.endswith(".json") for name in written) == 6, written
    assert not any(".tmp" in name for name in written)
    cached = PretrainDataModule(**settings, cache_dir=str(cache))
    cached.setup("fit")
    assert sorted(p.name for p in cache.iterdir()) == written  # read, not rebuilt
    for split in ("train", "valid"):
        ours, reference = cached.datasets[split], plain.datasets[split]
        assert isinstance(ours.dataset_index, np.memmap)
        assert all(isinstance(m.shuffle_index, np.memmap) and isinstance(m.doc_order, np.memmap)
                   for m in ours.datasets)
        assert len(ours) == len(reference)
        for i in range(len(ours)):
            for key, value in reference[i].items():
                np.testing.assert_array_equal(ours[i][key], value)
    PretrainDataModule(**{**settings, "seed": 5}, cache_dir=str(cache)).prepare_data()
    assert len(list(cache.iterdir())) > len(written)
