"""Hub checkpoints for the distributed conversion test (a Nemotron-H with MTP depths, a DeepSeek-V3 with its MTP
layer, both with enough expert weights that memory shows), and the work every rank does in its one launch."""

from __future__ import annotations

import ctypes
import gc
import json
import os
from pathlib import Path

import torch

EP = 2  # on 4 ranks: 2 expert-parallel ranks x 2 FSDP ranks per expert block
EXPERTS = 32


def nemotron_h_hub(directory: Path) -> Path:
    """transformers' NemotronH (Mamba-2, attention, MLP, MoE layers) plus hub-layout MTP tensors for 2 depths."""
    from test_nemotron_h import add_hub_mtp_tensors, hf_config
    from transformers import NemotronHForCausalLM

    torch.manual_seed(0)
    model = NemotronHForCausalLM(hf_config(latent=None, hidden_size=256, n_routed_experts=EXPERTS,
                                           moe_intermediate_size=256)).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.normal_(1.0 if name.endswith(("norm.weight", "norm_f.weight")) else 0.0, 0.1)
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.normal_(0.0, 0.1)
    model.save_pretrained(directory)
    add_hub_mtp_tensors(directory)
    return directory


def warmup_hub(directory: Path) -> Path:
    """A small Nemotron-H converted first and not measured: the first conversion of a process also imports the
    modules it uses, which would count as its memory."""
    from test_nemotron_h import add_hub_mtp_tensors, build_tiny

    build_tiny().save_pretrained(directory)
    add_hub_mtp_tensors(directory)
    return directory


def deepseek_v3_hub(directory: Path) -> Path:
    """transformers' DeepseekV3 (MLA, one dense layer, group-limited MoE) plus the hub's MTP layer."""
    import transformers as t
    from tiny_moe_hf import add_mtp_layer, save_tiny

    config = t.DeepseekV3Config(
        vocab_size=96, hidden_size=256, num_attention_heads=4, num_key_value_heads=4, num_hidden_layers=3,
        intermediate_size=96, moe_intermediate_size=256, n_routed_experts=EXPERTS, n_shared_experts=1,
        num_experts_per_tok=2, n_group=4, topk_group=2, first_k_dense_replace=1, q_lora_rank=32, kv_lora_rank=24,
        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12, max_position_embeddings=64,
    )
    save_tiny("deepseek_v3", directory, config=config)
    add_mtp_layer(directory, "deepseek_v3", config=config)
    return directory


def peak_rss_since_reset() -> int:
    """Peak resident bytes since the last ``start_peak_rss`` (VmHWM), Linux."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def current_rss() -> int:
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def start_peak_rss() -> int:
    """The resident bytes a measure starts from, with the peak reset to them. Freed heap memory is returned to the
    system first: glibc keeps freed blocks resident, and a conversion reusing them would not raise the peak."""
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS
    return current_rss()


def convert_on_every_rank(work: Path, names: list[str]) -> None:
    """Each rank: ``convert import --ep 2`` then ``convert export --distributed-save --ep 2`` of every checkpoint,
    and the export of the one-process import (the command line, as torchrun runs it), recording the hub and native tensors it read and its peak memory
    above what it held before each conversion."""
    import torch.distributed as dist

    from lightning_moe import convert_command as commands
    from lightning_moe.io.safetensors_io import SafetensorsDir

    rank = dist.get_rank()
    reads: list[str] = []
    get, get_rows = SafetensorsDir.get, SafetensorsDir.get_rows

    def logged_get(self, name):
        reads.append(f"{self.directory.name}:{name}")
        return get(self, name)

    def logged_rows(self, name, start, stop):
        reads.append(f"{self.directory.name}:{name}[{start}:{stop}]")
        return get_rows(self, name, start, stop)

    SafetensorsDir.get, SafetensorsDir.get_rows = logged_get, logged_rows
    report = {}
    for name in names:
        steps = {"import": ["import", "--hf-path", str(work / f"{name}-hub"), "--out", str(work / f"{name}-dcp"),
                            "--ep", str(EP)],
                 "export": ["export", "--ckpt", str(work / f"{name}-dcp"), "--out", str(work / f"{name}-export"),
                            "--distributed-save", "--ep", str(EP), "--max-shard-size", str(4 * 2**20)],
                 # from the one-process import's safetensors: row ranges of its expert stacks
                 "export-native": ["export", "--ckpt", str(work / f"{name}-native"), "--out",
                                   str(work / f"{name}-export-native"), "--distributed-save", "--ep", str(EP)]}
        for step, argv in steps.items():
            dist.barrier()
            reads.clear()
            before = start_peak_rss()
            assert commands.main(argv) == 0, (rank, argv)
            report[f"{name}-{step}"] = {"peak_bytes": peak_rss_since_reset() - before, "reads": list(reads)}
    (work / f"rank{rank}.json").write_text(json.dumps(report))
