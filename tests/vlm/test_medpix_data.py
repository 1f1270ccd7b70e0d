"""MedPix data on the shipped sample: loss masks are exactly the answers through the end-of-turn token, image
tokens match the image processor, packed rows keep samples apart, and bad rows are counted or named."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from tiny_vlm import SAMPLE, save_tokenizer_and_image_processor

from lightning_moe.data import MedPixDataModule

END_OF_TURN = "<|im_end|>"


@pytest.fixture(scope="module")
def processor_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("processor")
    save_tokenizer_and_image_processor(path)
    return path


def rows(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def data(processor_dir, dataset=SAMPLE / "train.jsonl", **options):
    module = MedPixDataModule(processor=str(processor_dir), dataset=str(dataset), **options)
    module.setup("fit")
    return module


def test_loss_masks_are_the_answers_through_the_end_of_turn_token(processor_dir):
    module = data(processor_dir)
    tokenizer = module.processor.tokenizer
    expected = rows(SAMPLE / "train.jsonl")
    assert len(module.train_data) == len(expected) and not module.skipped["train"]
    grids = set()
    for i, row in enumerate(expected):
        sample = module.train_data[i]
        labels, ids = sample["labels"], sample["input_ids"]
        assert tokenizer.decode(labels[labels != -100]) == row["answer"] + END_OF_TURN
        # shifted labels: the target of position t is token t + 1
        targets = labels != -100
        assert (labels[:-1][targets[:-1]] == ids[1:][targets[:-1]]).all()
        text = tokenizer.decode(ids)
        assert text.endswith(row["answer"] + END_OF_TURN + "\n") and row["question"] in text
        grid = sample["image_grid_thw"][0]
        image_tokens = int((ids == module.processor.image_token_id).sum())
        assert image_tokens == int(grid.prod()) // 4 == int(sample["mm_token_type_ids"].sum())
        assert sample["pixel_values"].shape[0] == int(grid.prod())
        grids.add(tuple(grid.tolist()))
    assert len(grids) > 3, f"expected images of several sizes, got grids {grids}"


def test_packed_rows_keep_each_sample_and_its_image(processor_dir):
    module = data(processor_dir, packing="ffd", packed_sequence_size=256, micro_batch_size=2)
    answers = {row["answer"] + END_OF_TURN for row in rows(SAMPLE / "train.jsonl")}
    tokenizer = module.processor.tokenizer
    assert len(module.train_data) < len(rows(SAMPLE / "train.jsonl")) / 2
    for i in range(len(module.train_data)):
        row = module.train_data[i]
        starts = (row["position_ids"] == 0).nonzero()[0].tolist() + [len(row["input_ids"])]
        assert len(starts) - 1 == len(row["image_grid_thw"]) == len(module.train_data.packs[i])
        for start, end in zip(starts[:-1], starts[1:]):
            labels = row["labels"][start:end]
            assert tokenizer.decode(labels[labels != -100]) in answers
    batch = next(iter(module.train_dataloader()))
    assert batch["input_ids"].shape == (2, 256)
    assert batch["pixel_values"].shape[0] == int(batch["image_grid_thw"].prod(-1).sum())
    assert int(batch["num_label_tokens"]) == int((batch["labels"] != -100).sum())
    assert torch.equal(batch["mm_token_type_ids"].bool(), batch["input_ids"] == module.processor.image_token_id)


def test_bad_rows_are_counted_and_skipped_or_stop_the_run_naming_the_row(processor_dir, tmp_path):
    shutil.copytree(SAMPLE / "images", tmp_path / "images")
    (tmp_path / "images" / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n not really a png")
    good = rows(SAMPLE / "train.jsonl")[:6]
    bad = [{**good[0], "image_id": "images/missing.png"}, {**good[1], "image_id": "images/broken.png"},
           {**good[2], "image_id": None}, {**good[3], "answer": "  "}]
    dataset = tmp_path / "rows.jsonl"
    dataset.write_text("\n".join(json.dumps(r) for r in good[:3] + bad + good[3:]) + "\n")
    module = data(processor_dir, dataset)
    assert len(module.train_data) == 6
    assert module.skipped["train"] == {"missing or undecodable image": 3, "invalid text": 1}
    with pytest.raises(ValueError, match=r"rows.jsonl row 3: column 'image_id': image file .*missing.png does not "
                                         r"exist \(set bad_rows: skip"):
        data(processor_dir, dataset, bad_rows="error")
    (tmp_path / "no_answer.jsonl").write_text(json.dumps({"image_id": "x.png", "question": "q"}) + "\n")
    with pytest.raises(ValueError, match="column 'answer' missing"):
        data(processor_dir, tmp_path / "no_answer.jsonl")


def test_image_feature_parquet_with_embedded_bytes(processor_dir, tmp_path):
    """The hub dataset's layout: a parquet whose ``image_id`` is a ``datasets`` Image column (PNG bytes); an
    undecodable image is one skipped row, not a crash inside ``datasets``."""
    import datasets

    records = rows(SAMPLE / "train.jsonl")[:5]
    images = [{"bytes": (SAMPLE / r["image_id"]).read_bytes(), "path": None} for r in records]
    images[2] = {"bytes": b"garbage", "path": None}
    table = {key: [r[key] for r in records] for key in ("mode", "case_id", "question", "answer")}
    ds = datasets.Dataset.from_dict({"image_id": images, **table}).cast_column("image_id", datasets.Image())
    ds.to_parquet(tmp_path / "train.parquet")
    module = data(processor_dir, tmp_path / "train.parquet")
    assert len(module.train_data) == 4
    assert module.skipped["train"] == {"missing or undecodable image": 1}
    tokenizer = module.processor.tokenizer
    labels = module.train_data[0]["labels"]
    assert tokenizer.decode(labels[labels != -100]) == records[0]["answer"] + END_OF_TURN
