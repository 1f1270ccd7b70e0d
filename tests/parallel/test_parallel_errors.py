"""Bad parallel settings fail before the first step with one line naming the size and what would work."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from lightning_moe import ParallelStrategy
from lightning_moe.data import MockDataModule
from lightning_moe.models.config import (
    AttentionConfig,
    MambaConfig,
    MLPConfig,
    ModelConfig,
    MoEConfig,
)
from lightning_moe.models.decoder import Decoder
from lightning_moe.parallel import ParallelDims
from lightning_moe.parallel.context import load_balanced_indices, shard_batch


def dense(vocab_size: int = 96, intermediate_size: int = 48, **attention) -> ModelConfig:
    return ModelConfig(vocab_size=vocab_size, hidden_size=32, pattern="*-", mlp=MLPConfig(intermediate_size),
                       attention=AttentionConfig(**{"num_heads": 8, "num_kv_heads": 4, "head_dim": 4, **attention}))


def moe(num_experts: int = 8) -> ModelConfig:
    return ModelConfig(vocab_size=96, hidden_size=32, pattern="*E", mlp=None,
                       attention=AttentionConfig(num_heads=4, num_kv_heads=4, head_dim=8),
                       moe=MoEConfig(num_experts=num_experts, top_k=2, intermediate_size=16))


@pytest.mark.parametrize("sizes, world, message", [
    ({"tp": 2, "dp_shard": 2}, 8, r"dp_replicate\*dp_shard\*cp\*tp = 1\*2\*1\*2 = 4 != world size 8 .*dp_shard=-1"),
    ({"tp": 3}, 8, r"dp_replicate\*cp\*tp = 1\*1\*3 = 3 does not divide the world size 8"),
    ({"ep": 3}, 4, r"ep=3 does not divide dp_shard\*cp\*tp = 4\*1\*1 = 4 .*use ep in \[1, 2, 4\]"),
    ({"ep": 8, "tp": 2}, 4, r"ep=8 does not divide dp_shard\*cp\*tp = 2\*1\*2 = 4 .*use ep in \[1, 2, 4\]"),
    ({"cp": 0}, 4, r"cp=0 must be a positive integer"),
    ({"dp_shard": -2}, 4, r"dp_shard=-2 must be a positive integer, or -1"),
    ({"tp": 2.0}, 4, r"tp=2.0 must be an integer"),
])
def test_sizes_that_do_not_fit_the_world(sizes, world, message):
    with pytest.raises((ValueError, TypeError), match=message):
        ParallelDims(**sizes, world_size=world)


def test_dp_shard_takes_the_remaining_ranks():
    dims = ParallelDims(dp_replicate=2, cp=2, tp=2, world_size=16)
    assert dims.sizes == {"dp_replicate": 2, "dp_shard": 2, "cp": 2, "tp": 2, "ep": 1}
    assert (dims.dp_size, dims.dp_cp_size) == (4, 8)
    assert ParallelDims(dp_shard=4, cp=2, ep=4, world_size=8).ep_shard == 2


@pytest.mark.parametrize("world, ep_shard", [(8, 1), (16, 2)])
def test_expert_parallelism_folds_over_tensor_parallel_ranks(world, ep_shard):
    """Nemotron's published tp=2, ep=8 on one and two 8-GPU nodes: ep spans dp_shard x tp on 8 ranks."""
    dims = ParallelDims(tp=2, ep=8, world_size=world)
    assert (dims.dp_shard, dims.ep_shard) == (world // 2, ep_shard)


@pytest.mark.parametrize("config, sizes, message", [
    (dense(), {"tp": 3}, r"tp=3 does not divide num_heads=8; use tp in \[1, 2, 4\]"),
    (dense(num_kv_heads=2), {"tp": 4}, r"tp=4 does not divide num_kv_heads=2; use tp in \[1, 2\]"),
    (dense(intermediate_size=50), {"tp": 4},
     r"tp=4 does not divide mlp.intermediate_size=50; use tp in \[1, 2, 5, 10, 25, 50\]"),
    (dense(vocab_size=90), {"tp": 4}, r"tp=4 does not divide vocab_size=90; pad the vocabulary or use tp in"),
    (moe(num_experts=6), {"ep": 4}, r"ep=4 does not divide moe.num_experts=6; use ep in \[1, 2\]"),
    (dense(), {"ep": 2}, r"ep=2 but the model has no MoE layers; use ep=1"),
    (dense(type="mla", kv_lora_rank=8, qk_nope_head_dim=4, qk_rope_head_dim=4, v_head_dim=4, out_bias=True),
     {"tp": 2}, r"tp=2: tensor parallelism of MLA with attention.out_bias is not supported"),
    (dense(backend="te"), {"cp": 2}, r"cp=2: attention backend 'te' is not supported with context parallelism"),
    (ModelConfig(vocab_size=96, hidden_size=32, pattern="*-", mlp=MLPConfig(48), te_modules=True,
                 attention=AttentionConfig(num_heads=8, num_kv_heads=4, head_dim=4)),
     {"tp": 2}, r"tp=2: model.te_modules: true is not split by tensor parallelism .*use te_modules: false"),
    (ModelConfig(vocab_size=96, hidden_size=32, pattern="M-", mlp=MLPConfig(48), mamba=MambaConfig(num_heads=4)),
     {"cp": 2}, r"cp=2 does not divide mamba.n_groups=1 \(each cp rank scans whole B/C groups\); use cp in \[1\]"),
    (ModelConfig(vocab_size=96, hidden_size=32, pattern="M-", mlp=MLPConfig(48), mamba=MambaConfig(num_heads=4)),
     {"tp": 2}, r"tp=2 does not divide mamba.n_groups=1 \(each tp rank scans whole B/C groups\); use tp in \[1\]"),
    (ModelConfig(vocab_size=96, hidden_size=32, pattern="M-", mlp=MLPConfig(48),
                 mamba=MambaConfig(num_heads=4, n_groups=2)),
     {"tp": 2, "cp": 2}, r"cp\*tp=4 does not divide mamba.n_groups=2 \(each cp\*tp rank scans whole B/C groups\); "
                         r"use cp\*tp in \[1, 2\]"),
])
def test_models_that_do_not_split(config, sizes, message):
    dims = ParallelDims(**sizes, world_size=sizes.get("tp", 1) * sizes.get("cp", 1) * sizes.get("ep", 1))
    with pytest.raises(ValueError, match=message):
        dims.check_model(config)


class PretrainRows:
    seq_length = 18


def test_row_lengths_that_do_not_split():
    dims = ParallelDims(cp=2, tp=2, world_size=4)
    assert dims.sequence_multiple() == 4
    with pytest.raises(ValueError, match=r"PretrainRows.seq_length 18 is not a multiple of 4 \(2\*cp=4 load-balanced "
                                         r"chunks, cp\*tp=4 sequence-parallel shards\); .* e.g. 20"):
        dims.check_data_module(PretrainRows())
    with pytest.raises(ValueError, match=r"MockDataModule.seq_length 18 is not a multiple of 4"):
        dims.check_data_module(MockDataModule(seq_length=18))  # the package's modules state their row length
    with pytest.raises(ValueError, match=r"pad_seq_to_mult=2: unpacked rows must be padded to a multiple of 4"):
        dims.check_data_module(SimpleNamespace(packing="none", pad_seq_to_mult=2, packed_sequence_size=64))
    dims.check_data_module(SimpleNamespace(packing="ffd", pad_seq_to_mult=2, packed_sequence_size=64))
    with pytest.raises(ValueError, match=r"sequence length 6 is not a multiple of 2\*cp=4"):
        load_balanced_indices(6, 2, 0)


def test_strategy_options_are_checked_when_built():
    with pytest.raises(ValueError, match=r"activation_checkpointing='some' is not one of"):
        ParallelStrategy(activation_checkpointing="some")
    with pytest.raises(ValueError, match=r"param_dtype='bf32' is not one of"):
        ParallelStrategy(param_dtype="bf32")
    with pytest.raises(ValueError, match=r"ep=0 must be a positive integer"):
        ParallelStrategy(ep=0)
    with pytest.raises(ValueError, match=r"compile_backend='indcutor' is not a torch.compile backend; .*inductor"):
        ParallelStrategy(compile=True, compile_backend="indcutor")
    ParallelStrategy(compile=True, tp=2)  # compiled blocks under tensor parallelism: see test_parallel_training
    assert ParallelStrategy(tp=2).parallel_sizes == {"dp_replicate": 1, "dp_shard": -1, "cp": 1, "tp": 2, "ep": 1}


class _CPMesh:
    """The two calls ``shard_batch`` makes on a mesh, for a single-process check of the split."""

    def __init__(self, rank: int, size: int) -> None:
        self.rank, self.cp = rank, size

    def size(self) -> int:
        return self.cp

    def get_local_rank(self) -> int:
        return self.rank


def test_context_parallel_split_is_load_balanced_and_complete():
    batch = {"input_ids": torch.arange(16).view(1, 16), "labels": torch.arange(16).view(1, 16).masked_fill(torch.arange(16) % 3 == 0, -100),
             "num_label_tokens": torch.tensor(99)}
    shards = [shard_batch(batch, _CPMesh(rank, 2)) for rank in range(2)]
    assert shards[0]["input_ids"].tolist() == [[0, 1, 2, 3, 12, 13, 14, 15]]
    assert shards[1]["input_ids"].tolist() == [[4, 5, 6, 7, 8, 9, 10, 11]]
    # positions are created from the full row, and the label count is the shard's own
    assert shards[1]["position_ids"].tolist() == [[4, 5, 6, 7, 8, 9, 10, 11]]
    assert sum(int(s["num_label_tokens"]) for s in shards) == int((batch["labels"] != -100).sum())


def test_tensor_parallel_refuses_low_precision_shards_of_partial_blocks():
    from lightning_moe.parallel.native import refuse_converted_layers
    from lightning_moe.precision import Float8Config, apply_float8

    with torch.device("meta"):
        model = Decoder(ModelConfig(vocab_size=64, hidden_size=64, pattern="*-",
                                    attention=AttentionConfig(num_heads=4, num_kv_heads=2, head_dim=16),
                                    mlp=MLPConfig(64)))
    apply_float8(model, Float8Config(recipe="mxfp8", emulate=True, min_dim=16))
    refuse_converted_layers(model, 1)
    with pytest.raises(ValueError, match=r"tp=2: layers.0.attn.k_proj \(TokenPaddedMXFP8Linear\) splits its output "
                                         r"size 32 into shards of 16, not a multiple of 32 .*filter_fqns: \['k_proj'\]"):
        refuse_converted_layers(model, 2)
