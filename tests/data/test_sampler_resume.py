"""Data-parallel sharding and exact resume (through a real Lightning Trainer and checkpoint)."""

from __future__ import annotations

import lightning as L
import numpy as np
import pytest
import torch

from lightning_moe.data import MockDataModule, SFTDataModule
from lightning_moe.data.sampler import DataParallelSampler


class _Strategy:
    def __init__(self, rank, size):
        self.data_parallel_rank, self.data_parallel_size = rank, size


class _SamplerKwargs:
    def __init__(self, **kwargs):
        self.distributed_sampler_kwargs = kwargs


class _Trainer:
    """What the data modules read from a trainer: the strategy's data-parallel rank, or global rank."""

    training = True

    def __init__(self, strategy, global_rank=0, world_size=1):
        self.strategy, self.global_rank, self.world_size = strategy, global_rank, world_size


def test_sampler_shards_disjointly_and_covers_the_epoch():
    ds = list(range(103))
    per_rank = [list(DataParallelSampler(ds, r, 4, micro_batch_size=3, global_batch_size=24, seed=5))
                for r in range(4)]
    assert len({len(p) for p in per_rank}) == 1 and len(per_rank[0]) == 96 // 4
    flat = [i for p in per_rank for i in p]
    assert len(set(flat)) == 96  # disjoint, an epoch truncated to whole global batches
    order = DataParallelSampler(ds, 0, 4, 3, 24, seed=5).epoch_order(0)
    step0 = [i for r in range(4) for i in per_rank[r][:3]]
    assert step0 == order[:12].tolist()  # one step = consecutive chunks of the global order


def test_sampler_resumes_at_consumed_samples():
    ds = list(range(50))
    full = list(DataParallelSampler(ds, 1, 2, micro_batch_size=2, seed=3)) + \
        list(DataParallelSampler(ds, 1, 2, micro_batch_size=2, seed=3, consumed_samples=48))
    resumed = list(DataParallelSampler(ds, 1, 2, micro_batch_size=2, seed=3, consumed_samples=20))
    assert resumed == full[10:24]
    with pytest.raises(ValueError, match="not a multiple"):
        list(DataParallelSampler(ds, 1, 2, micro_batch_size=2, consumed_samples=3))


def test_model_parallel_peers_get_the_same_batches_dp_ranks_differ():
    def first_batches(trainer):
        dm = MockDataModule(seq_length=8, micro_batch_size=2, vocab_size=1000, num_train_samples=64)
        dm.trainer = trainer
        it = iter(dm.train_dataloader())
        return [next(it)["input_ids"] for _ in range(3)]

    # global ranks 0 and 1 are tensor-parallel peers in data-parallel rank 0; rank 2 is dp rank 1
    peer_a = first_batches(_Trainer(_Strategy(0, 2), global_rank=0, world_size=4))
    peer_b = first_batches(_Trainer(_Strategy(0, 2), global_rank=1, world_size=4))
    other = first_batches(_Trainer(_Strategy(1, 2), global_rank=2, world_size=4))
    assert all(torch.equal(a, b) for a, b in zip(peer_a, peer_b))
    assert not any(torch.equal(a, c) for a, c in zip(peer_a, other))
    # Lightning's own strategies name the data-parallel rank in distributed_sampler_kwargs (ModelParallelStrategy:
    # its data-parallel mesh, so global rank 3 of a 2 x 2 dp x tp mesh is dp rank 1)
    lightning_mp = first_batches(_Trainer(_SamplerKwargs(rank=1, num_replicas=2), global_rank=3, world_size=4))
    assert all(torch.equal(a, c) for a, c in zip(lightning_mp, other))
    # without either, the trainer's global rank and world size are used
    plain = first_batches(_Trainer(object(), global_rank=1, world_size=2))
    assert all(torch.equal(a, c) for a, c in zip(plain, other))


def test_mock_is_deterministic_per_seed_and_index():
    a = MockDataModule(seq_length=16, vocab_size=50, seed=1, num_train_samples=8, micro_batch_size=4)
    b = MockDataModule(seq_length=16, vocab_size=50, seed=1, num_train_samples=8, micro_batch_size=2)
    ba, bb = next(iter(a.train_dataloader())), next(iter(b.train_dataloader()))
    assert torch.equal(ba["input_ids"][:2], bb["input_ids"])
    assert torch.equal(ba["labels"][:, :-1], ba["input_ids"][:, 1:])
    assert ba["num_label_tokens"] == 4 * 16


class _Recorder(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1))
        self.seen: list[tuple[int, ...]] = []

    def training_step(self, batch, batch_idx):
        for row in batch["input_ids"]:
            self.seen.append(tuple(row[:24].tolist()))
        return (self.w * batch["num_label_tokens"].float()).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)


def _trainer(max_steps, tmp_path, callbacks=()):
    return L.Trainer(max_steps=max_steps, accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                     enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
                     callbacks=list(callbacks), default_root_dir=str(tmp_path), enable_checkpointing=bool(callbacks))


def test_resume_continues_with_the_next_samples(tmp_path, tokenizer_path, data_dir):
    """Uninterrupted run vs. a run resumed from a mid-epoch checkpoint (with DataLoader workers)."""

    def module(num_workers):
        return SFTDataModule(tokenizer=tokenizer_path, dataset=str(data_dir / "hellaswag_sample.jsonl"),
                             preset="hellaswag", packed_sequence_size=128, micro_batch_size=2,
                             cache_dir=str(tmp_path / "cache"), seed=11, num_workers=num_workers)

    ckpt = L.pytorch.callbacks.ModelCheckpoint(dirpath=str(tmp_path / "ckpt"), every_n_train_steps=7,
                                               save_top_k=-1, filename="{step}")
    reference = _Recorder()
    dm = module(0)
    _trainer(30, tmp_path, [ckpt]).fit(reference, dm)
    steps_per_epoch = len(dm.train_dataset) // 2
    assert 7 < steps_per_epoch < 30  # the resumed run crosses an epoch boundary
    assert dm.state_dict()["consumed_samples"] == 60

    resumed = _Recorder()
    dm2 = module(2)
    _trainer(30, tmp_path).fit(resumed, dm2, ckpt_path=str(tmp_path / "ckpt" / "step=7.ckpt"))
    assert resumed.seen == reference.seen[14:]
    epoch0, epoch1 = reference.seen[:2 * steps_per_epoch], reference.seen[2 * steps_per_epoch:]
    assert len(set(epoch0)) == len(epoch0) and epoch1[: len(epoch0)] != epoch0[: len(epoch1)]


def test_state_dict_round_trip_without_trainer():
    dm = MockDataModule(seq_length=4, micro_batch_size=2, num_train_samples=20, vocab_size=100)
    full = [b["input_ids"] for b in dm.train_dataloader()]
    dm.advance(3)
    fresh = MockDataModule(seq_length=4, micro_batch_size=2, num_train_samples=20, vocab_size=100)
    fresh.load_state_dict(dm.state_dict())
    rest = [b["input_ids"] for b in fresh.train_dataloader()]
    assert len(rest) == len(full) - 3 and all(torch.equal(a, b) for a, b in zip(rest, full[3:]))
    assert np.all([b.shape == (2, 4) for b in rest])


def test_resuming_with_another_global_batch_size_warns_and_keeps_the_position():
    dm = MockDataModule(seq_length=4, micro_batch_size=2, global_batch_size=4, num_train_samples=40, vocab_size=100)
    dm.advance(4)
    resumed = MockDataModule(seq_length=4, micro_batch_size=2, global_batch_size=8, num_train_samples=40,
                             vocab_size=100)
    with pytest.warns(UserWarning, match=r"resuming with global_batch_size 8 but the checkpoint used 4: .*8 consumed"):
        resumed.load_state_dict(dm.state_dict())
    assert resumed.consumed_samples == 8
