"""Context parallelism and packed rows on the generic transformers path (``model: {hf: ...}``).

Tiny random MiMo-V2-Flash (sliding-window layers with attention sinks, unequal q/k and v head widths, MoE) and
Laguna (sliding-window layers, gated heads, MoE) checkpoints built from their config classes (and Qwen3-MoE forced
through transformers) train on packed
rows (documents of 3-8 tokens, positions restarting, a sliding window of 4) with their attention switched to the
package's context-parallel attention: five AdamW steps' losses within 1e-5 and the first step's gradients within
1e-5 of the same model on one process with transformers' own attention and masks; cp composes with FSDP, expert
parallelism (ep=2 x cp=2) and activation checkpointing. Models whose layers carry a state along the sequence are
refused by name; on one process packed rows give each sample's logits alone.
"""

from __future__ import annotations

import json

import parallel_cases
import pytest
import torch
from distributed_harness import run_distributed_test
from hf_cp_cases import VOCAB, fit_context_parallel

from lightning_moe.models.hf import HFModelConfig, build_hf_model
from lightning_moe.parallel import ParallelDims, parallelize

WINDOW = 4  # shorter than the longest packed documents, so the window masks something


def tiny(tmp_path, architecture: str, **overrides) -> str:
    from tiny_hf_models import save_tiny
    from tiny_hf_moes import ARCHITECTURES

    return str(save_tiny(ARCHITECTURES[architecture](**overrides), tmp_path / architecture))


@pytest.mark.distributed
def test_cp_with_packed_rows_matches_one_process_with_fsdp_ep_and_checkpointing(tmp_path):
    mimo = tiny(tmp_path, "mimo_v2_flash", sliding_window=WINDOW)
    laguna = tiny(tmp_path, "laguna", sliding_window=WINDOW)
    qwen3_moe = tiny(tmp_path, "qwen3_moe")
    cases = [
        ("hf_cp_cases.run_hf_layout", ("mimo_v2_flash ep=2 x cp=2 x fsdp", mimo, {"dp_shard": 2, "cp": 2, "ep": 2}), {}),
        ("hf_cp_cases.run_hf_layout", ("qwen3_moe (native: never) ep=2 x cp=2 x fsdp", qwen3_moe,
                                       {"dp_shard": 2, "cp": 2, "ep": 2}), {}),
        ("hf_cp_cases.run_hf_layout", ("laguna cp=2 x fsdp, full activation checkpointing", laguna,
                                       {"dp_shard": 2, "cp": 2}), {"activation_checkpointing": "full"}),
        ("hf_cp_cases.run_hf_layout", ("mimo_v2_flash cp=4", mimo, {"dp_shard": 1, "cp": 4}), {}),
    ]
    run_distributed_test(parallel_cases.check_cases, 4, cases)


@pytest.mark.distributed
def test_trainer_with_cp2_trains_like_one_process(tmp_path):
    """The training module under ParallelStrategy(cp=2): the strategy splits each micro-batch along the sequence
    and the loss is normalized over the cp ranks; five steps' losses equal one process's."""
    from trainer_cases import SEQ, fit

    laguna = tiny(tmp_path, "laguna", sliding_window=WINDOW)
    single, _ = fit(laguna, str(tmp_path / "single"), steps=5, native="never")
    root = tmp_path / "cp"
    root.mkdir()
    run_distributed_test(fit_context_parallel, 2, laguna, str(root), {"cp": 2}, init_process_group=False)
    record = json.loads((root / "losses.json").read_text())
    assert record["query_lengths"] == [SEQ // 2] and record["calls"] >= 5 * 2 * 3  # steps x micro-batches x layers
    assert len(record["losses"]) == 5 and record["losses"] == pytest.approx(single, abs=1e-5)


@pytest.mark.parametrize("architecture, message", [
    ("qwen3_next", r"cp=2: Qwen3NextForCausalLM runs through transformers .*context parallelism splits attention only "
                   r"\(Qwen3NextGatedDeltaNet, layer type 'linear_attention' carry a state along the sequence"),
    ("kimi_linear", r"cp=2: KimiLinearForCausalLM runs through transformers .*\(KimiLinearDeltaAttention, layer type "
                    r"'linear_attention' carry a state along the sequence"),
])
def test_cp_of_layers_that_carry_a_state_along_the_sequence_is_refused_by_name(tmp_path, architecture, message):
    model_dir = tiny(tmp_path, architecture)
    dims = ParallelDims(cp=2, world_size=2)  # refused before any mesh is used
    with pytest.raises(ValueError, match=message):
        build_hf_model(HFModelConfig(hf=model_dir, native="never"), parallelize=lambda m: parallelize(m, dims))


@pytest.mark.parametrize("architecture, message", [
    ("glm_moe_dsa", r"cp=2: GlmMoeDsaForCausalLM's GlmMoeDsaIndexer select or pool keys along the sequence"),
    ("deepseek_v4", r"cp=2: DeepseekV4ForCausalLM's DeepseekV4CSACompressor, DeepseekV4Indexer select or pool keys "
                    r"along the sequence"),
])
def test_cp_of_sparse_attention_indexers_and_kv_compressors_is_refused_by_name(tmp_path, architecture, message):
    """Their key selection reaches attention only as a mask of the model's own making, over local keys."""
    model_dir = tiny(tmp_path, architecture)
    dims = ParallelDims(cp=2, world_size=2)
    with pytest.raises(ValueError, match=message):
        build_hf_model(HFModelConfig(hf=model_dir, native="never"), parallelize=lambda m: parallelize(m, dims))


def qwen2_moe_config():
    """Qwen2-MoE with its sliding window on: its attention does not pass ``sliding_window`` to the attention
    function (transformers' mask alone carries it)."""
    import transformers as t

    return t.Qwen2MoeConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
        shared_expert_intermediate_size=32, num_experts=4, num_experts_per_tok=2, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, use_sliding_window=True, sliding_window=WINDOW,
        max_window_layers=2, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )


@pytest.fixture
def one_rank_cp_mesh():
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,), mesh_dim_names=("cp",))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("architecture", ["mimo_v2_flash", "laguna", "qwen2_moe"])
def test_context_parallel_attention_gives_transformers_logits_on_packed_rows(tmp_path, one_rank_cp_mesh,
                                                                             architecture):
    """On one rank the split row is the whole row: the masks the attention function rebuilds from the positions
    (documents, each layer's window, sinks) give transformers' own logits."""
    from hf_cp_cases import count_attention_calls
    from tiny_hf_models import save_tiny

    from lightning_moe.parallel.hf_context import apply_hf_context_parallel

    if architecture == "qwen2_moe":
        model_dir = str(save_tiny(qwen2_moe_config(), tmp_path / architecture))
    else:
        model_dir = tiny(tmp_path, architecture, sliding_window=WINDOW)
    config = HFModelConfig(hf=model_dir, native="never")
    reference = build_hf_model(config)
    model = build_hf_model(config, parallelize=lambda m: apply_hf_context_parallel(m, one_rank_cp_mesh))
    calls = count_attention_calls()
    batch = parallel_cases.global_batches(VOCAB)[0]
    with torch.no_grad():
        expected = reference(batch["input_ids"], batch["position_ids"])
        torch.testing.assert_close(model(batch["input_ids"], batch["position_ids"]), expected, rtol=1e-5, atol=1e-5)
    assert len(calls) == reference.hf.config.num_hidden_layers


@pytest.mark.parametrize("architecture", ["mimo_v2_flash", "laguna"])
def test_packed_rows_give_each_sample_its_own_logits(tmp_path, architecture):
    """transformers masks packed rows by their restarting position ids (sliding windows and sinks included)."""
    model = build_hf_model(HFModelConfig(hf=tiny(tmp_path, architecture, sliding_window=WINDOW), native="never"))
    gen = torch.Generator().manual_seed(0)
    samples = [torch.randint(3, VOCAB, (length,), generator=gen) for length in (7, 5, 9)]
    packed = torch.cat(samples)[None]
    positions = torch.cat([torch.arange(len(s)) for s in samples])[None]
    with torch.no_grad():
        logits = model(packed, positions)[0].split([len(s) for s in samples])
        for sample, got in zip(samples, logits):
            torch.testing.assert_close(got, model(sample[None], torch.arange(len(sample))[None])[0],
                                       rtol=1e-5, atol=1e-5)
        # the same row read as one sequence differs: the boundaries were honoured, not ignored
        whole = model(packed, torch.arange(packed.shape[1])[None])[0].split([len(s) for s in samples])
        assert not torch.allclose(whole[1], logits[1], atol=1e-3)


def test_packed_rows_of_a_model_whose_mask_ignores_position_ids_are_refused(tmp_path):
    """transformers' GPT-OSS builds its masks without position_ids: packed samples would attend to each other."""
    import transformers as t
    from tiny_hf_models import save_tiny

    config = t.GptOssConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
                            num_experts_per_tok=2, sliding_window=WINDOW, pad_token_id=0, bos_token_id=1,
                            eos_token_id=2)
    model = build_hf_model(HFModelConfig(hf=str(save_tiny(config, tmp_path / "gpt_oss")), native="never"))
    batch = parallel_cases.global_batches(VOCAB)[0]
    model(batch["input_ids"], labels=batch["labels"])  # one sample per row: nothing to keep apart
    with pytest.raises(ValueError, match=r"GptOssForCausalLM cannot train on packed rows: its transformers code "
                                         r"builds the attention mask without position_ids"):
        model(batch["input_ids"], batch["position_ids"], labels=batch["labels"])
