"""Every parallel layout trains like one process.

Five fp32 steps of tiny Llama-, Qwen3-MoE-, DeepSeek-V3-, GPT-OSS- and Nemotron-H-style models on packed global batches (also
with compiled blocks): per-step losses
equal the single-process run within 1e-5, gradient norms and first-step gradients match, and 2-way FSDP keeps
at most 0.6x the single-process parameters + gradients + AdamW state per rank. Checkpoints saved on one mesh
resume on another and continue the same loss curve. Gradient accumulation under HSDP (the all-reduce
across replicas deferred to a step's last micro-batch) trains like one process on the whole global batch.
Tensor and expert parallelism share ranks (experts split over
dp_shard x tp); LoRA adapters split with their tensor-parallel base layers, and FP8 / MXFP8 layers (emulated)
keep the one-process scales; blocks compile under tensor parallelism. One launch per world size runs all its layouts.
"""

from __future__ import annotations

import parallel_cases
import pytest
from distributed_harness import run_distributed_test

pytestmark = pytest.mark.distributed
# cases of converted models (LoRA, FP8) under tensor parallelism
TP = "tensor_parallel_cases"


def test_two_rank_layouts_match_single_process(tmp_path):
    cases = [
        ("run_layout", ("fsdp, full activation checkpointing", "llama", {"dp_shard": 2}),
         {"activation_checkpointing": "full", "max_state_ratio": 0.6}),
        ("run_layout", ("tp+sp, qk-norm, MoE on sequence shards", "qwen3_moe", {"tp": 2}), {}),
        ("run_layout", ("tp+sp, tied output, biases, sinks, window", "gpt_oss_like", {"tp": 2}), {}),
        ("run_layout", ("tp+sp, MLA, MTP", "deepseek_like", {"tp": 2}), {}),
        ("run_layout", ("ep, MLA, shared expert, MoE in the MTP depth", "deepseek_like", {"dp_shard": 2, "ep": 2}), {}),
        ("run_layout", ("ep, every token to rank 0's experts", "qwen3_moe_skewed", {"dp_shard": 2, "ep": 2}), {}),
        ("run_layout", ("fsdp x ep, compiled blocks with activation checkpointing inside", "qwen3_moe",
                        {"dp_shard": 2, "ep": 2}),
         {"compile": True, "compile_backend": "aot_eager", "activation_checkpointing": "full"}),
        ("run_layout", ("cp, packed rows", "llama", {"cp": 2}), {}),
        ("run_layout", ("cp, sinks and window", "gpt_oss_like", {"cp": 2}), {}),
        ("run_layout", ("cp, MLA", "mla_moe", {"cp": 2}), {}),
        ("run_layout", ("cp, Mamba-2 heads traded for tokens, attention and MoE, packed rows", "hybrid",
                        {"cp": 2}), {}),
        ("run_layout", ("cp, MLA, MTP targets across rank boundaries", "deepseek_like", {"cp": 2}), {}),
        ("run_layout", ("cp, one MTP layer shared by 2 depths, targets across rank boundaries",
                        "deepseek_shared_mtp", {"cp": 2}), {}),
        ("run_layout", ("tp+sp, one MTP layer shared by 2 depths", "deepseek_shared_mtp", {"tp": 2}), {}),
        ("run_layout", ("tp+sp, Mamba-2 heads traded for sequence shards", "hybrid", {"tp": 2}), {}),
        ("run_layout", ("tp x ep over the tp ranks (no FSDP), Mamba-2, shared expert", "hybrid",
                        {"tp": 2, "ep": 2}), {}),
        (f"{TP}.run_lora_layout", ("tp LoRA, dense", "llama", {"tp": 2}, {"r": 4, "alpha": 8}), {}),
        (f"{TP}.run_lora_layout", ("tp LoRA, stacked-expert adapters, qk-norm", "qwen3_moe", {"tp": 2},
                                   {"r": 4, "alpha": 8, "target_experts": True}), {}),
        (f"{TP}.run_lora_layout", ("tp LoRA, MLA, shared and stacked experts, MTP adapters", "deepseek_like",
                                   {"tp": 2}, {"r": 4, "alpha": 8, "target_experts": True, "include_mtp": True}), {}),
        (f"{TP}.run_fp8_layout", ("tp FP8 tensorwise", "llama_wide", {"tp": 2}, "tensorwise"), {}),
        (f"{TP}.run_fp8_layout", ("tp FP8 rowwise", "llama_wide", {"tp": 2}, "rowwise"), {}),
        (f"{TP}.run_fp8_layout", ("tp MXFP8", "llama_wide", {"tp": 2}, "mxfp8"), {}),
        (f"{TP}.run_compiled_layout", ("tp+sp, compiled blocks with activation checkpointing inside, MoE",
                                       "qwen3_moe", {"tp": 2}), {"compile_backend": "aot_eager",
                                                                 "activation_checkpointing": "full"}),
        ("run_layout", ("cp, compiled blocks with activation checkpointing inside", "hybrid", {"cp": 2}),
         {"compile": True, "compile_backend": "aot_eager", "activation_checkpointing": "full"}),
        ("run_reshard", ("saved with fsdp, resumed with tp", "qwen3_moe", {"dp_shard": 2}, {"tp": 2},
                         str(tmp_path / "fsdp-to-tp")), {}),
    ]
    run_distributed_test(parallel_cases.check_cases, 2, cases)


def test_four_rank_layouts_match_single_process(tmp_path):
    cases = [
        ("run_layout", ("hsdp 2x2", "llama", {"dp_replicate": 2, "dp_shard": 2}), {}),
        ("run_layout", ("fsdp x ep", "qwen3_moe", {"dp_shard": 4, "ep": 2}), {}),
        ("run_layout", ("tp x cp, selective activation checkpointing", "qwen3_moe", {"tp": 2, "cp": 2}),
         {"activation_checkpointing": "selective", "activation_checkpointing_every": 2}),
        ("run_layout", ("tp x cp, MLA", "mla_moe", {"tp": 2, "cp": 2}), {}),
        ("run_layout", ("tp x cp, Mamba-2 heads traded over cp x tp at once, attention and MoE, packed rows",
                        "hybrid_4_groups", {"tp": 2, "cp": 2}), {}),
        ("run_layout", ("fsdp x cp x ep, Mamba-2", "hybrid", {"dp_shard": 2, "cp": 2, "ep": 4}), {}),
        ("run_layout", ("hsdp x ep, 2 micro-batches per step (all-reduce across replicas deferred to the last)",
                        "qwen3_moe", {"dp_replicate": 2, "dp_shard": 2, "ep": 2}), {"micro_batches": 2}),
        ("run_layout", ("ep over dp_shard x cp", "qwen3_moe", {"dp_shard": 2, "cp": 2, "ep": 4}), {}),
        ("run_layout", ("tp x ep=2 (ep over the tp ranks, experts FSDP over dp_shard), MLA, shared expert, MTP",
                        "deepseek_like", {"tp": 2, "ep": 2}), {}),
        ("run_layout", ("tp x ep=4 (ep over dp_shard x tp), MLA, shared expert, MTP", "deepseek_like",
                        {"tp": 2, "ep": 4}), {}),
        (f"{TP}.run_lora_layout", ("tp x fsdp LoRA, dense", "llama", {"tp": 2, "dp_shard": 2},
                                   {"r": 4, "alpha": 8}), {}),
        (f"{TP}.run_lora_layout", ("tp x ep=4 LoRA, MLA, stacked-expert and MTP adapters", "deepseek_like",
                                   {"tp": 2, "ep": 4}, {"r": 4, "alpha": 8, "target_experts": True,
                                                        "include_mtp": True}), {}),
        (f"{TP}.run_lora_layout", ("tp x ep=2 LoRA, Nemotron-like: Mamba-2, latent MoE, shared expert", "hybrid_latent",
                                   {"tp": 2, "ep": 2}, {"r": 4, "alpha": 8, "target_experts": True}), {}),
        ("run_reshard", ("saved with fsdp x ep, resumed with hsdp", "qwen3_moe", {"dp_shard": 4, "ep": 2},
                         {"dp_replicate": 2, "dp_shard": 2}, str(tmp_path / "ep-to-hsdp")), {}),
    ]
    run_distributed_test(parallel_cases.check_cases, 4, cases)


@pytest.mark.slow
def test_context_parallel_flex_attention_block_masks():
    """flex_attention under context parallelism: block masks over (local queries, gathered keys) with packed
    documents and a sliding window give the single-process loss (forward only; compiling takes ~30 s)."""
    cases = [("run_forward", ("cp, flex", "llama", {"cp": 2}, "flex", 6), {})]
    run_distributed_test(parallel_cases.check_cases, 2, cases)
