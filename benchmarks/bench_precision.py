"""LoRA on stacked experts and emulated FP8: what they cost on this machine.

    python benchmarks/bench_precision.py [--experts 16] [--hidden 512] [--intermediate 256] [--tokens 4096]
                                         [--rank 32] [--rounds 5]

1. Expert LoRA, forward + backward of one projection stack (gate, up, down) with frozen experts: the native
   grouped-GEMM adapter (``lightning_moe.peft.experts``) against peft's ``target_parameters`` adapter
   (``ParamWrapper``), which folds ``W + scale * B @ A`` into a full ``[E, out, in]`` weight every forward. Reports
   median step time and the bytes autograd keeps for backward.
2. Emulated FP8 / MXFP8 (CPU, or GPUs without the formats): step time of a small decoder per recipe, relative
   to the same model in high precision. Emulation quantizes and dequantizes around a high-precision GEMM, so
   it measures overhead, not the speed-up real FP8 hardware gives.
"""

from __future__ import annotations

import argparse
import os

import torch
from bench_mamba import median_seconds  # alternating rounds, median (wall, CPU) seconds per step

os.environ.setdefault("HF_HUB_OFFLINE", "1")


class SavedBytes:
    """Bytes of the distinct tensors autograd saves for backward while the context is open, not counting the
    module's own parameters (saving those costs no memory)."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.params = {p.untyped_storage().data_ptr() for p in module.parameters()}
        self.seen: dict[int, int] = {}

    def __enter__(self):
        def pack(tensor):
            storage = tensor.untyped_storage()
            if storage.data_ptr() not in self.params:
                self.seen[storage.data_ptr()] = storage.nbytes()
            return tensor

        self.hooks = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
        self.hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self.hooks.__exit__(*exc)

    @property
    def total(self) -> int:
        return sum(self.seen.values())


def expert_lora(args) -> None:
    import peft

    from lightning_moe.models.config import MoEConfig
    from lightning_moe.models.layers.moe import GroupedExperts
    from lightning_moe.peft.experts import ExpertLora

    torch.manual_seed(0)
    cfg = MoEConfig(num_experts=args.experts, intermediate_size=args.intermediate)
    x = torch.randn(args.tokens, args.hidden)
    counts = torch.full((args.experts,), args.tokens // args.experts)
    counts[-1] += args.tokens - counts.sum()

    native = GroupedExperts(cfg, args.hidden)
    native.reset_parameters(0.02)
    native.adapter = ExpertLora(native, args.rank, args.rank, 0.0)
    native.adapter.reset_parameters()
    theirs = torch.nn.Module()
    theirs.experts = GroupedExperts(cfg, args.hidden)
    theirs.experts.load_state_dict(native.state_dict(), strict=False)
    peft.inject_adapter_in_model(peft.LoraConfig(r=args.rank, lora_alpha=args.rank, target_parameters=[
        "experts.gate_proj", "experts.up_proj", "experts.down_proj"]), theirs)
    for module in (native, theirs):
        for name, param in module.named_parameters():
            param.requires_grad_("lora_" in name)

    def step(experts):
        def run():
            experts(x, counts).square().mean().backward()
        return run

    candidates = {"native grouped-GEMM adapter": native, "peft ParamWrapper": theirs.experts}
    saved = {}
    for name, module in candidates.items():
        with SavedBytes(module) as bytes_saved:
            module(x, counts).square().mean().backward()
        saved[name] = bytes_saved.total
    seconds = median_seconds({name: step(module) for name, module in candidates.items()}, args.rounds)
    print(f"expert LoRA: E={args.experts} hidden={args.hidden} intermediate={args.intermediate} "
          f"tokens={args.tokens} r={args.rank}; median ms/step by wall | process CPU time")
    for name in candidates:
        (wall, cpu) = seconds[name]
        print(f"  {name:30s} {wall * 1e3:8.1f} | {cpu * 1e3:8.1f} ms/step   {saved[name] / 2**20:8.1f} MiB of "
              f"activations saved")
    (ours_wall, ours_cpu), (peft_wall, peft_cpu) = seconds.values()
    print(f"  {'ratio peft / native':30s} {peft_wall / ours_wall:7.2f}x | {peft_cpu / ours_cpu:7.2f}x   "
          f"{saved['peft ParamWrapper'] / saved['native grouped-GEMM adapter']:7.2f}x")


def fp8_overhead(args) -> None:
    from lightning_moe.models.config import AttentionConfig, MLPConfig, ModelConfig, MoEConfig
    from lightning_moe.models.decoder import Decoder
    from lightning_moe.precision import RECIPES, Float8Config, apply_float8

    cfg = ModelConfig(vocab_size=1024, hidden_size=256, pattern="*-*E",
                      attention=AttentionConfig(num_heads=4, num_kv_heads=2, head_dim=64),
                      mlp=MLPConfig(intermediate_size=512), moe=MoEConfig(num_experts=4, intermediate_size=256))
    ids = torch.randint(0, 1024, (4, 256))

    def step_for(recipe):
        with torch.device("meta"):
            model = Decoder(cfg)
        if recipe != "bf16":
            apply_float8(model, Float8Config(recipe=recipe, min_dim=64))
        model.to_empty(device="cpu")
        model.init_weights()
        model.to(torch.bfloat16)

        def run():
            out = model(ids, labels=ids)
            out.loss_sum.backward()
        return run

    seconds = median_seconds({recipe: step_for(recipe) for recipe in ("bf16", *RECIPES)}, args.rounds)
    base_wall, base_cpu = seconds["bf16"]
    print("emulated FP8, bf16 decoder hidden=256, 4 x 256 tokens: median ms/step by wall | process CPU time, "
          "and relative to bf16")
    for recipe, (wall, cpu) in seconds.items():
        print(f"  {recipe:20s} {wall * 1e3:8.1f} | {cpu * 1e3:8.1f} ms/step   x{wall / base_wall:.2f} | "
              f"x{cpu / base_cpu:.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--intermediate", type=int, default=256)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--rank", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    expert_lora(args)
    fp8_overhead(args)


if __name__ == "__main__":
    main()
