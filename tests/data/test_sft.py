"""SFTDataModule: batch format, sample boundaries, padding, over-long samples, caching, and the
equivalence of packed and per-sample logits in a real transformers model."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lightning_moe.data import SFTDataModule
from lightning_moe.data.formats import IGNORE_INDEX, SampleFormat, shift_labels, tokenize_row


def _segments(position_ids):
    """(start, end) of every run of positions restarting at 0."""
    starts = [t for t, p in enumerate(position_ids) if p == 0] + [len(position_ids)]
    return list(zip(starts[:-1], starts[1:]))


def _module(tmp_path, tokenizer_path, data_dir, **kw):
    args = dict(tokenizer=tokenizer_path, dataset=str(data_dir / "tulu3_sample.jsonl"), preset="tulu3",
                packed_sequence_size=1024, cache_dir=str(tmp_path / "cache"), micro_batch_size=2)
    args.update(kw)
    dm = SFTDataModule(**args)
    dm.prepare_data()
    dm.setup("fit")
    return dm


def test_batch_format_and_boundaries(tmp_path, tokenizer_path, data_dir, tokenizer):
    dm = _module(tmp_path, tokenizer_path, data_dir)
    batches = list(dm.train_dataloader())
    assert len(batches) == len(dm.train_dataset) // 2
    pad = tokenizer.pad_token_id
    samples_seen = 0
    for batch in batches:
        assert set(batch) == {"input_ids", "labels", "position_ids", "num_label_tokens", "layout"}
        for k in ("input_ids", "labels", "position_ids"):
            assert batch[k].dtype == torch.long and batch[k].shape == (2, 1024)
        # the host layout describes the same rows
        layout = batch["layout"]
        assert (layout.position_ids == batch["position_ids"].numpy()).all()
        assert layout.label_tokens() == int(batch["num_label_tokens"])
        assert layout.packed == bool((batch["position_ids"][:, 1:] == 0).any())
        assert batch["num_label_tokens"].ndim == 0
        assert batch["num_label_tokens"] == (batch["labels"] != IGNORE_INDEX).sum()
        for ids, labels, pos in zip(batch["input_ids"].tolist(), batch["labels"].tolist(),
                                    batch["position_ids"].tolist()):
            for s, e in _segments(pos):
                assert pos[s:e] == list(range(e - s))
                assert labels[e - 1] == IGNORE_INDEX  # no label crosses into the next sample
                for t in range(s, e - 1):
                    assert labels[t] in (IGNORE_INDEX, ids[t + 1])
                if ids[s] == pad:  # pack padding: its own run, no loss
                    assert set(ids[s:e]) == {pad} and set(labels[s:e]) == {IGNORE_INDEX}
                else:
                    assert ids[s] == tokenizer.bos_token_id
                    samples_seen += 1
    meta = dm.train_dataset.metadata
    assert meta["num_dropped_overlong"] > 0 and samples_seen <= meta["num_samples"]


def test_pad_seq_to_mult_and_truncate(tmp_path, tokenizer_path, data_dir):
    dm = _module(tmp_path, tokenizer_path, data_dir, pad_seq_to_mult=16, overlong="truncate",
                 packed_sequence_size=512)
    meta = dm.train_dataset.metadata
    assert meta["num_truncated"] > 0 and meta["num_dropped_overlong"] == 0
    assert meta["num_samples"] == meta["num_input_samples"] == 300
    for i in range(len(dm.train_dataset)):
        row = dm.train_dataset[i]
        starts = [s for s, _ in _segments(row["position_ids"].tolist())]
        assert all(s % 16 == 0 for s in starts) and len(row["input_ids"]) % 16 == 0


def test_label_tokens_equal_per_sample_labels(tmp_path, tokenizer_path, data_dir, tokenizer, tulu_rows):
    """The label tokens of the packed data are exactly those of the samples, tokenized one by one."""
    dm = _module(tmp_path, tokenizer_path, data_dir, packing="greedy", packed_sequence_size=4096)
    expected = []
    for row in tulu_rows:
        ids, mask = tokenize_row(row, tokenizer, SampleFormat())
        if len(ids) <= 4096:
            expected.append([x for x in shift_labels(ids, mask) if x != IGNORE_INDEX])
    got = []
    for i in range(len(dm.train_dataset)):
        row = dm.train_dataset[i]
        for s, e in _segments(row["position_ids"].tolist()):
            got.append([x for x in row["labels"][s:e].tolist() if x != IGNORE_INDEX])
    assert got == expected  # greedy keeps dataset order


def test_cache_is_reused(tmp_path, tokenizer_path, data_dir, monkeypatch):
    import lightning_moe.data.sft as sft

    first = _module(tmp_path, tokenizer_path, data_dir)
    calls = []
    original = sft.build_packed_sft
    monkeypatch.setattr(sft, "build_packed_sft", lambda *a, **k: calls.append(1) or original(*a, **k))
    second = _module(tmp_path, tokenizer_path, data_dir)
    assert calls == [] and second.train_dataset.path == first.train_dataset.path
    third = _module(tmp_path, tokenizer_path, data_dir, pad_seq_to_mult=8)  # new settings -> rebuild
    assert calls == [1] and third.train_dataset.path != first.train_dataset.path


def test_validation_loader(tmp_path, tokenizer_path, data_dir):
    dm = _module(tmp_path, tokenizer_path, data_dir, preset="hellaswag",
                 dataset=str(data_dir / "hellaswag_sample.jsonl"), val_dataset=str(data_dir / "hellaswag_sample.jsonl"),
                 val_split="train[:50]", packed_sequence_size=256)
    val = list(dm.val_dataloader())
    assert val and all(b["input_ids"].shape == (2, 256) for b in val)
    assert dm.val_dataset_packed.metadata["num_samples"] == 50


def test_unpacked_rows_pad_to_longest(tmp_path, tokenizer_path, data_dir):
    dm = _module(tmp_path, tokenizer_path, data_dir, packing="none", pad_seq_to_mult=8,
                 dataset=str(data_dir / "openmathinstruct2_sample.jsonl"), preset="openmathinstruct2")
    batch = next(iter(dm.train_dataloader()))
    width = batch["input_ids"].shape[1]
    assert width % 8 == 0 and width < 1024
    assert all(len(_segments(p.tolist())) <= 2 for p in batch["position_ids"])


def _tiny_llama(vocab_size):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                      attn_implementation="sdpa")
    return LlamaForCausalLM(cfg).float().eval()


def test_packed_logits_equal_per_sample_logits(tmp_path, tokenizer_path, data_dir, tokenizer):
    dm = _module(tmp_path, tokenizer_path, data_dir, packed_sequence_size=512, pad_seq_to_mult=4,
                 dataset=str(data_dir / "openmathinstruct2_sample.jsonl"), preset="openmathinstruct2")
    batch = next(iter(dm.train_dataloader()))
    model = _tiny_llama(len(tokenizer))
    ids, pos, labels = batch["input_ids"][:1], batch["position_ids"][:1], batch["labels"][:1]
    segments = _segments(pos[0].tolist())
    assert len(segments) >= 3
    # a block-diagonal causal mask built from the position-id restarts
    seg_id = torch.cumsum((pos[0] == 0).long(), 0)
    block = (seg_id[:, None] == seg_id[None, :]) & torch.ones(512, 512, dtype=torch.bool).tril()
    with torch.no_grad():
        packed_mask = model(input_ids=ids, position_ids=pos, attention_mask=block[None, None]).logits[0]
        # transformers' own packed-sequence detection from restarting position_ids (needs no cache)
        packed_pos = model(input_ids=ids, position_ids=pos, use_cache=False).logits[0]
        per_sample_loss = torch.zeros(())
        for s, e in segments:
            if ids[0, s] == tokenizer.pad_token_id:
                continue
            alone = model(input_ids=ids[:, s:e]).logits[0]
            assert (packed_mask[s:e] - alone).abs().max() <= 1e-4
            assert (packed_pos[s:e] - alone).abs().max() <= 1e-4
            per_sample_loss += torch.nn.functional.cross_entropy(alone, labels[0, s:e], ignore_index=IGNORE_INDEX,
                                                                 reduction="sum")
    # the summed loss of the packed row (labels already shifted: no shift here) is the samples' sum
    packed_loss = torch.nn.functional.cross_entropy(packed_mask, labels[0], ignore_index=IGNORE_INDEX,
                                                    reduction="sum")
    assert torch.allclose(packed_loss, per_sample_loss, rtol=1e-5)


def test_hub_style_split_slicing_and_parquet(tmp_path, tokenizer_path, data_dir):
    import datasets

    ds = datasets.load_dataset("json", data_files=str(data_dir / "tulu3_sample.jsonl"), split="train")
    ds.to_parquet(str(tmp_path / "tulu.parquet"))
    ds.save_to_disk(str(tmp_path / "tulu_disk"))
    counts = []
    for source in (str(tmp_path / "tulu.parquet"), str(tmp_path / "tulu_disk")):
        dm = _module(tmp_path, tokenizer_path, data_dir, dataset=source, split="train[:40]")
        counts.append(dm.train_dataset.metadata["num_input_samples"])
    assert counts == [40, 40]


def test_global_batch_size_must_divide(tmp_path, tokenizer_path, data_dir):
    with pytest.raises(ValueError, match="global_batch_size 3 must be a positive multiple of micro_batch_size 2"):
        SFTDataModule(tokenizer=tokenizer_path, dataset="x.jsonl", micro_batch_size=2, global_batch_size=3)
    dm = _module(tmp_path, tokenizer_path, data_dir, global_batch_size=4)

    class _Strategy:
        data_parallel_rank, data_parallel_size = 0, 3

    class _Trainer:
        strategy, global_rank, world_size, training = _Strategy(), 0, 6, True

    dm.trainer = _Trainer()
    with pytest.raises(ValueError, match=r"divisible by micro_batch_size \* data-parallel size = 2 \* 3"):
        dm.train_dataloader()


def test_lengths_scale(tokenizer, tulu_rows):
    lengths = [len(tokenize_row(r, tokenizer, SampleFormat())[0]) for r in tulu_rows]
    assert 15 <= min(lengths) <= 60 and 2000 <= max(lengths) <= 4000
    assert np.median(lengths) < 600


def test_tokenization_workers_give_the_same_packs(tmp_path, tokenizer_path, data_dir):
    one = _module(tmp_path / "a", tokenizer_path, data_dir)
    two = _module(tmp_path / "b", tokenizer_path, data_dir, num_proc=2)
    assert len(one.train_dataset) == len(two.train_dataset)
    for i in range(len(one.train_dataset)):
        for k in ("input_ids", "labels", "position_ids"):
            assert np.array_equal(one.train_dataset[i][k], two.train_dataset[i][k])


def test_save_to_disk_slices_count_rows_like_datasets(tmp_path, write_rows):
    """A percent slice of a save_to_disk folder selects the rows datasets selects from the same file."""
    import datasets

    from lightning_moe.data.sources import load_source

    path = write_rows("rows.jsonl", [{"text": str(i)} for i in range(10)])
    datasets.load_dataset("json", data_files=path, split="train").save_to_disk(str(tmp_path / "disk"))
    for split in ("train[:15%]", "train[15%:]", "train[:25%]", "train[-35%:]", "train[2:7]"):
        from_file = load_source(path, split).dataset["text"]
        assert load_source(str(tmp_path / "disk"), split).dataset["text"] == from_file, split


def test_cache_built_by_another_node_at_the_same_time(tmp_path, tokenizer, data_dir, monkeypatch):
    """Two nodes sharing the cache build the same folder; the one whose rename loses uses the winner's."""
    import lightning_moe.data.sft as sft
    from lightning_moe.data.sft import cached_packed_sft, make_sample_format

    original = sft.build_packed_sft

    def other_node_first(path, *args):
        original(path, *args)  # the other node's copy lands first
        raise OSError(39, "Directory not empty")  # so this node's rename fails

    monkeypatch.setattr(sft, "build_packed_sft", other_node_first)
    args = (str(tmp_path / "cache"), str(data_dir / "hellaswag_sample.jsonl"), tokenizer,
            make_sample_format("hellaswag"), 256, 1, "ffd", "drop", "train", None, None, None, False)
    path = cached_packed_sft(*args)
    assert sft.PackedDataset(path).metadata["num_input_samples"] == 200

    def disk_full(path, *args):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(sft, "build_packed_sft", disk_full)
    with pytest.raises(OSError, match="No space left"):
        cached_packed_sft(str(tmp_path / "other_cache"), *args[1:])
